"""The ``kvplane`` command: router, indexer, demo and benchmarks."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvplane.router.config import RouterConfig

# transformers announces on import that PyTorch is missing; kvplane only tokenizes, so
# the line concerns no kvplane user (an explicit setting wins)
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

Handler = Callable[[argparse.Namespace], int]


class ConfigError(Exception):
    """A config file that cannot be read or does not validate."""


def _load(path: str) -> RouterConfig:
    """The config's (first) pool; a readable error for a bad file."""
    return _load_pools(path)[0]


def _load_pools(path: str) -> list[RouterConfig]:
    import pydantic
    import yaml

    from kvplane.router.models import load_pools

    try:
        return load_pools(path)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except (yaml.YAMLError, pydantic.ValidationError, ValueError) as exc:
        raise ConfigError(f"invalid config {path}:\n{exc}") from exc


def _router(args: argparse.Namespace) -> int:
    from kvplane.router import serving

    configs = _load_pools(args.config)  # fail fast, with a readable error, before forking
    if args.workers > 1 and any(c.index.backend == "memory" for c in configs):
        print(
            "kvplane router: --workers > 1 needs a shared index (index.backend: redis); "
            "the in-memory index lives in one process",
            file=sys.stderr,
        )
        return 2
    os.environ["KVPLANE_ROUTER_CONFIG"] = str(args.config)
    if args.embedded_indexer:
        os.environ["KVPLANE_EMBEDDED_INDEXER"] = "1"
    serving.run(configs[0], args.host, args.port, args.workers, args.log_level)
    return 0


def _epp(args: argparse.Namespace) -> int:
    configs = _load_pools(args.config)
    from kvplane.router.epp.picker import PickerSettings
    from kvplane.router.epp.server import serve

    settings = PickerSettings(fallbacks=args.fallbacks, max_body_bytes=args.max_body_bytes)
    try:
        asyncio.run(serve(configs, args.port, settings, args.host, args.metrics_port))
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return 0


def _indexer(args: argparse.Namespace) -> int:
    from kvplane.router.indexer_main import run_indexer

    _load(args.config)
    code: int = asyncio.run(
        run_indexer(args.config, args.metrics_port, indexer_id=args.id, lease_s=args.lease_s)
    )
    return code


def _demo(args: argparse.Namespace) -> int:
    try:
        from kvplane.demo import run_demo
    except ImportError as exc:  # the demo extra: the openai client
        raise SystemExit(f"kvplane demo needs {exc.name}: pip install 'kvplane[demo]'") from exc

    return run_demo(args)


def _bench_overhead(args: argparse.Namespace) -> int:
    from kvplane.bench import overhead

    overhead.run(args)
    return 0


def _bench_routing(args: argparse.Namespace) -> int:
    from kvplane.bench import routing

    args.argv_echo = sys.argv[3:]
    routing.run(args)
    return 0


def _bench_index(args: argparse.Namespace) -> int:
    from kvplane.bench import index

    args.argv_echo = sys.argv[3:]
    index.run(args)
    return 0


def _bench_pd(args: argparse.Namespace) -> int:
    from kvplane.bench import pd

    args.argv_echo = sys.argv[3:]
    pd.run(args)
    return 0


def _bench_gateway(args: argparse.Namespace) -> int:
    from kvplane.bench import gateway

    args.argv_echo = sys.argv[3:]
    gateway.run(args)
    return 0


def _bench_tail(args: argparse.Namespace) -> int:
    from kvplane.bench import tail

    tail.run(args)
    return 0


def _bench_soak(args: argparse.Namespace) -> int:
    from kvplane.bench import soak

    args.argv_echo = sys.argv[3:]
    soak.run(args)
    return 0


def _sim(args: argparse.Namespace) -> int:
    from kvplane.sim.main import run

    return run(args)


def _operator(args: argparse.Namespace) -> int:
    import kopf

    import kvplane.operator.handlers  # noqa: F401  (registers the handlers)
    from kvplane.operator.settings import OperatorSettings

    settings = OperatorSettings.from_env()
    namespaces = args.namespace or settings.namespaces
    peering = args.peering or settings.peering
    import os
    import secrets
    import socket

    if peering:
        # kopf's identity in the peering object; the operator's writes check it too
        os.environ.setdefault("POD_ID", f"{socket.gethostname()}-{os.getpid()}")
    # the controller's watches cover what kopf watches
    os.environ["KVPLANE_WATCH_NAMESPACES"] = ",".join(namespaces)
    kopf.run(
        # peers of equal priority all pause; a random one makes exactly one of them active
        priority=secrets.randbelow(2**31 - 1) + 1 if peering else 0,
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=peering is None,
        peering_name=peering,
        liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz",
    )
    return 0


def _adapter_rules(args: argparse.Namespace) -> int:
    import yaml

    from kvplane.operator.render.autoscaling import ADAPTER_HEADER, prometheus_adapter_config

    print(ADAPTER_HEADER + yaml.safe_dump(prometheus_adapter_config(), sort_keys=False), end="")
    return 0


def _crds(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvplane.operator.crdgen import all_crds, render_yaml

    out = Path(args.out)
    stale = []
    for name, manifest in all_crds().items():
        text = render_yaml(manifest)
        path = out / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if stale:
        print("stale CRDs (run `kvplane crds`): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane",
        description="Cache-aware routing over a cluster-wide KV cache for vLLM and SGLang.",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("router", help="serve the OpenAI-compatible cache-aware router")
    r.add_argument(
        "--config",
        required=True,
        help="router config (YAML, docs/router.md), or several pools: pools: [...]",
    )
    r.add_argument("--host", default="127.0.0.1")
    r.add_argument("--port", type=int, default=8000)
    r.add_argument("--workers", type=int, default=1, help="processes (needs the Redis index)")
    r.add_argument(
        "--embedded-indexer",
        action="store_true",
        help="also ingest KV events in this process (the default with the in-memory index)",
    )
    r.set_defaults(handler=_router)

    e = sub.add_parser(
        "epp",
        help="serve the Gateway API Inference Extension's endpoint picker (Envoy ext_proc gRPC)",
    )
    e.add_argument("--config", required=True, help="router config (YAML), or several: pools: [...]")
    e.add_argument("--host", default="0.0.0.0")
    e.add_argument("--port", type=int, default=9002, help="gRPC port (GIE's default: 9002)")
    e.add_argument(
        "--fallbacks",
        type=int,
        default=0,
        help="endpoints after the chosen one, for a data plane that retries down the list "
        "(Envoy's override_host policy; an ORIGINAL_DST cluster takes exactly one)",
    )
    e.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    e.add_argument("--metrics-port", type=int, default=9090, help="0 disables /metrics")
    e.set_defaults(handler=_epp)

    i = sub.add_parser("indexer", help="ingest engine KV events into the Redis residency index")
    i.add_argument("--config", required=True, help="router config (YAML): backends and index")
    i.add_argument("--metrics-port", type=int, default=9090, help="0 disables /metrics")
    i.add_argument(
        "--id",
        default=None,
        help="this indexer's id among a pool's indexers (default: host, pid and a random part)",
    )
    i.add_argument(
        "--lease-s",
        type=float,
        default=10.0,
        help="a pod's stream lease: a dead indexer's pods move to others within it",
    )
    i.set_defaults(handler=_indexer)

    d = sub.add_parser(
        "demo",
        help="start local vLLM engines, the indexer and the router; compare with round-robin",
    )
    d.add_argument("--once", action="store_true", help="exit after the comparison table")
    d.add_argument("--engines", type=int, default=2)
    d.add_argument("--port", type=int, default=8000, help="router port left serving")
    d.add_argument("--groups", type=int, default=4, help="shared-prefix groups")
    d.add_argument("--per-group", type=int, default=8, help="requests per group")
    d.add_argument("--prefix-tokens", type=int, default=7000)
    # about half of the prefixes fit one engine: all of them do not
    d.add_argument(
        "--kv-cache-tokens", type=int, default=16384, help="each engine's KV cache, in tokens"
    )
    d.add_argument("--rounds", type=int, default=3, help="local rounds of both routers")
    d.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    d.add_argument("--skip-sim", action="store_true", help="no simulated H100 comparison")
    d.add_argument("--sim-requests", type=int, default=256)
    # slow enough that a busy 2-core machine keeps the simulated timeline
    d.add_argument("--sim-time-scale", type=float, default=8.0, help="wall s per simulated s")
    d.add_argument(
        "--plot",
        default=os.path.join(
            os.environ.get("KVPLANE_CACHE", os.path.expanduser("~/.cache/kvplane")),
            "kvplane-demo.png",
        ),
        help="the PNG written",
    )
    d.set_defaults(handler=_demo)

    op = sub.add_parser("operator", help="run the kopf operator (reconciles kvplane.io CRs)")
    op.add_argument(
        "--namespace",
        action="append",
        help="watch only this namespace (repeatable); default: the whole cluster",
    )
    op.add_argument(
        "--peering", default=None, help="kopf peering name for HA (default: standalone)"
    )
    op.add_argument("--health-port", type=int, default=8080)
    op.set_defaults(handler=_operator)

    s = sub.add_parser(
        "sim", help="serve simulated vLLM engines (H100 timing model) for routing benchmarks"
    )
    from kvplane.sim.main import add_arguments as add_sim_arguments

    add_sim_arguments(s)
    s.set_defaults(handler=_sim)

    c = sub.add_parser("crds", help="write the CRD manifests generated from the typed models")
    c.add_argument("--out", default="crds", help="directory (default: crds)")
    c.add_argument("--check", action="store_true", help="fail if the files are stale")
    c.set_defaults(handler=_crds)
    a = sub.add_parser(
        "adapter-rules",
        help="print the Prometheus adapter config serving the autoscaling signals",
    )
    a.set_defaults(handler=_adapter_rules)

    b = sub.add_parser("bench", help="benchmarks (print figures, write bench/results)")
    bsub = b.add_subparsers(dest="bench", required=True)
    o = bsub.add_parser("overhead", help="router-added latency and max req/s vs vllm-router")
    from kvplane.bench.overhead import add_arguments

    add_arguments(o)
    o.set_defaults(handler=_bench_overhead)
    r = bsub.add_parser(
        "routing",
        help="routing quality vs NVIDIA Dynamo, vllm-router and sglang-router on a simulated fleet",
    )
    from kvplane.bench.routing import add_arguments as routing_arguments

    routing_arguments(r)
    r.set_defaults(handler=_bench_routing)
    d = bsub.add_parser(
        "pd", help="aggregated vs disaggregated vs conditional P/D serving on a simulated fleet"
    )
    from kvplane.bench.pd import add_arguments as pd_arguments

    pd_arguments(d)
    d.set_defaults(handler=_bench_pd)
    g = bsub.add_parser(
        "gateway", help="kvplane's endpoint picker behind real Envoy vs kvplane's router"
    )
    from kvplane.bench.gateway import add_arguments as gateway_arguments

    gateway_arguments(g)
    g.set_defaults(handler=_bench_gateway)
    t = bsub.add_parser("tail", help="which requests make a routing run's TTFT tail, and why")
    from kvplane.bench.tail import add_arguments as tail_arguments

    tail_arguments(t)
    t.set_defaults(handler=_bench_tail)
    x = bsub.add_parser(
        "index", help="the residency index: ingest rate, lookup latency, memory, shard skew"
    )
    from kvplane.bench.index import add_arguments as index_arguments

    index_arguments(x)
    x.set_defaults(handler=_bench_index)
    cal = bsub.add_parser(
        "calibration", help="a GPU's measured forward, decode and copy times beside the simulator's"
    )
    from kvplane.bench.calibration import add_arguments as calibration_arguments
    from kvplane.bench.calibration import run as calibration_run

    calibration_arguments(cal)
    cal.set_defaults(handler=calibration_run)
    tk = bsub.add_parser(
        "tokenize", help="the router's tokenizer on a workload's prompts, reuse cache off and on"
    )
    from kvplane.bench.tokenize import add_arguments as tokenize_arguments
    from kvplane.bench.tokenize import run as tokenize_run

    tokenize_arguments(tk)
    tk.set_defaults(handler=tokenize_run)
    s = bsub.add_parser(
        "soak", help="the router under steady traffic for a long time: memory, FDs, index size"
    )
    from kvplane.bench.soak import add_arguments as soak_arguments

    soak_arguments(s)
    s.set_defaults(handler=_bench_soak)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.log_level != "debug":  # a line per scrape and per P/D leg says nothing
        for name in ("httpx", "httpcore"):
            logging.getLogger(name).setLevel(logging.WARNING)
    handler: Handler = args.handler
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"kvplane {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
