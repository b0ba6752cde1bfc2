"""The run: cells of (regime, size), the paired latency phase, the rate search, and the
command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import functools
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvplane.bench.overhead.client import Target, _body
from kvplane.bench.overhead.fleet import RouterSpec, router_specs, start_redis
from kvplane.bench.overhead.measure import hf_tokenizer, max_rps
from kvplane.bench.overhead.prompts import PromptFactory, Session, load_counter
from kvplane.bench.overhead.report import (
    check_targets,
    format_table,
    render_markdown,
    update_markdown,
)
from kvplane.bench.overhead.scope import MODEL, REGIMES, ROUTERS, SECTION, TARGET_TOKENS
from kvplane.bench.procs import HOST, Proc, bench_main, default_tokenizer_dir
from kvplane.bench.procs import machine_info as _machine
from kvplane.bench.procs import repo_root as _repo_root
from kvplane.bench.procs import spawn as _spawn
from kvplane.bench.procs import venv_bin as _venv_bin
from kvplane.bench.procs import versions as _pkg_versions
from kvplane.bench.procs import wait_ready as _wait_ready
from kvplane.local.ports import free_port
from kvplane.workload.results import percentile


@dataclass
class Cell:
    regime: str
    tokens: int
    prompts: list[str]
    warmup: list[str]
    make: Callable[[], str]


class _SharedMaker:
    """New shared-regime prompts for the load phase, taking the sessions in turn."""

    def __init__(self, factory: PromptFactory, sessions: list[Session], tokens: int) -> None:
        self.factory, self.sessions, self.tokens = factory, sessions, tokens
        self.i = 0

    def __call__(self) -> str:
        self.i += 1
        return self.factory.shared(self.sessions[self.i % len(self.sessions)], self.tokens)


def _cells(
    factory: PromptFactory, sizes: Sequence[int], regimes: Sequence[str], args: argparse.Namespace
) -> Iterator[Cell]:
    for tokens in sizes:
        n = args.requests if tokens <= TARGET_TOKENS else args.requests_large
        for regime in regimes:
            if regime == "fresh":
                warm = [factory.fresh(tokens) for _ in range(args.warmup)]
                prompts = [factory.fresh(tokens) for _ in range(n)]
                yield Cell(regime, tokens, prompts, warm, functools.partial(factory.fresh, tokens))
            else:
                sessions = [factory.session(tokens) for _ in range(args.sessions)]
                warm = [s.root for s in sessions]
                prompts = [factory.shared(sessions[i % len(sessions)], tokens) for i in range(n)]
                yield Cell(regime, tokens, prompts, warm, _SharedMaker(factory, sessions, tokens))


async def _latency_phase(
    routers: Sequence[Target], direct: Target, cell: Cell, tokenizer: Any
) -> tuple[dict[str, dict[str, Any]], list[float], list[int]]:
    """Paired, interleaved, sequential: (direct, router) per prompt and router.

    The standalone tokenization of each prompt is timed in the same loop, so that
    it sees the same machine noise as the requests it is compared with.
    """
    tokenizer.encode(cell.warmup[0] if cell.warmup else "warm-up")
    tok_s: list[float] = []
    tok_n: list[int] = []
    for p in cell.warmup:
        body = _body(p)
        dv = direct.encode(body)
        for r in routers:
            await r.send(r.encode(body))
            await direct.send(dv)
    pairs: dict[str, list[tuple[float, float]]] = {r.name: [] for r in routers}
    errors: dict[str, int] = {r.name: 0 for r in routers}
    for i, prompt in enumerate(cell.prompts):
        t0 = time.perf_counter()
        ids = tokenizer.encode(prompt)
        tok_s.append(time.perf_counter() - t0)
        tok_n.append(len(ids))
        body = _body(prompt)
        dv = direct.encode(body)
        order = list(routers[i % len(routers) :]) + list(routers[: i % len(routers)])
        for j, r in enumerate(order):
            rv = r.encode(body)
            if (i + j) % 2:
                td, tr = await direct.timed(dv), await r.timed(rv)
            else:
                tr = await r.timed(rv)
                td = await direct.timed(dv)
            if td is None or tr is None:
                errors[r.name] += 1
            else:
                pairs[r.name].append((td, tr))
    out: dict[str, dict[str, Any]] = {}
    for name, ps in pairs.items():
        added = [tr - td for td, tr in ps]

        def ms(xs: Sequence[float], q: float) -> float:
            return percentile(xs, q) * 1e3 if xs else math.nan

        out[name] = {
            "added_p50_ms": ms(added, 50),
            "added_p99_ms": ms(added, 99),
            "routed_p50_ms": ms([tr for _, tr in ps], 50),
            "routed_p99_ms": ms([tr for _, tr in ps], 99),
            "direct_p50_ms": ms([td for td, _ in ps], 50),
            "direct_p99_ms": ms([td for td, _ in ps], 99),
            "pairs": len(ps),
            "errors": errors[name],
        }
    return out, tok_s, tok_n


def _parse_sizes(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        if not part:
            continue
        mult = 1024 if part.endswith("k") else 1
        out.append(int(float(part.rstrip("k")) * mult))
    return out


def _csv(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _worker_counts(text: str) -> list[int]:
    try:
        counts = [int(p) for p in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not counts or any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise argparse.ArgumentTypeError(f"worker counts must be distinct and >= 1: {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``kvplane bench overhead`` (also ``python -m kvplane.bench.overhead``)."""
    g = parser.add_argument_group("overhead benchmark")
    g.add_argument("--sizes", default="1k,8k,32k", help="prompt lengths in tokens (1k = 1024)")
    g.add_argument("--regimes", default="fresh,shared", help="fresh,shared")
    g.add_argument(
        "--routers", default=",".join(ROUTERS), help="comma list of " + ",".join(ROUTERS)
    )
    g.add_argument("--requests", type=int, default=200, help="measured prompts per cell <= 8K")
    g.add_argument("--requests-large", type=int, default=40, help="measured prompts per cell > 8K")
    g.add_argument("--warmup", type=int, default=8, help="unmeasured prompts per cell")
    g.add_argument("--sessions", type=int, default=8, help="shared regime: distinct prefixes")
    g.add_argument("--rps-step-s", type=float, default=2.0, help="duration of one load step")
    g.add_argument("--rps-max-steps", type=int, default=9, help="0 skips the max req/s search")
    g.add_argument("--p99-bound-ms", type=float, default=50.0, help="p99 SLO of a load step")
    g.add_argument("--quick", action="store_true", help="1k,8k; 60 prompts; short load steps")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--tokenizer", default=None, help="dir with tokenizer.json (default: cache)")
    g.add_argument("--results-dir", default=None, help="default: <repo>/bench/results")
    g.add_argument("--results-md", default=None, help="default: <repo>/bench/RESULTS.md")
    g.add_argument("--no-markdown", action="store_true", help="do not touch RESULTS.md")
    g.add_argument(
        "--no-write", action="store_true", help="write no files (neither JSON nor RESULTS.md)"
    )
    g.add_argument("--kvplane-cmd", default=None, help="the kvplane executable")
    g.add_argument(
        "--kvplane-workers",
        type=_worker_counts,
        default=[1],
        help="comma list of kvplane process counts, e.g. 1,2: one row each (N > 1: "
        "`kvplane router --workers N` on a Redis index the benchmark starts)",
    )
    g.add_argument(
        "--kvplane-redis",
        action="store_true",
        help="also one kvplane process on the Redis index (kvplane-r1): the index's share "
        "of kvplane-wN's latency, apart from the workers'",
    )
    g.add_argument(
        "--kvplane-profile", default=None, help="run kvplane under cProfile, write stats here"
    )
    g.add_argument("--vllm-router-cmd", default=None, help="the vllm-router executable")
    g.add_argument("--keep-logs", action="store_true", help="keep the run dir (process logs)")


def _apply_quick(args: argparse.Namespace) -> None:
    if not args.quick:
        return
    defaults = {"sizes": "1k,8k,32k", "requests": 200, "rps_step_s": 2.0, "rps_max_steps": 9}
    quick = {"sizes": "1k,8k", "requests": 60, "rps_step_s": 1.0, "rps_max_steps": 6}
    for k, v in quick.items():
        if getattr(args, k) == defaults[k]:
            setattr(args, k, v)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Runs the matrix; writes the JSON (and RESULTS.md section); returns the JSON document."""
    _apply_quick(args)
    sizes = _parse_sizes(args.sizes)
    regimes = _csv(args.regimes)
    names = _csv(args.routers)
    for r in regimes:
        if r not in REGIMES:
            raise SystemExit(f"bench overhead: unknown regime {r!r}")
    tokenizer_dir = Path(args.tokenizer).expanduser() if args.tokenizer else default_tokenizer_dir()
    root = _repo_root()
    results_dir = Path(args.results_dir) if args.results_dir else root / "bench" / "results"
    results_md = Path(args.results_md) if args.results_md else root / "bench" / "RESULTS.md"
    echo = getattr(args, "argv_echo", None)
    if echo is None:  # via the kvplane CLI: keep what follows `overhead`
        echo = sys.argv[1:]
        if "overhead" in echo:
            echo = echo[echo.index("overhead") + 1 :]
    command = " ".join(["kvplane bench overhead", *(shlex.quote(a) for a in echo)])
    t_start = time.monotonic()
    with contextlib.suppress(ImportError, ValueError, OSError):
        import resource  # many sockets under open-loop load: lift the soft limit

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    machine = _machine()
    rundir = Path(tempfile.mkdtemp(prefix="kvplane-bench-overhead-"))
    procs: list[Proc] = []
    doc: dict[str, Any] = {}
    try:
        doc = _run_inner(args, sizes, regimes, names, tokenizer_dir, rundir, procs, machine)
    finally:
        for p in reversed(procs):
            p.stop()
        if args.keep_logs:
            print(f"bench overhead: logs kept in {rundir}", file=sys.stderr)
        else:
            import shutil

            shutil.rmtree(rundir, ignore_errors=True)
    machine["loadavg_end"] = list(os.getloadavg())
    doc["date"] = _dt.date.today().isoformat()
    doc["command"] = command
    doc["machine"] = machine
    doc["versions"] = _pkg_versions(("kvplane", "vllm-router", "transformers", "tokenizers"))
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    doc["config"] = {
        k: getattr(args, k)
        for k in (
            "sizes", "regimes", "routers", "requests", "requests_large", "warmup", "sessions",
            "rps_step_s", "rps_max_steps", "p99_bound_ms", "seed", "kvplane_workers",
            "kvplane_redis",
        )
    }  # fmt: skip
    doc["targets"] = check_targets(doc["runs"])
    doc = _clean(doc)
    if args.no_write:  # a trial run: the table only
        print(format_table(doc))
        return doc
    results_dir.mkdir(parents=True, exist_ok=True)
    out = results_dir / f"overhead-{doc['date']}.json"
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
    tmp.replace(out)
    doc["_json_path"] = str(out)
    print(format_table(doc))
    print(f"\nwrote {out}")
    if not args.no_markdown:
        update_markdown(results_md, render_markdown(doc))
        print(f"updated {results_md} ({SECTION})")
    return doc


def _clean(o: Any) -> Any:
    """Strict JSON: a step with no successful request has an infinite p99; write null."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_clean(v) for v in o]
    return o


def _finite(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None


def _run_inner(
    args: argparse.Namespace,
    sizes: list[int],
    regimes: list[str],
    names: list[str],
    tokenizer_dir: Path,
    rundir: Path,
    procs: list[Proc],
    machine: dict[str, Any],
) -> dict[str, Any]:
    counter = load_counter(tokenizer_dir)
    factory = PromptFactory(counter, seed=args.seed)
    backend_ports = [free_port(), free_port()]
    zmq_ports = [free_port(), free_port()]
    for i, (port, zport) in enumerate(zip(backend_ports, zmq_ports, strict=True)):
        argv = [sys.executable, "-m", "kvplane.bench.noop_backend", "--host", HOST]
        argv += ["--port", str(port), "--kv-events-port", str(zport), "--model", MODEL]
        argv += ["--tokenizer", str(tokenizer_dir)]
        procs.append(_spawn(f"noop-{i}", argv, rundir))
    for p, port in zip(procs, backend_ports, strict=True):
        if not _wait_ready(p, port, 30, None):
            raise SystemExit(f"bench overhead: no-op backend did not start:\n{p.tail()}")

    kvplane_cmd = args.kvplane_cmd or _venv_bin("kvplane")
    vllm_cmd = args.vllm_router_cmd or _venv_bin("vllm-router")
    profile = Path(args.kvplane_profile).resolve() if args.kvplane_profile else None
    redis_url: str | None = None
    if "kvplane" in names and (args.kvplane_redis or any(n > 1 for n in args.kvplane_workers)):
        redis_url = start_redis(rundir, procs)
    specs = router_specs(
        names,
        backend_ports,
        tokenizer_dir,
        rundir,
        kvplane_cmd,
        vllm_cmd,
        args.kvplane_workers,
        profile,
        redis_url,
        redis_single=args.kvplane_redis,
    )
    probe = _body(factory.fresh(64))
    started: list[tuple[RouterSpec, Proc]] = []
    skipped: dict[str, str] = {}
    for spec in specs:
        try:
            proc = _spawn(spec.name, spec.argv, rundir, spec.env, spec.stop_signal)
        except OSError as exc:
            skipped[spec.name] = f"could not start: {exc}"
            continue
        procs.append(proc)
        started.append((spec, proc))
    for spec, proc in started:
        if not _wait_ready(proc, spec.port, 90, probe):
            skipped[spec.name] = "not ready within 90 s: " + proc.tail(8)
            proc.stop()
            print(f"bench overhead: skipping {spec.name}:\n{proc.tail(8)}", file=sys.stderr)
    live = [(s, p) for s, p in started if s.name not in skipped]
    if not live:
        raise SystemExit(f"bench overhead: no router started: {skipped}")

    doc = _run_loop(_measure(args, factory, sizes, regimes, live, backend_ports, tokenizer_dir))
    doc["skipped"] = skipped
    doc["commands"] = {s.name: " ".join(shlex.quote(a) for a in s.argv) for s, _ in live}
    doc["kvplane_configs"] = {
        s.name: (rundir / f"{s.name}-router.yaml").read_text()
        for s, _ in live
        if s.name.startswith("kvplane")
    }
    if redis_url is not None:
        doc["redis"] = next(" ".join(p.argv) for p in procs if p.name == "redis")
    doc["backends"] = {
        "processes": [" ".join(shlex.quote(a) for a in p.argv) for p in procs[:2]],
        "note": "one no-op process per backend; render/tokenize on, a silent ZMQ PUB each",
    }
    return doc


async def _measure(
    args: argparse.Namespace,
    factory: PromptFactory,
    sizes: list[int],
    regimes: list[str],
    live: list[tuple[RouterSpec, Proc]],
    backend_ports: list[int],
    tokenizer_dir: Path,
) -> dict[str, Any]:
    routers = [Target(s.name, [s.port]) for s, _ in live]
    direct = Target("direct", backend_ports)
    runs: list[dict[str, Any]] = []
    baseline: list[dict[str, Any]] = []
    hf = hf_tokenizer(tokenizer_dir)
    for cell in _cells(factory, sizes, regimes, args):
        print(
            f"[{cell.regime} {cell.tokens}] {len(cell.prompts)} prompts x {len(routers)} routers",
            file=sys.stderr,
            flush=True,
        )
        lat, tt, counts = await _latency_phase(routers, direct, cell, hf)
        tok_p50_ms = percentile(tt, 50) * 1e3 if tt else math.nan
        cell_bound_ms = max(args.p99_bound_ms, 4 * tok_p50_ms)
        print(f"  tokenize p50 {tok_p50_ms:.2f} ms", file=sys.stderr, flush=True)

        def make_payloads(n: int, c: Cell = cell) -> list[list[bytes]]:
            return [[_body(c.make())] for _ in range(n)]

        def for_target(t: Target, mk: Callable[[int], list[list[bytes]]] = make_payloads) -> Any:
            return lambda n: [t.encode(b[0]) for b in mk(n)]

        probe_body = _body(cell.make())
        if cell.regime == REGIMES[0] and args.rps_max_steps > 0:
            direct_lat = statistics.median(v["direct_p50_ms"] for v in lat.values())
            best, steps = await max_rps(
                direct,
                for_target(direct),
                0.5 / max(direct_lat / 1e3, 1e-4),
                cell_bound_ms / 1e3,
                args.rps_step_s,
                args.rps_max_steps,
                direct.encode(probe_body),
                direct_lat / 1e3,
            )
            baseline.append(
                {
                    "regime": cell.regime,
                    "prompt_tokens": cell.tokens,
                    "direct_p50_ms": _finite(direct_lat),
                    "max_rps": round(best, 1),
                    "rps_steps": [asdict(s) for s in steps],
                }
            )
        for t in routers:
            m = lat[t.name]
            best = math.nan
            steps = []
            routed_s = max(m["routed_p50_ms"] / 1e3, 1e-4) if m["pairs"] else 0.05
            # the cell's SLO, or 4x this router's own unloaded median when that is larger:
            # a router slower than the SLO even when idle still has a capacity to measure
            bound_s = max(cell_bound_ms / 1e3, 4 * routed_s)
            if args.rps_max_steps > 0:
                best, steps = await max_rps(
                    t,
                    for_target(t),
                    0.5 / routed_s,
                    bound_s,
                    args.rps_step_s,
                    args.rps_max_steps,
                    t.encode(probe_body),
                    routed_s,
                )
            run = {
                "router": t.name,
                "regime": cell.regime,
                "prompt_tokens": cell.tokens,
                "added_p50_ms": _finite(m["added_p50_ms"]),
                "added_p99_ms": _finite(m["added_p99_ms"]),
                "max_rps": _finite(best) if args.rps_max_steps > 0 else None,
                "tokenize_p50_ms": _finite(tok_p50_ms),
                "prompt_tokens_actual": round(statistics.mean(counts)),
                "routed_p50_ms": _finite(m["routed_p50_ms"]),
                "routed_p99_ms": _finite(m["routed_p99_ms"]),
                "direct_p50_ms": _finite(m["direct_p50_ms"]),
                "direct_p99_ms": _finite(m["direct_p99_ms"]),
                "pairs": m["pairs"],
                "errors": m["errors"],
                "p99_bound_ms": round(bound_s * 1e3, 2),
                "rps_steps": [asdict(s) for s in steps],
            }
            runs.append(run)
            print(
                f"  {t.name:26s} added p50 {run['added_p50_ms']} ms p99 {run['added_p99_ms']} ms"
                f"  max {run['max_rps']} req/s",
                file=sys.stderr,
                flush=True,
            )
    for t in [*routers, direct]:
        t.close()
    return {"runs": runs, "baseline": baseline}


def _run_loop(coro: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """uvloop when installed: a cheaper, steadier client (the load generator)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    from kvplane.bench import overhead  # the package's docstring is the command's help

    return bench_main(
        "python -m kvplane.bench.overhead", overhead.__doc__, add_arguments, run, argv
    )


if __name__ == "__main__":
    sys.exit(main())
