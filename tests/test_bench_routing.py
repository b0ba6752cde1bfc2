"""`kvplane bench routing` end to end, tiny: real routers in front of a real simulated fleet.

Figures are not checked (a smoke run on a loaded machine says nothing about speed);
the run must complete for every router without errors and write the documented rows.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, cast

import pytest
from kvplane.router.config import CostParams, RouterConfig
from kvplane.router.policies.cost import CostReason
from pydantic import ValidationError

from kvplane.bench import routing
from kvplane.bench.routers import EngineEndpoint, kvplane_config
from kvplane.bench.routing_report import SECTION, check_targets
from kvplane.workload.results import CORE_KEYS, load_results

pytestmark = pytest.mark.timeout(600)

REASONS = [v for k, v in vars(CostReason).items() if k.isupper()]


def _rows(out: Path, stem: str) -> list[dict[str, object]]:
    files = sorted(out.glob(f"{stem}-*.json"))
    assert len(files) == 1, files
    doc = json.loads(files[0].read_text())
    rows: list[dict[str, object]] = doc["runs"]
    return rows


def test_http_run_through_kvplane_and_sglang_router(tmp_path: Path) -> None:
    argv = ["--workloads", "gsp", "--routers", "kvplane,sglang-router-cache_aware"]
    argv += ["--quick", "--limit", "12", "--time-scale", "1", "--out-dir", str(tmp_path)]
    argv += ["--no-progress", "--rate-scale", "0.5", "--save-requests", str(tmp_path / "req")]
    assert routing.main(argv) == 0
    rows = _rows(tmp_path, "routing")
    # per-request results keep the router's stated reason (kvplane's x-kvplane-reason)
    saved = {p.name: load_results(p) for p in (tmp_path / "req").glob("*.jsonl.xz")}
    ours = next(v for k, v in saved.items() if "-kvplane-" in k)
    theirs = next(v for k, v in saved.items() if "-sglang-router-" in k)
    assert len(ours) == 12 and {r.reason for r in ours} <= set(REASONS)
    assert all(r.reason is None for r in theirs)
    assert [r["router"] for r in rows] == ["kvplane", "sglang-router-cache_aware"]
    for r in rows:
        assert list(r)[: len(CORE_KEYS)] == list(CORE_KEYS)
        assert r["errors"] == 0 and r["mode"] == "http" and r["requests"] == 12
        assert r["ttft_p50_ms"] is not None and r["oracle_hit_ratio"] is not None
    md = (tmp_path / "RESULTS.md").read_text()
    assert SECTION in md and "sglang-router-cache_aware" in md
    assert list(tmp_path.glob("routing-*-gsp.png"))


def test_des_run_accumulates_workloads_in_one_results_file(tmp_path: Path) -> None:
    base = ["--mode", "des", "--routers", "kvplane,kvplane-round_robin", "--limit", "64"]
    base += ["--engines", "2", "--out-dir", str(tmp_path), "--no-progress"]
    assert routing.main([*base, "--workloads", "gsp"]) == 0
    assert routing.main([*base, "--workloads", "no-reuse"]) == 0
    rows = _rows(tmp_path, "routing-des")
    assert sorted({str(r["workload"]) for r in rows}) == ["gsp", "no-reuse"]
    assert all(r["mode"] == "des" and r["errors"] == 0 for r in rows)
    noreuse = [r for r in rows if r["workload"] == "no-reuse"]
    assert all(r["hit_ratio"] == 0 for r in noreuse)
    # each row keeps its TTFT distribution, so a later run's plot can redraw its CDF
    for r in rows:
        q = [float(x) for x in r["ttft_quantiles_ms"]]  # type: ignore[attr-defined]
        p99 = float(r["ttft_p99_ms"])  # type: ignore[arg-type]
        assert len(q) == 51 and q == sorted(q)
        assert q[0] > 0 and q[-1] >= p99 >= q[45]
    # A longer replay of gsp is another slice: its rows replace every gsp row, so that no
    # comparison mixes slices (one router redone would otherwise sit next to the rest).
    longer = ["--mode", "des", "--routers", "kvplane", "--limit", "96", "--engines", "2"]
    longer += ["--out-dir", str(tmp_path), "--no-progress", "--workloads", "gsp"]
    assert routing.main(longer) == 0
    rows = _rows(tmp_path, "routing-des")
    assert [(r["router"], r["requests"]) for r in rows if r["workload"] == "gsp"] == [
        ("kvplane", 96)
    ]
    assert sorted(str(r["router"]) for r in rows if r["workload"] == "no-reuse") == [
        "kvplane",
        "kvplane-round_robin",
    ]
    # So is the same replay on another fleet (a DRAM tier)
    dram = [*longer, "--profile", "h100-llama-3.1-8b-dram", "--routers", "kvplane-sticky"]
    assert routing.main(dram) == 0
    rows = _rows(tmp_path, "routing-des")
    assert [(r["router"], r["profile"]) for r in rows if r["workload"] == "gsp"] == [
        ("kvplane-sticky", "h100-llama-3.1-8b-dram")
    ]
    # The markdown says what each workload's rows replayed, and which runs they came from
    md = (tmp_path / "RESULTS.md").read_text()
    assert "- gsp: 96 requests at" in md and "2 engines of `h100-llama-3.1-8b-dram`" in md
    assert "- no-reuse: 64 requests at" in md and "of `h100-llama-3.1-8b`" in md
    assert "Earlier runs of the day" in md and "--workloads no-reuse" in md


def test_targets_compare_kvplane_with_the_best_peer() -> None:
    def row(router: str, p90: float, hit: float, imb: float) -> dict[str, object]:
        return {
            "router": router,
            "workload": "gsp",
            "ttft_p90_ms": p90,
            "hit_ratio": hit,
            "oracle_hit_ratio": 0.8,
            "imbalance": imb,
            "errors": 0,
        }

    runs = [
        row("kvplane", 40.0, 0.78, 1.1),
        row("vllm-router-round_robin", 400.0, 0.4, 1.0),
        row("sglang-router-cache_aware", 100.0, 0.8, 1.3),
        row("kvplane-round_robin", 10.0, 0.4, 1.0),  # our own baseline is not a peer
    ]
    t = {str(x["target"]).split(" ")[0]: x for x in check_targets(runs)}
    assert "sglang-router-cache_aware" in t["TTFT"]["target"]
    assert t["TTFT"]["value"] == 0.4 and t["TTFT"]["pass"]
    assert t["captured"]["pass"] and t["load"]["pass"]


def test_kvplane_is_told_the_fleet_calibration_and_experiment_settings() -> None:
    """The router config renders the profile's DRAM tier as the discrete-event mode costs
    it, and ``--cost-set`` keys on top; a fleet without a CPU tier names none."""

    def cost(profile: str, settings: dict[str, Any] | None = None) -> dict[str, Any]:
        args = argparse.Namespace(profile=profile, block_size=64)
        cfg = kvplane_config(routing.model_facts(args, Path("tok"), settings), [], "cost")
        return cast(dict[str, Any], cfg["cost"])

    dram = cost("h100-llama-3.1-8b-dram", {"recompute_weight": 4})
    assert dram["tiers"] == {"dram": {"bandwidth_gbps": 50.0, "latency_ms": 0.05}}
    assert CostParams.model_validate(dram).recompute_weight == 4
    assert "tiers" not in cost("h100-llama-3.1-8b")


def test_kvplane_is_told_a_host_tier_the_engines_do_not_report() -> None:
    """Dynamo's mockers publish no events for their host tier: kvplane's router is told
    its size (``unreported_tier``); engines that report theirs, or have none, get none."""
    args = argparse.Namespace(profile="h100-llama-3.1-8b-dram", block_size=64)
    facts = routing.model_facts(args, Path("tok"), None)

    def told(*host_blocks: int) -> object:
        engines = [
            EngineEndpoint(f"e{i}", f"http://e{i}", "tcp://e:1", "tcp://e:2", {}, "off", n)
            for i, n in enumerate(host_blocks)
        ]
        cfg = kvplane_config(facts, engines, "cost")
        RouterConfig.model_validate(cfg)  # what the router is started with
        return cfg.get("unreported_tier")

    assert told(32000, 32000) == {"tier": "dram", "blocks": 32000}
    assert told(0, 0) is None


def _http_args(*extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    routing.add_arguments(p)
    return p.parse_args(["--engines", "4", *extra])


def test_an_http_fleet_shape_reaches_the_simulator_and_kvplanes_router() -> None:
    """Over HTTP one ``--fleet-shape`` becomes ``kvplane sim`` flags (the fleet's DRAM
    tier, store and peer pulls) and what kvplane's router is told of it (the tier's
    cost, the store as a shared store, the peer link), as the DES mode configures both."""
    from kvplane.sim import main as sim_main
    from kvplane.sim.kvcache import SIM_STORE

    def shaped(*extra: str) -> tuple[Any, dict[str, Any]]:
        args = _http_args(*extra)
        facts = routing._http_shape(args, routing.model_facts(args, Path("tok")))
        p = argparse.ArgumentParser()
        sim_main.add_arguments(p)
        fleet = sim_main.fleet_config(p.parse_args(["--tokenizer", "tok", *args.sim_flags]))
        cfg = kvplane_config(facts, [], "cost")
        RouterConfig.model_validate(cfg)  # what the router is started with
        return fleet, cfg

    fleet, cfg = shaped("--fleet-shape", "hbm+shared+peer")
    assert fleet.store_blocks == 4 * 32000 and fleet.cpu_offload_blocks == 0
    assert fleet.store_link.bandwidth_gbps == 25.0 and not fleet.store_write_through
    assert fleet.peer_link is not None and fleet.peer_link.bandwidth_gbps == 40.0
    assert cfg["shared_stores"] == [
        {"name": SIM_STORE, "link": {"bandwidth_gbps": 25.0, "latency_ms": 1.0}}
    ]
    assert cfg["peer_pull"] == {"link": {"bandwidth_gbps": 40.0, "latency_ms": 0.2}}
    assert "tiers" not in cast(dict[str, Any], cfg["cost"])
    fleet, cfg = shaped("--fleet-shape", "hbm+dram", "--dram-tokens", "640000")
    assert fleet.cpu_offload_blocks == 10000 and fleet.store_blocks == 0
    assert "dram" in cast(dict[str, Any], cfg["cost"])["tiers"] and "shared_stores" not in cfg
    # the HBM shape takes the DRAM profile's tier away, from the fleet and the router
    fleet, cfg = shaped("--fleet-shape", "hbm", "--profile", "h100-llama-3.1-8b-dram")
    assert fleet.cpu_offload_blocks == 0 and "tiers" not in cast(dict[str, Any], cfg["cost"])
    fleet, _ = shaped("--fleet-shape", "hbm+oracle")
    assert fleet.store_write_through and fleet.store_link.latency_ms == 0.0
    # no shape: the fleet as the profile has it
    args = _http_args()
    assert routing._http_shape(args, routing.model_facts(args, Path("tok"))).fleet_kv == {}
    assert args.sim_flags == []
    for extra in (
        ("--fleet-shape", "hbm,hbm+dram"),  # one fleet per HTTP run
        ("--fleet-shape", "hbm+dram-silent"),  # the simulator always publishes its tier
        ("--fleet-shape", "hbm+shared", "--fleet", "dynamo-mocker"),
    ):
        args = _http_args(*extra)
        with pytest.raises(SystemExit):
            routing._http_shape(args, routing.model_facts(args, Path("tok")))


def test_http_run_on_the_oracle_fleet_reuses_what_any_pod_computed(tmp_path: Path) -> None:
    """Least-loaded, blind to residency, over real HTTP engines: on the oracle fleet it
    reuses what the oracle does (every block any engine computed is every engine's)."""
    argv = ["--workloads", "gsp", "--routers", "kvplane-least_loaded", "--quick"]
    argv += ["--limit", "24", "--time-scale", "1", "--rate-scale", "0.5", "--no-progress"]
    argv += ["--fleet-shape", "hbm+oracle", "--out-dir", str(tmp_path)]
    assert routing.main(argv) == 0
    (row,) = _rows(tmp_path, "routing")
    assert row["errors"] == 0 and row["requests"] == 24
    # (all of it unless a sibling arrives while the first is still being computed; on
    # HBM alone least-loaded captures about three quarters here)
    hit, oracle = cast(float, row["hit_ratio"]), cast(float, row["oracle_hit_ratio"])
    assert hit >= 0.9 * oracle, row
    assert "fleet shapes hbm+oracle" in (tmp_path / "RESULTS.md").read_text()


def test_des_cost_settings_are_validated_and_reported(tmp_path: Path) -> None:
    """``--cost-set`` goes through the router's own ``CostParams`` (a strict model)."""
    argv = ["--mode", "des", "--routers", "kvplane", "--limit", "64", "--engines", "2"]
    argv += ["--workloads", "gsp", "--out-dir", str(tmp_path), "--no-progress"]
    assert routing.main([*argv, "--cost-set", "recompute_weight=1,balance_band=0"]) == 0
    doc = json.loads(next(tmp_path.glob("routing-des-*.json")).read_text())
    assert doc["setup"]["kvplane cost"] == "recompute_weight=1,balance_band=0"
    with pytest.raises(SystemExit, match="key=value"):
        routing.main([*argv, "--cost-set", "recompute_weight"])
    with pytest.raises(ValidationError, match="no_such_knob"):
        routing.main([*argv, "--cost-set", "no_such_knob=1"])
