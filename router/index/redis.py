"""Redis residency index: shared by every router replica and the indexers.

Layout and encodings: ``redis_layout``. A lookup sends one script to each node that
serves a chunk of the prompt (and to the one holding the pods table), all at once,
and combines the holders they return in this process. Writes of any number of
callers are gathered into one script per node and batch (group commit): a write is
applied when its call returns, and concurrent streams share round trips. Works
against one Redis or a Redis Cluster (Redis 7 or later); which one is asked of the
server.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from kvplane.router.index.base import CHUNK, Blocks, NotOwner, PrefixMatches
from kvplane.router.index.redis_layout import (
    MAX_SLOTS,
    TENTATIVE_POD_INC,
    Found,
    Names,
    parse_pod,
    prefixes,
    tentative_entry,
    window_suffix,
)
from kvplane.router.index.redis_lua import LOOKUP, SLOT, TENTATIVE, WRITE
from kvplane.router.index.redis_nodes import Arg, Nodes, Script, TopologyChanged
from kvplane.router.tiers import TIER_BIT, TIER_ORDER, Tier

# Tentative marks live in windows this long; a mark's TTL is at most one window.
DEFAULT_WINDOW_S: Final = 10.0
# Fields one node's write script takes at most (a script blocks its node while it runs).
DEFAULT_BATCH_FIELDS: Final = 4096
_SEGMENT_FIELDS: Final = 512  # one bucket's fields per segment (Lua's unpack is bounded)
_SEEN_S: Final = 1.0  # a pod's slot read by a lookup serves its marks this long
_BUCKET_CACHE: Final = 1 << 16
_T = TypeVar("_T")


class SlotsExhausted(Exception):
    """Every pod slot is live or still being collected."""


@dataclass(frozen=True, slots=True)
class _Segment:
    bucket: bytes
    store: bool
    slot: int
    bit: int
    blob: bytes

    @property
    def fields(self) -> int:
        return len(self.blob) >> 3


@dataclass(slots=True)
class _Pending:
    segments: list[_Segment]
    done: asyncio.Future[None]


def _pack(keys: Sequence[int]) -> bytes:
    return struct.pack(f">{len(keys)}Q", *keys)


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
    ) -> None:
        """``clock`` (seconds) dates tentative marks: replicas must agree on it (wall
        clocks, or one simulation's). ``owner``: this indexer's id when the pods' streams
        are leased among several indexers (``kvevents.ownership``); starting or dropping
        a pod's incarnation then needs its lease."""
        self.url = url
        self.nodes = Nodes(url, timeout_s=timeout_s, password=password)
        self.names = Names(generation)
        self._clock = clock
        self._window_ms = max(1, int(window_s * 1000))
        self._owner = owner
        self._batch_fields = batch_fields
        self._writing: dict[str, tuple[str, int]] = {}  # pod -> (incarnation, slot)
        self._seen: dict[str, tuple[int, float]] = {}  # pod -> (slot, when), from lookups
        self._buckets: dict[int, bytes] = {}  # anchor >> 32 -> bucket name
        self._pending: list[_Pending] = []
        self._flusher: asyncio.Task[None] | None = None
        self.flushes = 0  # write round trips (metrics, benchmarks)
        self.flushed_fields = 0

    @property
    def pending_fields(self) -> int:
        """Block writes queued for the next round trip (back-pressure)."""
        return sum(s.fields for item in self._pending for s in item.segments)

    @property
    def window_s(self) -> float:
        return self._window_ms / 1000

    def now_ms(self) -> int:
        """The clock tentative marks and slot deaths are dated by, in ms."""
        return round(self._clock() * 1000)

    def _meta_node(self) -> int:
        return self.nodes.node_of(self.names.pods)

    def _bucket(self, anchor: int) -> bytes:
        hi = anchor >> 32
        name = self._buckets.get(hi)
        if name is None:
            if len(self._buckets) >= _BUCKET_CACHE:
                self._buckets.clear()
            name = self._buckets[hi] = self.names.bucket(anchor)
        return name

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
        leased = self._owner is not None and op != "mark"
        lease, owner = (n.lease(pod), self._owner or "") if leased else (b"", "")
        args: list[Arg] = [op, n.pods, n.slots, lease, owner, pod, incarnation]
        args += [self.now_ms(), MAX_SLOTS]
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
        bit = TIER_BIT[tier]
        segments = [
            _Segment(bucket, store, slot, bit, _pack(keys))
            for bucket, keys in self._by_bucket(blocks, _SEGMENT_FIELDS)
        ]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(segments, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_pending())
        await done

    def _by_bucket(self, blocks: Blocks, limit: int) -> list[tuple[bytes, list[int]]]:
        """The keys grouped by chunk bucket, at most ``limit`` to a group."""
        groups: dict[bytes, list[int]] = {}
        bucket = self._bucket
        for key, anchor in zip(blocks.keys, blocks.anchors, strict=True):
            name = bucket(anchor)
            group = groups.get(name)
            if group is None:
                groups[name] = [key]
            else:
                group.append(key)
        out: list[tuple[bytes, list[int]]] = []
        for name, keys in groups.items():
            out += [(name, keys[i : i + limit]) for i in range(0, len(keys), limit)]
        return out

    async def flush(self) -> None:
        """Wait until every write queued so far is applied."""
        while self._flusher is not None and not self._flusher.done():
            await asyncio.shield(self._flusher)

    async def _flush_pending(self) -> None:
        while self._pending:
            taken, fields = 0, 0
            for item in self._pending:
                fields += sum(s.fields for s in item.segments)
                taken += 1
                if fields >= self._batch_fields:
                    break
            batch, self._pending = self._pending[:taken], self._pending[taken:]
            try:
                await self._send([s for item in batch for s in item.segments])
            except Exception as exc:
                for item in batch:
                    if not item.done.done():
                        item.done.set_exception(exc)
                continue
            for item in batch:
                if not item.done.done():
                    item.done.set_result(None)

    async def _send(self, segments: Sequence[_Segment]) -> None:
        await self.nodes.connect()
        await self._retry(lambda: self._send_once(segments))
        self.flushed_fields += sum(s.fields for s in segments)

    async def _send_once(self, segments: Sequence[_Segment]) -> None:
        window = self.now_ms() // self._window_ms
        head: list[Arg] = [window_suffix(window), window_suffix(window - 1)]
        by_node: dict[int, list[Arg]] = {}
        node_of = self.nodes.node_of
        for s in segments:
            args = by_node.get(node := node_of(s.bucket))
            if args is None:
                args = by_node[node] = list(head)
            args += [s.bucket, b"s" if s.store else b"r", s.slot, s.bit, s.blob]
        await self.nodes.eval_each(WRITE, by_node)
        self.flushes += len(by_node)

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
        head: list[Arg] = [window_suffix(now_ms // self._window_ms), 2 * self._window_ms + 1000]
        head += [slot_b, expiry_b]
        groups = [
            (bucket, _pack(keys)) for bucket, keys in self._by_bucket(blocks, _SEGMENT_FIELDS)
        ]

        async def once() -> None:
            by_node: dict[int, list[Arg]] = {}
            for bucket, blob in groups:
                args = by_node.get(node := self.nodes.node_of(bucket))
                if args is None:
                    args = by_node[node] = list(head)
                args += [bucket, blob]
            await self.nodes.eval_each(TENTATIVE, by_node)

        await self._retry(once)

    # ----------------------------------------------------------------------- lookups

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        if not pods:
            return {}
        if not keys:
            return {p: dict.fromkeys(TIER_ORDER, 0) for p in pods}
        await self.nodes.connect()
        now = self._clock()
        now_ms = round(now * 1000)
        window = now_ms // self._window_ms
        blob = _pack(keys)
        node_of = self.nodes.node_of
        meta = self._meta_node()
        # per node: its buckets, their field counts, their blocks' positions, fields blob
        plan: dict[int, tuple[list[bytes], bytearray, list[int], list[bytes]]] = {}
        for start in range(0, len(keys), CHUNK):
            bucket = self._bucket(keys[start])
            node = node_of(bucket)
            entry = plan.get(node)
            if entry is None:
                entry = plan[node] = ([], bytearray(), [], [])
            stop = min(start + CHUNK, len(keys))
            entry[0].append(bucket)
            entry[1].append(stop - start)
            entry[2].extend(range(start, stop))
            entry[3].append(blob[8 * start : 8 * stop])
        plan.setdefault(meta, ([], bytearray(), [], []))
        head: list[Arg] = [window_suffix(window), window_suffix(window - 1)]
        args: dict[int, list[Arg]] = {}
        for node, (buckets, per, _, parts) in plan.items():
            tail: list[Arg] = (
                [self.names.pods, *buckets, *pods] if node == meta else [b"", *buckets]
            )
            args[node] = [*head, b"".join(parts), bytes(per), *tail]
        replies = await self.nodes.eval_each(LOOKUP, args)
        found = Found([], [], [], [])
        slots: list[int | None] = [None] * len(pods)
        for node, (held, mark1, mark0, pod_values) in replies.items():
            positions = plan[node][2]
            found.add(positions, held)
            found.add_marks(positions, mark1)
            found.add_marks(positions, mark0)
            if node == meta:
                for i, value in enumerate(pod_values):
                    parsed = parse_pod(value)
                    if parsed is not None:
                        slots[i] = parsed[0]
                        self._seen[pods[i]] = (parsed[0], now)
        runs = prefixes(len(keys), slots, found, now_ms)
        return {
            pod: dict(zip(TIER_ORDER, run, strict=True))
            for pod, run in zip(pods, runs, strict=True)
        }

    async def ping(self) -> None:
        await self.nodes.connect()
        await self.nodes.call_each("PING")

    async def close(self) -> None:
        if self._flusher is not None and not self._flusher.done():
            await self.flush()
        await self.nodes.close()


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
