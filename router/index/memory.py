"""In-process ResidencyIndex: the embedded default for local (single router) mode.

Two views of the same facts:

- per pod, ``block key -> tier bitmask`` (plus a tentative bit), which writes
  update and which a new incarnation simply replaces, so entries of an older
  incarnation never count and need no garbage collection;
- per key, one int packing every pod's *cumulative* field (4 bits per pod slot,
  bit t set when the pod holds the block in tier t or a faster one).

A lookup ANDs the packed ints of the prompt's keys in order (``accumulate`` in
C), starting from the requested pods' bits and stopping as soon as no pod can
extend; each pod's prefix per tier is then where its bit drops out, found by
bisection. That is one dict probe per key whatever the number of pods.
"""

import heapq
import time
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, repeat, takewhile
from operator import and_
from typing import Final

from kvplane.router.index.base import Blocks, PrefixMatches
from kvplane.router.shared import SharedReads
from kvplane.router.tiers import TIER_BIT, TIER_ORDER, Tier

N_TIERS: Final = len(TIER_ORDER)
FIELD: Final = (1 << N_TIERS) - 1
HBM_BIT: Final = TIER_BIT[Tier.HBM]
# A router-made mark: counts as HBM until it expires or an event settles it.
TENTATIVE_BIT: Final = 1 << N_TIERS


def cumulative_field(mask: int) -> int:
    """Tier bitmask (+ tentative bit) -> bits t set for every tier t at or
    slower than the fastest tier holding the block."""
    bits = (mask & FIELD) | (HBM_BIT if mask & TENTATIVE_BIT else 0)
    if not bits:
        return 0
    fastest = (bits & -bits).bit_length() - 1
    return FIELD & ~((1 << fastest) - 1)


_CUM: Final = tuple(cumulative_field(m) for m in range(TENTATIVE_BIT << 1))


@dataclass(slots=True)
class _PodState:
    slot: int  # position of the pod's field in the packed ints
    incarnation: str | None  # None: only tentative marks, no event stream yet
    masks: dict[int, int] = field(default_factory=dict)
    tentative: dict[int, float] = field(default_factory=dict)  # key -> expiry
    expiries: list[tuple[float, int]] = field(default_factory=list)  # heap


def _spread(spreads: tuple[tuple[int, int], ...], packed: int) -> int:
    """``packed`` with each holder's field ORed into its reader's: the union of two
    cumulative fields is the cumulative field of the union of their tiers."""
    for holder, reader in spreads:
        packed |= ((packed >> holder) & FIELD) << reader
    return packed


def _lacks(bit: int, packed: int) -> bool:
    return not packed & bit


def prefix_from_running_and(running: Sequence[int], slot: int) -> dict[Tier, int]:
    """One pod's prefix per tier from the running AND (``running[0]`` is the
    start mask, ``running[i]`` the AND over the first ``i`` keys)."""
    out: dict[Tier, int] = {}
    last = running[-1]
    for t, tier in enumerate(TIER_ORDER):
        bit = 1 << (slot * N_TIERS + t)
        if last & bit:
            out[tier] = len(running) - 1
        else:
            out[tier] = bisect_left(running, True, key=partial(_lacks, bit)) - 1
    return out


class MemoryIndex:
    """ResidencyIndex held in this process (see ``kvplane.router.index.base``)."""

    in_process = True

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._pods: dict[str, _PodState] = {}
        self._packed: dict[int, int] = {}
        self._free_slots: list[int] = []

    async def begin_incarnation(self, pod: str, incarnation: str) -> None:
        state = self._pods.get(pod)
        if state is not None and state.incarnation == incarnation:
            return
        if state is None:
            slot = self._take_slot()
        else:
            self._wipe(state)
            slot = state.slot
        self._pods[pod] = _PodState(slot, incarnation)

    async def drop_pod(self, pod: str) -> None:
        state = self._pods.pop(pod, None)
        if state is not None:
            self._wipe(state)
            heapq.heappush(self._free_slots, state.slot)

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        state = self._current(pod, incarnation)
        if state is None:
            return
        keys = blocks.keys
        bit = TIER_BIT[tier]
        keep = ~TENTATIVE_BIT if tier is Tier.HBM else -1  # a confirmed mark has done its job
        if tier is Tier.HBM and state.tentative:
            pop = state.tentative.pop
            for key in keys:
                pop(key, None)
        # _set inlined: this is the hot write path. Adding a tier only widens the
        # pod's cumulative field, so the packed value cannot become 0.
        masks, packed, shift = state.masks, self._packed, state.slot * N_TIERS
        for key in keys:
            old = masks.get(key, 0)
            new = (old | bit) & keep
            if new == old:
                continue
            masks[key] = new
            delta = _CUM[old] ^ _CUM[new]
            if delta:
                packed[key] = packed.get(key, 0) ^ (delta << shift)

    async def remove(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        state = self._current(pod, incarnation)
        if state is None:
            return
        keys = blocks.keys
        drop = TIER_BIT[tier]
        if tier is Tier.HBM:
            drop |= TENTATIVE_BIT
            for key in keys:
                state.tentative.pop(key, None)
        for key in keys:
            mask = state.masks.get(key)
            if mask is not None:
                self._set(state, key, mask & ~drop)

    async def clear(self, pod: str, incarnation: str, tier: Tier) -> None:
        state = self._current(pod, incarnation)
        if state is None:
            return
        bit = TIER_BIT[tier]
        for key, mask in list(state.masks.items()):
            if mask & bit:
                self._set(state, key, mask & ~bit)

    async def mark_tentative(self, pod: str, blocks: Blocks, ttl_s: float) -> None:
        keys = blocks.keys
        state = self._pods.get(pod)
        if state is None:
            state = self._pods[pod] = _PodState(self._take_slot(), None)
        now = self._clock()
        self._expire(state, now)
        expiry = now + ttl_s
        tentative, heap = state.tentative, state.expiries
        for key in keys:
            self._set(state, key, state.masks.get(key, 0) | TENTATIVE_BIT)
            previous = tentative.get(key)
            if previous is None:
                # one heap entry per marked key: a re-mark only moves the expiry
                heapq.heappush(heap, (expiry, key))
                tentative[key] = expiry
            elif expiry > previous:
                tentative[key] = expiry

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        return self._lookup(keys, pods, ())

    async def lookup_shared(
        self, keys: Sequence[int], pods: Sequence[str], shared: SharedReads
    ) -> PrefixMatches:
        """``lookup`` where each pod of ``shared`` also holds what its holders hold (per
        block: a run may alternate between the pod's own tiers and a store)."""
        holders = [h for pod in pods for h in shared.get(pod, ())]
        asked = list(dict.fromkeys([*pods, *holders]))
        spreads: list[tuple[int, int]] = []  # (holder's shift, reader's shift)
        slotless: list[tuple[str, str]] = []  # a reader with no state: the holder's run
        for pod in pods:
            reader = self._pods.get(pod)
            for holder in shared.get(pod, ()):
                held = self._pods.get(holder)
                if held is None:
                    continue
                if reader is None:
                    slotless.append((pod, holder))
                else:
                    spreads.append((held.slot * N_TIERS, reader.slot * N_TIERS))
        out = self._lookup(keys, asked, tuple(spreads))
        for pod, holder in slotless:
            mine = out[pod]
            for tier, n in out[holder].items():
                mine[tier] = max(mine[tier], n)
        return {pod: out[pod] for pod in pods}

    def _lookup(
        self, keys: Sequence[int], pods: Sequence[str], spreads: tuple[tuple[int, int], ...]
    ) -> PrefixMatches:
        now = self._clock()
        start = 0
        for pod in pods:
            state = self._pods.get(pod)
            if state is not None:
                self._expire(state, now)
                start |= FIELD << (state.slot * N_TIERS)
        running = [start]
        if start:
            values = map(self._packed.get, keys, repeat(0))
            if spreads:
                values = map(partial(_spread, spreads), values)
            running = list(takewhile(bool, accumulate(values, and_, initial=start)))
        out: PrefixMatches = {}
        for pod in pods:
            state = self._pods.get(pod)
            if state is None:
                out[pod] = dict.fromkeys(TIER_ORDER, 0)
            else:
                out[pod] = prefix_from_running_and(running, state.slot)
        return out

    async def incarnations(self) -> Mapping[str, str]:
        return {p: s.incarnation for p, s in self._pods.items() if s.incarnation is not None}

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        self._pods.clear()
        self._packed.clear()
        self._free_slots.clear()

    def __len__(self) -> int:
        """Number of (pod, key) entries held: for tests and memory metrics."""
        return sum(len(s.masks) for s in self._pods.values())

    def _take_slot(self) -> int:
        """Lowest free slot, so packed ints stay as short as the pod count allows."""
        if self._free_slots:
            return heapq.heappop(self._free_slots)
        return len(self._pods) + len(self._free_slots)

    def _current(self, pod: str, incarnation: str) -> _PodState | None:
        """The pod's state if ``incarnation`` is current; writes from a stale or
        never-begun stream are dropped."""
        state = self._pods.get(pod)
        if state is None or state.incarnation != incarnation:
            return None
        return state

    def _set(self, state: _PodState, key: int, mask: int) -> None:
        """Write one pod's mask for ``key`` into both views."""
        old = state.masks.get(key, 0)
        if mask == old:
            return
        if mask:
            state.masks[key] = mask
        else:
            del state.masks[key]
        delta = _CUM[old] ^ _CUM[mask]
        if delta:
            packed = self._packed.get(key, 0) ^ (delta << (state.slot * N_TIERS))
            if packed:
                self._packed[key] = packed
            else:
                del self._packed[key]

    def _wipe(self, state: _PodState) -> None:
        """Remove the pod's field from every packed key it touches."""
        clear = ~(FIELD << (state.slot * N_TIERS))
        packed = self._packed
        for key in state.masks:
            value = packed[key] & clear
            if value:
                packed[key] = value
            else:
                del packed[key]
        state.masks = {}

    def _expire(self, state: _PodState, now: float) -> None:
        """Retire tentative marks whose TTL has passed. A heap entry whose mark
        was confirmed is skipped; one whose mark was extended is re-queued."""
        heap, tentative = state.expiries, state.tentative
        while heap and heap[0][0] <= now:
            _, key = heapq.heappop(heap)
            expiry = tentative.get(key)
            if expiry is None:
                continue
            if expiry > now:
                heapq.heappush(heap, (expiry, key))
                continue
            del tentative[key]
            self._set(state, key, state.masks.get(key, 0) & ~TENTATIVE_BIT)
