"""P/D in virtual time: kvplane's P/D choice against simulated engines (``kvplane.sim.des_pd``),
and ``kvplane bench pd --mode des``.

The engines are the simulator's ``EngineCore``; the router parts are the live
router's own (``choose_pd``, the in-memory index fed by the engines' KV events, the
pool's load accounting). Figures are deterministic, so the timing checks are exact.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from kvplane.router.config import LinkClass, LinkCost, PDSpec
from kvplane.router.pd.choice import PDReason

from kvplane.bench import pd as bench_pd
from kvplane.bench import pd_des, pd_setup
from kvplane.sim.des_pd import Topology, run_des_pd
from kvplane.sim.profiles import LLAMA_8B_H100
from kvplane.workload.traces import TraceRequest, Workload, generated_shared_prefix

BS = 64
KV_BYTES = LLAMA_8B_H100.kv_bytes_per_token


def links(nic: float = 50.0, nvlink: float | None = None) -> dict[LinkClass, LinkCost]:
    out = {LinkClass.SAME_ZONE: LinkCost(bandwidth_gbps=nic, latency_ms=0.0)}
    if nvlink is not None:
        out[LinkClass.SAME_NODE] = LinkCost(bandwidth_gbps=nvlink, latency_ms=0.0)
    return out


def always(nic: float = 50.0, nvlink: float | None = None) -> PDSpec:
    return PDSpec(links=links(nic, nvlink), aggregate_max_uncached_tokens=0)


def heavy(n: int = 12, rate: float = 4.0, lengths: tuple[int, int] = (2000, 6000)) -> Workload:
    return pd_setup.prefill_heavy(n=n, input_range=lengths, output_range=(16, 48), rate=rate)


def one_request(tokens: int, output: int = 8) -> Workload:
    segs = tuple(range(-(-(tokens - 1) // 512)))
    req = TraceRequest(0.0, "r0", tokens, output, segs, 512)
    return Workload(name="one", description="one request", requests=[req], segment_tokens=512)


def test_disaggregated_hands_every_request_off_and_moves_its_full_blocks() -> None:
    wl = heavy()
    roles = ["prefill", "prefill", "decode", "decode"]
    run = run_des_pd(wl, roles, always(), name="disaggregated", block_size=BS)
    x = run.record.extra
    assert run.record.errors == 0 and len(run.results) == 12
    assert x["decisions"] == {PDReason.DISAGGREGATED: 12} and x["disaggregated_share"] == 1.0
    # every request decodes on a decode pod, which received the prompt's full blocks and
    # computed only its last partial block
    full = [(r.prompt_tokens - 1) // BS * BS for r in run.results]
    for r, blocks in zip(run.results, full, strict=True):
        assert r.backend in {"e2", "e3"}
        assert r.cached_tokens == blocks
        assert r.output_tokens == next(
            q.output_tokens for q in wl.requests if q.arrival_s == r.arrival_s
        )
    assert x["transfers"] == {"same_zone": {"handoffs": 12, "tokens": sum(full)}}
    assert x["prefill_busy"] > 0 and x["decode_busy"] > 0
    assert x["token_gap_p99_ms"] > 0


def test_the_handoff_costs_its_transfer_time_on_ttft_exactly() -> None:
    """One request on an idle fleet: TTFT on a slow link minus TTFT on a fast one is the
    difference of the two transfer times of its full blocks, nothing else."""
    wl = one_request(4097)
    roles = ["prefill", "decode"]
    slow = run_des_pd(wl, roles, always(nic=1.0), name="slow", block_size=BS).results[0]
    fast = run_des_pd(wl, roles, always(nic=100.0), name="fast", block_size=BS).results[0]
    moved = 4096 * KV_BYTES
    assert slow.ttft_s is not None and fast.ttft_s is not None
    assert slow.ttft_s - fast.ttft_s == pytest.approx(moved / 1e9 - moved / 100e9, rel=1e-9)
    # and the aggregated baseline on one pod has no transfer at all
    agg = run_des_pd(wl, ["both"], None, name="aggregated", block_size=BS).results[0]
    assert agg.ttft_s is not None and agg.ttft_s < fast.ttft_s


def test_pairs_stay_on_a_node_when_the_router_knows_the_placement() -> None:
    """Two nodes of four pods (3 prefill + 1 decode each): told the nodes, the router
    keeps every handoff on NVLink; blind to them, it sends some over the NIC."""
    wl = heavy(n=16, rate=2.0)
    roles = ["prefill"] * 6 + ["decode"] * 2
    spec = always(nic=50.0, nvlink=450.0)
    known = run_des_pd(wl, roles, spec, name="c", block_size=BS, topology=Topology(4))
    assert set(known.record.extra["transfers"]) == {"same_node"}
    blind = run_des_pd(
        wl, roles, spec, name="c", block_size=BS, topology=Topology(4, router_sees_nodes=False)
    )
    moved = blind.record.extra["transfers"]
    assert moved["same_zone"]["handoffs"] > 0  # crossed nodes at NIC speed
    assert sum(v["handoffs"] for v in moved.values()) == 16
    assert (known.record.ttft_mean_ms or 0) < (blind.record.ttft_mean_ms or 0)


def test_topology_spreads_each_pool_over_the_nodes() -> None:
    roles = ["prefill"] * 6 + ["decode"] * 2
    nodes = Topology(4).nodes(roles)
    assert nodes[:6] == ["node-0", "node-1"] * 3
    assert nodes[6:] == ["node-0", "node-1"]
    assert Topology().nodes(roles) == [None] * 8
    # no node gets more pods than GPUs: 22 prefill + 10 decode on 4 nodes of 8
    uneven = Topology(8).nodes(["prefill"] * 22 + ["decode"] * 10)
    per_node = Counter(uneven)
    assert set(per_node.values()) == {8}
    decode_per_node = Counter(uneven[22:])
    assert sorted(decode_per_node.values()) == [2, 2, 3, 3]


def test_conditional_keeps_short_prompts_on_the_decode_pod() -> None:
    wl = heavy(n=10, lengths=(100, 400))
    run = run_des_pd(
        wl, ["prefill", "decode", "decode"], PDSpec(links=links()), name="c", block_size=BS
    )
    assert run.record.errors == 0
    assert run.record.extra["decisions"] == {PDReason.SHORT_PROMPT: 10}
    assert run.record.extra["transfers"] == {}
    assert {r.backend for r in run.results} <= {"e1", "e2"}


def test_idle_prefill_pods_serve_the_shared_prefixes_they_computed() -> None:
    """Shared system prompts: the prefill pods computed them, hold them, and sit idle
    between first requests, so follow-ups are served there whole, the plain vLLM
    request a NIXL (kv_both) engine takes; switched off, they queue on the decode pod."""
    wl = generated_shared_prefix(groups=2, per_group=8, system_len=2048, rate=8.0)
    roles = ["prefill", "prefill", "decode"]
    run = run_des_pd(wl, roles, PDSpec(links=links()), name="c", block_size=BS)
    decisions = run.record.extra["decisions"]
    assert run.record.errors == 0 and len(run.results) == 16
    assert decisions.get(PDReason.RESIDENT_ON_PREFILL, 0) > 0
    on_prefill = [r for r in run.results if r.backend in {"e0", "e1"}]
    assert len(on_prefill) == decisions[PDReason.RESIDENT_ON_PREFILL]
    assert all((r.cached_tokens or 0) >= 2048 for r in on_prefill)
    off = PDSpec(links=links(), prefill_serves_resident=False)
    run_off = run_des_pd(wl, roles, off, name="c", block_size=BS)
    assert PDReason.RESIDENT_ON_PREFILL not in run_off.record.extra["decisions"]
    assert {r.backend for r in run_off.results} == {"e2"}


def test_a_prompt_under_one_block_is_prefilled_on_the_decode_pod() -> None:
    """vLLM hands off nothing without a full block: the decode pod prefills it."""
    run = run_des_pd(one_request(40), ["prefill", "decode"], always(), name="d", block_size=BS)
    assert run.record.errors == 0 and run.results[0].backend == "e1"
    assert run.record.extra["decisions"] == {PDReason.NO_KV_PARAMS: 1}


def test_deterministic_and_checked_arguments() -> None:
    wl = heavy(n=8)
    roles = ["prefill", "decode", "decode"]
    a = run_des_pd(wl, roles, PDSpec(links=links()), name="c", block_size=BS).record.to_json()
    b = run_des_pd(wl, roles, PDSpec(links=links()), name="c", block_size=BS).record.to_json()
    a.pop("router_cpu_s")
    b.pop("router_cpu_s")
    assert a == b
    with pytest.raises(ValueError, match="every pod must be 'both'"):
        run_des_pd(wl, roles, None, name="x")


def test_bench_pd_des_mode_accumulates_rows_and_checks_targets_per_split(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--mode", "des", "--engines", "4", "--workloads", pd_setup.PREFILL_HEAVY]
    base += ["--limit", "16", "--out-dir", str(tmp_path), "--no-progress"]
    assert bench_pd.main([*base, "--modes", "aggregated,disaggregated,conditional"]) == 0
    assert "4 GPUs, placement unknown (50 GB/s)" in capsys.readouterr().out
    argv = [*base, "--modes", "aggregated,conditional", "--prefill", "2,3"]
    argv += ["--gpus-per-node", "2", "--seeds", "0,1"]
    assert bench_pd.main(argv) == 0
    (path,) = tmp_path.glob("pd-des-*.json")
    doc = json.loads(path.read_text())
    assert len(doc["commands"]) == 2
    rows = doc["runs"]
    first = [r for r in rows if r["gpus_per_node"] == 0]
    assert [r["router"] for r in first] == ["aggregated", "disaggregated", "conditional"]
    second = [r for r in rows if r["gpus_per_node"] == 2]
    assert sorted((r["seed"], r["router"], r["split"]) for r in second) == [
        (s, m, sp)
        for s in (0, 1)
        for m, sp in (("aggregated", "4 both"), ("conditional", "2:2"), ("conditional", "3:1"))
    ]
    assert all(r["errors"] == 0 and r["mode"] == "des" for r in rows)
    # one TTFT verdict per (fleet, seed, split) of the conditional mode, and an ITL one
    ttft = [t for t in doc["targets"] if "TTFT" in t["target"]]
    assert sorted((t["fleet"].split(",")[1].strip(), t["seed"], t["split"]) for t in ttft) == [
        ("2 nodes x 2 (NVLink 450 / NIC 50 GB/s)", 0, "2:2"),
        ("2 nodes x 2 (NVLink 450 / NIC 50 GB/s)", 0, "3:1"),
        ("2 nodes x 2 (NVLink 450 / NIC 50 GB/s)", 1, "2:2"),
        ("2 nodes x 2 (NVLink 450 / NIC 50 GB/s)", 1, "3:1"),
        ("placement unknown (50 GB/s)", 0, "3:1"),
    ]
    assert all(t["mode"] == "conditional" for t in doc["targets"])
    # a rerun of the same command replaces its rows instead of adding them
    assert bench_pd.main(argv) == 0
    again = json.loads(path.read_text())
    assert len(again["runs"]) == len(rows) and len(again["commands"]) == 2
    md = (tmp_path / "RESULTS.md").read_text()
    assert pd_des.SECTION in md and "| 4 GPUs, 2 nodes x 2" in md


def test_over_http_the_node_placement_is_refused() -> None:
    with pytest.raises(SystemExit, match="needs --mode des"):
        bench_pd.main(["--gpus-per-node", "8", "--workloads", pd_setup.PREFILL_HEAVY])
