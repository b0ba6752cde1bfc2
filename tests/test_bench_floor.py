"""The ideal floor, goodput at an SLO, the tail analysis and the targets against Dynamo:
pure functions over workloads and results, checked against the simulator itself."""

from __future__ import annotations

import math

import pytest

from kvplane.bench import floor, tail
from kvplane.bench.peers.dynamo import PRESETS, DynamoSetting, is_frontend_peer, is_selector_peer
from kvplane.bench.routing_report import dynamo_targets
from kvplane.sim.des import profile_for, run_des
from kvplane.sim.timing import prefill_ms
from kvplane.workload.results import RequestResult
from kvplane.workload.traces import TraceRequest, Workload

PROFILE = "h100-llama-3.1-8b"


def _workload(*reqs: tuple[float, tuple[int, ...], int]) -> Workload:
    rs = [TraceRequest(t, f"s{i}", n, 1, segs, 512) for i, (t, segs, n) in enumerate(reqs)]
    return Workload("test", "test", rs, 512)


def test_floor_is_the_engines_own_ttft_alone_with_the_oracles_prefix_cached() -> None:
    """Requests far apart on one engine never queue and find every earlier prefix in
    HBM: the simulator's TTFTs are the floor, request by request."""
    wl = _workload(
        (0.0, (1, 2, 3), 1400),
        (60.0, (1, 2, 3, 4, 5), 2300),  # reuses 1399 -> 1344 tokens (whole blocks of 64)
        (120.0, (9, 10), 900),  # nothing but BOS in common: no block
        (180.0, (1, 2, 7), 1500),  # shares the first two segments: 1025 -> 1024 tokens
    )
    prof = profile_for(PROFILE, 64)
    fl = floor.floor_of(wl, 64, floor.sim_model(prof))
    assert fl.cached == [0, 1344, 0, 1024]
    assert fl.ttft_ms[1] == pytest.approx(prefill_ms(prof, 2300 - 1344, 1344))
    _, results = run_des(wl, "kvplane", engines=1, profile=PROFILE, block_size=64)
    got = [1000.0 * (r.ttft_s or 0.0) for r in sorted(results, key=lambda r: r.arrival_s)]
    assert got == pytest.approx(fl.ttft_ms, rel=1e-9)
    assert fl.slo_ms == pytest.approx(floor.SLO_FACTOR * max(fl.ttft_ms))


def test_grid_model_interpolates_measured_points() -> None:
    grid = floor.GridModel(
        (64, 1024, 8192), (0, 8192), ((20.0, 30.0), (40.0, 55.0), (220.0, 260.0))
    )
    assert grid(1024, 0) == pytest.approx(40.0)
    assert grid(544, 0) == pytest.approx(30.0)  # halfway between 64 and 1024
    assert grid(1024, 4096) == pytest.approx(47.5)  # halfway in context
    assert grid(16384, 0) == pytest.approx(220.0 + 180.0 * 8192 / 7168)  # linear beyond
    # the rate a router is calibrated with: between the two longest fresh prompts
    assert grid.prefill_tokens_per_s() == pytest.approx(7168 / 180.0 * 1000.0)


def test_goodput_is_the_load_where_p90_crosses_the_slo() -> None:
    pts = [(1.0, 100.0), (2.0, 400.0), (4.0, 1600.0)]
    assert floor.goodput(pts, 400.0) == pytest.approx(2.0)
    assert floor.goodput(pts, 800.0) == pytest.approx(3.0)  # halfway in log TTFT
    assert floor.goodput(pts, 5000.0) == pytest.approx(4.0)  # never crossed: the heaviest
    assert floor.goodput(pts, 50.0) is None
    # a run with errors misses the SLO whatever its latency
    rows = [
        {"workload": "w", "router": "a", "offered_rps": 1.0, "ttft_p90_ms": 100.0},
        {"workload": "w", "router": "a", "offered_rps": 2.0, "ttft_p90_ms": 10.0, "errors": 3},
    ]
    (g,) = floor.goodput_table(rows, {"w": 400.0})
    assert g["goodput_rps"] == 1.0 and not g["saturated"]


def test_tail_names_long_prompts_missed_reuse_and_queueing() -> None:
    prof = profile_for(PROFILE, 64)
    model = floor.sim_model(prof)
    wl = _workload(
        (0.0, tuple(range(1, 41)), 20000),  # long and fresh
        (1.0, (100, 101, 102), 1500),  # its prefix was on another pod: recomputed
        (1.1, (100, 101, 102, 103), 2000),
        (0.5, (200,), 500),  # short, queued behind the long one
    )
    fl = floor.floor_of(wl, 64, model)
    own0 = model(20000, 0)
    results = [
        RequestResult(
            "r",
            True,
            own0 / 1000 + 0.01,
            prompt_tokens=20000,
            cached_tokens=0,
            backend="e0",
            arrival_s=0.0,
        ),
        RequestResult(
            "r", True, 0.06, prompt_tokens=1500, cached_tokens=0, backend="e1", arrival_s=1.0
        ),
        RequestResult(
            "r",
            True,
            model(2000, 0) / 1000 + 0.01,
            prompt_tokens=2000,
            cached_tokens=0,
            backend="e2",
            arrival_s=1.1,
        ),
        RequestResult(
            "r",
            True,
            own0 / 1000 + 0.01 - 0.5 + model(500, 0) / 1000,
            prompt_tokens=500,
            cached_tokens=0,
            backend="e0",
            arrival_s=0.5,
        ),
    ]
    rows = {round(r.arrival_s, 1): r for r in tail.tail(results, wl, fl, model, 64, q=0.0)}
    assert rows[0.0].cause == "long prompt"
    assert rows[1.1].cause == "missed reuse" and rows[1.1].oracle_cached == 1472
    assert rows[0.5].cause == "queued" and rows[0.5].pending_tokens == 20000
    assert rows[0.5].least_pending_tokens == 0
    assert "long prompt 2, queued 1, missed reuse 1" in tail.markdown(list(rows.values()), "t")


def _row(router: str, p90: float, p99: float, prefill: int, **kw: object) -> dict[str, object]:
    return {
        "workload": "w",
        "router": router,
        "ttft_p90_ms": p90,
        "ttft_p99_ms": p99,
        "prefill_tokens_computed": prefill,
        "errors": 0,
        "floor_p90_ms": 100.0,
        **kw,
    }


def test_dynamo_targets() -> None:
    runs = [
        _row("kvplane", 200.0, 900.0, 90),
        _row("dynamo", 400.0, 1000.0, 100),
        _row("dynamo-credit2", 300.0, 800.0, 95),
    ]
    goodput = [
        {"workload": "w", "router": "kvplane", "goodput_rps": 13.0},
        {"workload": "w", "router": "dynamo", "goodput_rps": 9.0},
        {"workload": "w", "router": "dynamo-credit2", "goodput_rps": 10.0},
    ]
    t = {x["target"]: x for x in dynamo_targets(runs, goodput)}
    p90 = t["TTFT p90 <= 0.7 x Dynamo's best (dynamo-credit2)"]
    assert p90["value"] == pytest.approx(0.667, abs=1e-3) and p90["pass"]
    assert t["TTFT p99 <= Dynamo's (dynamo)"]["pass"]
    assert not t["TTFT p99 <= Dynamo's (dynamo-credit2)"]["pass"]
    assert t["engine prefill tokens <= Dynamo's (dynamo-credit2)"]["pass"]
    assert t["goodput at the SLO >= 1.3 x Dynamo's best (dynamo-credit2)"]["pass"]
    # Dynamo within 1.5 x the floor: kvplane must be within 1.1 x the floor
    near = [_row("kvplane", 115.0, 900.0, 90), _row("dynamo", 140.0, 1000.0, 100)]
    (p90,) = [x for x in dynamo_targets(near, []) if "p90" in x["target"]]
    assert p90["target"].startswith("TTFT p90 <= 1.1 x the floor") and not p90["pass"]


def test_dynamo_settings_are_documented_presets_in_the_router_name() -> None:
    s = DynamoSetting.parse("dynamo-credit2-predict5", "dynamo")
    env = s.env(time_scale=6.0)
    assert env == {
        "DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT": "2.0",
        "DYN_ROUTER_PREDICTED_TTL_SECS": "30",
    }
    assert DynamoSetting.parse("dynamo", "dynamo").env(6.0) == {}
    scale = DynamoSetting.parse("dynamo-frontend-prefill4", "dynamo-frontend")
    assert scale.env(6.0) == {"DYN_ROUTER_PREFILL_LOAD_SCALE": "4.0"}  # not in seconds
    with pytest.raises(ValueError, match="unknown Dynamo setting"):
        DynamoSetting.parse("dynamo-fast", "dynamo")
    assert is_selector_peer("dynamo-credit2") and not is_selector_peer("dynamo-frontend")
    assert is_frontend_peer("dynamo-frontend-predict5") and not is_frontend_peer("dynamo")
    assert all(var.startswith("DYN_ROUTER_") for var, _, _ in PRESETS.values())
    assert math.isfinite(float(PRESETS["credit2"][1]))
