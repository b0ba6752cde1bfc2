"""Ingest rate through the real event path: decode (``decode_batch``), re-key and plan
(``Ingestor``), write (the index), for every pod's stream at once.

With several processes, each takes a share of the pods (as indexers sharing a pool by
ownership do) and they start together; the rate is all their block events over the
span from the first start to the last end. CPU is counted per process (client) and,
for Redis, from the servers' own ``used_cpu`` counters.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvplane.bench.index.synthetic import StreamShape, event_stream
from kvplane.local.redis import LocalRedis
from kvplane.router.index.base import ResidencyIndex
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.index.redis import RedisIndex
from kvplane.router.kvevents.decode import decode_batch
from kvplane.router.kvevents.ingest import Ingestor

GENERATION = "bench-index"


@dataclass(frozen=True, slots=True)
class IngestRun:
    backend: str
    processes: int
    pods: int
    block_events: int
    seconds: float
    client_cpu_s: float
    server_cpu_s: float

    @property
    def rate(self) -> float:
        return self.block_events / self.seconds if self.seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rate": self.rate}


async def _ingest(
    index: ResidencyIndex, pods: Sequence[int], shape: StreamShape
) -> tuple[int, float, float, float]:
    """(block events, start, end, cpu seconds) of every pod's stream into ``index``."""
    streams = {f"pod-{p:04d}": event_stream(p, shape) for p in pods}
    ingestor = Ingestor(index, generation=GENERATION, block_size=shape.block_size)
    for name in streams:
        await index.begin_incarnation(name, "1")

    async def one(name: str, batches: list[bytes]) -> None:
        for payload in batches:
            await ingestor.apply(name, "1", decode_batch(payload))

    events = sum(count for _, count in streams.values())
    start, cpu = time.time(), time.process_time()
    await asyncio.gather(*(one(name, batches) for name, (batches, _) in streams.items()))
    return events, start, time.time(), time.process_time() - cpu


def _worker(
    url: str | None,
    pods: list[int],
    shape: StreamShape,
    ready: Any,
    go: Any,
    results: Any,
) -> None:
    async def main() -> None:
        index: ResidencyIndex = MemoryIndex() if url is None else RedisIndex(url, GENERATION)
        try:
            await index.ping()
            ready.put(True)
            await asyncio.to_thread(go.wait)  # the others may still be making their streams
            results.put(await _ingest(index, pods, shape))
        finally:
            await index.close()

    asyncio.run(main())


def _server_cpu(local: LocalRedis | None) -> float:
    if local is None:
        return 0.0
    total = 0.0
    for client in local.clients():
        with client:
            info = client.info("cpu")
            total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


def measure(
    backend: str,
    local: LocalRedis | None,
    pods: int,
    processes: int,
    shape: StreamShape,
) -> IngestRun:
    """Ingest ``pods`` streams with ``processes`` processes (memory: one, in this one)."""
    if local is None:
        events, start, end, cpu = asyncio.run(_ingest(MemoryIndex(), range(pods), shape))
        return IngestRun(backend, 1, pods, events, end - start, cpu, 0.0)
    local.flush()
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [list(range(i, pods, processes)) for i in range(processes)]
    procs = [
        ctx.Process(target=_worker, args=(local.url, share, shape, ready, go, results))
        for share in shares
    ]
    for proc in procs:
        proc.start()
    try:
        for _ in procs:
            ready.get(timeout=600)
        cpu0 = _server_cpu(local)
        go.set()
        got = [results.get(timeout=1800) for _ in procs]
        server_cpu = _server_cpu(local) - cpu0
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    events = sum(g[0] for g in got)
    span = max(g[2] for g in got) - min(g[1] for g in got)
    return IngestRun(backend, processes, pods, events, span, sum(g[3] for g in got), server_cpu)


def run_all(
    backends: dict[str, LocalRedis | None],
    pods: int,
    processes: Sequence[int],
    shape: StreamShape,
    progress: Callable[[str], None],
) -> list[IngestRun]:
    out: list[IngestRun] = []
    for name, local in backends.items():
        for n in [1] if local is None else processes:
            run = measure(name, local, pods, n, shape)
            progress(
                f"ingest {name} x{n}: {run.rate:,.0f} block events/s "
                f"(client {run.client_cpu_s / run.block_events * 1e6:.2f} us/event, "
                f"server {run.server_cpu_s / run.block_events * 1e6:.2f} us/event)"
            )
            out.append(run)
    return out
