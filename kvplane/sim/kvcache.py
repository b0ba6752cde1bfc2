"""The paged KV block pool with vLLM v1 prefix caching, and an optional CPU tier.

Mirrors ``vllm/v1/core/block_pool.py``:

- blocks are ints; block 0 is the null block and never handed out;
- a full block of a request gets its chained hash when its KV is scheduled and becomes
  findable by that hash (two requests may hold copies of one hash: the map keeps every
  copy and lookups take the oldest);
- freed blocks (ref count 0) go to the free queue: cached ones at the tail (LRU
  eviction), uncached ones at the head (reused first); a request frees its blocks in
  reverse, so a prompt's tail is evicted before its head;
- a new block comes from the head of the free queue; if it still had a hash, that hash
  is evicted (one ``BlockRemoved`` each) and, with a CPU tier, the block is offloaded.

The CPU tier is an LRU of evicted blocks (``BlockStored``/``BlockRemoved`` with medium
"CPU", self-describing: tokens and parent hash included); a prefix found there is loaded
back into new GPU blocks instead of being recomputed.

A fleet may share a store (``SharedStore``: Mooncake Store, an LMCache remote server)
that every engine writes its computed blocks to and loads from, and may let engines pull
KV from each other (``PeerFabric``: NIXL, LMCache P2P, Mooncake's transfer engine).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from kvplane.sim.events import (
    LOCALITY_REMOTE,
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a CPU-tier event needs to describe a block: its event hash, its parent's
    and its tokens."""

    ext: int
    parent: int | None
    tokens: tuple[int, ...]
    lora_id: int | None = None  # a LoRA adapter's block: announced with its adapter
    lora_name: str | None = None


class CpuTier:
    """LRU of offloaded blocks keyed by block hash."""

    __slots__ = ("block_size", "capacity", "entries", "events")

    def __init__(self, capacity: int, block_size: int) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.entries: OrderedDict[bytes, BlockMeta] = OrderedDict()
        self.events: list[KVEvent] = []

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries

    def offload(self, h: bytes, meta: BlockMeta) -> None:
        """Keep a block evicted from the GPU (refreshes it when already here)."""
        entries = self.entries
        if h in entries:
            entries.move_to_end(h)
            return
        while len(entries) >= self.capacity:
            old = entries.popitem(last=False)[1]
            self.events.append(BlockRemoved([old.ext], MEDIUM_CPU))
        entries[h] = meta
        stored = BlockStored(
            [meta.ext],
            meta.parent,
            list(meta.tokens),
            self.block_size,
            MEDIUM_CPU,
            lora_id=meta.lora_id,
            lora_name=meta.lora_name,
        )
        self.events.append(stored)

    def match(self, hashes: list[bytes], start: int, end: int) -> int:
        """How many consecutive blocks ``hashes[start:end]`` are here. They are refreshed
        tail first, so that a prefix's head is the last of them to be dropped."""
        entries = self.entries
        stop = start
        while stop < end and hashes[stop] in entries:
            stop += 1
        for i in range(stop - 1, start - 1, -1):
            entries.move_to_end(hashes[i])
        return stop - start

    def usage(self) -> float:
        return len(self.entries) / self.capacity if self.capacity else 0.0


@dataclass(frozen=True, slots=True)
class Link:
    """A path KV is loaded over into an engine's HBM."""

    bandwidth_gbps: float
    latency_ms: float = 0.0

    def load_ms(self, tokens: int, kv_bytes_per_token: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.latency_ms + tokens * kv_bytes_per_token / (self.bandwidth_gbps * 1e9) * 1e3


SIM_STORE: Final = "sim-store"  # the shared store's name in a router's config


def router_kv_settings(store: Link | None, peer: Link | None) -> dict[str, Any]:
    """What a kvplane router config says of a simulated fleet's shared store and peer
    pulls, as the operator renders a remote tier: the store as a ``shared_stores`` entry
    at its link, peer pulls at theirs (nothing for what the fleet lacks)."""
    doc: dict[str, Any] = {}
    if store is not None:
        link = {"bandwidth_gbps": store.bandwidth_gbps, "latency_ms": store.latency_ms}
        doc["shared_stores"] = [{"name": SIM_STORE, "link": link}]
    if peer is not None:
        doc["peer_pull"] = {
            "link": {"bandwidth_gbps": peer.bandwidth_gbps, "latency_ms": peer.latency_ms}
        }
    return doc


STORE_POLICIES: Final = ("lru", "slru")
# One traced store access: (True, blocks written) or (False, blocks a load looked up).
StoreAccess = tuple[bool, tuple[bytes, ...]]
PROTECTED_SHARE = 0.8  # slru: the share of the store that blocks reused once may hold


class SharedStore:
    """One store for the whole fleet: ``capacity`` blocks by hash, loaded over ``link``
    by every engine. Engines write the blocks their HBM evicts (as to a CPU tier) or,
    write-through, every block as they compute it (as LMCache and Mooncake Store
    connectors save KV), and load a prefix they lack from it. Its events are vLLM's for
    a remote store (medium STORAGE, locality REMOTE); each goes out on the stream of the
    engine that wrote the block, an eviction included: the store's own model of what it
    holds, told by its writers.

    Eviction (``policy``): ``lru``, or ``slru``, segmented LRU: a block enters on
    probation and moves to the protected segment (at most ``PROTECTED_SHARE`` of the
    store) when a later request loads it; the probation segment's LRU block goes first,
    so a prefix many requests reuse (a system prompt, a document, an agent's tool
    preamble) outlives one-off conversation tails that no request ever loads again,
    however recently they were written. A protected block pushed out of its segment goes
    back on probation as its most recent block.
    """

    __slots__ = (
        "block_size",
        "capacity",
        "entries",
        "events",
        "found",
        "link",
        "policy",
        "protected",
        "protected_cap",
        "trace",
    )

    def __init__(
        self,
        capacity: int,
        block_size: int,
        link: Link,
        policy: str = "lru",
        *,
        trace: bool = False,
    ) -> None:
        if capacity < 1:
            raise ValueError("a shared store needs at least one block")
        if policy not in STORE_POLICIES:
            raise ValueError(f"unknown store policy {policy!r} (known: {STORE_POLICIES})")
        self.capacity = capacity
        self.block_size = block_size
        self.link = link
        self.policy = policy
        # lru: every block, least recent first; slru: the probation segment
        self.entries: OrderedDict[bytes, tuple[BlockMeta, str]] = OrderedDict()
        self.protected: OrderedDict[bytes, tuple[BlockMeta, str]] = OrderedDict()
        self.protected_cap = int(capacity * PROTECTED_SHARE) if policy == "slru" else 0
        self.events: dict[str, list[KVEvent]] = {}  # writer -> its events, in order
        self.found = 0  # blocks loads found here
        # with ``trace``: every write and load attempt, in order (kvplane.sim.store_bound)
        self.trace: list[StoreAccess] | None = [] if trace else None

    def __len__(self) -> int:
        return len(self.entries) + len(self.protected)

    def __contains__(self, h: bytes) -> bool:
        return h in self.entries or h in self.protected

    def _victim(self) -> tuple[BlockMeta, str]:
        segment = self.entries if self.entries else self.protected
        return segment.popitem(last=False)[1]

    def write(self, writer: str, blocks: list[tuple[bytes, BlockMeta]]) -> None:
        """Consecutive blocks of one chain computed by ``writer``: new ones are stored
        (one ``BlockStored`` per run of new blocks), known ones refreshed in their
        segment (a write is not a reuse)."""
        entries, protected = self.entries, self.protected
        if self.trace is not None:
            self.trace.append((True, tuple(h for h, _ in blocks)))
        run: list[BlockMeta] = []
        for h, meta in blocks:
            if h in entries or h in protected:
                (entries if h in entries else protected).move_to_end(h)
                self._announce(writer, run)
                run = []
                continue
            while len(self) >= self.capacity:
                old, who = self._victim()
                if run and old is run[0]:
                    run = run[1:]  # stored and evicted in one write: never announced
                    continue
                self.events.setdefault(who, []).append(
                    BlockRemoved([old.ext], MEDIUM_STORAGE, LOCALITY_REMOTE)
                )
            entries[h] = (meta, writer)
            run.append(meta)
        self._announce(writer, run)

    def _announce(self, writer: str, run: list[BlockMeta]) -> None:
        if not run:
            return
        tokens = [t for meta in run for t in meta.tokens]
        head = run[0]
        stored = BlockStored(
            [m.ext for m in run],
            head.parent,
            tokens,
            self.block_size,
            MEDIUM_STORAGE,
            lora_id=head.lora_id,
            lora_name=head.lora_name,
            locality=LOCALITY_REMOTE,
        )
        self.events.setdefault(writer, []).append(stored)

    def match(self, hashes: list[bytes], start: int, end: int) -> int:
        """How many consecutive blocks ``hashes[start:end]`` are here. A load refreshes
        them tail first (as the CPU tier does), so a prefix's head is the last of it to
        go; under ``slru`` it also protects them."""
        if self.trace is not None:
            self.trace.append((False, tuple(hashes[start:end])))
        stop = start
        while stop < end and hashes[stop] in self:
            stop += 1
        for i in range(stop - 1, start - 1, -1):
            self._touch(hashes[i])
        self.found += stop - start
        return stop - start

    def _touch(self, h: bytes) -> None:
        entries, protected = self.entries, self.protected
        if self.policy == "lru":
            entries.move_to_end(h)
            return
        if h in protected:
            protected.move_to_end(h)
            return
        protected[h] = entries.pop(h)
        while len(protected) > self.protected_cap:
            old, value = protected.popitem(last=False)
            entries[old] = value  # back on probation, as its most recent block

    def writer(self, name: str) -> StoreWriter:
        """What engine ``name``'s block pool offloads its evicted blocks to."""
        return StoreWriter(self, name)

    def take_events(self) -> dict[str, list[KVEvent]]:
        """Every writer's events since the last call."""
        events, self.events = self.events, {}
        return events

    def usage(self) -> float:
        return len(self) / self.capacity


@dataclass(frozen=True, slots=True)
class StoreWriter:
    """One engine writing its evicted blocks to a shared store (as it does to its CPU
    tier)."""

    store: SharedStore
    name: str

    def offload(self, h: bytes, meta: BlockMeta) -> None:
        self.store.write(self.name, [(h, meta)])


class PeerFabric:
    """Engines that pull KV from each other's HBM or CPU tier: over ``link``, or over
    ``node_link`` between two engines on one node (``nodes``: each engine's node; an
    engine left out shares a node with none)."""

    __slots__ = ("link", "node_link", "nodes", "pools")

    def __init__(
        self,
        link: Link,
        *,
        node_link: Link | None = None,
        nodes: Mapping[str, str] | None = None,
    ) -> None:
        self.link = link
        self.node_link = node_link
        self.nodes = dict(nodes or {})
        self.pools: dict[str, BlockPool] = {}

    def join(self, name: str, pool: BlockPool) -> None:
        self.pools[name] = pool

    def link_between(self, a: str, b: str) -> Link:
        node = self.nodes.get(a)
        if self.node_link is not None and node is not None and node == self.nodes.get(b):
            return self.node_link
        return self.link

    def match(
        self,
        me: str,
        hashes: list[bytes],
        start: int,
        end: int,
        tokens_per_block: int,
        kv_bytes_per_token: int,
        recompute_ms_per_token: float,
    ) -> tuple[int, float]:
        """The run of ``hashes[start:end]`` to pull and its transfer in ms: of the other
        engines holding some of it in HBM or in their CPU tier, the one whose pull plus
        recomputing the rest (at ``recompute_ms_per_token``) is quickest, the longer run
        on a tie (their caches are read, not refreshed)."""
        best: tuple[float, int, float] = (math.inf, 0, 0.0)  # (estimate, -blocks, ms)
        for name, pool in self.pools.items():
            if name == me:
                continue
            cached, cpu = pool.cached, pool.cpu
            stop = start
            while stop < end and (hashes[stop] in cached or (cpu and hashes[stop] in cpu)):
                stop += 1
            n = stop - start
            if n == 0:
                continue
            ms = self.link_between(me, name).load_ms(n * tokens_per_block, kv_bytes_per_token)
            rest = (end - stop) * tokens_per_block * recompute_ms_per_token
            best = min(best, (ms + rest, -n, ms))
        return -best[1], best[2]


class BlockPool:
    """GPU KV blocks: reference counts, the hash -> block map and the LRU free queue."""

    __slots__ = (
        "cached",
        "cpu",
        "dups",
        "enable_caching",
        "events",
        "ext_of",
        "free",
        "hash_of",
        "meta_of",
        "num_blocks",
        "ref",
        "remote",
    )

    def __init__(
        self,
        num_blocks: int,
        *,
        enable_caching: bool = True,
        cpu: CpuTier | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError("a pool needs the null block and at least one more")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.cpu = cpu
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.ext_of = [0] * num_blocks  # event value of hash_of[b]
        self.meta_of: list[BlockMeta | None] = [None] * num_blocks
        # block 0 is vLLM's null block: never free, never cached
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        # hash -> its oldest block; younger copies of the same hash (two requests
        # computed it) wait in dups, oldest first
        self.cached: dict[bytes, int] = {}
        self.dups: dict[bytes, list[int]] = {}
        self.events: list[KVEvent] = []
        self.remote: StoreWriter | None = None  # a shared store evicted blocks also go to

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: never used, freed, or cached but unreferenced."""
        return len(self.free)

    def usage(self) -> float:
        """vLLM's ``kv_cache_usage_perc``: referenced blocks over usable ones."""
        return 1.0 - len(self.free) / (self.num_blocks - 1)

    def lookup(self, h: bytes) -> int | None:
        """The oldest GPU block holding hash ``h``."""
        return self.cached.get(h)

    def evictable(self, blocks: list[int]) -> int:
        """How many of ``blocks`` sit in the free queue (touching them takes them out)."""
        ref = self.ref
        return sum(1 for b in blocks if ref[b] == 0)

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on prefix-hit blocks."""
        ref = self.ref
        free = self.free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` new blocks from the head of the free queue, evicting their hashes."""
        free = self.free
        if n > len(free):
            raise ValueError(f"cannot allocate {n} blocks, {len(free)} free")
        ref = self.ref
        hash_of = self.hash_of
        out: list[int] = []
        for _ in range(n):
            b = free.popitem(last=False)[0]
            h = hash_of[b]
            if h is not None:
                self._evict(b, h)
            ref[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int, h: bytes) -> None:
        if self.cached[h] == b:
            younger = self.dups.get(h)
            if younger:
                self.cached[h] = younger.pop(0)
                if not younger:
                    del self.dups[h]
            else:
                del self.cached[h]
        else:
            younger = self.dups[h]
            younger.remove(b)
            if not younger:
                del self.dups[h]
        self.hash_of[b] = None
        self.events.append(BlockRemoved([self.ext_of[b]]))
        meta = self.meta_of[b]
        self.meta_of[b] = None
        if meta is not None:
            if self.cpu is not None:
                self.cpu.offload(h, meta)
            if self.remote is not None:
                self.remote.offload(h, meta)

    def insert(self, b: int, h: bytes, ext: int, meta: BlockMeta | None = None) -> None:
        """Make block ``b`` findable by hash ``h`` (event value ``ext``); its KV is
        computed this step. ``meta`` describes it to the CPU tier."""
        self.hash_of[b] = h
        self.ext_of[b] = ext
        self.meta_of[b] = meta
        first = self.cached.setdefault(h, b)
        if first != b:
            self.dups.setdefault(h, []).append(b)

    def release(self, blocks: list[int]) -> None:
        """Drop a request's references, its tail first (vLLM frees in reverse)."""
        ref = self.ref
        free = self.free
        hash_of = self.hash_of
        first: list[int] = []
        for b in reversed(blocks):
            ref[b] -= 1
            if ref[b] == 0:
                if hash_of[b] is None:
                    first.append(b)
                else:
                    free[b] = None
        # uncached blocks are reused first, in the order freed
        for b in reversed(first):
            free[b] = None
            free.move_to_end(b, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; refused (False) while any block is referenced."""
        if len(self.free) != self.num_blocks - 1:
            return False
        self.cached.clear()
        self.dups.clear()
        self.hash_of = [None] * self.num_blocks
        self.meta_of = [None] * self.num_blocks
        return True

    def take_events(self) -> list[KVEvent]:
        """This step's events: the GPU pool's, then the CPU tier's."""
        events = self.events
        self.events = []
        if self.cpu is not None and self.cpu.events:
            events.extend(self.cpu.events)
            self.cpu.events = []
        return events
