"""Lookup latency and memory per entry, against the pods asked and the entries held.

The index is filled with a ``Residency`` through its own writes (many in flight, as
an indexer's streams are), then asked one 128-key prompt at a time, every pod of the
fleet a candidate, from one client: p50/p99 of the round trips. The answer is
checked (the pod holding the conversation holds all 128 blocks). Memory per entry is
Redis' ``used_memory`` growth over every shard (the memory index: this process's
resident set growth) divided by the entries written.
"""

from __future__ import annotations

import asyncio
import gc
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvplane.bench.index.synthetic import PROMPT_BLOCKS, Residency
from kvplane.local.redis import LocalRedis
from kvplane.router.index.base import ResidencyIndex
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.index.redis import RedisIndex
from kvplane.router.tiers import Tier
from kvplane.workload.results import percentile

GENERATION = "bench-index"
IN_FLIGHT = 16  # writes in flight while filling


@dataclass(frozen=True, slots=True)
class LookupRun:
    backend: str
    pods: int
    entries: int
    lookups: int
    p50_ms: float
    p99_ms: float
    mean_ms: float
    server_us: float  # Redis time per lookup, over every shard (0: memory)
    bytes_per_entry: float
    fill_rate: float  # entries written per second

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096


async def fill(index: ResidencyIndex, residency: Residency) -> float:
    """Write the residency; returns seconds."""
    sem = asyncio.Semaphore(IN_FLIGHT)

    async def pod(p: int) -> None:
        name = residency.pod_name(p)
        await index.begin_incarnation(name, "1")
        for blocks in residency.writes(p):
            async with sem:
                await index.store(name, "1", blocks, Tier.HBM)

    start = time.perf_counter()
    await asyncio.gather(*(pod(p) for p in range(residency.pods)))
    return time.perf_counter() - start


def _evalsha_us(local: LocalRedis) -> float:
    total = 0.0
    for client in local.clients():
        with client:
            stats = client.info("commandstats").get("cmdstat_evalsha")
            total += float(stats["usec"]) if stats else 0.0
    return total


async def _measure(
    backend: str, local: LocalRedis | None, residency: Residency, lookups: int
) -> LookupRun:
    index: ResidencyIndex
    if local is None:
        gc.collect()
        before = _rss()
        index = MemoryIndex()
    else:
        local.flush()
        before = local.used_memory()
        index = RedisIndex(local.url, GENERATION, timeout_s=30.0)
    try:
        seconds = await fill(index, residency)
        entries = residency.total_entries
        if local is None:
            gc.collect()
            used = _rss() - before
        else:
            used = local.used_memory() - before
        pods = [residency.pod_name(p) for p in range(residency.pods)]
        queries = residency.queries(lookups + 50, residency.pods)
        for _, keys in queries[:50]:  # warm: connections, scripts, the pods table
            await index.lookup(keys, pods)
        server0 = 0.0 if local is None else _evalsha_us(local)
        times: list[float] = []
        for owner, keys in queries[50:]:
            start = time.perf_counter()
            got = await index.lookup(keys, pods)
            times.append(time.perf_counter() - start)
            if got[owner][Tier.HBM] != PROMPT_BLOCKS:
                raise AssertionError(f"{backend}: {owner} holds {got[owner]}, not the prompt")
        server = 0.0 if local is None else (_evalsha_us(local) - server0) / lookups
    finally:
        await index.close()
    ms = [t * 1000 for t in times]
    return LookupRun(
        backend,
        residency.pods,
        entries,
        lookups,
        percentile(ms, 50),
        percentile(ms, 99),
        sum(ms) / len(ms),
        server,
        used / entries,
        entries / seconds,
    )


def measure(
    backend: str, local: LocalRedis | None, pods: int, entries: int, lookups: int
) -> LookupRun:
    return asyncio.run(_measure(backend, local, Residency(pods, entries), lookups))


def points(entries: list[int], pods: list[int], cap: int | None) -> list[tuple[int, int]]:
    """(pods, entries) to measure: ``entries`` at 100 pods, then ``pods`` at the largest
    size measured, every size at most ``cap``."""
    sizes = [e for e in entries if cap is None or e <= cap]
    if not sizes:
        return []
    return [(100, e) for e in sizes] + [(p, max(sizes)) for p in pods if p != 100]


def run_all(
    backends: dict[str, LocalRedis | None],
    plan: dict[str, list[tuple[int, int]]],
    lookups: int,
    progress: Callable[[str], None],
) -> list[LookupRun]:
    """``plan``: the (pods, entries) points of each backend."""
    out: list[LookupRun] = []
    for name, local in backends.items():
        for pods, entries in plan[name]:
            run = measure(name, local, pods, entries, lookups)
            progress(
                f"lookup {name} pods={pods} entries={run.entries:,}: p50 {run.p50_ms:.3f} "
                f"p99 {run.p99_ms:.3f} ms, server {run.server_us:.0f} us, "
                f"{run.bytes_per_entry:.1f} B/entry, fill {run.fill_rate:,.0f}/s"
            )
            out.append(run)
        if local is not None:
            local.flush()
    return out
