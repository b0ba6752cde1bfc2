"""An index wrapper that keeps a slow or dead index off the request path.

Every lookup of an index in another process (Redis) is cut at ``timeout_s``; after a
failure the index is skipped for a back-off that doubles up to 5 s, so an unreachable
Redis costs one timeout per back-off, not one per request. A lookup that is cut or
skipped raises ``IndexUnavailable``, which the routing policies answer with sticky
hashing (``policies.route``). Writes pass through unguarded: they are not on a
request's path.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from kvplane.router.backoff import Backoff
from kvplane.router.index.base import IndexUnavailable, PrefixMatches, ResidencyIndex
from kvplane.router.index.wrapper import IndexWrapper
from kvplane.router.telemetry import RouterMetrics

log = logging.getLogger("kvplane.router.index")

MAX_BACKOFF_S = 5.0
FIRST_BACKOFF_S = 0.25


class GuardedIndex(IndexWrapper):
    def __init__(self, inner: ResidencyIndex, timeout_s: float, metrics: RouterMetrics) -> None:
        super().__init__(inner)
        self._timeout = timeout_s
        self._errors = metrics.index_errors.labels(**metrics.labels)
        self._open_until = 0.0
        self._backoff = Backoff(FIRST_BACKOFF_S, MAX_BACKOFF_S)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        if not self.available:
            raise IndexUnavailable("skipped during back-off")
        try:
            if self.in_process:  # never waits on I/O: no deadline to keep
                result = await self.inner.lookup(keys, pods)
            else:  # a deadline on this task (wait_for would start another)
                async with asyncio.timeout(self._timeout):
                    result = await self.inner.lookup(keys, pods)
        except Exception as exc:  # timeout, connection refused, script error
            self._errors.inc()
            delay = self._backoff.next()
            self._open_until = time.monotonic() + delay
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            log.warning("index lookup failed (%s); sticky routing for %.2fs", why, delay)
            raise IndexUnavailable(why) from exc
        self._backoff.reset()
        return result
