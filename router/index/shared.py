"""Shared-store residency: a remote-tier block is the store's, not its writer's.

``SharedTierIndex`` wraps a backend (memory or Redis). Writes of the remote tier by a
pod that writes to a shared store go to the store's holder (``router.shared``), so they
outlive the writer: its death or new incarnation drops only its own tiers. A lookup
asks the backend for the pods and their stores' holders at once, and the backend
counts a holder's blocks for each pod that reads it, block by block. Everything else
passes through.

The store's blocks leave the index with the store's own BlockRemoved events (the
remote medium), from whichever reader reports them. For a store that publishes none,
``capacity_blocks`` models it: an LRU of the blocks written through this index, the
least recently written dropped beyond the capacity; without either, its blocks stay
indexed until the pool's generation changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from kvplane.router.index.base import Blocks, PrefixMatches, ResidencyIndex
from kvplane.router.index.wrapper import IndexWrapper
from kvplane.router.shared import HOLDER_INCARNATION, SharedReads, SharedStores
from kvplane.router.tiers import Tier


class SharedLookup(ResidencyIndex, Protocol):
    """A backend that can count holders' blocks for their readers (both backends)."""

    async def lookup_shared(
        self, keys: Sequence[int], pods: Sequence[str], shared: SharedReads
    ) -> PrefixMatches: ...


class SharedTierIndex(IndexWrapper):
    def __init__(self, inner: SharedLookup, stores: SharedStores) -> None:
        super().__init__(inner)
        self.backend = inner
        self.stores = stores
        self._begun: set[str] = set()
        self._lru: dict[str, OrderedDict[int, int]] = {}  # holder -> key -> anchor

    async def _holder(self, pod: str, tier: Tier) -> str | None:
        """The holder that takes ``pod``'s writes of ``tier`` (None: the pod's own)."""
        if tier is not Tier.REMOTE:
            return None
        holder = self.stores.writes_to(pod)
        if holder is not None and holder not in self._begun:
            await self.inner.begin_incarnation(holder, HOLDER_INCARNATION)  # idempotent
            self._begun.add(holder)
        return holder

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        holder = await self._holder(pod, tier)
        if holder is None:
            await self.inner.store(pod, incarnation, blocks, tier)
            return
        await self.inner.store(holder, HOLDER_INCARNATION, blocks, tier)
        capacity = self.stores.capacity(holder)
        if capacity is not None:
            lru = self._lru.setdefault(holder, OrderedDict())
            for key, anchor in zip(blocks.keys, blocks.anchors, strict=True):
                lru[key] = anchor
                lru.move_to_end(key)
            over = [lru.popitem(last=False) for _ in range(len(lru) - capacity)]
            if over:
                gone = Blocks([k for k, _ in over], [a for _, a in over])
                await self.inner.remove(holder, HOLDER_INCARNATION, gone, tier)

    async def remove(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        holder = await self._holder(pod, tier)
        if holder is None:
            await self.inner.remove(pod, incarnation, blocks, tier)
            return
        await self.inner.remove(holder, HOLDER_INCARNATION, blocks, tier)
        lru = self._lru.get(holder)
        if lru is not None:
            for key in blocks.keys:
                lru.pop(key, None)

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        reads = self.stores.reads(pods)
        if not reads:
            return await self.inner.lookup(keys, pods)
        return await self.backend.lookup_shared(keys, pods, reads)


def with_shared_stores(index: SharedLookup, stores: SharedStores) -> ResidencyIndex:
    """``index`` behind a ``SharedTierIndex`` when the pool has shared stores."""
    return SharedTierIndex(index, stores) if stores else index
