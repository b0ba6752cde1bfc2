"""Routing benchmark output: the JSON document, the RESULTS.md section, targets and plots.

Pure functions over the run records (plain dicts with the keys of
``RunRecord.to_json``), so a saved JSON file can be re-rendered without a rerun.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SECTION = "## Routing quality"
TARGET_WORKLOADS = ("mooncake", "gsp")
PEER_PREFIXES = ("vllm-router-", "sglang-router-")


def fmt(x: Any, nd: int = 1) -> str:
    """A table cell: "–" for missing or non-finite figures."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def best_peer(runs: Sequence[Mapping[str, Any]], workload: str) -> Mapping[str, Any] | None:
    """The peer router run with the lowest TTFT p90 on ``workload`` (errors disqualify)."""
    peers = [
        r
        for r in runs
        if r["workload"] == workload
        and str(r["router"]).startswith(PEER_PREFIXES)
        and not r.get("errors")
        and r.get("ttft_p90_ms") is not None
    ]
    return min(peers, key=lambda r: r["ttft_p90_ms"]) if peers else None


def check_targets(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The project's routing targets, per target workload present in ``runs``."""
    out: list[dict[str, Any]] = []
    for wl in TARGET_WORKLOADS:
        ours = next((r for r in runs if r["workload"] == wl and r["router"] == "kvplane"), None)
        if ours is None:
            continue
        peer = best_peer(runs, wl)
        if peer is not None:
            ratio = ours["ttft_p90_ms"] / peer["ttft_p90_ms"] if peer["ttft_p90_ms"] else math.inf
            out.append(
                {
                    "workload": wl,
                    "target": f"TTFT p90 <= 0.5 x best peer ({peer['router']})",
                    "value": round(ratio, 3),
                    "pass": ratio <= 0.5 and not ours.get("errors"),
                }
            )
        oracle = ours.get("oracle_hit_ratio") or 0.0
        captured = ours["hit_ratio"] / oracle if oracle else math.nan
        out.append(
            {
                "workload": wl,
                "target": "captured reuse (hit / oracle) >= 0.9",
                "value": round(captured, 3),
                "pass": captured >= 0.9,
            }
        )
        out.append(
            {
                "workload": wl,
                "target": "load imbalance (max/mean prefill tokens) <= 1.2",
                "value": round(ours["imbalance"], 3),
                "pass": ours["imbalance"] <= 1.2,
            }
        )
    return out


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    """One line per row; with the ideal floor (``floor_p*_ms``) and the engines' prefill
    compute (``prefill_tokens_computed``) where the rows carry them."""
    extra = any("floor_p90_ms" in r for r in runs)
    head = (
        "| workload | router | load | TTFT p50 / p90 / p99 ms | ITL p50 ms | req/s | errors "
        "| hit | oracle | captured | imbalance | router CPU s |"
        + (" floor p50 / p90 / p99 ms | p90 / floor p90 | prefill Mtok |" if extra else "")
        + "\n|---|---|---|---|---|---|---|---|---|---|---|---|"
        + ("---|---|---|" if extra else "")
        + "\n"
    )
    rows = []
    for r in runs:
        oracle = r.get("oracle_hit_ratio") or 0.0
        captured = r["hit_ratio"] / oracle if oracle and r.get("hit_ratio") is not None else None
        line = (
            f"| {r['workload']} | {r['router']} | x{float(r.get('load_factor', 1.0)):g} | "
            f"{fmt(r['ttft_p50_ms'], 0)} / "
            f"{fmt(r['ttft_p90_ms'], 0)} / {fmt(r['ttft_p99_ms'], 0)} | "
            f"{fmt(r['itl_p50_ms'], 1)} | {fmt(r['throughput_rps'], 2)} | {r['errors']} | "
            f"{fmt(r['hit_ratio'], 3)} | {fmt(r['oracle_hit_ratio'], 3)} | "
            f"{fmt(captured, 2)} | {fmt(r['imbalance'], 2)} | {fmt(r['router_cpu_s'], 1)} |"
        )
        if extra:
            f90 = r.get("floor_p90_ms")
            p90 = r.get("ttft_p90_ms")
            ratio = p90 / f90 if p90 is not None and f90 else None
            prefill = r.get("prefill_tokens_computed")
            line += (
                f" {fmt(r.get('floor_p50_ms'), 0)} / {fmt(f90, 0)} / "
                f"{fmt(r.get('floor_p99_ms'), 0)} | {fmt(ratio, 2)} | "
                f"{fmt(None if prefill is None else prefill / 1e6, 3)} |"
            )
        rows.append(line)
    return head + "\n".join(rows) + "\n"


# --------------------------------------------------------------------------- Dynamo


def _is_dynamo(router: str) -> bool:
    return router == "dynamo" or router.startswith("dynamo-")


def dynamo_targets(
    runs: Sequence[Mapping[str, Any]], goodput: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """The targets against NVIDIA Dynamo's KV router (issue 20), per workload with a
    kvplane row and Dynamo rows at the base load: goodput at the SLO >= 1.3 x Dynamo's
    best setting; TTFT p90 <= 0.7 x Dynamo's best where that is over 1.5 x the floor's
    p90, else within 1.1 x the floor; TTFT p99 and engine prefill compute no worse than
    Dynamo's defaults' or best setting's."""
    out: list[dict[str, Any]] = []
    base = [r for r in runs if float(r.get("load_factor", 1.0)) == 1.0]
    for wl in dict.fromkeys(r["workload"] for r in base):
        ours = next((r for r in base if r["workload"] == wl and r["router"] == "kvplane"), None)
        dyn = [
            r
            for r in base
            if r["workload"] == wl
            and _is_dynamo(str(r["router"]))
            and not r.get("errors")
            and r.get("ttft_p90_ms") is not None
        ]
        if ours is None or not dyn or ours.get("ttft_p90_ms") is None:
            continue
        best = min(dyn, key=lambda r: r["ttft_p90_ms"])
        defaults = next((r for r in dyn if r["router"] in ("dynamo", "dynamo-frontend")), best)
        ok = not ours.get("errors")

        def add(target: str, value: float, passed: bool, wl: str = wl) -> None:
            out.append({"workload": wl, "target": target, "value": round(value, 3), "pass": passed})

        f90 = ours.get("floor_p90_ms")
        if f90 and best["ttft_p90_ms"] > 1.5 * f90:
            ratio = ours["ttft_p90_ms"] / best["ttft_p90_ms"]
            add(f"TTFT p90 <= 0.7 x Dynamo's best ({best['router']})", ratio, ok and ratio <= 0.7)
        elif f90:
            ratio = ours["ttft_p90_ms"] / f90
            add("TTFT p90 <= 1.1 x the floor's (Dynamo within 1.5 x)", ratio, ok and ratio <= 1.1)
        for ref in dict.fromkeys((defaults["router"], best["router"])):
            row = next(r for r in dyn if r["router"] == ref)
            if ours.get("ttft_p99_ms") is not None and row.get("ttft_p99_ms"):
                ratio = ours["ttft_p99_ms"] / row["ttft_p99_ms"]
                add(f"TTFT p99 <= Dynamo's ({ref})", ratio, ok and ratio <= 1.0)
            mine, theirs = ours.get("prefill_tokens_computed"), row.get("prefill_tokens_computed")
            if mine is not None and theirs:
                ratio = mine / theirs
                add(f"engine prefill tokens <= Dynamo's ({ref})", ratio, ok and ratio <= 1.0)
        gp = {g["router"]: g for g in goodput if g["workload"] == wl}
        dyn_rows = [g for r, g in gp.items() if _is_dynamo(r)]
        mine_gp = gp["kvplane"].get("goodput_rps") or 0.0 if "kvplane" in gp else None
        dyn_gp = [g for g in dyn_rows if g.get("goodput_rps")]
        if mine_gp is not None and dyn_gp:
            top = max(dyn_gp, key=lambda g: g["goodput_rps"])
            ratio = mine_gp / top["goodput_rps"]
            add(f"goodput at the SLO >= 1.3 x Dynamo's best ({top['router']})", ratio, ratio >= 1.3)
        elif mine_gp is not None and dyn_rows:  # Dynamo missed the SLO at every load
            out.append(
                {
                    "workload": wl,
                    "target": "goodput at the SLO >= 1.3 x Dynamo's best (Dynamo misses "
                    "the SLO at every load measured)",
                    "value": round(mine_gp, 3),
                    "pass": mine_gp > 0,
                }
            )
    return out


def goodput_markdown(goodput: Sequence[Mapping[str, Any]]) -> list[str]:
    if not goodput:
        return []
    lines = [
        "Goodput (highest offered load whose TTFT p90 stays within the SLO, interpolated "
        "between the sweep's loads; ≥ where even the heaviest load stayed within it):",
        "",
        "| workload | router | SLO (TTFT p90) ms | loads | goodput req/s |",
        "|---|---|---|---|---|",
    ]
    for g in goodput:
        gp = g.get("goodput_rps")
        cell = "–" if gp is None else ("≥ " if g.get("saturated") else "") + fmt(float(gp), 2)
        lines.append(
            f"| {g['workload']} | {g['router']} | {fmt(g['slo_ms'], 0)} | {g['loads']} | {cell} |"
        )
    return [*lines, ""]


def slices(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    """What each workload's rows replayed (a day's runs accumulate, so the last
    command's setup need not be every row's)."""
    seen: dict[str, Mapping[str, Any]] = {}
    for r in runs:
        if float(r.get("load_factor", 1.0)) == 1.0:
            seen.setdefault(str(r["workload"]), r)
    if not seen:
        return []
    out = ["Rows per workload (same slice, same fleet, each router on a cold fleet):", ""]
    for wl, r in seen.items():
        out.append(
            f"- {wl}: {r.get('requests')} requests at {fmt(r.get('offered_rps'), 2)} req/s "
            f"offered, {r.get('engines')} engines of `{r.get('profile')}`"
        )
    return [*out, ""]


def render_markdown(doc: Mapping[str, Any], json_path: str, plots: Sequence[str]) -> str:
    setup = doc.get("setup", {})
    lines = [
        SECTION,
        "",
        f"`{doc.get('command', 'kvplane bench routing')}` on {doc.get('date', '?')} "
        f"(raw: `{json_path}`).",
        "",
        "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()) + ".",
        "",
        *slices(doc["runs"]),
        table(doc["runs"]),
    ]
    lines += goodput_markdown(doc.get("goodput") or [])
    targets = doc.get("targets") or []
    if targets:
        lines += ["Targets:", "", "| workload | target | value | result |", "|---|---|---|---|"]
        for t in targets:
            res = "PASS" if t["pass"] else "**FAIL**"
            lines.append(f"| {t['workload']} | {t['target']} | {t['value']} | {res} |")
        lines.append("")
    if plots:
        lines += ["Plots: " + ", ".join(f"[{Path(p).name}]({p})" for p in plots), ""]
    earlier = [c for c in doc.get("earlier_commands", []) if c and c != doc.get("command")]
    if earlier:
        lines += [
            "Earlier runs of the day (their rows stay unless a later run redid them or "
            "replayed another slice of their workload): "
            + "; ".join(f"`{c}`" for c in dict.fromkeys(earlier)),
            "",
        ]
    for note in doc.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip("\n") + "\n"


CDF_POINTS = 51  # TTFT quantiles kept per row: every 2%, enough to redraw a CDF


def ttft_quantiles_ms(ttfts_s: Sequence[float]) -> list[float]:
    """A row's TTFT distribution in a few numbers (ms, 0th to 100th percentile), so that a
    plot can redraw the CDF of rows that earlier runs of the day left in the file."""
    if not ttfts_s:
        return []
    s = sorted(x * 1000 for x in ttfts_s)
    n = len(s) - 1
    return [round(s[round(i * n / (CDF_POINTS - 1))], 3) for i in range(CDF_POINTS)]


def plot(doc: Mapping[str, Any], workloads: Sequence[str], stem: Path) -> list[Path]:
    """PNGs of ``workloads`` (those this run measured): TTFT CDF per router; hit ratio
    against the ceiling; TTFT vs load. None without matplotlib (``kvplane[plots]``)."""
    try:
        import matplotlib
    except ImportError:
        print("bench: no plots (matplotlib is not installed: pip install 'kvplane[plots]')")
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: list[Path] = []
    runs = doc["runs"]
    # 1 + 2. per workload measured in this invocation: TTFT CDF (of every row of the
    # workload, earlier runs' included, from the quantiles each row keeps), hit ratio vs
    # the ceiling
    for wl in workloads:
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
        for row in runs:
            q = row.get("ttft_quantiles_ms")
            if row["workload"] == wl and row.get("load_factor", 1.0) == 1.0 and q:
                ax.plot(q, [i / (len(q) - 1) for i in range(len(q))], label=row["router"])
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF: {wl}")
        ax.set_xlabel("TTFT (ms, simulated H100)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        rs = [r for r in runs if r["workload"] == wl and r.get("load_factor", 1.0) == 1.0]
        bx.barh([r["router"] for r in rs], [r["hit_ratio"] or 0.0 for r in rs])
        if rs and rs[0].get("oracle_hit_ratio") is not None:
            bx.axvline(rs[0]["oracle_hit_ratio"], color="k", linestyle="--", label="oracle")
            bx.legend(fontsize=7)
        bx.set_title(f"cache hit ratio vs ceiling: {wl}")
        bx.set_xlim(0, 1)
        bx.tick_params(axis="y", labelsize=7)
        fig.tight_layout()
        p = stem.with_name(f"{stem.name}-{wl}.png")
        fig.savefig(p, dpi=90)
        plt.close(fig)
        out.append(p)
    # 3. TTFT p90 against offered load (runs of the load sweep)
    sweep = [r for r in runs if r.get("sweep") and r["workload"] in workloads]
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for router in dict.fromkeys(r["router"] for r in sweep):
            pts = sorted(
                (r["offered_rps"], r["ttft_p90_ms"])
                for r in sweep
                if r["router"] == router and r["ttft_p90_ms"] is not None
            )
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=router)
        slo = next((r.get("slo_ms") for r in sweep if r.get("slo_ms")), None)
        if slo:
            ax.axhline(slo, color="k", linestyle="--", label="SLO (10 x floor p90)")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (req/s, simulated)")
        ax.set_ylabel("TTFT p90 (ms)")
        ax.set_title(f"TTFT p90 vs offered load: {sweep[0]['workload']}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = stem.with_name(f"{stem.name}-{sweep[0]['workload']}-ttft-vs-load.png")
        fig.savefig(p, dpi=90)
        plt.close(fig)
        out.append(p)
    return out
