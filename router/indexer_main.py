"""``kvplane indexer``: engine KV events -> the shared Redis residency index.

Runs apart from the router so that many router replicas read one index that a
single writer keeps in step with the engines. Exposes its counters on /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Iterator
from pathlib import Path

from kvplane.router.app import make_discovery, make_index, pool_generation
from kvplane.router.config import load_config
from kvplane.router.index.instrumented import CountedWrites
from kvplane.router.kvevents.service import Indexer
from kvplane.router.telemetry import indexer_blocks
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

log = logging.getLogger("kvplane.indexer")


class IndexerCollector(Collector):
    """Exports the ingest and per-stream counters at scrape time."""

    def __init__(self, indexer: Indexer) -> None:
        self._indexer = indexer

    def collect(self) -> Iterator[Metric]:
        events = CounterMetricFamily(
            "kvplane_indexer_events", "KV events ingested, by outcome", labels=["outcome"]
        )
        stats = self._indexer.ingest_stats
        for name in stats.__slots__:
            events.add_metric([name], float(getattr(stats, name)))
        yield events


async def run_indexer(config_path: str | Path, metrics_port: int) -> int:
    config = load_config(config_path)
    if config.index.backend != "redis":
        log.warning("indexer with an in-memory index only helps an embedded router")
    generation = pool_generation(config)
    index = make_index(config, generation)
    registry = CollectorRegistry()
    writes = CountedWrites(index, indexer_blocks(registry))
    indexer = Indexer(writes, generation=generation, block_size=config.model.block_size)
    if metrics_port:
        registry.register(IndexerCollector(indexer))
        start_http_server(metrics_port, registry=registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await indexer.start()

    async def follow() -> None:
        async for backends in make_discovery(config).watch():
            await indexer.set_backends(backends)
            log.info("indexing %d backends (generation %s)", len(backends), generation)

    follower = asyncio.create_task(follow(), name="discovery")
    await stop.wait()
    follower.cancel()
    await indexer.stop()
    await index.close()
    return 0
