"""A router's background life: pod discovery, engine scrapes and (with the in-memory
index) KV event ingestion, started before the first request and stopped after the
last. The HTTP router and the endpoint picker run the same ``Router`` state through
these two calls."""

from __future__ import annotations

import asyncio
import gc
from typing import TYPE_CHECKING

from kvplane.router.config import Backend
from kvplane.router.discovery import Discovery
from kvplane.router.kvevents.service import Indexer
from kvplane.router.pool import Scraper

if TYPE_CHECKING:
    from kvplane.router.app import Router

FIRST_BACKENDS_WAIT_S = 1.0


async def start(router: Router, discovery: Discovery, embed: bool) -> None:
    """Follow ``discovery``, scrape the backends once and then on an interval, and
    ingest KV events in this process when ``embed``."""
    config = router.config
    await router.gate.start()
    router.scraper = Scraper(router.pool, config.scrape_interval_s, config.connect_timeout_s)
    if embed:
        router.indexer = Indexer(
            router.index,
            generation=router.generation,
            block_size=config.model.block_size,
            unreported=config.unreported_tier,
        )
        await router.indexer.start()
    watch = asyncio.create_task(_follow_discovery(router, discovery), name="discovery")
    router.tasks.append(watch)
    for _ in range(int(FIRST_BACKENDS_WAIT_S / 0.01)):  # the first backend set, before serving
        if router.pool.states or watch.done():
            break
        await asyncio.sleep(0.01)
    await router.scraper.scrape_once()
    router.scraper.start()


def settle() -> None:
    """What start-up built (tokenizer, templates, models, imports) lives as long as the
    process: out of the collector's sight, a full collection stays short instead of
    walking it all in some request's path."""
    gc.collect()
    gc.freeze()


async def stop(router: Router) -> None:
    await router.gate.stop()
    if router.scraper is not None:
        await router.scraper.stop()
    if router.indexer is not None:
        await router.indexer.stop()
    for task in router.tasks:
        task.cancel()
    await router.client.aclose()
    router.proxy.close()
    await router.index.close()
    router.tokenizer.close()
    router.pipeline.close()
    router.tracing.shutdown()


async def _follow_discovery(router: Router, discovery: Discovery) -> None:
    async for backends in discovery.watch():
        await apply_backends(router, backends)


async def apply_backends(router: Router, backends: list[Backend]) -> None:
    _, removed = router.pool.set_backends(backends)
    urls = [s.backend.url for s in router.pool.states.values()]
    router.proxy.retain(urls)
    if router.scraper is not None:
        router.scraper.retain(urls)
    if router.indexer is not None:
        await router.indexer.set_backends(backends)
    for name in removed:  # nothing kept per pod outlives it
        router.metrics.forget_pod(name)
        router.proxy.forget(name)
        for key in [k for k in router.metric_children if k[-1] == name]:
            del router.metric_children[key]
