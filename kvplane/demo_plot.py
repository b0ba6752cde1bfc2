"""The demo's picture: each local round (hit ratio and mean TTFT, round-robin against
kvplane) beside the simulated H100 fleet's TTFT p50/p90 per router. None without
matplotlib (``kvplane[plots]``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvplane.demo import RunResult
    from kvplane.demo_sim import SimRun

RR, KV = "#9e9e9e", "#1f77b4"


def plot(
    rounds: Sequence[tuple[RunResult, RunResult]], sim: Sequence[SimRun] | None, path: Path
) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3 if sim else 2
    fig, axes = plt.subplots(1, cols, figsize=(5.5 * cols, 4))
    xs = list(range(1, len(rounds) + 1))
    w = 0.38
    hit, ttft = axes[0], axes[1]
    hit.bar([x - w / 2 for x in xs], [rr.hit_ratio for rr, _ in rounds], w, color=RR,
            label="round-robin")  # fmt: skip
    hit.bar([x + w / 2 for x in xs], [kv.hit_ratio for _, kv in rounds], w, color=KV,
            label="kvplane")  # fmt: skip
    hit.set(title="vLLM engines here: prefix cache hit ratio", xlabel="round", ylim=(0, 1))
    hit.set_xticks(xs)
    hit.legend(loc="lower right")
    ttft.bar([x - w / 2 for x in xs], [rr.mean for rr, _ in rounds], w, color=RR,
             label="round-robin")  # fmt: skip
    ttft.bar([x + w / 2 for x in xs], [kv.mean for _, kv in rounds], w, color=KV,
             label="kvplane")  # fmt: skip
    ttft.set(title="vLLM engines here: mean TTFT", xlabel="round", ylabel="ms")
    ttft.set_xticks(xs)
    if sim:
        ax = axes[2]
        ys = list(range(len(sim)))
        colors = [KV if r.router == "kvplane" else RR for r in sim]
        p50 = [r.row["ttft_p50_ms"] for r in sim]
        p90 = [r.row["ttft_p90_ms"] for r in sim]
        ax.barh([y + 0.2 for y in ys], p90, 0.4, color=colors)
        ax.barh([y - 0.2 for y in ys], p50, 0.4, color=colors, alpha=0.45)
        for y, a, b in zip(ys, p50, p90, strict=True):
            ax.text(a, y - 0.2, f" p50 {a:.0f}", va="center", fontsize=8)
            ax.text(b, y + 0.2, f" p90 {b:.0f}", va="center", fontsize=8)
        ax.set_yticks(ys, [r.label for r in sim])
        ax.set_xlim(0, max(p90) * 1.3)
        ax.set(title="8 simulated H100s: TTFT", xlabel="simulated ms")
        ax.invert_yaxis()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
