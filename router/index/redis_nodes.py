"""The Redis servers behind an index URL: one server, or the primaries of a Redis Cluster.

A lookup or a write batch sends one script to every node it touches, all at once,
each with every key that node serves (scripts flagged ``allow-cross-slot-keys``,
Redis 7), and then reads the answers: one round trip, whatever the number of shards.
redis-py's cluster client routes each command by its keys and refuses a script whose
keys span slots, and its per-command path costs about 3x a packed command on a bare
connection here (bench/RESULTS.md, index): so this module keeps the slot map and one
redis-py connection pool per node (auth, TLS, the hiredis parser), and packs commands
itself. Whether the URL names a cluster is asked of the server (``INFO cluster``).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import numpy as np
import numpy.typing as npt
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.crc import key_slot
from redis.exceptions import NoScriptError, ResponseError

log = logging.getLogger(__name__)

SLOTS: Final = 16384
# Errors after which the slot map is read again: a slot moved, a node failed over.
_TOPOLOGY_ERRORS: Final = ("MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "non local key")

# Connections a process holds per node: callers beyond them wait for one, up to the
# socket timeout (redis-py's plain pool refuses its 101st connection outright, which
# failed a fleet's worth of concurrent writes).
MAX_CONNECTIONS: Final = 64

Arg = bytes | str | int | float


class TopologyChanged(Exception):
    """A node no longer serves some key sent to it: the map has been read again; retry."""


def _is_topology_error(exc: BaseException) -> bool:
    if isinstance(exc, ConnectionError | OSError | TimeoutError):
        return True
    return isinstance(exc, ResponseError) and any(e in str(exc) for e in _TOPOLOGY_ERRORS)


class Script:
    """A Lua script run by SHA, loaded on each node when it is first missed."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()


class Nodes:
    """One pool per primary and the map from slot to node."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float,
        password: str | None = None,
        ca_file: str | None = None,
    ) -> None:
        tls: dict[str, Any] = {"ssl_ca_certs": ca_file} if ca_file else {}
        if tls and not url.startswith("rediss://"):
            raise ValueError("a CA file is for a rediss:// index")
        self._timeout_s = timeout_s
        self._seed = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=MAX_CONNECTIONS,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            password=password,
            decode_responses=False,
            protocol=2,  # arrays for HGETALL and the scripts' tables alike
            **tls,
        )
        self._pools: list[aioredis.ConnectionPool] = []
        self._slot_node: list[int] | None = None  # None: one server, not a cluster
        self._slot_array: npt.NDArray[np.intp] | None = None
        self._refreshing: asyncio.Lock | None = None

    @property
    def cluster(self) -> bool:
        return self._slot_node is not None

    @property
    def count(self) -> int:
        return len(self._pools)

    def node_of(self, key: bytes) -> int:
        """The node serving ``key`` (by its hash tag)."""
        table = self._slot_node
        return 0 if table is None else table[key_slot(key)]

    @property
    def slot_nodes(self) -> npt.NDArray[np.intp] | None:
        """Node of every slot (None: one server)."""
        return self._slot_array

    async def connect(self) -> None:
        if not self._pools:
            await self.refresh()

    async def refresh(self) -> None:
        """Read the topology again (concurrent callers share one refresh)."""
        if self._refreshing is None:
            self._refreshing = asyncio.Lock()
        if self._refreshing.locked():
            async with self._refreshing:
                return
        async with self._refreshing:
            await self._read_topology()

    async def _read_topology(self) -> None:
        info = await self._call_pool(self._seed, ("INFO", "cluster"))
        if b"cluster_enabled:1" not in info:
            self._pools, self._slot_node, self._slot_array = [self._seed], None, None
            return
        ranges = await self._call_pool(self._seed, ("CLUSTER", "SLOTS"))
        kw = dict(self._seed.connection_kwargs)
        cls = self._seed.connection_class
        index: dict[tuple[str, int], int] = {}
        old = {(p.connection_kwargs["host"], p.connection_kwargs["port"]): p for p in self._pools}
        pools: list[aioredis.ConnectionPool] = []
        table = [0] * SLOTS
        for start, end, primary, *_replicas in ranges:
            host = primary[0].decode() or kw["host"]  # empty: the address we asked
            addr = (host, int(primary[1]))
            if addr not in index:
                index[addr] = len(pools)
                pool = old.pop(addr, None)
                if pool is None:
                    pool = aioredis.BlockingConnectionPool(
                        max_connections=MAX_CONNECTIONS,
                        timeout=self._timeout_s,
                        connection_class=cls,
                        **{**kw, "host": addr[0], "port": addr[1]},
                    )
                pools.append(pool)
            for slot in range(int(start), int(end) + 1):
                table[slot] = index[addr]
        for pool in old.values():
            if pool is not self._seed:
                await pool.disconnect()
        self._pools, self._slot_node = pools, table
        self._slot_array = np.asarray(table, dtype=np.intp)
        log.info("redis index: a cluster of %d primaries", len(pools))

    async def call(self, node: int, *args: Arg) -> Any:
        """One command on one node."""
        return (await self.run({node: [args]}))[node][0]

    async def call_each(self, *args: Arg) -> list[Any]:
        """One command on every node (SCAN, INFO, FLUSH...)."""
        got = await self.run({n: [args] for n in range(self.count)})
        return [got[n][0] for n in range(self.count)]

    async def eval_each(
        self, script: Script, args_by_node: Mapping[int, Sequence[Arg]]
    ) -> dict[int, Any]:
        """``script`` on each node with its own arguments (no declared keys), at once."""
        commands = {n: [("EVALSHA", script.sha, 0, *a)] for n, a in args_by_node.items()}
        try:
            got = await self.run(commands)
        except NoScriptError:
            await asyncio.gather(*(self.call(n, "SCRIPT", "LOAD", script.source) for n in commands))
            got = await self.run(commands)
        return {n: replies[0] for n, replies in got.items()}

    async def run(self, commands: Mapping[int, Sequence[Sequence[Arg]]]) -> dict[int, list[Any]]:
        """Send each node its commands (pipelined), then read every answer."""
        await self.connect()
        pools = self._pools
        held: list[tuple[aioredis.ConnectionPool, AbstractConnection]] = []
        clean = False
        # connections are taken in node order: callers waiting for a full pool never
        # hold one another's next node
        order = sorted(commands)
        try:
            for node in order:
                pool = pools[node]
                conn = await pool.get_connection()  # type: ignore[no-untyped-call]
                held.append((pool, conn))
                cmds = commands[node]
                await conn.send_packed_command(conn.pack_commands(cmds), check_health=False)
            out: dict[int, list[Any]] = {}
            error: BaseException | None = None
            for (_, conn), node in zip(held, order, strict=True):
                replies: list[Any] = []
                for _ in commands[node]:
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:  # the reply was read: the connection is fine
                        replies.append(exc)
                        error = error or exc
                out[node] = replies
            clean = True
        except BaseException as exc:
            if _is_topology_error(exc) and self.cluster:
                await self.refresh()
                raise TopologyChanged(str(exc)) from exc
            raise
        finally:
            for pool, conn in held:
                if not clean:  # an answer may still be on its way: never reuse
                    await conn.disconnect()
                await pool.release(conn)
        if error is not None:
            if _is_topology_error(error) and self.cluster:
                await self.refresh()
                raise TopologyChanged(str(error)) from error
            raise error
        return out

    async def _call_pool(self, pool: aioredis.ConnectionPool, args: Sequence[Arg]) -> Any:
        conn = await pool.get_connection()  # type: ignore[no-untyped-call]
        ok = False
        try:
            await conn.send_packed_command(conn.pack_command(*args), check_health=False)
            reply = await conn.read_response()
            ok = True
            return reply
        finally:
            if not ok:
                await conn.disconnect()
            await pool.release(conn)

    async def close(self) -> None:
        for pool in {id(p): p for p in [*self._pools, self._seed]}.values():
            await pool.disconnect()
        self._pools = []
