"""``kvplane bench calibration``: a GPU's measured figures beside the simulator's model.

The figures come from ``kvplane/bench/calibrate_gpu.py`` run on the GPU (it needs only
PyTorch); this module reads them and sets each beside what
:func:`kvplane.sim.timing.step_ms` and :func:`kvplane.sim.timing.load_ms` predict for the
same work with an engine profile. Pure functions; the command prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.sim.profiles import PROFILES, EngineProfile
from kvplane.sim.timing import load_ms, step_ms


@dataclass(frozen=True, slots=True)
class Point:
    """One quantity, measured and modelled, in the same unit."""

    what: str
    unit: str
    measured: float
    model: float

    @property
    def ratio(self) -> float:
        """model / measured: above 1 the model is slower (or, for a rate, faster)."""
        return self.model / self.measured if self.measured else float("inf")


def _ints(figures: Mapping[str, Any], key: str) -> list[tuple[int, float]]:
    return sorted((int(k), float(v)) for k, v in figures.get(key, {}).items())


def points(figures: Mapping[str, Any], profile: EngineProfile) -> Iterator[Point]:
    """Every measured quantity with the profile's prediction of it."""
    for n, ms in _ints(figures, "forward_ms") + _ints(figures, "prompt_ms"):
        yield Point(f"forward of {n:,} prompt tokens", "ms", ms, step_ms(profile, [(n, 0)], []))
    chunk = int(figures.get("chunk_tokens", 0))
    for past, ms in _ints(figures, "chunk_ms"):
        model = step_ms(profile, [(chunk, past)], [])
        yield Point(f"chunk of {chunk:,} after {past:,} cached", "ms", ms, model)
    ctx = int(figures.get("decode_context", 0))
    for batch, ms in _ints(figures, "decode_ms"):
        model = step_ms(profile, [], [ctx + 1] * batch)
        yield Point(f"decode step, {batch} x {ctx + 1} context", "ms", ms, model)
    kv = int(figures.get("kv_bytes_per_token", profile.kv_bytes_per_token))
    for tokens, gbps in _ints(figures, "h2d_gbps"):
        ms = tokens * kv / (gbps * 1e9) * 1000.0
        yield Point(
            f"load of {tokens:,} tokens from pinned host memory", "ms", ms, load_ms(profile, tokens)
        )


@dataclass(frozen=True, slots=True)
class PrefillFit:
    """``ms(n) = n / rate + attn_coeff * n^2 / 2``, least squares over the forwards of at
    least ``min_tokens`` prompt tokens (where the forward floor no longer shows)."""

    tokens_per_s: float
    attn_coeff: float  # ms per (new token x context token)
    points: int


def fit_prefill(figures: Mapping[str, Any], min_tokens: int = 1024) -> PrefillFit | None:
    """The prefill rate and attention coefficient of the measured full-prompt forwards
    (None with fewer than two of them)."""
    measured = _ints(figures, "forward_ms") + _ints(figures, "prompt_ms")
    pts = [(float(n), ms) for n, ms in measured if n >= min_tokens]
    if len(pts) < 2:
        return None
    # normal equations of ms = a*x1 + b*x2 with x1 = n, x2 = n^2 / 2
    s11 = sum(n * n for n, _ in pts)
    s12 = sum(n * n * n / 2 for n, _ in pts)
    s22 = sum((n * n / 2) ** 2 for n, _ in pts)
    t1 = sum(n * ms for n, ms in pts)
    t2 = sum(n * n / 2 * ms for n, ms in pts)
    det = s11 * s22 - s12 * s12
    a = (t1 * s22 - t2 * s12) / det
    b = (s11 * t2 - s12 * t1) / det
    return PrefillFit(tokens_per_s=1000.0 / a, attn_coeff=b, points=len(pts))


def table(pts: list[Point]) -> str:
    """The points as a Markdown table."""
    rows = ["| quantity | measured | model | model / measured |", "|---|---|---|---|"]
    rows += [
        f"| {p.what} | {p.measured:.3f} {p.unit} | {p.model:.3f} {p.unit} | {p.ratio:.2f} |"
        for p in pts
    ]
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("figures", type=Path, help="the JSON that calibrate_gpu.py wrote")
    p.add_argument("--profile", default="h100-llama-3.1-8b", choices=sorted(PROFILES))


def run(args: argparse.Namespace) -> int:
    figures = json.loads(args.figures.read_text())
    env = figures.get("environment", {})
    print(
        f"{env.get('gpu', env.get('device', '?'))}, torch {env.get('torch', '?')}, "
        f"CUDA graphs {figures.get('graph')}; model: profile {args.profile}"
    )
    profile = PROFILES[args.profile]
    print(table(list(points(figures, profile))))
    fit = fit_prefill(figures)
    if fit is not None:
        print(
            f"\nfull-prompt forwards of >= 1,024 tokens ({fit.points}) fitted: prefill "
            f"{fit.tokens_per_s:,.0f} tok/s, attention {fit.attn_coeff * 1e6:.2f}e-6 ms per "
            f"token pair; profile: {profile.prefill_tokens_per_s:,.0f} tok/s, "
            f"{profile.attn_coeff * 1e6:.2f}e-6"
        )
    return 0
