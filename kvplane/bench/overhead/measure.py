"""Measurement: open-loop rate steps and the search for the maximum sustainable rate."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.bench.overhead.client import Target
from kvplane.workload.results import percentile


@dataclass
class StepResult:
    offered_rps: float
    requests: int
    errors: int
    p50_ms: float
    p99_ms: float
    achieved_rps: float
    ok: bool


async def rate_step(
    target: Target, payloads: Sequence[Sequence[bytes]], rate: float, bound_s: float
) -> StepResult:
    """Open loop: request k leaves at t0 + k/rate; latency counts from that instant."""
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    errors = 0
    last_done = 0.0
    clock = time.perf_counter  # loop.time() is millisecond-grained on uvloop

    async def one(variants: Sequence[bytes], sched: float) -> None:
        nonlocal errors, last_done
        try:
            ok = await target.send(variants)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            ok = False
        now = clock()
        if ok:
            lat.append(now - sched)
            last_done = max(last_done, now)
        else:
            errors += 1

    n = len(payloads)
    t0 = clock() + 0.01
    tasks: list[asyncio.Task[None]] = []
    k = 0
    while k < n:
        now = clock()
        while k < n and t0 + k / rate <= now:
            tasks.append(loop.create_task(one(payloads[k], t0 + k / rate)))
            k += 1
        if k < n:
            await asyncio.sleep(max(0.0, t0 + k / rate - clock()))
    drain = max(2.0, 10 * bound_s)
    _, pending = await asyncio.wait(tasks, timeout=drain) if tasks else (set(), set())
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=2.0)
        errors += len(pending)
        target.close()  # half-read connections cannot be reused
    p99 = percentile(lat, 99) if lat else math.inf
    span = max(last_done - t0, 1e-9)
    return StepResult(
        offered_rps=rate,
        requests=n,
        errors=errors,
        p50_ms=percentile(lat, 50) * 1e3 if lat else math.inf,
        p99_ms=p99 * 1e3,
        achieved_rps=len(lat) / span,
        ok=errors == 0 and p99 <= bound_s,
    )


async def _settle(target: Target, probe: Sequence[bytes], baseline_s: float) -> None:
    """After an overloaded step: wait (bounded) until the target answers at its idle speed."""
    deadline = time.monotonic() + 10
    await asyncio.sleep(0.3)
    while time.monotonic() < deadline:
        t = await target.timed(probe)
        if t is not None and t < 3 * baseline_s + 0.002:
            return
        await asyncio.sleep(0.3)


async def max_rps(
    target: Target,
    make_payloads: Callable[[int], list[list[bytes]]],
    start_rps: float,
    bound_s: float,
    step_s: float,
    max_steps: int,
    probe: Sequence[bytes],
    idle_latency_s: float,
) -> tuple[float, list[StepResult]]:
    """Highest offered rate that passes: double until a failure, then bisect (bounded).

    A failed rate is tried once more before it counts: on a shared machine one
    spike from a neighbour would otherwise decide a short step (its p99 is
    nearly its maximum). Each try is a step of its own in the returned list.
    """
    rate = max(1.0, start_rps)
    best = 0.0
    fail = math.inf
    steps: list[StepResult] = []
    tries = 0
    deadline = time.monotonic() + 25 * step_s  # a wall-clock cap on top of max_steps
    while tries < max_steps and time.monotonic() < deadline:
        ok = False
        for _attempt in range(2):
            tries += 1
            # at low rates a step of step_s seconds is too few requests for a p99
            n = max(round(rate * step_s), min(20, max(8, round(3 * rate * step_s))))
            res = await rate_step(target, make_payloads(n), rate, bound_s)
            steps.append(res)
            ok = res.ok
            if not ok:
                await _settle(target, probe, idle_latency_s)
            if ok or tries >= max_steps:
                break
        if ok:
            best = max(best, rate)
        else:
            fail = min(fail, rate)
        if fail <= 1.0 or (best > 0 and fail < math.inf and fail / best <= 1.25):
            break
        if fail == math.inf:
            rate = rate * 2
        elif best == 0:
            rate = max(1.0, rate / 3)
        else:
            rate = math.sqrt(best * fail)
    target.close()  # the sockets of a search end with it
    return best, steps


def hf_tokenizer(tokenizer_dir: Path) -> Any:
    """The transformers fast tokenizer: the standalone tokenization figure's reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))
