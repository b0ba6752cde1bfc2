"""Applies decoded engine KV events to a ResidencyIndex.

Engines hash blocks with their own algorithm and seed, so their hashes cannot
be compared with the router's keys. Every BlockStored carries the tokens and
the parent's engine hash, though, so we re-key: the parent's engine hash maps
to a router key we already computed (or the generation root for a chain
start), and ``chain_keys`` over the carried tokens gives the router keys of the
new blocks. The mapping is kept per pod for its current incarnation only. Once a
block has left every tier its mapping is kept a while longer (a bounded LRU):
an engine sends a batch's GPU events before its offload connector's, so a block
evicted and offloaded in one step is announced to the CPU tier (by its parent's
hash, or by its own hash alone) after the GPU removal that emptied its mapping.

A LoRA adapter's blocks (``lora_name`` set) chain from the adapter's root
(``blockkeys.adapter_root``), so they are keyed apart from the base model's and from
other adapters'; vLLM's per-block extra keys then hold just the adapter's name. Blocks
with any other extra key (multimodal, cache salt) are not keyed by tokens alone and
are skipped.

Every block also carries its chunk *anchor* (``index.base.Blocks``): the key of the
first block of its ``CHUNK``, found from the parent's anchor and position in the chain.

An *unreported tier* (``RouterConfig.unreported_tier``) is an offload tier the engines
fill without events for it that can be keyed, or without its removals: Dynamo's mocker's
host offload, LMCache's CPU tier (reported in chunks of its own size, no removals from
its in-process connector). It is taken to be write-through with LRU eviction,
as vLLM's own CPU offload is: a pod holds there the ``blocks`` blocks it most recently
stored (in HBM, or in that tier where stores are reported). A block that leaves HBM
while among them is indexed in that tier, and leaves it when newer blocks push it out.

Planning (state changes, pure) and writing (index I/O) are separate: a batch
becomes a short list of coalesced index operations, applied in order.
"""

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from kvplane.router.blockkeys import adapter_root, chain_keys, generation_root
from kvplane.router.config import UnreportedTierSpec
from kvplane.router.index.base import CHUNK, Blocks, ResidencyIndex
from kvplane.router.kvevents.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from kvplane.router.tiers import TIER_BIT, Tier, tier_of_medium

log = logging.getLogger(__name__)

DEFAULT_MAX_BLOCKS_PER_POD: Final = 1_000_000
# Mappings of blocks that left every tier, kept for later events that name them: one
# step's evictions (a long prompt's worth of blocks) fit many times over.
DEFAULT_RECENT_PER_POD: Final = 16_384

OpKind = Literal["store", "remove", "clear"]

# A block's place in its chain, packed in one int (one small object per mapped block):
# its chunk's anchor key above, its offset in the chunk in the low bits.
_OFFSET_BITS: Final = 8
_OFFSET_MASK: Final = (1 << _OFFSET_BITS) - 1
assert CHUNK <= 1 << _OFFSET_BITS


def _next_place(parent: int | None, key: int) -> int:
    """The place of ``key``, the child of a block at ``parent`` (None: a chain start)."""
    if parent is None:
        return key << _OFFSET_BITS
    offset = ((parent & _OFFSET_MASK) + 1) % CHUNK
    anchor = key if offset == 0 else parent >> _OFFSET_BITS
    return anchor << _OFFSET_BITS | offset


def _anchor(place: int) -> int:
    return place >> _OFFSET_BITS


@dataclass(slots=True)
class IngestStats:
    """Monotonic counters over every pod (exported to Prometheus by the caller)."""

    batches: int = 0
    stored: int = 0  # BlockStored events seen
    removed: int = 0  # BlockRemoved events seen
    cleared: int = 0  # AllBlocksCleared events seen
    unmapped: int = 0  # BlockStored whose parent (or placeholder hash) is unknown
    removed_unknown: int = 0  # removed hashes we never mapped in that tier
    block_size_mismatch: int = 0
    other_group: int = 0  # events of KV-cache groups other than 0 (hybrid models)
    namespaced: int = 0  # extra-key / salted blocks: not keyed by tokens alone (LoRA is)
    malformed: int = 0  # token count != blocks * block_size
    mapping_full: int = 0  # blocks not indexed because the pod's mapping hit its cap
    remapped: int = 0  # an engine hash re-stored with different tokens
    unreported_kept: int = 0  # blocks indexed in the unreported tier as they left HBM
    unreported_dropped: int = 0  # blocks its capacity took out of it in the index


@dataclass(frozen=True, slots=True)
class IndexOp:
    """One index write; consecutive writes of the same kind and tier are merged."""

    kind: OpKind
    tier: Tier
    keys: list[int] = field(default_factory=list)
    anchors: list[int] = field(default_factory=list)

    @property
    def blocks(self) -> Blocks:
        return Blocks(self.keys, self.anchors)


@dataclass(slots=True)
class PodChains:
    """Engine hash -> router key, place in the chain and tier bitmask, for one pod
    incarnation."""

    incarnation: str
    keys: dict[int, int] = field(default_factory=dict)
    places: dict[int, int] = field(default_factory=dict)
    tiers: dict[int, int] = field(default_factory=dict)
    # blocks that left every tier (key, place), oldest first; never a hash ``keys`` holds
    recent: OrderedDict[int, tuple[int, int]] = field(default_factory=OrderedDict)
    # what the unreported tier holds, oldest first: engine hashes of mapped blocks
    unreported: OrderedDict[int, None] = field(default_factory=OrderedDict)
    full_logged: bool = False

    def key_of(self, engine_hash: int) -> int | None:
        """The router key of a block held somewhere, or recently dropped."""
        key = self.keys.get(engine_hash)
        if key is None:
            gone = self.recent.get(engine_hash)
            return None if gone is None else gone[0]
        return key

    def locate(self, engine_hash: int) -> tuple[int, int] | None:
        """(router key, place) of a block held somewhere, or recently dropped."""
        key = self.keys.get(engine_hash)
        if key is None:
            return self.recent.get(engine_hash)
        return key, self.places[engine_hash]


def _tokens_and_adapter_only(ev: BlockStored) -> bool:
    """Whether the block hashes depend on nothing but the tokens and the LoRA adapter:
    vLLM's events carry the adapter's name as every block's extra key (untagged)."""
    if not ev.extra_keys:
        return True
    if ev.lora_name is None:
        return False
    name = ev.lora_name
    return all(k is None or k == [name] or k == (name,) for k in ev.extra_keys)


def _emit(
    ops: list[IndexOp], kind: OpKind, tier: Tier, keys: Sequence[int], anchors: Sequence[int]
) -> None:
    if kind != "clear" and not keys:
        return
    if ops and kind != "clear" and ops[-1].kind == kind and ops[-1].tier is tier:
        ops[-1].keys.extend(keys)
        ops[-1].anchors.extend(anchors)
    else:
        ops.append(IndexOp(kind, tier, list(keys), list(anchors)))


@dataclass(slots=True)
class Planner:
    """Turns events into index operations, updating a pod's chains (no I/O)."""

    root: int
    block_size: int
    max_blocks: int
    stats: IngestStats
    pod: str = ""
    max_recent: int = DEFAULT_RECENT_PER_POD
    unreported: UnreportedTierSpec | None = None

    def plan(self, chains: PodChains, events: Sequence[KVEvent]) -> list[IndexOp]:
        ops: list[IndexOp] = []
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(chains, event, ops)
            elif isinstance(event, BlockRemoved):
                self._removed(chains, event, ops)
            elif isinstance(event, AllBlocksCleared):
                self._cleared(chains, ops)
        return ops

    def _stored(self, chains: PodChains, ev: BlockStored, ops: list[IndexOp]) -> None:
        self.stats.stored += 1
        if ev.group_idx != 0:
            self.stats.other_group += 1
            return
        if not _tokens_and_adapter_only(ev):
            self.stats.namespaced += 1
            return
        tier = tier_of_medium(ev.medium, ev.locality)
        if not ev.token_ids:  # vLLM's offload placeholders say block_size 0: no size to check
            self._placeholder(chains, ev, tier, ops)
            return
        if ev.block_size != self.block_size:
            self.stats.block_size_mismatch += 1
            return
        if len(ev.token_ids) != len(ev.block_hashes) * self.block_size:
            self.stats.malformed += 1
            return
        place: int | None = None
        if ev.parent_block_hash is None:
            parent = adapter_root(self.root, ev.lora_name)
        else:
            found = chains.locate(ev.parent_block_hash)
            if found is None:
                self.stats.unmapped += 1
                return
            parent, place = found
        keys = chain_keys(ev.token_ids, self.block_size, parent)
        bit = TIER_BIT[tier]
        accepted: list[int] = []
        anchors: list[int] = []
        # the hot path of ingestion: dicts and methods held in locals
        mapped, places, tiers, recent = chains.keys, chains.places, chains.tiers, chains.recent
        for engine_hash, key in zip(ev.block_hashes, keys, strict=True):
            old = mapped.get(engine_hash)
            if old is None:
                if len(mapped) >= self.max_blocks:
                    self._full(chains, len(keys) - len(accepted))
                    break  # later blocks chain from this one: none can be mapped
                if recent:
                    recent.pop(engine_hash, None)
                mapped[engine_hash] = key
            elif old != key:
                self.stats.remapped += 1
                self._forget(chains, engine_hash, ops)
                mapped[engine_hash] = key
            place = _next_place(place, key)
            places[engine_hash] = place
            tiers[engine_hash] = tiers.get(engine_hash, 0) | bit
            accepted.append(key)
            anchors.append(place >> _OFFSET_BITS)
        _emit(ops, "store", tier, accepted, anchors)
        self._written_through(chains, tier, ev.block_hashes[: len(accepted)], ops)

    def _placeholder(
        self, chains: PodChains, ev: BlockStored, tier: Tier, ops: list[IndexOp]
    ) -> None:
        """A block announced without tokens (offload tiers): known by its engine hash."""
        bit = TIER_BIT[tier]
        accepted: list[int] = []
        anchors: list[int] = []
        touched: list[int] = []
        for engine_hash in ev.block_hashes:
            found = chains.locate(engine_hash)
            if found is None:
                continue
            key, place = found
            if engine_hash not in chains.keys:  # back from the recently dropped
                if len(chains.keys) >= self.max_blocks:
                    self._full(chains, 1)
                    continue
                del chains.recent[engine_hash]
                chains.keys[engine_hash] = key
                chains.places[engine_hash] = place
            chains.tiers[engine_hash] = chains.tiers.get(engine_hash, 0) | bit
            accepted.append(key)
            anchors.append(_anchor(place))
            touched.append(engine_hash)
        if len(accepted) < len(ev.block_hashes):
            self.stats.unmapped += 1
        _emit(ops, "store", tier, accepted, anchors)
        self._written_through(chains, tier, touched, ops)

    def _removed(self, chains: PodChains, ev: BlockRemoved, ops: list[IndexOp]) -> None:
        self.stats.removed += ev.events
        if ev.group_idx != 0:
            self.stats.other_group += ev.events
            return
        tier = tier_of_medium(ev.medium, ev.locality)
        bit = TIER_BIT[tier]
        gone: list[int] = []
        anchors: list[int] = []
        mapped, places, tiers = chains.keys, chains.places, chains.tiers
        # blocks leaving HBM that the unreported tier holds: indexed there from now on
        spec = self.unreported
        kept_in = spec.tier if spec is not None and tier is Tier.HBM else None
        held = chains.unreported
        kept_bit = TIER_BIT[kept_in] if kept_in is not None else 0
        kept: list[int] = []
        unknown = 0
        for engine_hash in ev.block_hashes:
            mask = tiers.get(engine_hash, 0)
            if not mask & bit:
                unknown += 1
                continue
            mask &= ~bit
            if kept_bit and engine_hash in held and not mask & kept_bit:
                mask |= kept_bit
                kept.append(engine_hash)
            if mask:
                tiers[engine_hash] = mask
                gone.append(mapped[engine_hash])
                anchors.append(places[engine_hash] >> _OFFSET_BITS)
            else:
                del tiers[engine_hash]
                key, place = self._retire(chains, engine_hash)
                gone.append(key)
                anchors.append(place >> _OFFSET_BITS)
        self.stats.removed_unknown += unknown
        _emit(ops, "remove", tier, gone, anchors)
        if kept_in is not None:
            self.stats.unreported_kept += len(kept)
            self._store_known(chains, kept_in, kept, ops)

    def _written_through(
        self, chains: PodChains, tier: Tier, engine_hashes: Sequence[int], ops: list[IndexOp]
    ) -> None:
        """Stored blocks join the unreported tier as its newest (a write-through tier
        takes whatever the engine stores); the oldest leave it beyond its capacity."""
        spec = self.unreported
        if spec is None or not engine_hashes or tier not in (Tier.HBM, spec.tier):
            return
        held = chains.unreported
        for engine_hash in engine_hashes:
            held[engine_hash] = None
            held.move_to_end(engine_hash)
        bit = TIER_BIT[spec.tier]
        gone: list[int] = []
        anchors: list[int] = []
        while len(held) > spec.blocks:
            engine_hash, _ = held.popitem(last=False)
            mask = chains.tiers.get(engine_hash, 0)
            if not mask & bit:
                continue  # still in HBM only: nothing indexed in the tier to withdraw
            if mask & ~bit:
                chains.tiers[engine_hash] = mask & ~bit
                key, place = chains.keys[engine_hash], chains.places[engine_hash]
            else:
                del chains.tiers[engine_hash]
                key, place = self._retire(chains, engine_hash)
            gone.append(key)
            anchors.append(_anchor(place))
        self.stats.unreported_dropped += len(gone)
        _emit(ops, "remove", spec.tier, gone, anchors)

    @staticmethod
    def _store_known(
        chains: PodChains, tier: Tier, engine_hashes: Sequence[int], ops: list[IndexOp]
    ) -> None:
        """Index mapped blocks (their tier bit already set) in ``tier``."""
        keys = [chains.keys[h] for h in engine_hashes]
        anchors = [_anchor(chains.places[h]) for h in engine_hashes]
        _emit(ops, "store", tier, keys, anchors)

    def _retire(self, chains: PodChains, engine_hash: int) -> tuple[int, int]:
        """Drop a block's mapping, but keep it for events still to name it (bounded
        LRU); returns its (key, place)."""
        gone = chains.keys.pop(engine_hash), chains.places.pop(engine_hash)
        chains.unreported.pop(engine_hash, None)
        if self.max_recent > 0:
            recent = chains.recent
            recent[engine_hash] = gone  # new here: it was in ``keys`` until now
            if len(recent) > self.max_recent:
                recent.popitem(last=False)
        return gone

    def _cleared(self, chains: PodChains, ops: list[IndexOp]) -> None:
        """Prefix-cache reset: HBM only, offload tiers keep their blocks."""
        self.stats.cleared += 1
        kept: list[int] = []
        if self.unreported is not None:  # HBM's blocks the unreported tier holds stay there
            bit = TIER_BIT[self.unreported.tier]
            kept = [h for h in chains.unreported if not chains.tiers.get(h, 0) & bit]
            for h in kept:
                chains.tiers[h] = chains.tiers.get(h, 0) | bit
        keep = ~TIER_BIT[Tier.HBM]
        tiers = {h: m & keep for h, m in chains.tiers.items() if m & keep}
        for h in [h for h in chains.keys if h not in tiers]:
            self._retire(chains, h)
        chains.tiers = tiers
        _emit(ops, "clear", Tier.HBM, (), ())
        if self.unreported is not None:
            self.stats.unreported_kept += len(kept)
            self._store_known(chains, self.unreported.tier, kept, ops)

    def _forget(self, chains: PodChains, engine_hash: int, ops: list[IndexOp]) -> None:
        """Withdraw an engine hash's old router key from every tier it was in."""
        key = chains.keys.pop(engine_hash)
        anchor = _anchor(chains.places.pop(engine_hash))
        mask = chains.tiers.pop(engine_hash, 0)
        chains.unreported.pop(engine_hash, None)
        for tier, bit in TIER_BIT.items():
            if mask & bit:
                _emit(ops, "remove", tier, [key], [anchor])

    def _full(self, chains: PodChains, dropped: int) -> None:
        self.stats.mapping_full += dropped
        if not chains.full_logged:
            chains.full_logged = True
            log.warning(
                "kv events: pod %s (incarnation %s) holds %d mapped blocks, the cap; "
                "new blocks are not indexed until some are removed "
                "(raise max_blocks_per_pod if the engine really caches this many)",
                self.pod,
                chains.incarnation,
                self.max_blocks,
            )


class Ingestor:
    """Applies batches of one or more pods to a ResidencyIndex, in arrival order."""

    def __init__(
        self,
        index: ResidencyIndex,
        *,
        generation: str,
        block_size: int,
        max_blocks_per_pod: int = DEFAULT_MAX_BLOCKS_PER_POD,
        recent_per_pod: int = DEFAULT_RECENT_PER_POD,
        unreported: UnreportedTierSpec | None = None,
    ) -> None:
        self.index = index
        self._unreported = unreported
        self.block_size = block_size
        self.stats = IngestStats()
        self._root = generation_root(generation)
        self._max_blocks = max_blocks_per_pod
        self._max_recent = recent_per_pod
        self._chains: dict[str, PodChains] = {}

    def chains(self, pod: str, incarnation: str) -> PodChains:
        """The pod's mapping for ``incarnation``; a new incarnation starts empty."""
        current = self._chains.get(pod)
        if current is None or current.incarnation != incarnation:
            current = self._chains[pod] = PodChains(incarnation)
        return current

    def forget(self, pod: str) -> None:
        """Drop the pod's mapping (pod removed, or its stream starts over)."""
        self._chains.pop(pod, None)

    def mapped_blocks(self, pod: str) -> int:
        chains = self._chains.get(pod)
        return 0 if chains is None else len(chains.keys)

    def plan(self, pod: str, incarnation: str, batch: EventBatch) -> list[IndexOp]:
        """Update the mapping for ``batch`` and return the index writes it implies."""
        planner = Planner(
            self._root,
            self.block_size,
            self._max_blocks,
            self.stats,
            pod,
            self._max_recent,
            self._unreported,
        )
        self.stats.batches += 1
        return planner.plan(self.chains(pod, incarnation), batch.events)

    async def apply(self, pod: str, incarnation: str, batch: EventBatch) -> None:
        """Plan and write one batch. If the index raises, the mapping is already
        ahead of it: the caller should start a new incarnation for the pod."""
        for op in self.plan(pod, incarnation, batch):
            await write(self.index, pod, incarnation, op)


async def write(index: ResidencyIndex, pod: str, incarnation: str, op: IndexOp) -> None:
    """Perform one planned operation."""
    if op.kind == "store":
        await index.store(pod, incarnation, op.blocks, op.tier)
    elif op.kind == "remove":
        await index.remove(pod, incarnation, op.blocks, op.tier)
    else:
        await index.clear(pod, incarnation, op.tier)
