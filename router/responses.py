"""Where a stored Responses API answer lives: vLLM keeps a response it stores (``store``,
on by default) in the engine process that produced it, so a request that continues it
(``previous_response_id``) can be served by that pod alone. The router learns each
response's id from the answer it relays (the body, or a stream's ``response.created``
event) and remembers the pod under it, bounded in entries and in time.

The map is this router replica's (``MemoryHomes``) or, with a Redis index, shared by
every replica through the index's Redis (``SharedHomes``: one key per response, the TTL
its expiry, with this replica's own map in front of it).
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from kvplane.router.errors import APIError, describe
from kvplane.router.index.redis_nodes import Nodes

log = logging.getLogger("kvplane.router.responses")

# a stream's response.created event comes first; a response whose first events do not
# name it within this many bytes is not remembered (the buffer stays bounded)
MAX_HEAD_BYTES = 256 * 1024


class ResponseHomes(Protocol):
    """response id -> the pod that stored it."""

    async def get(self, response_id: str) -> str | None: ...

    async def put(self, response_id: str, pod: str) -> None: ...


class MemoryHomes:
    """At most ``max_entries`` ids, least recently used first out; an id is forgotten
    ``ttl_s`` after it was recorded (or last looked up)."""

    def __init__(
        self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._max, self._ttl, self._clock = max_entries, ttl_s, clock
        self._homes: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._homes)

    async def get(self, response_id: str) -> str | None:
        entry = self._homes.get(response_id)
        if entry is None:
            return None
        now = self._clock()
        if entry[1] <= now:
            del self._homes[response_id]
            return None
        self._homes[response_id] = (entry[0], now + self._ttl)
        self._homes.move_to_end(response_id)
        return entry[0]

    async def put(self, response_id: str, pod: str) -> None:
        self._homes[response_id] = (pod, self._clock() + self._ttl)
        self._homes.move_to_end(response_id)
        while len(self._homes) > self._max:
            self._homes.popitem(last=False)


class SharedHomes:
    """The map in the index's Redis (or Redis Cluster), so that every router replica
    sends a continued response to the same pod: a key ``<prefix>resp:<id>`` per
    response, holding the pod, expiring ``ttl_s`` after it was written or last read
    (Redis bounds the entries: its ``maxmemory``). This replica's answers are also kept
    in ``local``, which answers first; an index that cannot answer is a 503."""

    def __init__(self, nodes: Nodes, prefix: bytes, local: MemoryHomes, ttl_s: float) -> None:
        self._nodes, self._prefix, self._local = nodes, prefix + b"resp:", local
        self._ttl_ms = max(1, int(ttl_s * 1000))

    async def get(self, response_id: str) -> str | None:
        pod = await self._local.get(response_id)
        if pod is not None:
            return pod
        try:
            value = await self._call("GETEX", response_id)
        except Exception as exc:
            raise APIError(
                503, f"the index holding response ids cannot answer: {describe(exc)}"
            ) from exc
        if value is None:
            return None
        pod = value.decode() if isinstance(value, bytes) else str(value)
        await self._local.put(response_id, pod)
        return pod

    async def put(self, response_id: str, pod: str) -> None:
        await self._local.put(response_id, pod)
        try:
            await self._call("SET", response_id, pod)
        except Exception as exc:  # this replica still knows it
            log.warning("response %s not shared: %s", response_id, describe(exc))

    async def _call(self, command: str, response_id: str, *value: str) -> object:
        key = self._prefix + response_id.encode()
        await self._nodes.connect()
        node = self._nodes.node_of(key)
        return await self._nodes.call(node, command, key, *value, "PX", self._ttl_ms)


def not_found(response_id: str) -> APIError:
    """vLLM's answer to a ``previous_response_id`` it does not hold."""
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        param="previous_response_id",
        code="response_not_found",
    )


class ResponseTap:
    """Reads the id of the response a pod relays (``Dispatch.tap``) and records its home."""

    def __init__(self, homes: ResponseHomes, stream: bool, pod: Callable[[], str | None]) -> None:
        self._homes, self._stream, self._pod = homes, stream, pod
        self._head = b""
        self._done = False

    async def __call__(self, chunk: bytes) -> None:
        if self._done:
            return
        rid = self._from_stream(chunk) if self._stream else _response_id(chunk)
        if rid is None and not self._stream:
            self._done = True
        if rid is None:
            return
        self._done = True
        pod = self._pod()
        if pod is not None:
            await self._homes.put(rid, pod)

    def _from_stream(self, chunk: bytes) -> str | None:
        """The id in the first event that carries the response (response.created)."""
        self._head += chunk
        while b"\n\n" in self._head:
            event, self._head = self._head.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    rid = _event_response_id(line[5:])
                    if rid is not None:
                        return rid
        if len(self._head) > MAX_HEAD_BYTES:
            self._done, self._head = True, b""
        return None


def _response_id(body: bytes) -> str | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    rid = obj.get("id") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) and rid else None


def _event_response_id(data: bytes) -> str | None:
    try:
        event = json.loads(data)
    except ValueError:
        return None
    response = event.get("response") if isinstance(event, dict) else None
    rid = response.get("id") if isinstance(response, dict) else None
    return rid if isinstance(rid, str) and rid else None
