"""The ideal floor of a routing run, and the SLO and goodput read against it.

- Floor: per request, the time to first token it would have on an idle engine that holds
  every reusable block of its prefix already (the oracle's reuse: one infinite cache
  shared by the whole fleet, :func:`kvplane.workload.results.oracle_cached`), with no
  queueing, from the fleet's own timing model. No router can beat it; the gap to it is
  what routing can still win. For kvplane's simulator the timing model is
  :func:`kvplane.sim.timing.prefill_ms` (chunked prefill, one forward per chunk); for an
  engine whose model is not known in closed form (Dynamo's mocker) it is a grid of
  idle-engine measurements (:class:`GridModel`).
- SLO: a TTFT p90 bound per workload, ``SLO_FACTOR`` times the floor's p90.
- Goodput: from a TTFT-vs-load sweep, the highest offered load whose TTFT p90 stays
  within the SLO (every lighter load within it too), interpolated in log TTFT between
  the last load within the SLO and the first beyond it.

Pure functions over plain data.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvplane.sim.profiles import EngineProfile
from kvplane.sim.timing import prefill_ms
from kvplane.workload.results import oracle_cached, percentile
from kvplane.workload.traces import Workload

SLO_FACTOR: Final = 10.0  # the SLO is this many times the floor's TTFT p90

PrefillModel = Callable[[int, int], float]  # (new tokens, cached tokens) -> ms


@dataclass(frozen=True, slots=True)
class Floor:
    """Per-request floor TTFTs (ms, in arrival order) and the oracle's cached tokens."""

    ttft_ms: list[float]
    cached: list[int]

    def quantiles(self) -> dict[str, float]:
        return {f"floor_p{q}_ms": round(percentile(self.ttft_ms, q), 3) for q in (50, 90, 99)}

    @property
    def slo_ms(self) -> float:
        return SLO_FACTOR * percentile(self.ttft_ms, 90)


def floor_of(workload: Workload, block_size: int, model: PrefillModel) -> Floor:
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)
    cached = list(oracle_cached(reqs, block_size))
    ttft = [model(r.input_length - c, c) for r, c in zip(reqs, cached, strict=True)]
    return Floor(ttft, cached)


def sim_model(profile: EngineProfile) -> PrefillModel:
    """kvplane's simulator: a lone prompt's chunked prefill on an idle engine."""

    def model(new: int, cached: int) -> float:
        return prefill_ms(profile, new, cached)

    return model


@dataclass(frozen=True, slots=True)
class GridModel:
    """Idle-engine TTFT measured on a grid of (new, cached) tokens, bilinear between grid
    points and linear beyond the last new-token column (prefill time grows linearly in
    new tokens at a given context)."""

    new: tuple[int, ...]  # ascending
    cached: tuple[int, ...]  # ascending, starting at 0
    ms: tuple[tuple[float, ...], ...]  # ms[i][j]: new[i] after cached[j]

    def __call__(self, new: int, cached: int) -> float:
        def along_new(j: int) -> float:
            xs, ys = self.new, [row[j] for row in self.ms]
            return _interp(xs, ys, new)

        cs = self.cached
        j = min(max(bisect.bisect_right(cs, cached) - 1, 0), len(cs) - 2) if len(cs) > 1 else 0
        if len(cs) == 1:
            return along_new(0)
        lo, hi = along_new(j), along_new(j + 1)
        t = (cached - cs[j]) / (cs[j + 1] - cs[j])
        return max(0.0, lo + (hi - lo) * t)

    def prefill_tokens_per_s(self) -> float:
        """The fresh-prompt prefill rate between the two longest measured prompts (what
        an operator calibrates a router's cost model with)."""
        (n0, n1), (t0, t1) = self.new[-2:], (self.ms[-2][0], self.ms[-1][0])
        return (n1 - n0) / max(t1 - t0, 1e-9) * 1000.0

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> GridModel:
        return cls(
            tuple(int(n) for n in doc["new"]),
            tuple(int(c) for c in doc["cached"]),
            tuple(tuple(float(v) for v in row) for row in doc["ms"]),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "new": list(self.new),
            "cached": list(self.cached),
            "ms": [list(r) for r in self.ms],
        }


def _interp(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys), extrapolated from the end segments."""
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


# --------------------------------------------------------------------------- goodput


def goodput(points: Sequence[tuple[float, float]], slo_ms: float) -> float | None:
    """The highest offered load (req/s) whose TTFT p90 stays within ``slo_ms``, from
    ``(offered_rps, ttft_p90_ms)`` points of one router's sweep; interpolated in log TTFT
    towards the first load beyond the SLO. None if even the lightest load misses it; the
    heaviest load measured if none misses it."""
    pts = sorted(points)
    if not pts or pts[0][1] > slo_ms:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if y1 > slo_ms:
            if y0 <= 0 or y1 <= y0 or math.isinf(y1):
                return x0
            t = (math.log(slo_ms) - math.log(y0)) / (math.log(y1) - math.log(y0))
            return x0 + (x1 - x0) * t
    return pts[-1][0]


def _p90_or_miss(row: Mapping[str, Any]) -> float:
    """A row's TTFT p90; a run with errors or no TTFT misses any SLO."""
    p90 = row.get("ttft_p90_ms")
    return math.inf if row.get("errors") or p90 is None else float(p90)


def goodput_table(
    runs: Sequence[Mapping[str, Any]], slo_ms: Mapping[str, float]
) -> list[dict[str, Any]]:
    """Per (workload, router): goodput at the workload's SLO from the rows of its sweep
    (every row of the workload and router, whatever its load factor)."""
    out: list[dict[str, Any]] = []
    keys = dict.fromkeys((r["workload"], r["router"]) for r in runs if r["workload"] in slo_ms)
    for wl, router in keys:
        pts = [
            (float(r["offered_rps"]), _p90_or_miss(r))
            for r in runs
            if r["workload"] == wl and r["router"] == router
        ]
        gp = goodput(pts, slo_ms[wl])
        out.append(
            {
                "workload": wl,
                "router": router,
                "slo_ms": round(slo_ms[wl], 1),
                "loads": len(pts),
                "goodput_rps": None if gp is None else round(gp, 3),
                "saturated": gp is not None and pts and gp >= max(p[0] for p in pts),
            }
        )
    return out
