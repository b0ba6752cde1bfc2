"""What both P/D benchmarks share (over HTTP: ``pd.py``; in virtual time: ``pd_des.py``):
the modes, the workloads, the P:D split each workload needs, and the command line's
per-workload defaults."""

from __future__ import annotations

import argparse
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

from kvplane.bench import pd_report
from kvplane.sim.profiles import EngineProfile
from kvplane.sim.timing import decode_step_ms, prefill_ms
from kvplane.workload.traces import MOONCAKE_BLOCK, TraceRequest, Workload, build_workload

MODES = pd_report.MODES
PREFILL_HEAVY = pd_report.PREFILL_HEAVY
KVPLANE_MODES = ("aggregated", "disaggregated", "conditional", "conditional-flex")
FLEX = "conditional-flex"  # every engine `both` over NIXL: the router picks the roles

# Offered load per workload (x its native rate, for 8 engines): the aggregated fleet is
# loaded (the long-prompt loads use about half its prefill capacity) but not collapsing.
DEFAULT_RATE_SCALE = {"mooncake": 2.0, "gsp": 2.0, PREFILL_HEAVY: 1.0}
# Requests per workload: about 15 simulated seconds of arrivals each, so that the four
# modes of three workloads replay in about a quarter of an hour at time scale 4. The
# first 80 Mooncake requests stop before its 120k-token prompt, which alone would hold
# a prefill engine for 5 simulated seconds.
DEFAULT_LIMIT = {"mooncake": 80, "gsp": 300, PREFILL_HEAVY: 120}


# conditional-flex: the largest uncached prompt a pod may prefill for itself (no gate).
FLEX_AGGREGATE_MAX = 1 << 30


def prefill_heavy(
    n: int = 120,
    input_range: tuple[int, int] = (6144, 14336),
    output_range: tuple[int, int] = (128, 384),
    rate: float = 10.0,
    seed: int = 0,
) -> Workload:
    """Long fresh prompts and moderate outputs at Poisson arrivals: the load under which
    an aggregated engine's decodes keep waiting for prefill chunks. Lengths are uniform
    in the ranges; prompts share nothing but BOS."""
    if n < 1 or rate <= 0:
        raise ValueError("prefill_heavy needs n >= 1 and a positive rate")
    rng = random.Random(seed)
    unit = MOONCAKE_BLOCK
    next_id = 0
    t = 0.0
    reqs: list[TraceRequest] = []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        length = rng.randint(*input_range)
        per = math.ceil((length - 1) / unit)
        segs = tuple(range(next_id, next_id + per))
        next_id += per
        reqs.append(TraceRequest(t, f"r{i}", length, rng.randint(*output_range), segs, unit))
    return Workload(
        name=PREFILL_HEAVY,
        description=f"prefill-heavy: {n} fresh prompts of {input_range[0]}-{input_range[1]} "
        f"tokens, outputs {output_range[0]}-{output_range[1]}, {rate:g} req/s",
        requests=reqs,
        segment_tokens=unit,
    )


def build(name: str, limit: int, rate_scale: float, trace: Path | None, seed: int = 0) -> Workload:
    if name == PREFILL_HEAVY:
        return prefill_heavy(n=limit, rate=10.0 * rate_scale, seed=seed)
    return build_workload(name, trace=trace, limit=limit, start=0, rate_scale=rate_scale, seed=seed)


# --------------------------------------------------------------------------- P:D split


@dataclass(frozen=True, slots=True)
class Split:
    """How many of the fleet's engines prefill, and the demand that says so."""

    prefill: int
    decode: int
    prefill_gpus: float  # prefill demand: GPU-seconds of prefill per second
    decode_tokens_per_s: float
    decode_context: float  # mean context of a decoding sequence (output-weighted)
    decode_capacity: float  # tokens/s one decode engine sustains at its largest batch
    prefill_util: float
    decode_util: float

    @property
    def label(self) -> str:
        return f"{self.prefill}:{self.decode}"

    def why(self) -> str:
        return (
            f"P:D {self.label}: prefill needs {self.prefill_gpus:.2f} GPUs "
            f"(utilisation {self.prefill_util:.2f} on {self.prefill}), decode "
            f"{self.decode_tokens_per_s:.0f} tok/s at {self.decode_context:.0f} tokens of "
            f"context, {self.decode_capacity:.0f} tok/s per engine at most "
            f"(utilisation {self.decode_util:.2f} on {self.decode})."
        )


def decode_capacity(profile: EngineProfile, context: float) -> float:
    """Tokens/s one engine decodes at the largest batch that fits its scheduler and its KV
    cache: decode is bound by the weight and KV reads of each step, not by flops."""
    best = 0.0
    per_seq = max(1.0, context)
    for b in range(1, profile.max_num_seqs + 1):
        if b * per_seq > profile.capacity_tokens:
            break
        best = max(best, b * 1000.0 / decode_step_ms(profile, b, int(b * per_seq)))
    return best


def split_for(workload: Workload, profile: EngineProfile, engines: int, hit_ratio: float) -> Split:
    """P:D with the lowest worse-side utilisation. Prefill demand: every prompt's
    uncached part (``hit_ratio`` of it reused) at the profile's chunked-prefill times.
    Decode demand: the output token rate against what one engine sustains at the mean
    context. Prefill queues (TTFT) and decode batches (ITL) both degrade as their side
    fills up, so neither side should be the fuller one."""
    if engines < 2:
        raise ValueError("a P/D split needs at least two engines")
    reqs = workload.requests
    span = max(workload.duration_s, 1e-9)
    pre_s = 0.0
    out_tokens = 0
    ctx_weighted = 0.0
    for r in reqs:
        cached = int(r.input_length * hit_ratio)
        pre_s += prefill_ms(profile, r.input_length - cached, cached) / 1000.0
        out_tokens += r.output_tokens
        ctx_weighted += r.output_tokens * (r.input_length + r.output_tokens / 2.0)
    demand = pre_s / span
    rate = out_tokens / span
    context = ctx_weighted / out_tokens if out_tokens else 0.0
    cap = decode_capacity(profile, context)
    best: Split | None = None
    for p in range(1, engines):
        d = engines - p
        s = Split(p, d, demand, rate, context, cap, demand / p, rate / (d * cap) if cap else 1.0)
        if best is None or max(s.prefill_util, s.decode_util) < max(
            best.prefill_util, best.decode_util
        ):
            best = s
    assert best is not None
    return best


def with_prefill(split: Split, prefill: int) -> Split:
    """The same demand on a split chosen by hand (``--prefill``)."""
    engines = split.prefill + split.decode
    if not 1 <= prefill < engines:
        raise SystemExit("bench pd: --prefill must leave at least one decode engine")
    decode = engines - prefill
    cap = decode * split.decode_capacity
    return replace(
        split,
        prefill=prefill,
        decode=decode,
        prefill_util=split.prefill_gpus / prefill,
        decode_util=split.decode_tokens_per_s / cap if cap else 1.0,
    )


def roles_for(mode: str, engines: int, prefill: int) -> list[str]:
    """Every engine ``both`` (aggregated, conditional-flex), else the P/D fleet's roles."""
    if mode in ("aggregated", FLEX):
        return ["both"] * engines
    return ["prefill"] * prefill + ["decode"] * (engines - prefill)


# --------------------------------------------------------------------------- command line


def limit_for(args: argparse.Namespace, workload: str) -> int:
    if args.limit is not None:
        return int(args.limit)
    return DEFAULT_LIMIT.get(workload, 100)


def rate_for(args: argparse.Namespace, workload: str) -> float:
    if args.rate_scale is not None:
        return float(args.rate_scale)
    return float(DEFAULT_RATE_SCALE.get(workload, 1.0) * args.engines / 8)


def trace_path(args: argparse.Namespace) -> Path | None:
    return Path(args.trace) if args.trace else None
