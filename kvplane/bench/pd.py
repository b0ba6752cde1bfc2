"""``kvplane bench pd``: aggregated, disaggregated and conditional serving side by side.

Every mode gets the same number of simulated GPUs (``--engines``, the H100
Llama-3.1-8B profile), cold, and the same request sequence replayed open-loop at the
same offered load (the routing benchmark's harness: :mod:`kvplane.bench.routing`):

- ``aggregated``: every engine prefills and decodes; kvplane's cost policy.
- ``disaggregated``: P prefill + D decode engines (NIXL handoffs); kvplane's P/D
  router with ``aggregate_max_uncached_tokens: 0``, so every request is handed off.
- ``conditional``: the same fleet with kvplane's P/D defaults: a decode pod prefills
  a request itself when it lacks few of its tokens and that scores cheaper.
- ``vllm-router-pd``: the same fleet behind ``vllm-router --vllm-pd-disaggregation``.

Why P/D at all: in an aggregated engine a prefill chunk rides in the same forward as
the decodes (chunked prefill), so every running request waits for it; that is the
inter-token latency a prefill-heavy load shows. P:D is sized per workload from its
prefill and decode demand (:func:`split_for`), since a fixed split starves one side.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import resource
import shlex
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from kvplane.bench import pd_report
from kvplane.bench.pd_setup import (
    FLEX,
    FLEX_AGGREGATE_MAX,
    KVPLANE_MODES,
    MODES,
    PREFILL_HEAVY,
    Split,
    build,
    limit_for,
    rate_for,
    roles_for,
    split_for,
    trace_path,
    with_prefill,
)
from kvplane.bench.procs import (
    HOST,
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
from kvplane.bench.replay import ReplayItem, replay
from kvplane.bench.routers import EngineEndpoint, ModelFacts, RouterLaunch, kvplane_config
from kvplane.bench.routing import MODEL, Progress, model_facts, start_fleet
from kvplane.local.ports import free_port
from kvplane.sim.profiles import PROFILES
from kvplane.workload.results import STALL_S, oracle_hit_ratio, summarize
from kvplane.workload.traces import (
    WORKLOAD_NAMES,
    PromptBuilder,
    Workload,
)

# --------------------------------------------------------------------------- routers

# The router's default scrape interval (the routing benchmark scrapes every 0.5 s): half
# the scrapes on two shared cores. 1 s wall is 0.25 simulated s at time scale 4, still
# fresh next to request lifetimes. (The recorded run predates the scraper's tolerance of
# slow scrapes, when a stalled loop could mark every backend unhealthy at once.)
SCRAPE_INTERVAL_S = 1.0


def kvplane_pd_config(
    model: ModelFacts,
    engines: Sequence[EngineEndpoint],
    roles: Sequence[str],
    *,
    link_gbps: float,
    aggregate_max_uncached_tokens: int | None,
    settings: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The aggregated config plus roles and a ``pd`` section whose link matches the
    simulated one (an operator would render the fleet's real bandwidth); ``settings``
    override ``pd`` keys (experiments)."""
    cfg = dict(kvplane_config(model, engines, "cost"))
    backends = cfg["backends"]
    assert isinstance(backends, list)
    for b, role in zip(backends, roles, strict=True):
        if role != "both":
            b["role"] = role
    pd: dict[str, Any] = {
        "connector": "nixl",
        "links": {"same_zone": {"bandwidth_gbps": link_gbps, "latency_ms": 0.0}},
    }
    if aggregate_max_uncached_tokens is not None:
        pd["aggregate_max_uncached_tokens"] = aggregate_max_uncached_tokens
    pd.update(settings or {})
    cfg["pd"] = pd
    cfg["scrape_interval_s"] = SCRAPE_INTERVAL_S
    return cfg


def vllm_router_pd_argv(
    port: int,
    prefill: Sequence[str],
    decode: Sequence[str],
    prefill_policy: str,
    decode_policy: str,
    prometheus_port: int,
) -> list[str]:
    """``vllm-router`` in vLLM P/D mode over NIXL (no bootstrap ports: NIXL needs none).

    It sends the prefill leg with ``kv_transfer_params.do_remote_decode`` and relays
    the returned params to the decode leg, as vLLM's toy proxy does. ``cache_aware``
    renders every prompt on every worker of its pool (``/v1/completions/render``), so
    it goes on the prefill pool only, where prefixes matter; the decode pool balances."""
    argv = [venv_bin("vllm-router"), "--host", HOST, "--port", str(port)]
    argv += ["--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for url in prefill:
        argv += ["--prefill", url, "none"]
    for url in decode:
        argv += ["--decode", url]
    # vllm-router refuses power_of_two over one worker; with one there is no choice anyway
    if len(prefill) < 2 and prefill_policy == "power_of_two":
        prefill_policy = "round_robin"
    if len(decode) < 2 and decode_policy == "power_of_two":
        decode_policy = "round_robin"
    argv += ["--prefill-policy", prefill_policy, "--decode-policy", decode_policy]
    argv += ["--prometheus-port", str(prometheus_port), "--log-level", "warning"]
    return argv


def launch_mode(
    mode: str,
    model: ModelFacts,
    engines: Sequence[EngineEndpoint],
    roles: Sequence[str],
    args: argparse.Namespace,
    rundir: Path,
) -> RouterLaunch:
    port = free_port()
    if mode == "vllm-router-pd":
        pre = [e.url for e, r in zip(engines, roles, strict=True) if r == "prefill"]
        dec = [e.url for e, r in zip(engines, roles, strict=True) if r != "prefill"]
        argv = vllm_router_pd_argv(
            port, pre, dec, args.vllm_prefill_policy, args.vllm_decode_policy, free_port()
        )
        return RouterLaunch(mode, port, argv, {"NO_COLOR": "1"})
    if mode == "aggregated":
        cfg = kvplane_config(model, engines, "cost")
        cfg["scrape_interval_s"] = SCRAPE_INTERVAL_S
    elif mode in ("disaggregated", "conditional"):
        cfg = kvplane_pd_config(
            model,
            engines,
            roles,
            link_gbps=args.pd_link_gbps,
            aggregate_max_uncached_tokens=0 if mode == "disaggregated" else None,
            settings=parse_settings(args.conditional_set) if mode == "conditional" else None,
        )
    elif mode == FLEX:
        # Any pod may prefill any request itself: the cost (interference included)
        # decides between that and a handoff, per request.
        cfg = kvplane_pd_config(
            model,
            engines,
            roles,
            link_gbps=args.pd_link_gbps,
            aggregate_max_uncached_tokens=FLEX_AGGREGATE_MAX,
            settings=parse_settings(args.flex_set),
        )
    else:
        raise SystemExit(f"bench pd: unknown mode {mode!r} (choose from {MODES})")
    path = rundir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    argv = [venv_bin("kvplane"), "--log-level", "warning", "router", "--config", str(path)]
    argv += ["--host", HOST, "--port", str(port)]
    return RouterLaunch(mode, port, argv)


def _self_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def _get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
        return body


def _decisions(port: int) -> dict[str, float]:
    return pd_report.decision_counts(_get(f"http://{HOST}:{port}/metrics").decode())


ITL_FAMILY = "vllm:inter_token_latency_seconds"


def _token_gaps(engines: Sequence[EngineEndpoint]) -> list[dict[float, float]]:
    """Each engine's histogram of gaps between consecutive output tokens of a request."""
    return [pd_report.histogram(_get(e.url + "/metrics").decode(), ITL_FAMILY) for e in engines]


# --------------------------------------------------------------------------- one run

STAT_KEYS = ("prefill_tokens_computed", "transferred_tokens", "generation_tokens", "busy_s")


def engine_deltas(
    before: Sequence[dict[str, Any]],
    after: Sequence[dict[str, Any]],
    roles: Sequence[str],
    sim_seconds: float,
) -> dict[str, dict[str, Any]]:
    """Per engine: what it did during the replay (/sim/stats differences) and whether
    its event loop kept up (late steps, lag resyncs: the timeline slipped)."""
    out: dict[str, dict[str, Any]] = {}
    for s0, s1, role in zip(before, after, roles, strict=True):
        row: dict[str, Any] = {"role": role}
        for k in STAT_KEYS:
            row[k] = round(float(s1[k]) - float(s0[k]), 4)
        row["busy"] = round(row["busy_s"] / sim_seconds, 3) if sim_seconds > 0 else None
        for k in ("late_steps", "lag_resyncs"):
            row[k] = int(s1[k]) - int(s0[k])
        row["max_lag_s"] = round(float(s1["max_lag_s"]), 4)
        h0, h1 = s0.get("http_requests") or {}, s1.get("http_requests") or {}
        row["http_requests"] = {k: int(v) - int(h0.get(k, 0)) for k, v in sorted(h1.items())}
        out[str(s1["name"])] = row
    return out


def _mean_busy(stats: dict[str, dict[str, Any]], roles: set[str]) -> float | None:
    xs = [float(s["busy"]) for s in stats.values() if s["role"] in roles and s["busy"] is not None]
    return round(sum(xs) / len(xs), 3) if xs else None


def run_mode(
    mode: str,
    workload: Workload,
    items: Sequence[ReplayItem],
    split: Split,
    facts: ModelFacts,
    args: argparse.Namespace,
    rundir: Path,
) -> dict[str, Any]:
    """One mode on a fresh fleet: start, replay, collect, stop (everything it started)."""
    roles = roles_for(mode, args.engines, split.prefill)
    if mode == "aggregated":
        extra: list[str] = []
    elif mode == FLEX:
        extra = ["--kv-role", "both", "--kv-connector", "nixl"]
        extra += ["--pd-link-gbps", str(args.pd_link_gbps)]
    else:
        extra = ["--prefill", str(split.prefill), "--kv-connector", "nixl"]
        extra += ["--pd-link-gbps", str(args.pd_link_gbps)]
    fleet = start_fleet(args, facts.tokenizer, rundir, facts.block_size, extra)
    try:
        launch = launch_mode(mode, facts, fleet.engines, roles, args, rundir)
        rproc = spawn(f"{workload.name}-{mode}", launch.argv, rundir, launch.env)
        try:
            probe = json.dumps({"model": MODEL, "prompt": "ready?", "max_tokens": 1}).encode()
            if not wait_ready(rproc, launch.port, 120, probe):
                raise SystemExit(f"bench pd: router for {mode} not ready:\n{rproc.tail()}")
            time.sleep(1.0)
            kv = mode in KVPLANE_MODES and mode != "aggregated"
            dec0 = _decisions(launch.port) if kv else {}
            cpu0 = cpu_seconds(rproc.popen.pid)
            sim_cpu0 = cpu_seconds(fleet.proc.popen.pid)
            client0 = _self_cpu()
            stats0 = fleet.stats()
            gaps0 = _token_gaps(fleet.engines)
            bar = Progress(f"{workload.name} {mode}", not args.no_progress)
            results, wall = asyncio.run(
                replay(
                    f"http://{HOST}:{launch.port}",
                    MODEL,
                    mode,
                    items,
                    time_scale=args.time_scale,
                    timeout_s=args.request_timeout,
                    progress=bar,
                )
            )
            cpu = cpu_seconds(rproc.popen.pid) - cpu0
            sim_cpu = cpu_seconds(fleet.proc.popen.pid) - sim_cpu0
            client_cpu = _self_cpu() - client0
            stats1 = fleet.stats()
            gaps1 = _token_gaps(fleet.engines)
            dec1 = _decisions(launch.port) if kv else {}
        finally:
            rproc.stop()
    finally:
        fleet.proc.stop()
    sim_s = wall / args.time_scale
    engines = engine_deltas(stats0, stats1, roles, sim_s)
    prefill = {name: int(s["prefill_tokens_computed"]) for name, s in engines.items()}
    offered = len(items) / max(items[-1].request.arrival_s, 1e-9) if items else 0.0
    rec = summarize(
        mode,
        workload.name,
        results,
        oracle_hit_ratio=None,
        prefill_tokens_per_engine=prefill,
        router_cpu_s=cpu,
        duration_s=sim_s,
        mode="http",
        engines=args.engines,
        profile=args.profile,
        offered_rps=offered,
    )
    row = rec.to_json()
    decisions = pd_report.decision_delta(dec0, dec1) if dec1 else {}
    if mode in ("aggregated", FLEX):
        row["split"] = f"{args.engines} both"
    else:
        row["split"] = split.label
    row["decisions"] = decisions or None
    row["disaggregated_share"] = pd_report.disaggregated_share(decisions)
    if mode == "vllm-router-pd":
        row["disaggregated_share"] = 1.0  # vLLM's P/D mode hands every request off
    row["prefill_busy"] = _mean_busy(engines, {"prefill"})
    row["decode_busy"] = _mean_busy(engines, {"decode", "both"})
    gaps = pd_report.merge_delta(gaps0, gaps1)
    p99 = pd_report.bucket_quantile(gaps, 0.99)
    row["token_gap_p99_ms"] = None if p99 is None else round(p99 * 1000.0, 1)
    stalled = pd_report.share_above(gaps, STALL_S)
    row["stalled_token_share"] = None if stalled is None else round(stalled, 4)
    row["prefill_tokens_computed"] = sum(prefill.values())
    row["transferred_tokens"] = int(sum(s["transferred_tokens"] for s in engines.values()))
    row["lag_resyncs"] = sum(int(s["lag_resyncs"]) for s in engines.values())
    row["max_lag_s"] = max((float(s["max_lag_s"]) for s in engines.values()), default=0.0)
    row["sim_cpu_s"] = round(sim_cpu, 2)
    row["client_cpu_s"] = round(client_cpu, 2)
    row["wall_s"] = round(wall, 1)
    row["engine_stats"] = engines
    row["router_argv"] = " ".join(shlex.quote(a) for a in launch.argv)
    row["error_samples"] = sorted({r.error for r in results if r.error})[:3]
    return row


# --------------------------------------------------------------------------- command


def add_arguments(p: argparse.ArgumentParser) -> None:
    known = (*WORKLOAD_NAMES, PREFILL_HEAVY)
    p.add_argument(
        "--workloads", default=f"mooncake,gsp,{PREFILL_HEAVY}", help=f"comma list of {known}"
    )
    p.add_argument("--modes", default=",".join(MODES), help="comma list")
    p.add_argument("--trace", default=None, help="a Mooncake-format JSONL trace")
    p.add_argument(
        "--limit", type=int, default=None, help="requests per workload (default per workload)"
    )
    p.add_argument("--rate-scale", type=float, default=None, help="offered load multiplier")
    p.add_argument(
        "--mode",
        choices=("http", "des"),
        default="http",
        help="http: the live router over a simulated fleet; des: virtual time (pd_des.py)",
    )
    p.add_argument("--engines", type=int, default=8)
    p.add_argument(
        "--prefill",
        default=None,
        help="prefill engines (default: sized); with --mode des a comma list of splits",
    )
    p.add_argument(
        "--gpus-per-node",
        type=int,
        default=0,
        help="des: pods per node (NVLink inside, --pd-link-gbps between); 0: unknown",
    )
    p.add_argument("--nvlink-gbps", type=float, default=450.0, help="des: same-node KV link GB/s")
    p.add_argument("--seeds", default="0", help="des: prefill-heavy workload seeds, comma list")
    p.add_argument(
        "--placement-blind",
        action="store_true",
        help="des: the router is not told the pods' nodes (ablation of topology-aware pairs)",
    )
    p.add_argument("--profile", default="h100-llama-3.1-8b", choices=sorted(PROFILES))
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--time-scale", type=float, default=4.0, help="wall s per simulated s")
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--pd-link-gbps", type=float, default=50.0, help="P/D KV link GB/s")
    p.add_argument("--vllm-prefill-policy", default="cache_aware", help="vllm-router P/D")
    p.add_argument("--vllm-decode-policy", default="power_of_two", help="vllm-router P/D")
    p.add_argument(
        "--conditional-set",
        default="",
        help="pd settings for the conditional mode, e.g. interference_weight=0.5 (experiments)",
    )
    p.add_argument(
        "--flex-set",
        default="",
        help="pd settings for the conditional-flex mode, e.g. interference_weight=0.2",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="wall s per request")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out-dir", default=None, help="default: bench/results of the checkout")
    p.add_argument("--no-write", action="store_true", help="print only")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--quick", action="store_true", help="a small smoke run")


def _print_row(r: dict[str, Any]) -> None:
    share = r.get("disaggregated_share")
    print(
        f"{r['workload']:>14} {r['router']:<15} {r.get('split', ''):>7}  "
        f"ttft p50/p90/p99 {r['ttft_p50_ms'] or 0:.0f}/{r['ttft_p90_ms'] or 0:.0f}/"
        f"{r['ttft_p99_ms'] or 0:.0f} ms  itl p50/p99 {r['itl_p50_ms'] or 0:.1f}/"
        f"{r.get('itl_p99_ms') or 0:.1f} ms  {r['throughput_rps']:.2f} req/s  "
        f"err {r['errors']}  disagg {'-' if share is None else f'{share:.2f}'}  "
        f"resyncs {r['lag_resyncs']}  cpu router/sim/client {r['router_cpu_s']:.0f}/"
        f"{r['sim_cpu_s']:.0f}/{r['client_cpu_s']:.0f} s in {r['wall_s']:.0f} s",
        flush=True,
    )
    for e in r.get("error_samples") or []:
        print(f"{'':>15} error: {e}", flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.quick:
        args.limit = min(args.limit or 12, 12)
        args.engines = min(args.engines, 3)
    if args.engines < 2:
        raise SystemExit("bench pd: needs at least two engines")
    if args.mode == "des":
        from kvplane.bench.pd_des import run as run_des

        return run_des(args)
    if args.gpus_per_node:
        raise SystemExit("bench pd: --gpus-per-node needs --mode des (one link class over HTTP)")
    if args.prefill is not None and not str(args.prefill).isdigit():
        raise SystemExit("bench pd: over HTTP --prefill is one number")
    modes = csv_list(args.modes)
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"bench pd: unknown modes {unknown} (choose from {MODES})")
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer_dir()
    builder = PromptBuilder(tokenizer)
    facts = model_facts(args, tokenizer)
    profile = PROFILES[args.profile]
    runs: list[dict[str, Any]] = []
    described: list[dict[str, Any]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-pd-") as tmp:
        rundir = Path(tmp)
        for wname in csv_list(args.workloads):
            wl = build(wname, limit_for(args, wname), rate_for(args, wname), trace_path(args))
            hit = oracle_hit_ratio(wl, args.block_size)
            split = split_for(wl, profile, args.engines, hit)
            if args.prefill is not None:
                split = with_prefill(split, int(args.prefill))
            reason = split.why() + (" (set by --prefill)" if args.prefill is not None else "")
            print(f"{wname}: {wl.description}; {reason}", flush=True)
            described.append(
                {
                    "name": wname,
                    "description": wl.description,
                    "requests": len(wl.requests),
                    "offered_rps": round(wl.offered_rps, 3),
                    "oracle_hit_ratio": round(hit, 4),
                    "split": split.label,
                    "split_reason": reason,
                }
            )
            items = [ReplayItem(r, builder.text(r)) for r in wl.requests]
            for mode in modes:
                row = run_mode(mode, wl, items, split, facts, args, rundir)
                runs.append(row)
                _print_row(row)
    return _finish(args, runs, described, time.monotonic() - started)


def _finish(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    described: list[dict[str, Any]],
    elapsed_s: float,
) -> dict[str, Any]:
    date = _dt.date.today().isoformat()
    doc: dict[str, Any] = {
        "date": date,
        "command": "kvplane bench pd " + " ".join(shlex.quote(a) for a in args.argv_echo),
        "setup": {
            "engines": args.engines,
            "profile": args.profile,
            "block size": args.block_size,
            "time scale": args.time_scale,
            "stream interval": args.stream_interval,
            "P/D link GB/s": args.pd_link_gbps,
            "connector": "nixl",
            "vllm-router prefill/decode policy": f"{args.vllm_prefill_policy}/"
            f"{args.vllm_decode_policy}",
            "kvplane scrape interval s": SCRAPE_INTERVAL_S,
            **({"conditional pd": args.conditional_set} if args.conditional_set else {}),
            **({"conditional-flex pd": args.flex_set} if args.flex_set else {}),
        },
        "machine": machine_info(),
        "versions": versions(("kvplane", "vllm-router", "transformers")),
        "elapsed_s": round(elapsed_s, 1),
        "workloads": described,
        "runs": runs,
    }
    doc["targets"] = pd_report.check_targets(runs)
    resyncs = sum(int(r.get("lag_resyncs") or 0) for r in runs)
    doc["notes"] = [
        "Latencies are simulated H100 seconds (client wall time / time scale). ITL is each "
        "request's mean gap between its first and last token (vLLM bench's TPOT); p50/p99 "
        "over requests. Token gap p99 is over every gap of every request (vLLM bench's "
        "ITL), from the engines' vllm:inter_token_latency_seconds histograms.",
        f"Simulator event-loop lag resyncs over all runs: {resyncs} (0 = the modeled "
        "timeline held; each is a step that started over 100 ms late).",
        "Why the targets come out as they do, and the conditional settings tried: "
        "bench/HISTORY.md, P/D points.",
    ]
    print(pd_report.table(runs))
    for t in doc["targets"]:
        print(f"{pd_report.verdict(t)}  {t['workload']}: {t['target']} = {t['value']}")
    if args.no_write:
        return doc
    out_dir, md = results_dir(args.out_dir)
    json_path = out_dir / f"pd-{date}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    section = pd_report.render_markdown(doc, bench_relative(json_path))
    update_markdown(md, section, pd_report.SECTION)
    print(f"wrote {json_path} and {md}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("kvplane bench pd", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
