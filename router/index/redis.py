"""Redis residency index: shared by every router replica and the indexers.

Layout and encodings: ``redis_layout``. A lookup sends one script to each node that
serves a chunk of the prompt (and to the one holding the pods table), all at once,
and combines the holders they return in this process. Writes of any number of
callers are gathered into one script per node and batch (group commit): a write is
applied when its call returns, and concurrent streams share round trips. Blocks
travel as packed arrays (numpy), so a write costs the client no Python work per
block. Works against one Redis or a Redis Cluster (Redis 7 or later); which one is
asked of the server.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Final, TypeVar

import numpy as np
import numpy.typing as npt
from kvplane.router.index.base import CHUNK, Blocks, NotOwner, PrefixMatches
from kvplane.router.index.redis_layout import (
    MAX_SLOTS,
    TAG_SLOTS,
    TENTATIVE_POD_INC,
    Found,
    Names,
    bucket_ids,
    parse_pod,
    prefixes,
    tag_index,
    tentative_entry,
    window_suffix,
)
from kvplane.router.index.redis_lua import LOOKUP, SLOT, TENTATIVE, WRITE
from kvplane.router.index.redis_nodes import Arg, Nodes, Script, TopologyChanged
from kvplane.router.shared import SharedReads, is_holder
from kvplane.router.tiers import TIER_BIT, TIER_ORDER, Tier

# Tentative marks live in windows this long; a mark's TTL is at most one window.
DEFAULT_WINDOW_S: Final = 10.0
# Block writes one node's script takes at most (a script blocks its node while it runs).
DEFAULT_BATCH_FIELDS: Final = 4096
_OP_RECORDS: Final = 0xFFFF  # records of one op in a script (its count is 2 bytes)
_SEEN_S: Final = 1.0  # a pod's slot read by a lookup serves its marks this long
_ZERO: Final = dict.fromkeys(TIER_ORDER, 0)
_T = TypeVar("_T")

U64 = npt.NDArray[np.uint64]
U32 = npt.NDArray[np.uint32]


class SlotsExhausted(Exception):
    """Every pod slot is live or still being collected."""


@dataclass(frozen=True, slots=True)
class _Op:
    """One write: a tier bit set (store) or cleared in one slot, for some blocks."""

    slot: int
    bit: int
    store: bool
    blocks: Blocks


@dataclass(slots=True)
class _Pending:
    op: _Op
    done: asyncio.Future[None]


_HEADER: Final = np.dtype([("slot", ">u2"), ("bit", "u1"), ("store", "u1"), ("count", ">u2")])


@dataclass(frozen=True, slots=True)
class _Records:
    """Ops as the write script takes them: per node, op headers and the records' bucket
    ids and keys, op after op, each op's records grouped by bucket."""

    headers: bytes
    ids: bytes
    keys: bytes


def _records(ops: Sequence[_Op], nodes_of: Callable[[U32], Any]) -> dict[int, _Records]:
    """Every op's blocks packed for the nodes that serve them: numpy over the whole
    batch, nothing in Python per block."""
    key_list: list[int] = []
    anchor_list: list[int] = []
    for op in ops:
        key_list += op.blocks.keys
        anchor_list += op.blocks.anchors
    counts = np.array([len(op.blocks.keys) for op in ops], dtype=np.intp)
    op_of = np.repeat(np.arange(len(ops)), counts)
    ids = bucket_ids(np.array(anchor_list, dtype=np.uint64))
    keys = np.array(key_list, dtype=np.uint64)
    order = np.lexsort((ids, op_of))  # by op, then by bucket within the op
    ids, keys, op_of = ids[order], keys[order], op_of[order]
    nodes = nodes_of(ids)
    if nodes is None:
        parts = {0: np.arange(len(keys))}
    else:
        by_node = np.argsort(nodes, kind="stable")
        edges = np.flatnonzero(np.diff(nodes[by_node])) + 1
        parts = {int(nodes[idx[0]]): idx for idx in np.split(by_node, edges)}
    table = np.array([(op.slot, op.bit, op.store) for op in ops], dtype=np.uint16)
    out: dict[int, _Records] = {}
    for node, idx in parts.items():
        mine = op_of[idx]
        starts = np.concatenate(([0], np.flatnonzero(np.diff(mine)) + 1))
        header = np.zeros(len(starts), dtype=_HEADER)
        which = mine[starts]
        header["slot"], header["bit"], header["store"] = table[which].T
        header["count"] = np.diff(np.append(starts, len(mine)))
        out[node] = _Records(
            header.tobytes(), ids[idx].astype(">u4").tobytes(), keys[idx].astype(">u8").tobytes()
        )
    return out


class RedisIndex:
    """ResidencyIndex on Redis or a Redis Cluster (redis-py connections, hiredis)."""

    in_process = False

    def __init__(
        self,
        url: str,
        generation: str,
        timeout_s: float = 0.5,
        password: str | None = None,
        *,
        clock: Callable[[], float] = time.time,
        window_s: float = DEFAULT_WINDOW_S,
        owner: str | None = None,
        batch_fields: int = DEFAULT_BATCH_FIELDS,
        ca_file: str | None = None,
        mark_keys_ttl_s: float | None = None,
    ) -> None:
        """``clock`` (seconds) dates tentative marks: replicas must agree on it (wall
        clocks, or one simulation's). ``owner``: this indexer's id when the pods' streams
        are leased among several indexers (``kvevents.ownership``); starting or dropping
        a pod's incarnation then needs its lease. ``ca_file``: the CA a ``rediss://``
        index's certificate chains to (default: the system's). ``mark_keys_ttl_s``: how
        long (wall time) a window of marks is kept; two windows and a second by default
        (a simulation whose clock may run slower than the wall's keeps them longer)."""
        self.url = url
        self.nodes = Nodes(url, timeout_s=timeout_s, password=password, ca_file=ca_file)
        self.names = Names(generation)
        self._prefix = self.names.prefix
        self._clock = clock
        self._window_ms = max(1, int(window_s * 1000))
        self._mark_keys_ms = (
            2 * self._window_ms + 1000 if mark_keys_ttl_s is None else int(mark_keys_ttl_s * 1000)
        )
        self._owner = owner
        self._batch_fields = batch_fields
        self._writing: dict[str, tuple[str, int]] = {}  # pod -> (incarnation, slot)
        self._seen: dict[str, tuple[int, float]] = {}  # pod -> (slot, when), from lookups
        # pod -> slot as of the last lookup, and the table's version then
        self._pods_table: dict[str, int] = {}
        self._pods_version: bytes = b"-"
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self.flushes = 0  # write round trips (metrics, benchmarks)
        self.flushed_fields = 0

    @property
    def pending_fields(self) -> int:
        """Block writes queued for the next round trip (back-pressure)."""
        return sum(len(p.op.blocks.keys) for p in self._pending)

    @property
    def window_s(self) -> float:
        return self._window_ms / 1000

    def now_ms(self) -> int:
        """The clock tentative marks and slot deaths are dated by, in ms."""
        return round(self._clock() * 1000)

    def _meta_node(self) -> int:
        return self.nodes.node_of(self.names.pods)

    def _nodes_of(self, ids: U32) -> npt.NDArray[np.intp] | None:
        """The node of each bucket id (None: one server holds all)."""
        slot_nodes = self.nodes.slot_nodes
        return None if slot_nodes is None else slot_nodes[TAG_SLOTS[tag_index(ids)]]

    # ------------------------------------------------------------------ incarnations

    async def begin_incarnation(self, pod: str, incarnation: str) -> None:
        slot = await self._slot_op("begin", pod, incarnation)
        self._writing[pod] = (incarnation, slot)

    async def drop_pod(self, pod: str) -> None:
        self._writing.pop(pod, None)
        self._seen.pop(pod, None)
        await self._slot_op("drop", pod, "")

    async def incarnations(self) -> Mapping[str, str]:
        await self.nodes.connect()
        raw = await self.nodes.call(self._meta_node(), "HGETALL", self.names.pods)
        out: dict[str, str] = {}
        for i in range(0, len(raw), 2):
            parsed = parse_pod(raw[i + 1])
            if parsed is not None and parsed[1] != TENTATIVE_POD_INC:
                out[raw[i].decode()] = parsed[1]
        return out

    async def _slot_op(self, op: str, pod: str, incarnation: str) -> int:
        await self.nodes.connect()
        n = self.names
        # a shared store's holder is written by every indexer of its readers: no lease
        leased = self._owner is not None and op != "mark" and not is_holder(pod)
        lease, owner = (n.lease(pod), self._owner or "") if leased else (b"", "")
        args: list[Arg] = [op, n.pods, n.slots, lease, owner, pod, incarnation]
        args += [self.now_ms(), MAX_SLOTS, n.pods_version]
        slot = int(await self._retry(lambda: self._eval_meta(SLOT, args)))
        if slot == -1:
            raise NotOwner(f"pod {pod}: another indexer holds its stream")
        if slot == -2:
            raise SlotsExhausted(f"all {MAX_SLOTS} pod slots are taken")
        return slot

    async def _slot_for_write(self, pod: str, incarnation: str) -> int | None:
        """The pod's slot if ``incarnation`` is current; None for a stale write."""
        known = self._writing.get(pod)
        if known is not None and known[0] == incarnation:
            return known[1]
        await self.nodes.connect()
        parsed = parse_pod(await self.nodes.call(self._meta_node(), "HGET", self.names.pods, pod))
        if parsed is None or parsed[1] != incarnation:
            return None
        self._writing[pod] = (incarnation, parsed[0])
        return parsed[0]

    async def _eval_meta(self, script: Script, args: Sequence[Arg]) -> Any:
        node = self._meta_node()
        return (await self.nodes.eval_each(script, {node: args}))[node]

    @staticmethod
    async def _retry(attempt: Callable[[], Awaitable[_T]]) -> _T:
        """Once more after the cluster's slot map changed, with keys placed anew. Every
        script is idempotent: a write sets or clears bits, a mark keeps the later expiry,
        a slot operation of an incarnation returns the slot it made."""
        try:
            return await attempt()
        except TopologyChanged:
            return await attempt()

    # ------------------------------------------------------------------------ writes

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        await self._write(pod, incarnation, blocks, tier, store=True)

    async def remove(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        await self._write(pod, incarnation, blocks, tier, store=False)

    async def clear(self, pod: str, incarnation: str, tier: Tier) -> None:
        from kvplane.router.index.redis_gc import sweep

        slot = await self._slot_for_write(pod, incarnation)
        if slot is not None:
            await self.flush()
            await sweep(self, {slot: TIER_BIT[tier]})

    async def _write(
        self, pod: str, incarnation: str, blocks: Blocks, tier: Tier, *, store: bool
    ) -> None:
        if not blocks.keys:
            return
        slot = await self._slot_for_write(pod, incarnation)
        if slot is None:
            return
        loop = asyncio.get_running_loop()
        for start in range(0, len(blocks.keys), _OP_RECORDS):  # a header counts 2 bytes
            part = blocks
            if len(blocks.keys) > _OP_RECORDS:
                stop = start + _OP_RECORDS
                part = Blocks(blocks.keys[start:stop], blocks.anchors[start:stop])
            done: asyncio.Future[None] = loop.create_future()
            self._pending.append(_Pending(_Op(slot, TIER_BIT[tier], store, part), done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_pending())
        await done  # the last part: parts are written in order

    async def flush(self) -> None:
        """Wait until every write queued so far is applied."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_pending(self) -> None:
        while self._pending:
            taken, fields = 0, 0
            for item in self._pending:
                fields += len(item.op.blocks.keys)
                taken += 1
                if fields >= self._batch_fields:
                    break
            batch, self._pending = self._pending[:taken], self._pending[taken:]
            try:
                await self.nodes.connect()
                await self._retry(partial(self._send, [item.op for item in batch]))
            except Exception as exc:
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(exc)
                continue
            self.flushed_fields += fields
            for item in batch:
                if not item.done.done():
                    item.done.set_result(None)

    async def _send(self, ops: Sequence[_Op]) -> None:
        """One write script per node for ``ops``, in their order."""
        window = self.now_ms() // self._window_ms
        head: list[Arg] = [self._prefix, window_suffix(window), window_suffix(window - 1)]
        args = {
            node: [*head, r.headers, r.ids, r.keys]
            for node, r in _records(ops, self._nodes_of).items()
        }
        await self.nodes.eval_each(WRITE, args)
        self.flushes += len(args)

    # -------------------------------------------------------------------- tentative

    async def mark_tentative(self, pod: str, blocks: Blocks, ttl_s: float) -> None:
        if not blocks.keys:
            return
        await self.nodes.connect()
        now = self._clock()
        seen = self._seen.get(pod)
        if seen is not None and now - seen[1] <= _SEEN_S:
            slot = seen[0]
        else:
            slot = await self._slot_op("mark", pod, TENTATIVE_POD_INC)
            self._seen[pod] = (slot, now)
        now_ms = round(now * 1000)
        ttl_ms = min(int(ttl_s * 1000), self._window_ms)
        slot_b, expiry_b = tentative_entry(slot, now_ms + ttl_ms)
        head: list[Arg] = [self._prefix, window_suffix(now_ms // self._window_ms)]
        head += [self._mark_keys_ms, slot_b, expiry_b]
        op = _Op(slot, 0, True, blocks)

        async def once() -> None:
            args = {n: [*head, r.ids, r.keys] for n, r in _records([op], self._nodes_of).items()}
            await self.nodes.eval_each(TENTATIVE, args)

        await self._retry(once)

    # ----------------------------------------------------------------------- lookups

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        return await self.lookup_shared(keys, pods, {})

    async def lookup_shared(
        self, keys: Sequence[int], pods: Sequence[str], shared: SharedReads
    ) -> PrefixMatches:
        """``lookup`` where each pod of ``shared`` also holds what its holders hold."""
        if not pods:
            return {}
        if not keys:
            return {p: _ZERO.copy() for p in pods}
        await self.nodes.connect()
        now = self._clock()
        now_ms = round(now * 1000)
        window = now_ms // self._window_ms
        n = len(keys)
        blob = np.array(keys, dtype=">u8").tobytes()
        chunk_ids = bucket_ids(np.array(keys[::CHUNK], dtype=np.uint64))
        id_blob = chunk_ids.astype(">u4").tobytes()
        meta = self._meta_node()
        nodes = self._nodes_of(chunk_ids)
        chunks = range(len(chunk_ids))
        # per node: its chunks, in order
        plan: dict[int, list[int]] = {0: list(chunks)} if nodes is None else {}
        if nodes is not None:
            for c, node in enumerate(nodes.tolist()):
                plan.setdefault(node, []).append(c)
        plan.setdefault(meta, [])
        head: list[Arg] = [self._prefix, window_suffix(window), window_suffix(window - 1)]
        names = self.names
        args: dict[int, list[Arg]] = {}
        for node, mine in plan.items():
            table: list[Arg] = [b"", b"", b""]
            if node == meta:
                table = [names.pods, names.pods_version, self._pods_version]
            if len(mine) == len(chunk_ids):
                records: list[Arg] = [id_blob, _counts(n, mine), blob]
            else:
                ids_b = b"".join(id_blob[4 * c : 4 * c + 4] for c in mine)
                keys_b = b"".join(blob[8 * CHUNK * c : 8 * CHUNK * (c + 1)] for c in mine)
                records = [ids_b, _counts(n, mine), keys_b]
            args[node] = [*head, *records, *table]
        replies = await self.nodes.eval_each(LOOKUP, args)
        found = Found(len(chunk_ids))
        for node, reply in replies.items():
            for c, (held, mark1, mark0) in zip(plan[node], reply, strict=False):
                found.add(c, held, mark1, mark0)
            if node == meta:
                self._read_pods_table(reply[-1])
        table_now = self._pods_table
        slots = [table_now.get(pod) for pod in pods]
        for pod, slot in zip(pods, slots, strict=True):
            if slot is not None:
                self._seen[pod] = (slot, now)
        unions: list[tuple[int, int]] = []  # (reader's column, holder's column)
        if shared:
            columns = {pod: c for c, pod in enumerate(pods)}
            for pod in pods:
                for holder in shared.get(pod, ()):
                    if holder not in columns:
                        columns[holder] = len(slots)
                        slots.append(table_now.get(holder))
                    unions.append((columns[pod], columns[holder]))
        runs = prefixes(n, slots, found, now_ms, unions)
        out: PrefixMatches = {}
        for pod, run in zip(pods, runs, strict=False):
            out[pod] = _ZERO.copy() if run is None else dict(zip(TIER_ORDER, run, strict=True))
        return out

    def _read_pods_table(self, reply: list[Any]) -> None:
        """The lookup's answer about the pods table: its version, and the table if it moved."""
        if len(reply) > 1:
            raw = reply[1]
            table: dict[str, int] = {}
            for i in range(0, len(raw), 2):
                parsed = parse_pod(raw[i + 1])
                if parsed is not None:
                    table[raw[i].decode()] = parsed[0]
            self._pods_table = table
        self._pods_version = reply[0]

    async def ping(self) -> None:
        await self.nodes.connect()
        await self.nodes.call_each("PING")

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            await self.flush()
        await self.nodes.close()


def _counts(n: int, chunks: Sequence[int]) -> bytes:
    """The block count of each chunk of an ``n``-block prompt."""
    return bytes(min(CHUNK, n - c * CHUNK) for c in chunks)


async def forget_generation(url: str, generation: str, password: str | None = None) -> int:
    """Delete every key of one generation (its pool is gone), on every node; how many."""
    nodes = Nodes(url, timeout_s=5.0, password=password)
    names = Names(generation)
    removed = 0
    try:
        await nodes.connect()
        for node in range(nodes.count):
            for pattern in names.patterns:
                cursor: int | bytes = 0
                while True:
                    cursor, batch = await nodes.call(
                        node, "SCAN", cursor, "MATCH", pattern, "COUNT", 1000
                    )
                    if batch:  # one key a command: a cluster refuses multi-slot UNLINK
                        got = await nodes.run({node: [("UNLINK", key) for key in batch]})
                        removed += sum(int(n) for n in got[node])
                    if int(cursor) == 0:
                        break
    finally:
        await nodes.close()
    return removed
