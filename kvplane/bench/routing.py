"""``kvplane bench routing``: routing quality side by side with the routers people use.

For every workload and router: a cold simulated fleet (``kvplane sim``, the H100
Llama-3.1-8B profile by default), the router in front of it, the same request
sequence replayed open-loop at the same offered load. Figures come from the
client (TTFT, inter-token latency, errors), the engines (cache hits, prefill
tokens computed per engine, hence load imbalance) and the router process (CPU
seconds). The oracle ceiling is the hit ratio of one infinite shared cache on the
same sequence. ``--mode des`` runs the discrete-event mode instead: kvplane's own
policy code against simulated engines in virtual time, no HTTP.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import itertools
import json
import logging
import lzma
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvplane.bench import floor, routing_report
from kvplane.bench.peers import dynamo, dynamo_mocker
from kvplane.bench.peers.dynamo_proxy import write_token_table
from kvplane.bench.procs import (
    HOST,
    Proc,
    bench_main,
    bench_relative,
    cpu_seconds,
    csv_list,
    default_tokenizer_dir,
    machine_info,
    parse_settings,
    results_dir,
    spawn,
    update_markdown,
    venv_bin,
    versions,
    wait_ready,
)
from kvplane.bench.replay import ReplayItem, ReplayOptions, replay
from kvplane.bench.routers import DEFAULT_ROUTERS, EngineEndpoint, ModelFacts, start_router
from kvplane.router.config import CostParams
from kvplane.router.tiers import Tier
from kvplane.workload.results import (
    RequestResult,
    computed_prefill,
    oracle_hit_ratio,
    percentile,
    save_results,
    summarize,
)
from kvplane.workload.traces import (
    WORKLOAD_NAMES,
    PromptBuilder,
    TraceRequest,
    Workload,
    build_workload,
)

if TYPE_CHECKING:
    from kvplane.sim.des import DesOptions

MODEL = "sim-llama-3.1-8b"


# --------------------------------------------------------------------------- progress


class Progress:
    """A one-line progress bar on stderr (no dependency, redrawn at most 4x a second)."""

    def __init__(self, label: str, enabled: bool = True) -> None:
        self.label = label
        self.enabled = enabled and sys.stderr.isatty()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if done < total and now - self._last < 0.25:
            return
        self._last = now
        width = 30
        fill = int(width * done / max(total, 1))
        bar = "#" * fill + "." * (width - fill)
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\r{self.label:<40} [{bar}] {done}/{total}{end}")
        sys.stderr.flush()


# --------------------------------------------------------------------------- processes


@dataclass
class Fleet:
    proc: Proc
    engines: list[EngineEndpoint]
    time_scale: float

    def stats(self) -> list[dict[str, Any]]:
        """Each engine's /sim/stats (prefill tokens computed, cached tokens, requests)."""
        out = []
        for e in self.engines:
            with urllib.request.urlopen(e.url + "/sim/stats", timeout=10) as r:
                out.append(json.loads(r.read()))
        return out

    def stop(self) -> None:
        self.proc.stop()


def start_fleet(
    args: argparse.Namespace,
    tokenizer: Path,
    rundir: Path,
    block_size: int,
    extra_argv: Sequence[str] = (),
) -> Fleet:
    """``kvplane sim`` with the run's engines and profile; ``extra_argv`` adds flags
    (the P/D benchmark's ``--prefill N --kv-connector ...``)."""
    ports_file = rundir / f"fleet-{time.monotonic_ns()}.json"
    argv = [venv_bin("kvplane"), "--log-level", "warning", "sim"]
    argv += ["--engines", str(args.engines), "--profile", args.profile]
    argv += ["--model", MODEL, "--tokenizer", str(tokenizer), "--block-size", str(block_size)]
    argv += ["--time-scale", str(args.time_scale), "--stream-interval", str(args.stream_interval)]
    argv += ["--host", HOST, "--describe", str(ports_file), *extra_argv]
    proc = spawn(f"sim-{ports_file.stem}", argv, rundir)
    deadline = time.monotonic() + 120
    while not ports_file.exists():
        if not proc.alive() or time.monotonic() > deadline:
            raise SystemExit(f"bench routing: the simulated fleet did not start:\n{proc.tail()}")
        time.sleep(0.2)
    time.sleep(0.2)  # written in one call, but let the writer finish
    rows = json.loads(ports_file.read_text())
    engines = [EngineEndpoint(e["name"], e["url"], e["kv_events"], e["replay"]) for e in rows]
    for e in engines:
        port = int(e.url.rsplit(":", 1)[1])
        if not wait_ready(proc, port, 60, None):
            raise SystemExit(f"bench routing: engine {e.name} not ready:\n{proc.tail()}")
    return Fleet(proc, engines, args.time_scale)


# --------------------------------------------------------------------------- one run


@dataclass
class RunOutput:
    record: dict[str, Any]
    results: list[RequestResult]


def mocker_spec(args: argparse.Namespace, facts: ModelFacts) -> dynamo_mocker.MockerSpec:
    """Dynamo's mockers with the run's engine profile (capacity, budget, CPU tier)."""
    from kvplane.sim.des import profile_for

    prof = profile_for(args.profile, args.block_size)
    return dynamo_mocker.MockerSpec(
        model=MODEL,
        tokenizer=facts.tokenizer,
        block_size=facts.block_size,
        kv_blocks=facts.kv_blocks,
        max_num_batched_tokens=facts.max_num_batched_tokens,
        max_model_len=facts.max_model_len,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        time_scale=args.time_scale,
        host_blocks=prof.cpu_offload_blocks,
        host_gbps=prof.cpu_bandwidth_gbps,
    )


def start_mocker_fleet(
    args: argparse.Namespace, facts: ModelFacts, rundir: Path, *, direct: bool
) -> dynamo_mocker.MockerFleet:
    return dynamo_mocker.start_fleet(mocker_spec(args, facts), args.engines, rundir, direct=direct)


def save_log(log: Path, stem: Path) -> None:
    """The router's log of a row beside its saved requests (the next row's replaces it in
    the run directory)."""
    if log.exists() and log.stat().st_size:
        with lzma.open(stem.with_name(stem.name + ".log.xz"), "wb") as out:
            out.write(log.read_bytes())


def run_one(
    router: str,
    workload: Workload,
    items: Sequence[ReplayItem],
    oracle: float,
    facts: ModelFacts,
    args: argparse.Namespace,
    rundir: Path,
    load_factor: float = 1.0,
    token_table: Path | None = None,
) -> RunOutput:
    mockers = args.fleet == "dynamo-mocker"
    fleet: Fleet | dynamo_mocker.MockerFleet = (
        start_mocker_fleet(args, facts, rundir, direct=not dynamo.is_frontend_peer(router))
        if mockers
        else start_fleet(
            args, facts.tokenizer, rundir, facts.block_size, getattr(args, "sim_flags", ())
        )
    )
    engines = fleet.engines if isinstance(fleet, Fleet) else fleet.endpoints
    opts = ReplayOptions()
    try:
        if dynamo.is_frontend_peer(router):
            if not isinstance(fleet, dynamo_mocker.MockerFleet):
                raise SystemExit(f"bench routing: {router} runs on --fleet dynamo-mocker only")
            running = fleet.start_frontend(router)
            opts = ReplayOptions(dynamo_mocker.WORKER_ID_BODY, fleet.worker_names)
        else:
            running = start_router(router, facts, engines, rundir, args.time_scale, token_table)
    except BaseException:
        fleet.stop()
        raise
    try:
        probe = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
        if not wait_ready(running, running.port, 120, probe):
            raise SystemExit(f"bench routing: router {router} not ready:\n{running.tail()}")
        # the probe cached a block somewhere: forget it so every router starts cold
        time.sleep(1.0)
        cpu0 = sum(cpu_seconds(pid) for pid in running.pids)
        # the direct-mode frontend kvplane routes through on the mocker fleet
        direct = fleet.direct if isinstance(fleet, dynamo_mocker.MockerFleet) else None
        hop = [direct.popen.pid] if direct is not None else []
        hop0 = sum(cpu_seconds(pid) for pid in hop)
        stats0 = fleet.stats() if isinstance(fleet, Fleet) else []
        bar = Progress(f"{workload.name} x{load_factor:g} {router}", not args.no_progress)
        results, wall = asyncio.run(
            replay(
                f"http://{HOST}:{running.port}",
                MODEL,
                router,
                items,
                time_scale=args.time_scale,
                timeout_s=args.request_timeout,
                progress=bar,
                options=opts,
            )
        )
        cpu = sum(cpu_seconds(pid) for pid in running.pids) - cpu0
        hop_cpu = sum(cpu_seconds(pid) for pid in hop) - hop0
        stats1 = fleet.stats() if isinstance(fleet, Fleet) else []
    finally:
        running.stop()
        fleet.stop()
    if stats1:
        prefill = {
            s1["name"]: int(s1["prefill_tokens_computed"]) - int(s0["prefill_tokens_computed"])
            for s0, s1 in zip(stats0, stats1, strict=True)
        }
    else:  # engines without counters: what the client saw (prompt - cached per engine)
        prefill = computed_prefill(results, [e.name for e in engines])
    offered = len(items) / max(items[-1].request.arrival_s, 1e-9) if items else 0.0
    rec = summarize(
        router,
        workload.name,
        results,
        oracle_hit_ratio=oracle,
        prefill_tokens_per_engine=prefill,
        router_cpu_s=cpu,
        duration_s=wall / args.time_scale,
        mode="http",
        engines=args.engines,
        profile=args.profile,
        offered_rps=offered,
    )
    out = rec.to_json()
    out["load_factor"] = load_factor
    out["fleet"] = args.fleet
    out["prefill_tokens_computed"] = sum(prefill.values())
    if hop:
        out["frontend_cpu_s"] = round(hop_cpu, 1)
    out.update({k: str(v) for k, v in running.notes.items()})
    if stats1:
        # requests each engine received, to compare with the pods the router named
        out["engine_requests"] = {
            s1["name"]: int(s1["requests"]) - int(s0["requests"])
            for s0, s1 in zip(stats0, stats1, strict=True)
        }
        # engines whose event loop fell behind the modeled timeline (an overloaded
        # machine): such a run's latencies include the machine's, not only the fleet's
        out["sim_max_lag_s"] = round(max(float(s.get("max_lag_s", 0.0)) for s in stats1), 3)
        out["sim_lag_resyncs"] = sum(int(s.get("lag_resyncs", 0)) for s in stats1)
    out["error_samples"] = sorted({str(r.error) for r in results if r.error})[:5]
    taken = [r.overhead_s * 1000.0 for r in results if r.overhead_s]
    if taken:  # a peer proxy's tokenizer time, taken out of its TTFT (wall ms)
        out["peer_tokenize_ms_p50"] = round(percentile(taken, 50), 3)
        out["peer_tokenize_ms_p99"] = round(percentile(taken, 99), 3)
    return RunOutput(out, results)


# --------------------------------------------------------------------------- command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mode", choices=("http", "des"), default="http")
    p.add_argument(
        "--fleet",
        choices=("sim", "dynamo-mocker"),
        default="sim",
        help="engines: kvplane's simulator, or Dynamo's mockers (python -m dynamo.mocker)",
    )
    p.add_argument("--workloads", default="mooncake,gsp", help=f"comma list of {WORKLOAD_NAMES}")
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS), help="comma list")
    p.add_argument("--trace", default=None, help="a Mooncake-format JSONL trace")
    p.add_argument(
        "--shape",
        default="",
        help="synthetic workloads' sizes, e.g. 'long-doc-qa:documents=40,repeat_count=4;"
        "multi-round-qa:users=64,rounds=8' (the builders' keyword arguments)",
    )
    p.add_argument("--limit", type=int, default=400, help="requests per workload")
    p.add_argument("--rate-scale", type=float, default=None, help="offered load multiplier")
    p.add_argument("--engines", type=int, default=8)
    p.add_argument("--profile", default="h100-llama-3.1-8b")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--time-scale", type=float, default=2.0, help="wall s per simulated s")
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument(
        "--sweep", default="", help="load factors for a TTFT-vs-load sweep, e.g. 0.5,1,1.5"
    )
    p.add_argument(
        "--sweep-routers", default="kvplane,vllm-router-kv_aware,sglang-router-cache_aware"
    )
    p.add_argument(
        "--cost-set",
        default="",
        help="kvplane cost settings, e.g. recompute_weight=4 (experiments; the report's "
        "setup names them)",
    )
    p.add_argument(
        "--index",
        choices=("memory", "redis"),
        default="memory",
        help="des: kvplane's residency index, in memory or on a local redis-server",
    )
    p.add_argument(
        "--fleet-shape",
        default="",
        help="where the cache beyond HBM sits (des: a comma list, rows labelled "
        "router@shape; http: one shape of the simulated fleet): hbm, hbm+dram (per pod), "
        "hbm+dram-silent (its KV events unpublished), hbm+dram-inferred (unpublished, the "
        "router told its size), hbm+shared (one store of the same total), hbm+shared+peer "
        "(and peer pulls), hbm+oracle (every block any pod computed, loaded at no cost: "
        "what the load costs at the oracle's reuse)",
    )
    p.add_argument(
        "--dram-tokens",
        type=int,
        default=2_048_000,
        help="des fleet shapes: DRAM per pod in tokens (the shared store holds engines x this)",
    )
    p.add_argument(
        "--store-policy",
        choices=("lru", "slru"),
        default="lru",
        help="des fleet shapes: the shared store's eviction (slru keeps reused blocks)",
    )
    p.add_argument(
        "--store-bound",
        action="store_true",
        help="des fleet shapes with a store: replay its accesses under lru, slru and "
        "Belady's optimum (the most any eviction policy could keep)",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="des fleet shapes: pods per node; peer pulls inside a node go over NVLink "
        "(--nvlink-gbps), the rest over the peer link; 0: one link for every pair",
    )
    p.add_argument(
        "--nvlink-gbps",
        type=float,
        default=450.0,
        help="des fleet shapes: same-node peer link GB/s",
    )
    p.add_argument(
        "--placement-blind",
        action="store_true",
        help="des fleet shapes: the router is told neither the pods' nodes nor the NVLink "
        "(one peer link for every pair), as before per-pair links",
    )
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out-dir", default=None, help="default: bench/results of the checkout")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--save-requests", default=None, help="folder for per-request results (jsonl.xz)"
    )
    p.add_argument("--quick", action="store_true", help="a small smoke run")
    p.add_argument(
        "--skip-base",
        action="store_true",
        help="run only the sweep's loads (with --sweep-routers naming the routers)",
    )
    p.add_argument(
        "--tag",
        default="",
        help="names this table: its JSON file and its own RESULTS.md section",
    )


# Offered load per workload (x its native rate) that puts the best peer near
# saturation on 8 H100-8B engines; calibrated with the discrete-event mode.
DEFAULT_RATE_SCALE = {
    "mooncake": 2.5,
    "gsp": 8.0,
    "multi-round-qa": 1.0,
    "long-doc-qa": 1.0,
    "no-reuse": 1.0,
}


def shapes(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """``--shape 'long-doc-qa:documents=40,repeat_count=4;multi-round-qa:users=64'``."""
    out: dict[str, dict[str, Any]] = {}
    for part in (getattr(args, "shape", "") or "").split(";"):
        if part.strip():
            name, sep, settings = part.partition(":")
            if not sep:
                raise SystemExit(f"bench: expected workload:key=value,..., got {part!r}")
            out[name.strip()] = parse_settings(settings)
    return out


def _rate(args: argparse.Namespace, workload: str) -> float:
    if args.rate_scale is not None:
        return float(args.rate_scale)
    return float(DEFAULT_RATE_SCALE.get(workload, 1.0) * args.engines / 8)


def model_facts(
    args: argparse.Namespace, tokenizer: Path, cost_set: Mapping[str, Any] | None = None
) -> ModelFacts:
    """The fleet as kvplane is told of it, calibrated as the discrete-event mode is
    (``cost_params_for``); ``cost_set`` overrides cost keys (experiments)."""
    from kvplane.sim.des import cost_params_for, profile_for
    from kvplane.sim.profiles import PROFILES

    prof = PROFILES[args.profile]
    cost = cost_params_for(prof)
    engine = profile_for(args.profile, args.block_size)
    return ModelFacts(
        name=MODEL,
        tokenizer=tokenizer,
        block_size=args.block_size,
        max_model_len=131072,
        kv_bytes_per_token=prof.kv_bytes_per_token,
        prefill_tokens_per_s=cost.prefill_tokens_per_s,
        prefill_attention_ms_per_mpair=cost.prefill_attention_ms_per_mpair,
        decode_step_ms=cost.decode_step_ms,
        dram=cost.tiers[Tier.DRAM] if prof.cpu_offload_blocks else None,
        cost_set=dict(cost_set or {}),
        max_num_batched_tokens=engine.max_num_batched_tokens,
        kv_blocks=engine.num_gpu_blocks,
    )


def _floor_model(
    args: argparse.Namespace, builder: PromptBuilder, facts: ModelFacts, rundir: Path
) -> floor.PrefillModel:
    """The fleet's idle-engine timing model: kvplane's simulator in closed form, Dynamo's
    mocker measured on a grid (once per invocation)."""
    from kvplane.sim.des import profile_for

    if args.fleet != "dynamo-mocker":
        return floor.sim_model(profile_for(args.profile, args.block_size))
    spec = mocker_spec(args, facts)

    def text(seed: int, n: int) -> str:
        segs = tuple(CALIBRATION_SEGMENTS + seed * 1000 + k for k in range(n // 512 + 1))
        return builder.text(TraceRequest(0.0, "calibration", n, 1, segs, 512))

    grid = dynamo_mocker.calibrate(spec, rundir, text)
    print(f"mocker idle-engine TTFT grid (ms): {json.dumps(grid.to_json())}", flush=True)
    args.floor_grid = grid.to_json()
    return grid


CALIBRATION_SEGMENTS = 10**9  # segment ids no workload uses


def best_dynamo(runs: Sequence[Mapping[str, Any]], workload: str) -> str | None:
    """The Dynamo setting with the lowest TTFT p90 at the base load of ``workload``."""
    rows = [
        r
        for r in runs
        if r["workload"] == workload
        and float(r.get("load_factor", 1.0)) == 1.0
        and (dynamo.is_selector_peer(r["router"]) or dynamo.is_frontend_peer(r["router"]))
        and not r.get("errors")
        and r.get("ttft_p90_ms") is not None
    ]
    return min(rows, key=lambda r: r["ttft_p90_ms"])["router"] if rows else None


def sweep_routers(
    args: argparse.Namespace, runs: Sequence[Mapping[str, Any]], wl: str
) -> list[str]:
    """``--sweep-routers``, with ``@best-dynamo`` resolved from the base load's rows."""
    out: list[str] = []
    for name in csv_list(args.sweep_routers):
        if name == BEST_DYNAMO:
            best = best_dynamo(runs, wl)
            if best is None:
                continue
            name = best
        if name not in out:
            out.append(name)
    return out


BEST_DYNAMO = "@best-dynamo"


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    # the machine's load and the code's commit as the run starts (a run takes minutes,
    # and a commit made meanwhile is not the code the routers started with)
    args.machine_at_start = machine_info()
    args.versions_at_start = versions(("kvplane", "vllm-router", "sglang-router", "transformers"))
    if args.quick:
        args.limit = min(args.limit, 40)
        args.engines = min(args.engines, 2)
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer_dir()
    builder = PromptBuilder(tokenizer)
    facts = model_facts(args, tokenizer, parse_settings(args.cost_set))
    routers = csv_list(args.routers)
    sweep = [float(x) for x in csv_list(args.sweep)]
    runs: list[dict[str, Any]] = []
    if args.mode == "des":
        return _run_des(args, builder, routers, sweep)
    facts = _http_shape(args, facts)
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-routing-") as tmp:
        rundir = Path(tmp)
        model = _floor_model(args, builder, facts, rundir)
        if isinstance(model, floor.GridModel):  # kvplane calibrated to the mocker's prefill
            rate = model.prefill_tokens_per_s()  # a linear fit: no attention term of its own
            facts = replace(facts, prefill_tokens_per_s=rate, prefill_attention_ms_per_mpair=0.0)
            args.mocker_prefill_tokens_per_s = round(facts.prefill_tokens_per_s)
        for wname in csv_list(args.workloads):
            fl: floor.Floor | None = None
            for factor in _factors(args, sweep):
                wl = build_workload(
                    wname,
                    trace=Path(args.trace) if args.trace else None,
                    limit=args.limit,
                    start=0,
                    rate_scale=_rate(args, wname) * factor,
                    shape=shapes(args).get(wname),
                )
                fl = fl or floor.floor_of(wl, args.block_size, model)
                oracle = oracle_hit_ratio(builder, wl, args.block_size)
                items = [ReplayItem(r, builder.text(r)) for r in wl.requests]
                names = routers if factor == 1.0 else sweep_routers(args, runs, wname)
                table = None
                if any(dynamo.is_selector_peer(n) for n in names):
                    table = write_token_table(
                        rundir / "tokens.bin",
                        ((it.prompt, builder.token_ids(it.request)) for it in items),
                    )
                for router in names:
                    out = run_one(router, wl, items, oracle, facts, args, rundir, factor, table)
                    out.record["sweep"] = bool(sweep)
                    out.record.update(fl.quantiles(), slo_ms=round(fl.slo_ms, 3))
                    if args.save_requests:
                        name = f"{args.fleet}-{args.profile}-{wname}-{router}-x{factor:g}"
                        save_results(Path(args.save_requests) / f"{name}.jsonl.xz", out.results)
                        save_log(rundir / f"{router}.log", Path(args.save_requests) / name)
                    runs.append(_with_quantiles(out.record, out.results, factor))
                    _print_row(out.record)
    return _finish(args, runs)


def _http_shape(args: argparse.Namespace, facts: ModelFacts) -> ModelFacts:
    """The simulated fleet over HTTP in the one ``--fleet-shape`` asked for: its
    ``kvplane sim`` flags (``args.sim_flags``) and what kvplane's router is told of it,
    the DRAM tier's cost, the store and the peer pulls (as the discrete-event mode
    configures the router for the same shape)."""
    from kvplane.sim.des import cost_params_for
    from kvplane.sim.profiles import PROFILES
    from kvplane.sim.shapes import fleet_shape

    args.sim_flags = []
    names = csv_list(getattr(args, "fleet_shape", "") or "")
    if not names:
        return facts
    if len(names) > 1 or args.fleet != "sim":
        raise SystemExit("bench routing: over HTTP, --fleet-shape names one shape of --fleet sim")
    dram_blocks = args.dram_tokens // args.block_size
    try:
        shape = fleet_shape(names[0], args.engines, dram_blocks, args.store_policy)
        args.sim_flags = shape.sim_flags()
    except ValueError as e:
        raise SystemExit(f"bench routing: {e}") from None
    dram = cost_params_for(PROFILES[args.profile]).tiers[Tier.DRAM]
    return replace(
        facts,
        dram=dram if shape.cpu_offload_blocks else None,
        fleet_kv=shape.router_settings(),
    )


def _factors(args: argparse.Namespace, sweep: Sequence[float]) -> list[float]:
    """The base load, then the sweep's; ``--skip-base`` redoes only the sweep's loads (a
    rerun of loads a busy machine spoiled: their rows replace the earlier ones)."""
    rest = [f for f in sweep if f != 1.0]
    return rest if getattr(args, "skip_base", False) else [1.0, *rest]


def _run_des(
    args: argparse.Namespace, builder: PromptBuilder, routers: list[str], sweep: list[float]
) -> dict[str, Any]:
    """kvplane's own policy code on simulated engines in virtual time (no HTTP, no peers)."""
    from kvplane.sim.des import ROUTERS, cost_params_for, profile_for

    base = cost_params_for(profile_for(args.profile, args.block_size))
    cost = CostParams.model_validate({**base.model_dump(), **parse_settings(args.cost_set)})

    ours = [r for r in routers if r in ROUTERS] or list(ROUTERS)
    sweepers = [r for r in csv_list(args.sweep_routers) if r in ROUTERS] or [
        r for r in ours if r != "kvplane-sticky"
    ]
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        index_url = None
        if args.index == "redis":
            from kvplane.local import redis as local_redis

            index_url = stack.enter_context(local_redis.running()).url
        for wname in csv_list(args.workloads):
            _des_workload(args, builder, wname, sweep, ours, sweepers, cost, index_url, runs)
    return _finish(args, runs)


def _des_workload(
    args: argparse.Namespace,
    builder: PromptBuilder,
    wname: str,
    sweep: list[float],
    ours: list[str],
    sweepers: list[str],
    cost: CostParams,
    index_url: str | None,
    runs: list[dict[str, Any]],
) -> None:
    from kvplane.sim.des import DesOptions, profile_for, run_des

    model = floor.sim_model(profile_for(args.profile, args.block_size))
    fl: floor.Floor | None = None
    for factor in [1.0, *[f for f in sweep if f != 1.0]]:
        wl = build_workload(
            wname,
            trace=Path(args.trace) if args.trace else None,
            limit=args.limit or None,
            start=0,
            rate_scale=_rate(args, wname) * factor,
            shape=shapes(args).get(wname),
        )
        fl = fl or floor.floor_of(wl, args.block_size, model)
        notes = [] if index_url is None else ["index redis"]
        base = DesOptions(
            oracle=oracle_hit_ratio(wl, args.block_size),
            cost=cost,
            index_url=index_url,
            notes=notes,
        )
        for (label, opts), router in itertools.product(
            _shaped(args, base), ours if factor == 1.0 else sweepers
        ):
            bar = Progress(f"{wname} x{factor:g} {router}{label} (des)", not args.no_progress)
            rec, results = run_des(
                wl,
                router,
                engines=args.engines,
                profile=args.profile,
                block_size=args.block_size,
                builder=builder,
                progress=bar,
                options=opts,
            )
            row = rec.to_json()
            row["router"] += label
            row["load_factor"] = factor
            row["sweep"] = bool(sweep)
            row["prefill_tokens_computed"] = sum(
                r.prompt_tokens - (r.cached_tokens or 0) for r in results if r.ok
            )
            row.update(fl.quantiles(), slo_ms=round(fl.slo_ms, 3))
            if args.save_requests:
                name = f"des-{args.profile}-{wname}-{router}{label}-x{factor:g}"
                save_results(Path(args.save_requests) / f"{name}.jsonl.xz", results)
            runs.append(_with_quantiles(row, results, factor))
            _print_row(row)


def _shaped(args: argparse.Namespace, base: DesOptions) -> list[tuple[str, DesOptions]]:
    """The run's DES options per ``--fleet-shape`` (``@shape`` labels its rows), or the
    options as they are when no shape is asked for."""
    from kvplane.sim.kvcache import Link
    from kvplane.sim.shapes import NVLINK_LATENCY_MS, fleet_shape

    names = csv_list(getattr(args, "fleet_shape", "") or "")
    if not names:
        return [("", base)]
    dram_blocks = args.dram_tokens // args.block_size
    out: list[tuple[str, DesOptions]] = []
    for name in names:
        shape = fleet_shape(
            name,
            args.engines,
            dram_blocks,
            getattr(args, "store_policy", "lru"),
            gpus_per_node=getattr(args, "gpus_per_node", 0),
            node_link=Link(getattr(args, "nvlink_gbps", 450.0), NVLINK_LATENCY_MS),
            placement_blind=getattr(args, "placement_blind", False),
        )
        kv = shape.shared_kv
        if kv is not None and kv.store_blocks and getattr(args, "store_bound", False):
            shape = replace(shape, shared_kv=replace(kv, store_bound=True))
        notes = [*base.notes, f"shape {name}"]
        opts = replace(
            base,
            cpu_offload_blocks=shape.cpu_offload_blocks,
            shared_kv=shape.shared_kv,
            dram_events=shape.dram_events,
            notes=notes,
        )
        out.append((f"@{name}", opts))
    return out


def _print_row(r: dict[str, Any]) -> None:
    print(
        f"{r['workload']:>14} x{r.get('load_factor', 1.0):<4g} {r['router']:<28} "
        f"ttft p50/p90 {r['ttft_p50_ms']:.0f}/{r['ttft_p90_ms']:.0f} ms  "
        f"hit {r['hit_ratio']:.3f}/{r['oracle_hit_ratio']:.3f}  imb {r['imbalance']:.2f}  "
        f"err {r['errors']}  cpu {r['router_cpu_s']:.1f}s  lag {r.get('sim_max_lag_s', 0)}s",
        flush=True,
    )
    bound = r.get("store_bound_blocks")
    if bound:  # the store's own stream under each policy (kvplane.sim.store_bound)
        lru = bound.get("lru") or 1
        print(
            "    store loads found, same stream: "
            + ", ".join(f"{p} {n:,} ({n / lru:.3f} x lru)" for p, n in bound.items()),
            flush=True,
        )


def _with_quantiles(
    row: dict[str, Any], results: Sequence[RequestResult], factor: float
) -> dict[str, Any]:
    """The row with its TTFT quantiles (at the base load), so that later runs of the day
    can redraw its CDF."""
    if factor == 1.0:
        row["ttft_quantiles_ms"] = routing_report.ttft_quantiles_ms(
            [r.ttft_s for r in results if r.ttft_s is not None]
        )
    return row


def _finish(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    date = _dt.date.today().isoformat()
    doc: dict[str, Any] = {
        "date": date,
        "command": "kvplane bench routing " + " ".join(shlex.quote(a) for a in args.argv_echo),
        "setup": {
            "mode": args.mode,
            "engines": args.engines,
            "profile": args.profile,
            "block size": args.block_size,
            "time scale": args.time_scale,
            "requests per workload": args.limit,
            **({"fleet": args.fleet} if args.fleet != "sim" else {}),
            **({"workload shapes": args.shape} if args.shape else {}),
            **({"kvplane cost": args.cost_set} if args.cost_set else {}),
            **(
                {
                    "fleet shapes": args.fleet_shape,
                    "dram tokens per pod": args.dram_tokens,
                    "store policy": getattr(args, "store_policy", "lru"),
                    **(
                        {
                            "gpus per node": args.gpus_per_node,
                            "nvlink GB/s": args.nvlink_gbps,
                            "placement blind": args.placement_blind,
                        }
                        if getattr(args, "gpus_per_node", 0)
                        else {}
                    ),
                }
                if getattr(args, "fleet_shape", "")
                else {}
            ),
        },
        "machine": args.machine_at_start,
        "versions": args.versions_at_start,
        "runs": runs,
    }
    if getattr(args, "floor_grid", None):
        doc["mocker_floor_grid"] = args.floor_grid
        doc["setup"]["kvplane prefill_tokens_per_s (mocker)"] = args.mocker_prefill_tokens_per_s
    _score(doc)
    print(routing_report.table(runs))
    for t in doc["targets"]:
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['workload']}: {t['target']} = {t['value']}")
    if args.no_write:
        return doc
    out_dir, md = results_dir(args.out_dir)
    suffix = ("" if args.mode == "http" else "-des") + (f"-{args.tag}" if args.tag else "")
    stem = out_dir / f"routing{suffix}-{date}"
    json_path = stem.with_suffix(".json")

    def key(r: dict[str, Any]) -> tuple[str, str, float]:
        return (r["workload"], r["router"], float(r.get("load_factor", 1.0)))

    def slice_of(r: dict[str, Any]) -> tuple[Any, ...]:
        """What makes rows comparable: the same requests at the same offered load, on the
        same fleet."""
        return (
            r.get("requests"),
            round(float(r.get("offered_rps") or 0.0), 3),
            r.get("mode"),
            r.get("profile"),
            r.get("engines"),
        )

    mine = {key(r) for r in runs}
    slices = {(r["workload"], float(r.get("load_factor", 1.0))): slice_of(r) for r in runs}
    if json_path.exists():  # a day's runs accumulate: rows this run did not redo are kept,
        with contextlib.suppress(ValueError, KeyError):  # unless they replay another slice
            old = json.loads(json_path.read_text())
            kept = [
                r
                for r in old["runs"]
                if key(r) not in mine
                and slices.get((r["workload"], float(r.get("load_factor", 1.0))), slice_of(r))
                == slice_of(r)
            ]
            doc["runs"] = kept + runs
            _score(doc)
            doc["earlier_commands"] = [
                *old.get("earlier_commands", []),
                old.get("command", ""),
            ]
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    if runs:
        routing_report.plot(doc, list(dict.fromkeys(r["workload"] for r in runs)), stem)
    plots = sorted(out_dir.glob(stem.name + "-*.png"))
    section = routing_report.render_markdown(
        doc, bench_relative(json_path), [bench_relative(p) for p in plots]
    )
    heading = routing_report.SECTION + ("" if args.mode == "http" else " (discrete-event)")
    heading += f": {args.tag}" if args.tag else ""
    section = section.replace(routing_report.SECTION, heading, 1)
    update_markdown(md, section, heading)
    print(f"wrote {json_path} and {md}")
    return doc


def _score(doc: dict[str, Any]) -> None:
    """Targets and goodput of the document's rows (recomputed as rows accumulate)."""
    runs = doc["runs"]
    slo = {r["workload"]: float(r["slo_ms"]) for r in runs if r.get("slo_ms")}
    sweeps = [r for r in runs if r.get("sweep")]
    doc["goodput"] = floor.goodput_table(sweeps, slo) if sweeps else []
    doc["targets"] = routing_report.check_targets(runs) + routing_report.dynamo_targets(
        runs, doc["goodput"]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("kvplane bench routing", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
