"""Open-loop replay of a workload through one router, measured at the client.

Requests leave at their trace arrival times (scaled to wall time by the fleet's
``time_scale``) whether or not earlier ones have finished, as production traffic
does: a router that queues badly shows it in TTFT instead of slowing the load. The
client's pool has a connection for every request (``pool_limits.client_limits``), so no
request waits at the client.
Each request streams; TTFT is the first content chunk, inter-token latency the
mean gap between first and last token, cached tokens come from the final usage
chunk. Times are converted back to simulated seconds, so figures read as H100s.
A peer's benchmark proxy may name the engine it chose (``x-bench-backend``) and the
milliseconds it spent on work the peer's real frontend does natively
(``x-bench-overhead-ms``, e.g. tokenizing in Python where the peer does it in Rust):
that time is taken out of the request's TTFT.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvplane.bench.peers import BACKEND_HEADER, OVERHEAD_HEADER, worker_of
from kvplane.bench.pool_limits import client_limits, fd_budget
from kvplane.workload.results import RequestResult
from kvplane.workload.traces import TraceRequest


@dataclass(frozen=True, slots=True)
class ReplayItem:
    request: TraceRequest
    prompt: str


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    """What one router needs beyond the common request: fields added to every body, and
    the names of the workers it reports by id in a chunk's ``nvext.worker_id`` (Dynamo)."""

    extra_body: Mapping[str, Any] = field(default_factory=dict)
    worker_names: Mapping[int, str] = field(default_factory=dict)


async def _one(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    router: str,
    item: ReplayItem,
    time_scale: float,
    timeout_s: float,
    options: ReplayOptions,
) -> RequestResult:
    req = item.request
    body: dict[str, Any] = {
        **options.extra_body,
        "model": model,
        "prompt": item.prompt,
        "max_tokens": req.output_tokens,
        "min_tokens": req.output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    overhead_s = 0.0  # what a peer's proxy spent on work its real frontend does natively
    first: float | None = None
    last: float | None = None
    completion_tokens = 0
    prompt_tokens = req.input_length
    cached: int | None = None
    backend: str | None = None
    reason: str | None = None
    error: str | None = None
    try:
        async with client.stream(
            "POST", url + "/v1/completions", json=body, timeout=timeout_s
        ) as resp:
            backend = resp.headers.get("x-kvplane-pod") or resp.headers.get(BACKEND_HEADER)
            overhead_s = float(resp.headers.get(OVERHEAD_HEADER) or 0.0) / 1000.0
            reason = resp.headers.get("x-kvplane-reason")
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        error = str(chunk["error"])[:200]
                        break
                    if backend is None and options.worker_names:
                        backend = options.worker_names.get(worker_of(chunk) or -1)
                    now = time.perf_counter()
                    choices = chunk.get("choices") or []
                    if choices and choices[0].get("text"):
                        if first is None:
                            first = now
                        last = now
                    usage = chunk.get("usage")
                    if usage:
                        completion_tokens = int(usage.get("completion_tokens") or 0)
                        prompt_tokens = int(usage.get("prompt_tokens") or prompt_tokens)
                        details = usage.get("prompt_tokens_details") or {}
                        if details.get("cached_tokens") is not None:
                            cached = int(details["cached_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        error = f"{type(e).__name__}: {e}"[:200]
    end = time.perf_counter()
    if error is None and first is None:
        error = "no token received"
    ok = error is None
    ttft = (first - start - overhead_s) / time_scale if first is not None else None
    itl = None
    if first is not None and last is not None and completion_tokens > 1:
        itl = (last - first) / time_scale / (completion_tokens - 1)
    return RequestResult(
        router=router,
        ok=ok,
        ttft_s=ttft,
        itl_s=itl,
        e2e_s=(end - start) / time_scale,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        backend=backend,
        arrival_s=req.arrival_s,
        error=error,
        overhead_s=overhead_s,
        reason=reason,
    )


async def replay(
    url: str,
    model: str,
    router: str,
    items: Sequence[ReplayItem],
    *,
    time_scale: float,
    timeout_s: float = 600.0,
    progress: Callable[[int, int], None] | None = None,
    options: ReplayOptions | None = None,
) -> tuple[list[RequestResult], float]:
    """Sends every item at its arrival time; returns results and the wall duration."""
    opts = options or ReplayOptions()
    limits = client_limits(len(items), fd_budget())
    done = 0
    results: list[RequestResult | None] = [None] * len(items)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        t0 = time.perf_counter()

        async def fire(i: int, item: ReplayItem) -> None:
            nonlocal done
            delay = t0 + item.request.arrival_s * time_scale - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            results[i] = await _one(client, url, model, router, item, time_scale, timeout_s, opts)
            done += 1
            if progress is not None:
                progress(done, len(items))

        await asyncio.gather(*(fire(i, it) for i, it in enumerate(items)))
        wall = time.perf_counter() - t0
    return [r for r in results if r is not None], wall
