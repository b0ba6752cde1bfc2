"""Index wrappers for metrics: ``InstrumentedIndex`` times every successful lookup
(``kvplane_router_index_lookup_seconds``; failures are counted by ``GuardedIndex``);
``CountedWrites`` counts the blocks the indexer stores and removes per tier
(``kvplane_indexer_blocks_total``: a removal from HBM is an eviction)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvplane.router import tracing
from kvplane.router.index.base import Blocks, PrefixMatches, ResidencyIndex
from kvplane.router.index.wrapper import IndexWrapper
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.tiers import Tier
from prometheus_client import Counter


class InstrumentedIndex(IndexWrapper):
    def __init__(self, inner: ResidencyIndex, metrics: RouterMetrics) -> None:
        super().__init__(inner)
        self._seconds = metrics.index_lookup.labels(**metrics.labels)  # labels() costs µs

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        start = time.perf_counter()
        result = await self.inner.lookup(keys, pods)
        self._seconds.observe(time.perf_counter() - start)
        tracing.record("kvplane.index_lookup", start)
        return result


class CountedWrites(IndexWrapper):
    def __init__(self, inner: ResidencyIndex, blocks: Counter) -> None:
        """``blocks``: a counter labelled (event, tier)."""
        super().__init__(inner)
        self._blocks = blocks

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        await self.inner.store(pod, incarnation, blocks, tier)
        self._blocks.labels("stored", tier.value).inc(len(blocks.keys))

    async def remove(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        await self.inner.remove(pod, incarnation, blocks, tier)
        self._blocks.labels("removed", tier.value).inc(len(blocks.keys))
