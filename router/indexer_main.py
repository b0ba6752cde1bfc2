"""``kvplane indexer``: engine KV events -> the shared Redis residency index.

Runs apart from the router so that many router replicas read one index that a
single writer keeps in step with the engines. Exposes its counters on /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kvplane.router.app import make_index, pool_generation
from kvplane.router.config import load_config
from kvplane.router.kvevents.service import Indexer

log = logging.getLogger("kvplane.indexer")


def _export(indexer: Indexer, registry: CollectorRegistry) -> None:
    """Mirror the ingest counters into gauges (they are monotonic ints upstream)."""
    gauge = Gauge(
        "kvplane_indexer_events", "KV events ingested, by outcome", ("outcome",), registry=registry
    )

    def collect() -> None:
        stats = indexer.ingest_stats
        for name in stats.__slots__:
            gauge.labels(outcome=name).set(getattr(stats, name))

    gauge.collect = _wrap(gauge.collect, collect)  # type: ignore[method-assign]


def _wrap(inner, before):  # type: ignore[no-untyped-def]
    def run():  # type: ignore[no-untyped-def]
        before()
        return inner()

    return run


async def run_indexer(config_path: str | Path, metrics_port: int) -> int:
    config = load_config(config_path)
    if config.index.backend != "redis":
        log.warning("indexer with an in-memory index only helps an embedded router")
    generation = pool_generation(config)
    index = make_index(config, generation)
    indexer = Indexer(
        index, generation=generation, block_size=config.model.block_size, backends=config.backends
    )
    if metrics_port:
        registry = CollectorRegistry()
        _export(indexer, registry)
        start_http_server(metrics_port, registry=registry)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await indexer.start()
    log.info("indexer running for %d backends (generation %s)", len(config.backends), generation)
    await stop.wait()
    await indexer.stop()
    await index.close()
    return 0
