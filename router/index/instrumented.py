"""An index wrapper that times every successful lookup
(``kvplane_router_index_lookup_seconds``); failures are counted by ``GuardedIndex``."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvplane.router.index.base import PrefixMatches, ResidencyIndex
from kvplane.router.index.wrapper import IndexWrapper
from kvplane.router.telemetry import RouterMetrics


class InstrumentedIndex(IndexWrapper):
    def __init__(self, inner: ResidencyIndex, metrics: RouterMetrics) -> None:
        super().__init__(inner)
        self._seconds = metrics.index_lookup.labels(**metrics.labels)  # labels() costs µs

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        start = time.perf_counter()
        result = await self.inner.lookup(keys, pods)
        self._seconds.observe(time.perf_counter() - start)
        return result
