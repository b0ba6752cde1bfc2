"""``kvplane indexer``: engine KV events -> the shared Redis residency index.

Runs apart from the router so that many router replicas read one index that the
indexers keep in step with the engines. Any number of indexers may serve a pool:
each pod's stream is owned by exactly one of them (``kvevents.ownership``) and taken
over when its owner dies. One of them at a time collects the index's garbage
(``index.redis_gc``). Exposes its counters, back-pressure included, on /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from kvplane.router.app import make_backend, make_discovery, pool_generation
from kvplane.router.config import Backend, load_config
from kvplane.router.index.base import ResidencyIndex
from kvplane.router.index.instrumented import CountedWrites
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.redis_gc import DEFAULT_GRACE_S, run_collector
from kvplane.router.index.shared import with_shared_stores
from kvplane.router.kvevents.ownership import DEFAULT_LEASE_S, Ownership, new_owner_id
from kvplane.router.kvevents.service import Indexer
from kvplane.router.shared import SharedStores
from kvplane.router.telemetry import indexer_blocks
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvplane.indexer")

ROUNDS_PER_LEASE: Final = 3  # ownership rounds per lease: a lease survives two lost rounds


class IndexerCollector(Collector):
    """Exports the ingest and per-stream counters at scrape time."""

    def __init__(
        self, indexer: Indexer, index: ResidencyIndex, ownership: Ownership | None = None
    ) -> None:
        """``index``: the index the indexer writes, under any wrapper."""
        self._indexer = indexer
        self._index = index
        self._ownership = ownership

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "kvplane_indexer_events", "KV events ingested, by outcome", labels=["outcome"]
        )
        stats = self._indexer.ingest_stats
        for name in stats.__slots__:
            events.add_metric([name], float(getattr(stats, name)))
        yield events
        lag = GaugeMetricFamily(
            "kvplane_indexer_lag_seconds",
            "how far behind its engine each stream's last applied batch was",
            labels=["pod"],
        )
        for pod, seconds in self._indexer.lag_s.items():
            lag.add_metric([pod], seconds)
        yield lag
        index = self._index
        if isinstance(index, RedisIndex):
            yield GaugeMetricFamily(
                "kvplane_indexer_pending_blocks",
                "blocks waiting for the index's next write round trip",
                value=float(index.pending_fields),
            )
            yield CounterMetricFamily(
                "kvplane_indexer_write_round_trips",
                "write scripts sent to index nodes",
                value=float(index.flushes),
            )
            yield CounterMetricFamily(
                "kvplane_indexer_written_blocks",
                "block writes applied to the index",
                value=float(index.flushed_fields),
            )
        if self._ownership is not None:
            yield GaugeMetricFamily(
                "kvplane_indexer_owned_pods",
                "pods whose stream this indexer owns",
                value=float(len(self._ownership.held)),
            )
            yield GaugeMetricFamily(
                "kvplane_indexer_live_indexers",
                "indexers of this pool alive",
                value=float(len(self._ownership.live)),
            )


class Discovered:
    """The latest backend list discovery gave, and whether it is news."""

    def __init__(self) -> None:
        self.backends: list[Backend] = []
        self.news = asyncio.Event()

    def update(self, backends: list[Backend]) -> None:
        self.backends = backends
        self.news.set()


async def follow_ownership(
    indexer: Indexer, ownership: Ownership, discovered: Discovered, stop: asyncio.Event
) -> None:
    """Index exactly the discovered pods this indexer owns, round after round."""
    period = ownership.lease_s / ROUNDS_PER_LEASE
    while not stop.is_set():
        discovered.news.clear()
        backends = discovered.backends
        try:
            wanted = set(ownership.wanted([b.name for b in backends]))
            # stop streams this indexer no longer ranks first for, then let their leases go
            await indexer.set_backends(
                [b for b in indexer.backends if b.name in wanted and b.name in ownership.held]
            )
            release = sorted(ownership.held - wanted)
            held = (await ownership.round(sorted(wanted), release)).held
            await indexer.set_backends([b for b in backends if b.name in held])
        except Exception as exc:
            log.warning("ownership round failed (%s: %s)", type(exc).__name__, exc)
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, discovered.news)]
        await asyncio.wait(waits, timeout=period, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()


async def run_indexer(
    config_path: str | Path,
    metrics_port: int,
    *,
    indexer_id: str | None = None,
    lease_s: float = DEFAULT_LEASE_S,
) -> int:
    config = load_config(config_path)
    if config.index.backend != "redis":
        log.warning("indexer with an in-memory index only helps an embedded router")
    generation = pool_generation(config)
    owner = indexer_id or new_owner_id()
    index = make_backend(config, generation, owner if config.index.backend == "redis" else None)
    registry = CollectorRegistry()
    stores = SharedStores.of(config.shared_stores)
    writes = CountedWrites(with_shared_stores(index, stores), indexer_blocks(registry))
    indexer = Indexer(
        writes,
        generation=generation,
        block_size=config.model.block_size,
        unreported=config.unreported_tier,
    )
    ownership = Ownership(index, owner, lease_s) if isinstance(index, RedisIndex) else None
    log.info("indexer %s (generation %s)", owner, generation)
    if metrics_port:
        registry.register(IndexerCollector(indexer, index, ownership))
        start_http_server(metrics_port, registry=registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    discovered = Discovered()

    async def follow() -> None:
        async for backends in make_discovery(config).watch():
            log.info("%d backends discovered (generation %s)", len(backends), generation)
            if ownership is None:
                await indexer.set_backends(backends)
            else:
                discovered.update(backends)

    await indexer.start()
    tasks = [asyncio.create_task(follow(), name="discovery")]
    if ownership is not None:
        assert isinstance(index, RedisIndex)
        tasks.append(asyncio.create_task(follow_ownership(indexer, ownership, discovered, stop)))
        # a dead slot is reused only once no writer can still write it nor its marks live
        grace = max(DEFAULT_GRACE_S, 2 * index.window_s + lease_s + 5)
        gc = run_collector(index, owner, stop, grace_s=grace)
        tasks.append(asyncio.create_task(gc, name="index-gc"))
    await stop.wait()
    tasks[0].cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await indexer.stop()
    if ownership is not None:
        with contextlib.suppress(Exception):  # hand over at once rather than at lease expiry
            await ownership.leave()
    await index.close()
    return 0
