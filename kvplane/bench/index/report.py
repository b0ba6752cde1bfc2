"""The index benchmark's output: targets, the RESULTS.md section, plots."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Final

SECTION: Final = "## Residency index"
REDIS_BACKENDS: Final = ("redis", "redis-cluster")
EXTRAPOLATE_TO: Final = (100_000_000, 1_000_000_000)


def _best(rows: Sequence[Mapping[str, Any]], key: str, **where: Any) -> Mapping[str, Any] | None:
    match = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    return max(match, key=lambda r: r[key]) if match else None


def _lookup_at(
    rows: Sequence[Mapping[str, Any]], backend: str, pods: int, entries: int
) -> Mapping[str, Any] | None:
    """The run of ``backend`` at ``pods`` closest to ``entries`` from below or at it."""
    match = [r for r in rows if r["backend"] == backend and r["pods"] == pods]
    near = [r for r in match if r["entries"] >= 0.9 * entries]
    return min(near, key=lambda r: r["entries"]) if near else None


def _get(row: Mapping[str, Any] | None, key: str) -> float | None:
    return None if row is None else float(row[key])


def targets(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    ingest, lookups = doc["ingest"], doc["lookup"]
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, higher_is_better: bool) -> None:
        ok = None if value is None else (value >= limit if higher_is_better else value <= limit)
        out.append({"target": name, "value": value, "limit": limit, "pass": ok})

    redis_best = max((r["rate"] for r in ingest if r["backend"] in REDIS_BACKENDS), default=None)
    add("ingest into Redis >= 500K block events/s per pool", redis_best, 500_000, True)
    memory = _best(ingest, "rate", backend="memory")
    add("ingest into memory >= 5M block events/s", _get(memory, "rate"), 5_000_000, True)
    for pods, limit in ((100, 1.0), (500, 2.0)):
        run = _lookup_at(lookups, "redis-cluster", pods, 50_000_000)
        add(
            f"lookup p99 <= {limit:g} ms, {pods} pods, 50M entries (cluster)",
            _get(run, "p99_ms"),
            limit,
            False,
        )
    big = [r for r in lookups if r["backend"] in REDIS_BACKENDS]
    largest = max(big, key=lambda r: r["entries"], default=None)
    add(
        "Redis bytes per (block, pod) entry <= 40",
        _get(largest, "bytes_per_entry"),
        40.0,
        False,
    )
    return out


def extrapolate(doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Memory at fleet sizes beyond the measured, from the largest run's bytes per entry."""
    out = []
    for backend in ("memory", *REDIS_BACKENDS):
        rows = [r for r in doc["lookup"] if r["backend"] == backend]
        if not rows:
            continue
        largest = max(rows, key=lambda r: r["entries"])
        for entries in EXTRAPOLATE_TO:
            out.append(
                {
                    "backend": backend,
                    "entries": entries,
                    "gib": entries * largest["bytes_per_entry"] / (1 << 30),
                    "from_entries": largest["entries"],
                }
            )
    return out


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:,.{nd}f}"
    return f"{x:,}" if isinstance(x, int) else str(x)


def render_markdown(doc: Mapping[str, Any], json_path: str, plots: Sequence[str]) -> str:
    m = doc["machine"]
    lines = [
        SECTION,
        "",
        f"`{doc['command']}` on {doc['date']} (raw: `{json_path}`); {m['nproc']} cores "
        f"({m['cpu_model']}), load average {_f(m['loadavg_start'][0])} at start and "
        f"{_f(m['loadavg_end'][0])} at the end, {doc['seconds']:.0f} s; "
        f"kvplane {doc['versions'].get('kvplane_git', '?')}, redis-server "
        f"{doc['setup']['redis_version']}.",
        "",
        f"Backends: `memory` (MemoryIndex, in process), `redis` (one local redis-server), "
        f"`redis-cluster` ({doc['setup']['shards']} local redis-server primaries in "
        "cluster mode on loopback), the same RedisIndex against both.",
        "",
        "### Ingest (decode, re-key, write)",
        "",
        f"{doc['setup']['ingest_pods']} engine streams at once, each "
        f"{doc['setup']['stream']}; block events = blocks stored + blocks evicted (one "
        "vLLM `BlockRemoved` each). CPU per block event: the ingesting processes "
        "(client) and the Redis servers.",
        "",
        "| backend | processes | block events | seconds | block events/s "
        "| client µs/event | Redis µs/event |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["ingest"]:
        lines.append(
            f"| {r['backend']} | {r['processes']} | {_f(r['block_events'])} | "
            f"{_f(r['seconds'])} | {_f(r['rate'], 0)} | "
            f"{_f(r['client_cpu_s'] / r['block_events'] * 1e6)} | "
            f"{_f(r['server_cpu_s'] / r['block_events'] * 1e6)} |"
        )
    lines += [
        "",
        "### Lookups and memory",
        "",
        "One 128-key prompt at a time (an 8K-token prompt at block size 64: a system prompt "
        "every pod holds, then 96 blocks one pod holds), every pod a candidate, one client; "
        "`server µs`: Redis time per lookup over every shard (`EVALSHA` commandstats).",
        "",
        "| backend | pods | entries | p50 ms | p99 ms | mean ms | server µs | bytes/entry "
        "| fill entries/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["lookup"]:
        lines.append(
            f"| {r['backend']} | {r['pods']} | {_f(r['entries'])} | {_f(r['p50_ms'], 3)} | "
            f"{_f(r['p99_ms'], 3)} | {_f(r['mean_ms'], 3)} | {_f(r['server_us'], 0)} | "
            f"{_f(r['bytes_per_entry'], 1)} | {_f(r['fill_rate'], 0)} |"
        )
    if doc["extrapolated"]:
        lines += [
            "",
            "Memory beyond the measured, at the largest run's bytes per entry:",
            "",
            "| backend | entries | GiB | from a run of |",
            "|---|---:|---:|---:|",
        ]
        for r in doc["extrapolated"]:
            lines.append(
                f"| {r['backend']} | {_f(r['entries'])} | {_f(r['gib'], 1)} | "
                f"{_f(r['from_entries'])} |"
            )
    if doc["skew"]:
        lines += [
            "",
            "### Hot-prefix skew",
            "",
            "Busiest shard against an even share (1.00 = even) of the lookup commands and "
            "of the blocks written; a bucket per block, per chunk of 16 (kvplane), or per "
            "prompt chain (`kvplane/bench/index/skew.py`); "
            f"{doc['setup']['skew_limit']} requests per workload, block size 16.",
            "",
            "| workload | placement | shards | lookup max/mean | write max/mean "
            "| shards per lookup | commands per lookup | largest bucket share |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in doc["skew"]:
            lines.append(
                f"| {r['workload']} | {r['scheme']} | {r['shards']} | "
                f"{_f(r['lookup_max_over_mean'])} | {_f(r['write_max_over_mean'])} | "
                f"{_f(r['shards_per_lookup'], 1)} | {_f(r['commands_per_lookup'], 1)} | "
                f"{_f(r['largest_bucket_share'], 4)} |"
            )
    lines += ["", "Targets:", ""]
    for t in doc["targets"]:
        verdict = {True: "**PASS**", False: "**FAIL**", None: "not measured"}[t["pass"]]
        lines.append(f"- {verdict} {t['target']} — {_f(t['value'])}")
    if plots:
        lines += ["", "Plots: " + ", ".join(f"[{Path(p).name}]({p})" for p in plots)]
    return "\n".join(lines) + "\n"


def plot(doc: Mapping[str, Any], stem: Path) -> list[Path]:
    """Latency against pods and against entries (with memory, measured and extrapolated).
    None without matplotlib (``kvplane[plots]``)."""
    try:
        import matplotlib
    except ImportError:
        print("bench: no plots (matplotlib is not installed: pip install 'kvplane[plots]')")
        return []
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["lookup"]
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    out: list[Path] = []
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for b in backends:
        mine = [r for r in rows if r["backend"] == b]
        top = max(r["entries"] for r in mine)
        pts = sorted((r for r in mine if r["entries"] >= 0.9 * top), key=lambda r: r["pods"])
        if len(pts) > 1:
            xs = [r["pods"] for r in pts]
            ax.plot(xs, [r["p99_ms"] for r in pts], marker="o", label=f"{b} p99")
            ax.plot(xs, [r["p50_ms"] for r in pts], marker=".", linestyle=":", label=f"{b} p50")
    ax.set_xscale("log")
    ax.set_xlabel("pods (candidates per lookup)")
    ax.set_ylabel("lookup latency (ms)")
    ax.set_title("128-key lookup vs pods (largest index measured)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    path = stem.with_name(stem.name + "-pods.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for b in backends:
        pts = sorted(
            (r for r in rows if r["backend"] == b and r["pods"] == 100), key=lambda r: r["entries"]
        )
        if pts:
            xs = [r["entries"] for r in pts]
            ax.plot(xs, [r["p99_ms"] for r in pts], marker="o", label=f"{b} p99")
            ax.plot(xs, [r["p50_ms"] for r in pts], marker=".", linestyle=":", label=f"{b} p50")
            bx.plot(
                xs,
                [r["entries"] * r["bytes_per_entry"] / (1 << 30) for r in pts],
                marker="o",
                label=b,
            )
        ext = [r for r in doc["extrapolated"] if r["backend"] == b]
        if pts and ext:
            last = pts[-1]
            xs = [last["entries"], *(r["entries"] for r in ext)]
            ys = [last["entries"] * last["bytes_per_entry"] / (1 << 30), *(r["gib"] for r in ext)]
            bx.plot(xs, ys, linestyle="--", color=bx.lines[-1].get_color())
    for axis in (ax, bx):
        axis.set_xscale("log")
        axis.set_xlabel("(block, pod) entries")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    ax.set_ylabel("lookup latency (ms)")
    ax.set_title("128-key lookup vs entries, 100 pods")
    bx.set_yscale("log")
    bx.set_ylabel("memory (GiB)")
    bx.set_title("memory: measured, extrapolated (dashed)")
    path = stem.with_name(stem.name + "-entries.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    out.append(path)
    return out
