"""The ``/metrics`` page of a simulated engine, with vLLM's names, labels and buckets.

Routers and dashboards read these by name (``vllm:num_requests_waiting`` for load,
``vllm:kv_cache_usage_perc`` for pressure, ``vllm:prefix_cache_hits_total`` over
``..._queries_total`` for the hit rate), so every family keeps vLLM 0.32/0.33's exact
name, HELP text, type, label set (``engine``, ``model_name``, sorted as
prometheus_client writes them) and bucket bounds, and counters carry the ``_total`` /
``_created`` series prometheus_client adds. Rendering is a pure function of the
counters: no registry, no locks, nothing global.

Times are *simulated* seconds (wall seconds divided by the fleet's time scale), so
the histograms read as they would on the modeled hardware.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from kvplane.sim.engine import EngineStats

# vLLM 0.32 v1/metrics bucket families (read from a live engine's /metrics)
TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: Final = (
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
)  # fmt: skip
PARAMS_N_BUCKETS: Final = (1.0, 2.0, 5.0, 10.0, 20.0)
FINISH_REASONS: Final = ("stop", "length", "abort", "error", "repetition")


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to ``max_model_len`` (token-count histograms)."""
    out: list[float] = []
    exp = 1
    while True:
        for m in (1, 2, 5):
            v = m * exp
            if v > max_model_len:
                return tuple(out)
            out.append(float(v))
        exp *= 10


@dataclass(slots=True)
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, the last one is +Inf
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1


@dataclass(slots=True)
class RequestHistograms:
    """Per-request and per-iteration distributions the server records as it runs."""

    max_model_len: int
    ttft: Histogram = field(init=False)
    itl: Histogram = field(init=False)
    tpot: Histogram = field(init=False)
    e2e: Histogram = field(init=False)
    queue: Histogram = field(init=False)
    inference: Histogram = field(init=False)
    prefill: Histogram = field(init=False)
    decode: Histogram = field(init=False)
    prompt_tokens: Histogram = field(init=False)
    generation_tokens: Histogram = field(init=False)
    max_tokens: Histogram = field(init=False)
    params_n: Histogram = field(init=False)
    max_num_generation_tokens: Histogram = field(init=False)
    prefill_kv_computed: Histogram = field(init=False)
    iteration_tokens: Histogram = field(init=False)

    def __post_init__(self) -> None:
        tok = request_tokens_buckets(self.max_model_len)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.tpot = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue = Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode = Histogram(REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = Histogram(tok)
        self.generation_tokens = Histogram(tok)
        self.max_tokens = Histogram(tok)
        self.params_n = Histogram(PARAMS_N_BUCKETS)
        self.max_num_generation_tokens = Histogram(tok)
        self.prefill_kv_computed = Histogram(tok)
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)

    def families(self) -> Iterator[tuple[str, str, Histogram]]:
        """(name, HELP, histogram) in vLLM's registration order."""
        yield (
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            (self.iteration_tokens),
        )
        yield (
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed.",
            (self.prompt_tokens),
        )
        yield (
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            (self.generation_tokens),
        )
        yield (
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            self.max_num_generation_tokens,
        )
        yield "vllm:request_params_n", "Histogram of the n request parameter.", self.params_n
        yield (
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            (self.max_tokens),
        )
        yield (
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            (self.ttft),
        )
        yield (
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            (self.itl),
        )
        yield (
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            self.tpot,
        )
        yield (
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            (self.e2e),
        )
        yield (
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            self.queue,
        )
        yield (
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            self.inference,
        )
        yield (
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            self.prefill,
        )
        yield (
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            self.decode,
        )
        yield (
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            self.prefill_kv_computed,
        )


@dataclass(frozen=True, slots=True)
class TransferCounters:
    """KV a connector supplied (P/D: received from a prefill engine), which EngineStats
    does not count: vLLM reports it as external prefix-cache queries and hits."""

    external_queries: int = 0
    external_hits: int = 0


def _fmt(v: float) -> str:
    """Prometheus float text as prometheus_client writes it (``1.0``, ``+Inf``)."""
    if v == float("inf"):
        return "+Inf"
    return repr(float(v))


def _labels(base: Mapping[str, str], **extra: str) -> str:
    merged = {**base, **extra}
    return ",".join(f'{k}="{merged[k]}"' for k in sorted(merged))


class _Page:
    def __init__(self, base: Mapping[str, str], created: float) -> None:
        self.base = base
        self.created = _fmt(created)
        self.lines: list[str] = []

    def gauge(self, name: str, help_: str, values: list[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge"]
        self.lines += [f"{name}{{{_labels(self.base, **lab)}}} {_fmt(v)}" for lab, v in values]

    def counter(self, name: str, help_: str, values: list[tuple[dict[str, str], float]]) -> None:
        self.lines += [f"# HELP {name}_total {help_}", f"# TYPE {name}_total counter"]
        self.lines += [
            f"{name}_total{{{_labels(self.base, **lab)}}} {_fmt(v)}" for lab, v in values
        ]
        self.lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
        self.lines += [
            f"{name}_created{{{_labels(self.base, **lab)}}} {self.created}" for lab, _ in values
        ]

    def histogram(self, name: str, help_: str, h: Histogram) -> None:
        self.lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        cum = 0
        for bound, count in zip((*h.bounds, float("inf")), h.counts, strict=True):
            cum += count
            self.lines.append(f"{name}_bucket{{{_labels(self.base, le=_fmt(bound))}}} {cum}.0")
        lab = _labels(self.base)
        self.lines += [f"{name}_count{{{lab}}} {h.n}.0", f"{name}_sum{{{lab}}} {_fmt(h.total)}"]
        self.lines += [f"# HELP {name}_created {help_}", f"# TYPE {name}_created gauge"]
        self.lines.append(f"{name}_created{{{lab}}} {self.created}")


def render_metrics(
    *,
    model_name: str,
    engine: str,
    stats: EngineStats,
    hists: RequestHistograms,
    cache_config: Mapping[str, str],
    created: float,
    transfers: TransferCounters | None = None,
    lora_series: Sequence[tuple[dict[str, str], float]] = (),
) -> str:
    """The whole Prometheus text page (format 0.0.4) of one engine; ``lora_series``:
    vllm:lora_requests_info's label sets and the times they were set (LoRA engines)."""
    p = _Page({"engine": engine, "model_name": model_name}, created)
    none: dict[str, str] = {}
    p.gauge(
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        [(none, stats.num_running)],
    )
    p.gauge(
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        [(none, stats.num_waiting)],
    )
    p.gauge(
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        [(none, stats.kv_cache_usage)],
    )
    p.counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        [(none, stats.prefix_cache_queries)],
    )
    p.counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        [(none, stats.prefix_cache_hits)],
    )
    xfer = transfers or TransferCounters()
    ext_queries = stats.external_prefix_cache_queries + xfer.external_queries
    ext_hits = stats.external_prefix_cache_hits + xfer.external_hits
    p.counter(
        "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, "
        "in terms of number of queried tokens.",
        [(none, ext_queries)],
    )
    p.counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, "
        "in terms of number of cached tokens.",
        [(none, ext_hits)],
    )
    p.counter(
        "vllm:num_preemptions",
        "Cumulative number of preemption from the engine.",
        [(none, stats.num_preemptions)],
    )
    p.counter(
        "vllm:prompt_tokens",
        "Number of prefill tokens processed.",
        [(none, stats.prompt_tokens)],
    )
    cached = stats.prompt_tokens_cached + xfer.external_hits
    p.counter(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        [
            ({"source": "local_compute"}, max(0, stats.prompt_tokens - cached)),
            ({"source": "local_cache_hit"}, max(0, cached - ext_hits)),
            ({"source": "external_kv_transfer"}, ext_hits),
        ],
    )
    p.counter(
        "vllm:prompt_tokens_cached",
        "Number of cached prompt tokens (local + external).",
        [(none, cached)],
    )
    p.counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        [(none, stats.generation_tokens)],
    )
    reasons = list(FINISH_REASONS) + sorted(set(stats.request_success) - set(FINISH_REASONS))
    p.counter(
        "vllm:request_success",
        "Count of successfully processed requests.",
        [({"finished_reason": r}, stats.request_success.get(r, 0)) for r in reasons],
    )
    for name, help_, h in hists.families():
        p.histogram(name, help_, h)
    if lora_series:  # labels of its own only, valued at the time set (as vLLM writes it)
        p.lines += [
            "# HELP vllm:lora_requests_info Running stats on lora requests.",
            "# TYPE vllm:lora_requests_info gauge",
        ]
        p.lines += [
            f"vllm:lora_requests_info{{{_labels(labels)}}} {_fmt(at)}" for labels, at in lora_series
        ]
    # an info gauge: the engine index and the config, no model_name (as vLLM writes it)
    info = _labels({"engine": engine, **cache_config})
    p.lines += [
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
        "# TYPE vllm:cache_config_info gauge",
        f"vllm:cache_config_info{{{info}}} 1.0",
    ]
    return "\n".join(p.lines) + "\n"
