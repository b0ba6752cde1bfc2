"""The demo's own parts (its full run needs vLLM engines: ``make demo``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvplane.demo import RunResult, agreement, pooled
from kvplane.demo_plot import plot
from kvplane.demo_sim import SimRun


def result(policy: str, cached: int, ttfts: list[float], pods: dict[str, int]) -> RunResult:
    return RunResult(policy, len(ttfts), 0, 1000, cached, ttfts, pods)


def test_rounds_pool_and_agreement_counts_each_measure() -> None:
    rr1 = result("rr", 500, [300.0, 200.0], {"e0": 1, "e1": 1})
    kv1 = result("kv", 800, [100.0, 150.0], {"e0": 2})
    rr2 = result("rr", 500, [100.0, 120.0], {"e0": 2})
    kv2 = result("kv", 900, [150.0, 160.0], {"e1": 2})
    rounds = [(rr1, kv1), (rr2, kv2)]
    both = pooled([kv for _, kv in rounds])
    assert (both.requests, both.prompt_tokens, both.cached_tokens) == (4, 2000, 1700)
    assert both.per_pod == {"e0": 2, "e1": 2} and both.hit_ratio == 0.85
    assert agreement(rounds) == (
        "kvplane ahead in 2/2 rounds on hit ratio, 1/2 on TTFT p50, 1/2 on mean TTFT"
    )


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    rr, kv = result("rr", 550, [250.0], {}), result("kv", 860, [120.0], {})
    sim = [
        SimRun("kvplane", "kvplane", {"ttft_p50_ms": 24, "ttft_p90_ms": 118}),
        SimRun("kvplane-round_robin", "round-robin", {"ttft_p50_ms": 308, "ttft_p90_ms": 547}),
    ]
    for runs in (sim, None):
        path = plot([(rr, kv)] * 3, runs, tmp_path / "demo.png")
        assert path is not None
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_no_pytorch_advice_from_transformers_on_any_command() -> None:
    """transformers says on import that PyTorch is missing; every kvplane command
    silences that advice (and only advice)."""
    code = "import kvplane.cli, transformers"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "PyTorch was not found" not in proc.stderr
