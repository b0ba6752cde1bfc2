"""The demo's second half: kvplane against round-robin and the strongest installed peer
router on a simulated 8 x H100 fleet, through ``kvplane bench routing``'s own run (each
router on a cold fleet, over HTTP, the same requests at the same offered times)."""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplane.bench import routing
from kvplane.bench.procs import default_tokenizer_dir
from kvplane.bench.replay import ReplayItem
from kvplane.workload.results import oracle_hit_ratio
from kvplane.workload.traces import PromptBuilder, build_workload

WORKLOAD = "gsp"  # SGLang's generated shared prefix
RATE_SCALE = 8.0  # x its native rate: the best peer near saturation on 8 H100s
# Peers by their recorded results on this workload (bench/RESULTS.md, Routing quality):
# the first one installed is the one the demo runs.
PEERS = (
    ("sglang-router-cache_aware", "sglang_router"),
    ("vllm-router-cache_aware", "vllm-router"),
)


def strongest_peer() -> str | None:
    for name, needs in PEERS:
        found = importlib.util.find_spec(needs) if "-" not in needs else shutil.which(needs)
        if found:
            return name
    return None


@dataclass
class SimRun:
    router: str
    label: str
    row: dict[str, Any]


def run_sim(requests: int, time_scale: float) -> list[SimRun]:
    parser = argparse.ArgumentParser()
    routing.add_arguments(parser)
    args = parser.parse_args(
        ["--engines", "8", "--limit", str(requests), "--time-scale", str(time_scale)]
    )
    tokenizer = default_tokenizer_dir()
    builder = PromptBuilder(tokenizer)
    facts = routing.model_facts(args, tokenizer)
    workload = build_workload(WORKLOAD, trace=None, limit=requests, start=0, rate_scale=RATE_SCALE)
    oracle = oracle_hit_ratio(builder, workload, args.block_size)
    items = [ReplayItem(r, builder.text(r)) for r in workload.requests]
    routers = [("kvplane", "kvplane"), ("kvplane-round_robin", "round-robin")]
    peer = strongest_peer()
    if peer is not None:
        routers.append((peer, peer))
    out = []
    with tempfile.TemporaryDirectory(prefix="kvplane-demo-sim-") as tmp:
        for name, label in routers:
            print(f"  {label}...", flush=True)
            run = routing.run_one(name, workload, items, oracle, facts, args, Path(tmp))
            out.append(SimRun(name, label, run.record))
    if peer is None:
        print("  (no peer router installed: pip install 'kvplane[peers]')")
    return out


def print_sim(runs: list[SimRun]) -> None:
    print("\n8 simulated H100s (h100-llama-3.1-8b), simulated milliseconds:")
    print(f"{'router':<28}{'requests':>9}{'errors':>8}{'hit ratio':>11}{'TTFT p50':>11}"
          f"{'TTFT p90':>11}")  # fmt: skip
    for r in runs:
        row = r.row
        print(
            f"{r.label:<28}{row['requests']:>9}{row['errors']:>8}{row['hit_ratio']:>11.2f}"
            f"{row['ttft_p50_ms']:>9.0f}ms{row['ttft_p90_ms']:>9.0f}ms"
        )
    lag = max(float(r.row.get("sim_max_lag_s") or 0.0) for r in runs)
    print(f"(the simulated engines kept their timeline within {lag:.2f} s of wall time)")
    kv = runs[0].row
    for r in runs[1:]:
        if r.row["ttft_p90_ms"]:
            print(f"kvplane TTFT p90 x{kv['ttft_p90_ms'] / r.row['ttft_p90_ms']:.2f} of {r.label}")
