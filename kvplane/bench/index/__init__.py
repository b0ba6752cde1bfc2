"""``kvplane bench index``: the residency index itself, at fleet scale.

Measured side by side in one run, for the in-process memory index, one local Redis,
and a Redis Cluster of ``--shards`` local primaries (redis-server in cluster mode on
loopback, formed by this benchmark):

* ingest rate through the real event path (``ingest``): vLLM-encoded KV event
  batches decoded, re-keyed and written, every engine stream at once, with one or
  several ingesting processes sharing the pods as indexers do;
* lookup latency of 128-key prompts against the pods asked (every pod a candidate)
  and the entries held (``lookup``), with memory per (block, pod) entry, and memory
  extrapolated beyond the measured sizes at the measured cost per entry;
* hot-prefix skew (``skew``): how three ways of placing blocks on cluster slots
  spread real workloads' lookups and writes over shards.

Results go to ``bench/results/index-<date>.json``, plots next to it, and the
``## Residency index`` section of ``bench/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import date
from typing import Any

from kvplane.bench.index import ingest, lookup, report, skew
from kvplane.bench.index.synthetic import StreamShape
from kvplane.bench.procs import (
    bench_main,
    bench_relative,
    machine_info,
    results_dir,
    update_markdown,
    versions,
)
from kvplane.local import redis as local_redis

BACKENDS = ("memory", "redis", "redis-cluster")


def _ints(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        scale = {"K": 1_000, "M": 1_000_000, "G": 1_000_000_000}.get(part[-1:], 1)
        out.append(int(float(part.rstrip("KMG")) * scale))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("index benchmark")
    g.add_argument("--backends", default=",".join(BACKENDS), help="memory, redis, redis-cluster")
    g.add_argument("--shards", type=int, default=3, help="primaries of the local Redis Cluster")
    g.add_argument(
        "--entries", default="1M,10M,50M", help="index sizes at 100 pods ((block, pod) entries)"
    )
    g.add_argument("--pods", default="10,100,500,1000", help="fleet sizes at the largest --entries")
    g.add_argument("--lookups", type=int, default=2000, help="lookups timed per point")
    g.add_argument(
        "--memory-max-entries",
        default="10M",
        help="the memory index is measured up to this size (it holds ~200 B/entry in Python)",
    )
    g.add_argument(
        "--redis-max-entries",
        default=None,
        help="one Redis is measured up to this size (default: every --entries); the cluster "
        "always goes to the largest",
    )
    g.add_argument("--ingest-pods", type=int, default=100, help="engine streams ingested at once")
    g.add_argument("--ingest-steps", type=int, default=150, help="engine steps per stream")
    g.add_argument("--ingest-procs", default="1,2", help="ingesting processes (Redis backends)")
    g.add_argument(
        "--skew-workloads", default="gsp,gsp-chat,mooncake", help="workloads for the skew table"
    )
    g.add_argument("--skew-limit", type=int, default=1024, help="requests per skew workload")
    g.add_argument("--skew-shards", default="3,8,16", help="shard counts for the skew table")
    g.add_argument("--skip", default="", help="parts to skip: ingest, lookup, skew")
    g.add_argument("--quick", action="store_true", help="small sizes: a check, not a result")
    g.add_argument("--out-dir", default=None, help="results folder (default bench/results)")
    g.add_argument("--no-write", action="store_true", help="print only")
    g.add_argument("--no-progress", action="store_true")


def _apply_quick(args: argparse.Namespace) -> None:
    args.entries = "100K,300K"
    args.pods = "10,100"
    args.lookups = min(args.lookups, 200)
    args.ingest_pods = min(args.ingest_pods, 8)
    args.ingest_steps = min(args.ingest_steps, 40)
    args.skew_limit = min(args.skew_limit, 128)
    args.skew_workloads = "gsp-chat"
    args.skew_shards = "3"


def _redis_version() -> str:
    try:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    except OSError:
        return "?"
    words = out.stdout.split()
    return next((w.removeprefix("v=") for w in words if w.startswith("v=")), "?")


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        _apply_quick(args)
    started = time.monotonic()
    names = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in names if b not in BACKENDS]
    if unknown:
        raise SystemExit(f"bench index: unknown backends {unknown} (choose from {BACKENDS})")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}

    def say(message: str) -> None:
        if not args.no_progress:
            print(message, flush=True)

    entries, pods = _ints(args.entries), _ints(args.pods)
    caps = {"memory": _ints(args.memory_max_entries)[0]}
    if args.redis_max_entries:
        caps["redis"] = _ints(args.redis_max_entries)[0]
    shape = StreamShape(steps=args.ingest_steps)
    doc: dict[str, Any] = {
        "date": date.today().isoformat(),
        "command": "kvplane bench index " + " ".join(getattr(args, "argv_echo", [])),
        "machine": machine_info(),
        "versions": versions(("kvplane", "redis", "numpy")),
        "setup": {
            "shards": args.shards,
            "redis_version": _redis_version(),
            "ingest_pods": args.ingest_pods,
            "stream": f"{shape.steps} steps of a {shape.blocks_per_step}-block prompt "
            f"(block size {shape.block_size}), evicting past {shape.capacity_blocks} blocks",
            "skew_limit": args.skew_limit,
        },
        "ingest": [],
        "lookup": [],
        "skew": [],
    }
    servers: dict[str, local_redis.LocalRedis | None] = {}
    try:
        for name in names:
            if name == "memory":
                servers[name] = None
            elif name == "redis":
                servers[name] = local_redis.start(0)
            else:
                servers[name] = local_redis.start(args.shards)
        if "ingest" not in skip:
            procs = _ints(args.ingest_procs)
            runs = ingest.run_all(servers, args.ingest_pods, procs, shape, say)
            doc["ingest"] = [r.as_dict() for r in runs]
        if "lookup" not in skip:
            plan = {n: lookup.points(entries, pods, caps.get(n)) for n in servers}
            runs_l = lookup.run_all(servers, plan, args.lookups, say)
            doc["lookup"] = [r.as_dict() for r in runs_l]
    finally:
        for server in servers.values():
            if server is not None:
                server.stop()
    if "skew" not in skip:
        for wl in [w.strip() for w in args.skew_workloads.split(",") if w.strip()]:
            rows = skew.analyse(wl, args.skew_limit, _ints(args.skew_shards))
            doc["skew"] += [r.as_dict() for r in rows]
            say(f"skew {wl}: done")
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    doc["seconds"] = time.monotonic() - started
    doc["extrapolated"] = report.extrapolate(doc)
    doc["targets"] = report.targets(doc)
    folder, md = results_dir(args.out_dir)
    stem = folder / f"index-{doc['date']}"
    json_path = stem.with_suffix(".json")
    plots = [] if args.no_write or not doc["lookup"] else report.plot(doc, stem)
    text = report.render_markdown(
        doc, bench_relative(json_path), [bench_relative(p) for p in plots]
    )
    print(text)
    if not args.no_write:
        json_path.write_text(json.dumps(doc, indent=1) + "\n")
        update_markdown(md, text, report.SECTION)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("kvplane bench index", __doc__, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
