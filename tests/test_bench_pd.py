"""``kvplane bench pd``: the P:D sizing, the report's pure functions, and a tiny run of
every mode end to end (1 prefill + 1 decode engine, a 2-engine aggregated fleet,
kvplane's router and vllm-router's P/D mode, real processes on loopback).

Functional only: no figure is asserted, only that every mode completed without
errors and that the rows, decisions and files say what they claim.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from kvplane.bench import pd, pd_report, pd_setup
from kvplane.sim.profiles import LLAMA_8B_H100

pytestmark = pytest.mark.timeout(420)


def test_prefill_heavy_workload_shape() -> None:
    wl = pd_setup.prefill_heavy(n=50, rate=5.0, seed=1)
    assert wl.name == pd_setup.PREFILL_HEAVY and len(wl.requests) == 50
    arrivals = [r.arrival_s for r in wl.requests]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0
    assert all(6144 <= r.input_length <= 14336 for r in wl.requests)
    assert all(128 <= r.output_tokens <= 384 for r in wl.requests)
    segs = [s for r in wl.requests for s in r.segments]
    assert len(segs) == len(set(segs))  # nothing shared but BOS
    for r in wl.requests:  # the segments cover the prompt after BOS
        assert (len(r.segments) - 1) * r.segment_tokens < r.input_length - 1
        assert len(r.segments) * r.segment_tokens >= r.input_length - 1
    assert pd_setup.prefill_heavy(n=50, rate=5.0, seed=1) == wl


def test_split_follows_the_prefill_decode_balance() -> None:
    heavy = pd_setup.prefill_heavy(n=200, rate=10.0)
    s = pd_setup.split_for(heavy, LLAMA_8B_H100, 8, 0.0)
    assert s.prefill + s.decode == 8 and s.prefill > s.decode
    # no other split has a lower worse-side utilisation
    for p in range(1, 8):
        other = pd_setup.with_prefill(s, p)
        assert max(other.prefill_util, other.decode_util) >= max(s.prefill_util, s.decode_util)
    light = pd_setup.prefill_heavy(
        n=200, rate=1.0, input_range=(256, 512), output_range=(512, 1024)
    )
    s2 = pd_setup.split_for(light, LLAMA_8B_H100, 8, 0.0)
    assert s2.prefill < s2.decode
    assert "P:D" in s.why() and s.label == f"{s.prefill}:{s.decode}"
    # decode capacity grows with a shorter context (fewer KV reads per step)
    assert pd_setup.decode_capacity(LLAMA_8B_H100, 1000) > pd_setup.decode_capacity(
        LLAMA_8B_H100, 20000
    )
    with pytest.raises(SystemExit):
        pd_setup.with_prefill(s, 8)


def test_decision_counts_and_targets() -> None:
    text = (
        "# HELP kvplane_router_pd_decisions_total P/D decisions\n"
        "# TYPE kvplane_router_pd_decisions_total counter\n"
        'kvplane_router_pd_decisions_total{model="m",pool="default",reason="disaggregated"} 7.0\n'
        'kvplane_router_pd_decisions_total{model="m",pool="default",'
        'reason="aggregated_short_prompt"} 3.0\n'
    )
    after = pd_report.decision_counts(text)
    assert after == {"disaggregated": 7.0, "aggregated_short_prompt": 3.0}
    delta = pd_report.decision_delta({"disaggregated": 2.0}, after)
    assert delta == {"aggregated_short_prompt": 3, "disaggregated": 5}
    assert pd_report.disaggregated_share(delta) == 5 / 8
    assert pd_report.disaggregated_share({}) is None

    def row(mode: str, p90: float, itl99: float, errors: int = 0) -> dict[str, Any]:
        return {
            "workload": pd_setup.PREFILL_HEAVY,
            "router": mode,
            "ttft_p50_ms": p90 / 2,
            "ttft_p90_ms": p90,
            "ttft_p99_ms": p90 * 2,
            "itl_p50_ms": itl99 / 2,
            "itl_p99_ms": itl99,
            "throughput_rps": 1.0,
            "errors": errors,
        }

    runs = [row("aggregated", 100, 40), row("disaggregated", 120, 10), row("conditional", 104, 20)]
    targets = pd_report.check_targets(runs)
    assert [(t["value"], t["pass"]) for t in targets] == [(1.04, True), (0.5, True)]
    flex = pd_report.check_targets([*runs, row("conditional-flex", 103, 36)])
    # TTFT within 5% of aggregated, ITL only 0.9x aggregated's
    verdicts = [(t["mode"], t["pass"]) for t in flex[2:]]
    assert verdicts == [("conditional-flex", True), ("conditional-flex", False)]
    assert all(t["trusted"] for t in targets) and pd_report.verdict(targets[0]) == "PASS"
    runs[0]["lag_resyncs"] = pd_report.MAX_RESYNCS + 1  # the machine, not the fleet
    shaky = pd_report.check_targets(runs)
    assert [t["trusted"] for t in shaky] == [False, False]
    assert pd_report.verdict(shaky[0]).startswith("PASS (untrusted")
    runs[0]["lag_resyncs"] = 0
    runs[0]["errors"] = 1  # a reference with errors does not count
    assert pd_report.check_targets(runs)[0]["value"] == round(104 / 120, 3)
    runs[2]["errors"] = 2
    assert not any(t["pass"] for t in pd_report.check_targets(runs))
    table = pd_report.table(runs)
    assert table.count("\n") == 2 + len(runs) and "| prefill-heavy | conditional |" in table
    # every row has the header's columns
    assert len({line.count("|") for line in table.splitlines()}) == 1


def test_histogram_quantile_and_share_match_prometheus() -> None:
    """The token-gap figures come from cumulative ``le`` buckets, read as Prometheus does."""
    gaps = {0.01: 50.0, 0.1: 90.0, 0.3: 100.0, math.inf: 100.0}
    # rank 99 lies in (0.1, 0.3], 9 of its 10 observations in: 0.1 + 0.2 * 0.9
    assert pd_report.bucket_quantile(gaps, 0.99) == pytest.approx(0.28)
    assert pd_report.bucket_quantile(gaps, 0.5) == pytest.approx(0.01)
    # rank in the +Inf bucket: its lower bound, as Prometheus answers
    assert pd_report.bucket_quantile({0.1: 2.0, math.inf: 4.0}, 0.99) == 0.1
    assert pd_report.bucket_quantile({0.1: 0.0, math.inf: 0.0}, 0.99) is None
    assert pd_report.share_above(gaps, 0.1) == pytest.approx(0.1)
    assert pd_report.share_above(gaps, 0.2) is None  # not a bucket bound


def test_bench_pd_every_mode_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--workloads", pd_setup.PREFILL_HEAVY, "--engines", "2", "--prefill", "1"]
    argv += ["--limit", "4", "--time-scale", "2", "--request-timeout", "120"]
    argv += ["--out-dir", str(out), "--no-progress"]
    assert pd.main(argv) == 0
    files = list(out.glob("pd-*.json"))
    assert len(files) == 1
    doc = json.loads(files[0].read_text())
    runs = doc["runs"]
    assert [r["router"] for r in runs] == list(pd_setup.MODES)
    for r in runs:
        assert r["workload"] == pd_setup.PREFILL_HEAVY and r["requests"] == 4, r
        assert r["errors"] == 0, r.get("error_samples")
        assert r["ttft_p50_ms"] is not None and r["itl_p99_ms"] is not None
        assert r["token_gap_p99_ms"] > 0  # from the engines' histograms
        assert set(r["engine_stats"]) == {"e0", "e1"}
        assert sum(s["generation_tokens"] for s in r["engine_stats"].values()) > 0
    agg, dis, cond, flex, vr = runs
    assert agg["split"] == flex["split"] == "2 both"
    assert dis["split"] == cond["split"] == vr["split"] == "1:1"
    assert {s["role"] for s in agg["engine_stats"].values()} == {"both"}
    assert {s["role"] for s in flex["engine_stats"].values()} == {"both"}
    assert sum(flex["decisions"].values()) == 4
    assert agg["transferred_tokens"] == 0 and agg["decisions"] is None
    # always-disaggregated: every prompt (over a block) handed off, KV crossed the link
    assert dis["decisions"] == {"disaggregated": 4} and dis["disaggregated_share"] == 1.0
    assert dis["transferred_tokens"] > 0
    assert dis["engine_stats"]["e1"]["prefill_tokens_computed"] < 4 * 64
    assert sum(cond["decisions"].values()) == 4
    # vllm-router's P/D mode moved KV over NIXL too
    assert vr["transferred_tokens"] > 0 and "--vllm-pd-disaggregation" in vr["router_argv"]
    assert {t["workload"] for t in doc["targets"]} == {pd_setup.PREFILL_HEAVY}
    md = (out / "RESULTS.md").read_text()
    assert pd_report.SECTION in md and "| prefill-heavy | vllm-router-pd | 1:1 |" in md
