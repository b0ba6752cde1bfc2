"""The P:D planner: how many prefill and decode replicas an InferencePool needs to meet
its TTFT and ITL targets under the workload its router observes.

After NVIDIA Dynamo's planner (which sizes prefill and decode workers from observed
input/output lengths and request rate against TTFT/ITL targets, using profiled engine
performance), with one difference: each candidate split is judged by replaying a
workload of the observed shape through kvplane's own P/D discrete-event simulation
(``kvplane.sim.des_pd``: the router's P/D choice against simulated engines), so prefix
reuse, handoffs and the router's conditional aggregation are part of the prediction.

Pure: ``observe`` turns two scrapes of a router's ``/metrics`` into an ``Observation``;
``recommend`` turns an observation, the targets and the GPU budget into a ``Plan``.
The operator's hook (``planner_hook.py``) does the I/O.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Final

from kvplane.router.config import PDSpec
from prometheus_client.parser import text_string_to_metric_families

from kvplane.bench.pd_setup import split_for
from kvplane.sim.des import profile_for
from kvplane.sim.des_pd import Topology, run_des_pd
from kvplane.workload.traces import TraceRequest, Workload

SEGMENT: Final = 64  # tokens per synthetic prompt segment (the unit of shared prefixes)
PREFIX_GROUPS: Final = 8  # distinct shared prefixes in a planning workload
JITTER: Final = 0.25  # lengths are uniform within +-25% of the observed means
DEFAULT_REQUESTS: Final = 200  # requests replayed per candidate split
GROUP_SEGMENTS: Final = 4096  # segments a shared prefix may span (256k tokens)


@dataclass(frozen=True, slots=True)
class Observation:
    """The workload as the router saw it over one interval."""

    arrival_rate: float  # requests per second
    prompt_tokens: float  # mean prompt length
    output_tokens: float  # mean requested output length
    prefix_reuse: float  # share of prompt tokens the engines reported cached, 0..1

    def describe(self) -> str:
        return (
            f"{self.arrival_rate:.2f} req/s, prompt {self.prompt_tokens:.0f} tokens, "
            f"output {self.output_tokens:.0f}, prefix reuse {self.prefix_reuse:.2f}"
        )


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_ms: float  # time to first token, p90
    itl_ms: float | None = None  # inter-token latency, p99


@dataclass(frozen=True, slots=True)
class Budget:
    """Replicas the plan may use (one GPU-replica each, the DES's unit)."""

    min_total: int = 2
    max_total: int = 16


@dataclass(frozen=True, slots=True)
class Trial:
    prefill: int
    decode: int
    ttft_p90_ms: float
    itl_p99_ms: float

    def score(self, t: Targets) -> float:
        """The worse of the two latencies as a share of its target (<= 1: met)."""
        itl = self.itl_p99_ms / t.itl_ms if t.itl_ms else 0.0
        return max(self.ttft_p90_ms / t.ttft_ms, itl)


@dataclass(frozen=True, slots=True)
class Plan:
    prefill: int
    decode: int
    meets_targets: bool
    ttft_p90_ms: float
    itl_p99_ms: float
    observed: Observation
    trials: tuple[Trial, ...] = field(default=(), compare=False)

    @property
    def ratio(self) -> str:
        return f"{self.prefill}:{self.decode}"


# --------------------------------------------------------------------------- observe

Sample = dict[str, float]  # series name -> value summed over label sets, and "time"

_SERIES: Final = {
    "kvplane_router_decisions_total": "requests",
    "kvplane_router_prompt_tokens_total": "prompt",
    "kvplane_router_reported_cached_tokens_total": "cached",
    "kvplane_router_requested_output_tokens_sum": "output_sum",
    "kvplane_router_requested_output_tokens_count": "output_count",
}


def sample(metrics_text: str, at: float) -> Sample:
    """The counters the planner reads from one scrape of a router's ``/metrics``."""
    out: Sample = dict.fromkeys(_SERIES.values(), 0.0)
    out["time"] = at
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            key = _SERIES.get(s.name)
            if key is not None:
                out[key] += s.value
    return out


def observe(before: Sample, after: Sample) -> Observation | None:
    """The workload between two samples of one router, or None without traffic (or when
    the router restarted in between: its counters went back)."""
    d = {k: after[k] - before[k] for k in after}
    if d["time"] <= 0 or d["requests"] <= 0 or any(v < 0 for v in d.values()):
        return None
    prompt = d["prompt"] / d["requests"]
    output = d["output_sum"] / d["output_count"] if d["output_count"] > 0 else 0.0
    reuse = min(1.0, d["cached"] / d["prompt"]) if d["prompt"] > 0 else 0.0
    return Observation(d["requests"] / d["time"], prompt, output, reuse)


# --------------------------------------------------------------------------- plan


def planning_workload(obs: Observation, requests: int, seed: int = 0) -> Workload:
    """Poisson arrivals at the observed rate, lengths around the observed means, each
    prompt opening with one of ``PREFIX_GROUPS`` shared prefixes that covers the observed
    reuse share of it."""
    if obs.arrival_rate <= 0 or requests < 1:
        raise ValueError("a planning workload needs traffic")
    rng = random.Random(seed)
    # segment ids become token ids in the simulator (a head token per segment): keep them
    # small; unique ones above every group's
    t, next_id = 0.0, PREFIX_GROUPS * GROUP_SEGMENTS
    out: list[TraceRequest] = []
    for i in range(requests):
        if i:
            t += rng.expovariate(obs.arrival_rate)
        length = max(2, round(obs.prompt_tokens * rng.uniform(1 - JITTER, 1 + JITTER)))
        output = max(1, round(max(obs.output_tokens, 1.0) * rng.uniform(1 - JITTER, 1 + JITTER)))
        segments = math.ceil((length - 1) / SEGMENT)
        shared = min(segments, GROUP_SEGMENTS, int(obs.prefix_reuse * length / SEGMENT))
        group = rng.randrange(PREFIX_GROUPS)
        ids = [group * GROUP_SEGMENTS + k for k in range(shared)]
        ids += range(next_id, next_id + segments - shared)
        next_id += segments - shared
        out.append(TraceRequest(t, f"g{group}", length, output, tuple(ids), SEGMENT))
    return Workload(
        name="planner",
        description=f"planner: {obs.describe()}",
        requests=out,
        segment_tokens=SEGMENT,
    )


@dataclass(frozen=True, slots=True)
class PlannerSetup:
    """What the simulated fleet is made of: the engine profile and the links."""

    pd: PDSpec
    profile: str = "h100-llama-3.1-8b"
    gpus_per_node: int = 8
    requests: int = DEFAULT_REQUESTS
    seed: int = 0


def trial(workload: Workload, prefill: int, decode: int, setup: PlannerSetup) -> Trial:
    roles = ["prefill"] * prefill + ["decode"] * decode
    run = run_des_pd(
        workload,
        roles,
        setup.pd,
        name=f"planner-{prefill}:{decode}",
        topology=Topology(setup.gpus_per_node),
        profile=setup.profile,
        seed=setup.seed,
    )
    rec = run.record
    return Trial(prefill, decode, rec.ttft_p90_ms or math.inf, rec.itl_p99_ms or math.inf)


def recommend(obs: Observation, targets: Targets, budget: Budget, setup: PlannerSetup) -> Plan:
    """The smallest fleet, and within it the split, whose simulated TTFT p90 and ITL p99
    meet the targets; the best split tried when none does.

    Fleets are tried from the smallest whose prefill and decode demand fit (the
    analytic split of ``bench.pd_setup.split_for``, the starting point), and in each
    fleet the analytic split and its neighbours."""
    workload = planning_workload(obs, setup.requests, setup.seed)
    prof = profile_for(setup.profile, None)
    lo = max(2, budget.min_total)
    if budget.max_total < lo:
        raise ValueError("the budget allows no prefill/decode fleet (at least 2 replicas)")
    trials: list[Trial] = []
    best: Trial | None = None
    for total in range(lo, budget.max_total + 1):
        split = split_for(workload, prof, total, obs.prefix_reuse)
        if max(split.prefill_util, split.decode_util) > 1.0 and total < budget.max_total:
            continue  # over capacity on one side: no split of this fleet can keep up
        candidates = sorted(
            {p for p in (split.prefill - 1, split.prefill, split.prefill + 1) if 1 <= p < total}
        )
        tried = [trial(workload, p, total - p, setup) for p in candidates]
        trials += tried
        fleet_best = min(tried, key=lambda x: x.score(targets))
        if best is None or fleet_best.score(targets) < best.score(targets):
            best = fleet_best
        if fleet_best.score(targets) <= 1.0:
            best = fleet_best
            break
    assert best is not None
    return Plan(
        best.prefill,
        best.decode,
        best.score(targets) <= 1.0,
        best.ttft_p90_ms,
        best.itl_p99_ms,
        obs,
        tuple(trials),
    )
