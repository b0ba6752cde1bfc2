"""Routing benchmark figures: per-request results -> one result row per router.

Pure functions over plain data, shared by the HTTP harness and the discrete-event
simulator so that both report the same numbers the same way.

- ``hit_ratio``: engine-reported cached prompt tokens / prompt tokens (successful requests).
- ``oracle_hit_ratio``: the same with one infinite cache shared by the whole fleet and
  perfect knowledge: the ceiling any router can reach on the trace.
- ``imbalance``: max / mean of the prefill tokens each engine *computed* (not cached).
- percentiles are nearest-rank.
"""

from __future__ import annotations

import json
import lzma
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final, overload

from kvplane.router.blockkeys import chain_keys
from kvplane.workload.traces import TraceRequest, Workload

STALL_S: Final = 0.1  # a token gap this long had a prefill chunk (or a KV wait) in its step


@dataclass(slots=True)
class RequestResult:
    router: str
    ok: bool
    ttft_s: float | None = None
    itl_s: float | None = None  # mean gap between output tokens: (t_last - t_first) / (n - 1)
    e2e_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    backend: str | None = None
    arrival_s: float = 0.0
    error: str | None = None
    output_tokens: int | None = None
    overhead_s: float = 0.0  # a peer proxy's own work, taken out of ttft_s (benchmarks)
    reason: str | None = None  # the router's stated reason for its pod (x-kvplane-reason)


def mean_itl(t_first: float, t_last: float, n_tokens: int) -> float | None:
    """A request's mean inter-token latency; None with fewer than two tokens."""
    if n_tokens < 2:
        return None
    return (t_last - t_first) / (n_tokens - 1)


# The leading keys of a result row, in order; extras follow.
CORE_KEYS = (
    "router",
    "workload",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "itl_p50_ms",
    "throughput_rps",
    "errors",
    "hit_ratio",
    "oracle_hit_ratio",
    "imbalance",
    "router_cpu_s",
)


@dataclass(slots=True)
class RunRecord:
    """One row of ``bench/results/routing-<date>.json``."""

    router: str
    workload: str
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    throughput_rps: float
    errors: int
    hit_ratio: float | None
    oracle_hit_ratio: float | None
    imbalance: float | None
    router_cpu_s: float | None
    mode: str = "http"  # "http" | "des"
    engines: int = 0
    profile: str = ""
    offered_rps: float = 0.0
    requests: int = 0
    itl_p99_ms: float | None = None
    ttft_mean_ms: float | None = None
    captured_reuse: float | None = None  # hit_ratio / oracle_hit_ratio
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in CORE_KEYS}
        for k in (
            "mode",
            "engines",
            "profile",
            "offered_rps",
            "requests",
            "itl_p99_ms",
            "ttft_mean_ms",
            "captured_reuse",
            "notes",
        ):
            out[k] = getattr(self, k)
        out.update(self.extra)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RunRecord:
        known = set(cls.__dataclass_fields__) - {"extra"}
        kwargs = {k: v for k, v in data.items() if k in known}
        return cls(**kwargs, extra={k: v for k, v in data.items() if k not in known})


def percentile(xs: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100]."""
    if not xs:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside [0, 100]")
    ordered = sorted(xs)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def imbalance(prefill_tokens_per_engine: Mapping[str, int]) -> float:
    """max / mean of the prefill tokens each engine computed (1.0 = perfectly even).

    Engines that got nothing must be present with 0: they are what makes a fleet
    unbalanced."""
    if not prefill_tokens_per_engine:
        raise ValueError("imbalance of no engines")
    values = list(prefill_tokens_per_engine.values())
    mean = sum(values) / len(values)
    return 1.0 if mean == 0 else max(values) / mean


def computed_prefill(results: Iterable[RequestResult], engines: Iterable[str]) -> dict[str, int]:
    """Prefill tokens computed per engine from results (prompt - cached), every engine listed."""
    out = dict.fromkeys(engines, 0)
    for r in results:
        if r.ok and r.backend is not None:
            out[r.backend] = out.get(r.backend, 0) + r.prompt_tokens - (r.cached_tokens or 0)
    return out


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 3)


def _pct_ms(xs: Sequence[float], q: float) -> float | None:
    return _ms(percentile(xs, q)) if xs else None


def _ratio(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def summarize(
    router: str,
    workload: str,
    results: Sequence[RequestResult],
    *,
    oracle_hit_ratio: float | None,
    prefill_tokens_per_engine: Mapping[str, int],
    router_cpu_s: float | None,
    duration_s: float,
    mode: str,
    engines: int,
    profile: str,
    offered_rps: float,
    notes: str = "",
) -> RunRecord:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    reported = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    hit = sum(reported) / prompt if prompt and reported else None
    captured = hit / oracle_hit_ratio if hit is not None and oracle_hit_ratio else None
    return RunRecord(
        router=router,
        workload=workload,
        ttft_p50_ms=_pct_ms(ttft, 50),
        ttft_p90_ms=_pct_ms(ttft, 90),
        ttft_p99_ms=_pct_ms(ttft, 99),
        itl_p50_ms=_pct_ms(itl, 50),
        throughput_rps=round(len(ok) / duration_s, 4) if duration_s > 0 else 0.0,
        errors=len(results) - len(ok),
        hit_ratio=_ratio(hit),
        oracle_hit_ratio=_ratio(oracle_hit_ratio),
        imbalance=_ratio(imbalance(prefill_tokens_per_engine))
        if prefill_tokens_per_engine
        else None,
        router_cpu_s=None if router_cpu_s is None else round(router_cpu_s, 4),
        mode=mode,
        engines=engines,
        profile=profile,
        offered_rps=round(offered_rps, 4),
        requests=len(results),
        itl_p99_ms=_pct_ms(itl, 99),
        ttft_mean_ms=_ms(sum(ttft) / len(ttft)) if ttft else None,
        captured_reuse=_ratio(captured),
        notes=notes,
    )


# --------------------------------------------------------------------------- oracle


def _cached(match: int, n: int, block_size: int) -> int:
    """Tokens an engine reuses: full blocks of the match, at most n - 1 tokens."""
    return min(match, n - 1) // block_size * block_size


def oracle_cached(requests: Iterable[TraceRequest], block_size: int) -> Iterator[int]:
    """Per request (in the order given), the tokens one infinite cache shared by everyone
    would serve it: the oracle's reuse, computed over segment ids and streamed.

    Equal leading segment ids mean equal tokens, so the longest prefix a prompt
    shares with any earlier one is found by walking its chain of segment-prefix
    hashes; for each we keep how far into that segment earlier prompts reached.
    Memory is one int per distinct segment prefix, whatever the block size.
    """
    reach: dict[int, int] = {}  # segment-prefix hash -> furthest prompt position seen
    seen_any = False
    for r in requests:
        n, size = r.input_length, r.segment_tokens
        match = 1 if seen_any else 0  # BOS
        matching = True
        h = 0
        for i, seg in enumerate(r.segments):
            start = 1 + i * size
            if start >= n:
                break
            end = min(n, start + size)
            h = hash((h, seg))
            prev = reach.get(h, 0)
            if matching:
                if prev > start:
                    match = prev
                    matching = prev >= start + size
                else:
                    matching = False
            if end > prev:
                reach[h] = end
        seen_any = True
        yield _cached(match, n, block_size)


def _oracle_segments(requests: Sequence[TraceRequest], block_size: int) -> float:
    """The oracle hit ratio over segment ids: no prompt is materialised."""
    total = sum(r.input_length for r in requests)
    cached = sum(oracle_cached(requests, block_size))
    return cached / total if total else 0.0


def _oracle_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> float:
    """The oracle over explicit token ids (chained block keys in one set)."""
    held: set[int] = set()
    cached = total = 0
    for tokens in prompts:
        n = len(tokens)
        total += n
        keys = chain_keys(tokens, block_size, 0)
        run = 0
        for k in keys:
            if k not in held:
                break
            run += 1
        cached += _cached(run * block_size, n, block_size)
        held.update(keys)
    return cached / total if total else 0.0


@overload
def oracle_hit_ratio(
    source: Workload | tuple[object, Workload] | Iterable[Sequence[int]], block_size: int, /
) -> float: ...
@overload
def oracle_hit_ratio(builder: object, workload: Workload, block_size: int, /) -> float: ...
def oracle_hit_ratio(first: object, second: object, third: int | None = None, /) -> float:
    """Cached / prompt tokens with one infinite cache shared by everyone.

    Requests in arrival order; full blocks only; at most n - 1 tokens reusable
    (vLLM recomputes the last prompt token). Called as ``(workload, block_size)``
    (streamed from the segment ids, nothing materialised), ``(builder, workload,
    block_size)`` or ``((builder, workload), block_size)`` (the builder is not
    needed: prompts are a function of the segments), or ``(token_id_lists,
    block_size)``.
    """
    source, size = (second, third) if third is not None else (first, second)
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"block_size must be a positive int, not {size!r}")
    block_size = size
    if isinstance(source, tuple) and len(source) == 2 and isinstance(source[1], Workload):
        source = source[1]
    if isinstance(source, Workload):
        return _oracle_segments(sorted(source.requests, key=lambda r: r.arrival_s), block_size)
    if isinstance(source, Iterable):
        return _oracle_tokens(source, block_size)
    raise TypeError(f"cannot compute an oracle hit ratio of {type(source).__name__}")


def segment_hit_ratio(workload: Workload) -> float:
    """Mooncake's own definition (its FAST'25 trace analysis): a request hits the longest
    leading run of its segment ids seen before; token hit = min(run x segment
    tokens, input length) / input length. 0.3736 on the full conversation trace."""
    seen: set[int] = set()
    cached = total = 0
    for r in sorted(workload.requests, key=lambda q: q.arrival_s):
        run = 0
        for seg in r.segments:
            if seg not in seen:
                break
            run += 1
        cached += min(run * r.segment_tokens, r.input_length)
        total += r.input_length
        seen.update(r.segments)
    return cached / total if total else 0.0


# --------------------------------------------------------------------------- files


def save_results(path: Path, results: Sequence[RequestResult]) -> None:
    """Per-request results as xz-compressed JSON lines (for analyses after a run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with lzma.open(tmp, "wt", encoding="utf-8") as fh:
        for r in results:
            fh.write(json.dumps(asdict(r), separators=(",", ":")) + "\n")
    tmp.replace(path)


def load_results(path: Path) -> list[RequestResult]:
    with lzma.open(path, "rt", encoding="utf-8") as fh:
        return [RequestResult(**json.loads(line)) for line in fh if line.strip()]


# --------------------------------------------------------------------------- rendering


def _cell(x: float | int | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def format_table(records: Sequence[RunRecord]) -> str:
    """A fixed-width table of the core figures, one line per record."""
    head = (
        f"{'router':<24} {'req':>6} {'err':>4} {'hit':>6} {'oracle':>6} {'capt':>5} "
        f"{'ttft p50':>9} {'ttft p90':>9} {'ttft p99':>9} {'itl p50':>8} {'rps':>7} "
        f"{'imbal':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in records:
        lines.append(
            f"{r.router:<24} {r.requests:>6} {r.errors:>4} {_cell(r.hit_ratio, '6.3f')} "
            f"{_cell(r.oracle_hit_ratio, '6.3f')} {_cell(r.captured_reuse, '5.2f')} "
            f"{_cell(r.ttft_p50_ms, '9.1f')} {_cell(r.ttft_p90_ms, '9.1f')} "
            f"{_cell(r.ttft_p99_ms, '9.1f')} {_cell(r.itl_p50_ms, '8.2f')} "
            f"{r.throughput_rps:>7.2f} {_cell(r.imbalance, '6.2f')}"
        )
    return "\n".join(lines)
