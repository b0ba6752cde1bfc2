"""Which requests make a run's TTFT tail, and why: ``kvplane bench tail``.

For every request at or above a TTFT percentile (p99 by default) of one run's
per-request results (``kvplane bench routing --save-requests``), set beside the same
request's ideal floor (:mod:`kvplane.bench.floor`):

- its own prefill on the pod that served it, from the fleet's timing model at the
  prefix it really reused (``own``), and the rest of its TTFT (``wait``: queued behind
  other prompts' prefill, or sharing steps with them);
- the reuse it missed: what the oracle (one infinite shared cache) would have served
  it, against what the engine reported cached;
- the prefill work pending on its pod when it arrived, and the least pending on any pod
  (reconstructed from the run: a request's uncached tokens are pending from its arrival
  to its first token);
- the requests in flight on its pod when it arrived (from arrival to last token), and
  the fewest on any pod: an engine with nothing in flight starts a prompt at once, one
  with requests running finishes the step it is in first (the summary counts the
  requests that found such an idle pod, and how many of them were sent to one);
- the pod, with the router's stated reason for it where the router gives one
  (kvplane's ``x-kvplane-reason``: ``cache_hit``, ``load_balance``, ...).

Each tail request gets one cause, the first that holds:

- ``long prompt``: its own prefill is at least 80% of its TTFT and it missed no reuse:
  only a faster prefill (more GPUs per prompt, or prefill/decode disaggregation taking
  the prompt off a decode pod) would help; no routing can;
- ``missed reuse``: recomputing what it missed is at least half of its gap to the floor:
  the pod holding the prefix, or a shared tier holding what was evicted, would help;
- ``queued``: it waited at least half of its TTFT: another pod (if one had less pending
  prefill work) or a scheduler that lets short prompts past a long one would help;
- ``mixed`` otherwise.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.bench.floor import Floor, PrefillModel
from kvplane.workload.results import RequestResult, load_results, percentile
from kvplane.workload.traces import Workload

LONG_SHARE = 0.8
MISSED_SHARE = 0.5
QUEUED_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class TailRequest:
    arrival_s: float
    ttft_ms: float
    prompt: int
    cached: int
    oracle_cached: int
    floor_ms: float
    own_ms: float  # its prefill at the prefix it reused, on an idle pod
    backend: str | None
    pending_tokens: int  # uncached prompt tokens pending on its pod when it arrived
    least_pending_tokens: int  # the least pending on any pod then
    cause: str
    in_flight: int = 0  # requests in flight on its pod when it arrived (itself not counted)
    least_in_flight: int = 0  # the fewest in flight on any pod then
    reason: str | None = None  # the router's stated reason for the pod, where it gave one

    @property
    def wait_ms(self) -> float:
        return max(0.0, self.ttft_ms - self.own_ms)

    def to_json(self) -> dict[str, Any]:
        return {
            "arrival_s": round(self.arrival_s, 3),
            "ttft_ms": round(self.ttft_ms, 1),
            "prompt": self.prompt,
            "cached": self.cached,
            "oracle_cached": self.oracle_cached,
            "floor_ms": round(self.floor_ms, 1),
            "own_ms": round(self.own_ms, 1),
            "wait_ms": round(self.wait_ms, 1),
            "backend": self.backend,
            "pending_tokens": self.pending_tokens,
            "least_pending_tokens": self.least_pending_tokens,
            "in_flight": self.in_flight,
            "least_in_flight": self.least_in_flight,
            "cause": self.cause,
            "reason": self.reason,
        }


class PendingWork:
    """Uncached prompt tokens pending on each pod over time (arrival to first token)."""

    def __init__(self, results: Sequence[RequestResult]) -> None:
        self._by_pod: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
        for r in results:
            if r.ok and r.backend is not None and r.ttft_s is not None:
                self._by_pod[r.backend].append(self._span(r))
        for rows in self._by_pod.values():
            rows.sort()
        self._starts = {p: [s for s, _, _ in rows] for p, rows in self._by_pod.items()}

    @staticmethod
    def _span(r: RequestResult) -> tuple[float, float, int]:
        return (
            r.arrival_s,
            r.arrival_s + (r.ttft_s or 0.0),
            r.prompt_tokens - (r.cached_tokens or 0),
        )

    def at(self, pod: str, t: float) -> int:
        """What the requests that arrived on ``pod`` before ``t`` still hold at ``t`` (one
        arriving at ``t``, the request asked about among them, is not counted)."""
        rows = self._by_pod.get(pod, [])
        hi = bisect.bisect_left(self._starts.get(pod, []), t)
        return sum(w for _, e, w in rows[:hi] if e > t)

    def least(self, t: float) -> int:
        return min((self.at(p, t) for p in self._by_pod), default=0)


class InFlight(PendingWork):
    """Requests in flight on each pod over time (arrival to last token), one each."""

    @staticmethod
    def _span(r: RequestResult) -> tuple[float, float, int]:
        return r.arrival_s, r.arrival_s + max(r.e2e_s or 0.0, r.ttft_s or 0.0), 1


def classify(ttft_ms: float, own_ms: float, floor_ms: float, missed_ms: float, missed: int) -> str:
    if own_ms >= LONG_SHARE * ttft_ms and missed <= 0:
        return "long prompt"
    if missed > 0 and missed_ms >= MISSED_SHARE * max(ttft_ms - floor_ms, 1e-9):
        return "missed reuse"
    if ttft_ms - own_ms >= QUEUED_SHARE * ttft_ms:
        return "queued"
    return "mixed"


def tail(
    results: Sequence[RequestResult],
    workload: Workload,
    fl: Floor,
    model: PrefillModel,
    block_size: int,
    q: float = 99.0,
) -> list[TailRequest]:
    """The requests at or above the ``q`` percentile of TTFT, slowest first."""
    ok = sorted((r for r in results if r.ok and r.ttft_s is not None), key=lambda r: r.arrival_s)
    if not ok:
        return []
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)
    if len(reqs) != len(results):
        raise ValueError("results and workload do not match (different request counts)")
    index = {round(r.arrival_s, 6): i for i, r in enumerate(reqs)}
    cut = percentile([r.ttft_s or 0.0 for r in ok], q)
    pending, in_flight = PendingWork(ok), InFlight(ok)
    out: list[TailRequest] = []
    for r in ok:
        ttft = r.ttft_s or 0.0
        if ttft < cut:
            continue
        i = index.get(round(r.arrival_s, 6))
        if i is None:
            raise ValueError(
                "results and workload do not match (an arrival the workload does not have: "
                "give the run's --workload, --limit, --rate-scale and --shape)"
            )
        cached = r.cached_tokens or 0
        oracle = fl.cached[i]
        own = model(r.prompt_tokens - cached, cached)
        missed = max(0, oracle - cached)
        missed_ms = own - fl.ttft_ms[i] if missed >= block_size else 0.0
        ttft_ms = ttft * 1000.0
        out.append(
            TailRequest(
                arrival_s=r.arrival_s,
                ttft_ms=ttft_ms,
                prompt=r.prompt_tokens,
                cached=cached,
                oracle_cached=oracle,
                floor_ms=fl.ttft_ms[i],
                own_ms=own,
                backend=r.backend,
                pending_tokens=pending.at(r.backend, r.arrival_s) if r.backend else 0,
                least_pending_tokens=pending.least(r.arrival_s),
                cause=classify(
                    ttft_ms, own, fl.ttft_ms[i], missed_ms, missed if missed >= block_size else 0
                ),
                reason=r.reason,
                in_flight=in_flight.at(r.backend, r.arrival_s) if r.backend else 0,
                least_in_flight=in_flight.least(r.arrival_s),
            )
        )
    return sorted(out, key=lambda t: -t.ttft_ms)


def summary(rows: Sequence[TailRequest]) -> dict[str, Any]:
    causes = Counter(r.cause for r in rows)
    idle = [r for r in rows if r.least_in_flight == 0]
    return {
        "requests": len(rows),
        "causes": dict(causes.most_common()),
        "found_idle_pod": len(idle),
        "sent_to_idle_pod": sum(1 for r in idle if r.in_flight == 0),
        "ttft_ms_from": round(min((r.ttft_ms for r in rows), default=0.0), 1),
        "own_share": round(
            sum(r.own_ms for r in rows) / max(sum(r.ttft_ms for r in rows), 1e-9), 3
        ),
    }


def markdown(rows: Sequence[TailRequest], title: str) -> str:
    s = summary(rows)
    lines = [
        f"{title}: {s['requests']} requests from {s['ttft_ms_from']:.0f} ms; causes "
        + ", ".join(f"{k} {v}" for k, v in s["causes"].items())
        + f"; their own prefill is {100 * s['own_share']:.0f}% of their TTFT; "
        f"{s['found_idle_pod']} arrived while a pod had nothing in flight, "
        f"{s['sent_to_idle_pod']} of them were sent to such a pod.",
        "",
        "| TTFT ms | prompt | cached | oracle cached | floor ms | own prefill ms | wait ms "
        "| pod | pending on pod (tok) | least pending (tok) | in flight on pod | least in "
        "flight | cause |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.ttft_ms:.0f} | {r.prompt} | {r.cached} | {r.oracle_cached} | "
            f"{r.floor_ms:.0f} | {r.own_ms:.0f} | {r.wait_ms:.0f} | {r.backend}"
            f"{f' ({r.reason})' if r.reason else ''} | "
            f"{r.pending_tokens} | {r.least_pending_tokens} | {r.in_flight} | "
            f"{r.least_in_flight} | {r.cause} |"
        )
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="per-request results (--save-requests files)")
    p.add_argument("--workload", default="mooncake")
    p.add_argument(
        "--shape",
        default="",
        help="the synthetic workload's size as the run was given it, e.g. "
        "'long-doc-qa:documents=40,repeat_count=4' (kvplane bench routing --shape)",
    )
    p.add_argument("--limit", type=int, default=1000)
    p.add_argument("--rate-scale", type=float, default=2.5)
    p.add_argument("--profile", default="h100-llama-3.1-8b")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--percentile", type=float, default=99.0)
    p.add_argument(
        "--run",
        type=Path,
        default=None,
        help="the run's results JSON (bench/results/routing-*.json): the floor and each "
        "request's own prefill then come from that run's timing model (on --fleet "
        "dynamo-mocker the mocker's measured grid), its profile and its block size",
    )


def timing_model(args: argparse.Namespace) -> tuple[PrefillModel, int]:
    """The fleet's idle-engine timing model and block size: the run's own (``--run``)
    where given, so that a mocker run is read in the mocker's time, else the simulator's
    profile."""
    from kvplane.bench.floor import GridModel, sim_model
    from kvplane.sim.des import profile_for

    profile, block_size = args.profile, args.block_size
    if args.run is not None:
        doc = json.loads(args.run.read_text())
        setup = doc.get("setup", {})
        profile = setup.get("profile", profile)
        block_size = int(setup.get("block size", block_size))
        if doc.get("mocker_floor_grid"):
            return GridModel.from_json(doc["mocker_floor_grid"]), block_size
    return sim_model(profile_for(profile, block_size)), block_size


def run(args: argparse.Namespace) -> None:
    from kvplane.bench.floor import floor_of
    from kvplane.bench.routing import shapes
    from kvplane.workload.traces import build_workload

    model, block_size = timing_model(args)
    wl = build_workload(
        args.workload,
        trace=None,
        limit=args.limit,
        start=0,
        rate_scale=args.rate_scale,
        shape=shapes(args).get(args.workload),
    )
    fl = floor_of(wl, block_size, model)
    for path in args.results:
        rows = tail(load_results(Path(path)), wl, fl, model, block_size, args.percentile)
        print(markdown(rows, Path(path).name))


def main(argv: Sequence[str] | None = None) -> int:
    from kvplane.bench.procs import bench_main

    return bench_main("kvplane bench tail", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
