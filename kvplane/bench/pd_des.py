"""``kvplane bench pd --mode des``: the P/D modes in virtual time (:mod:`kvplane.sim.des_pd`).

The HTTP benchmark replays through the live router and a simulated fleet on this
machine's two cores; its figures move from run to run with the machine's load by
about the size of the TTFT target itself, and it cannot simulate large fleets. This
mode runs kvplane's own P/D choice against the same engine model in virtual time: the
same arguments give the same figures, fleets of any size, several P:D splits and
workload seeds per fleet, and pods placed on nodes (``--gpus-per-node``) with NVLink
inside a node and NICs between nodes.

Rows accumulate in ``bench/results/pd-des-<date>.json``: a run replaces the rows of
the same fleet, workload slice, split, seed and mode, so one file holds a sweep made
in several invocations. Targets are checked per (fleet, workload, seed, split): each
conditional mode against the aggregated and disaggregated rows of the same group.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any

from kvplane.bench import pd_report
from kvplane.bench.pd_setup import (
    FLEX,
    FLEX_AGGREGATE_MAX,
    KVPLANE_MODES,
    PREFILL_HEAVY,
    build,
    limit_for,
    rate_for,
    roles_for,
    split_for,
    trace_path,
)
from kvplane.bench.procs import (
    bench_relative,
    csv_list,
    machine_info,
    parse_settings,
    results_dir,
    update_markdown,
    versions,
)
from kvplane.bench.routing_report import fmt
from kvplane.router.config import LinkClass, LinkCost, PDSpec
from kvplane.sim.des_pd import Topology, run_des_pd
from kvplane.sim.profiles import PROFILES
from kvplane.workload.results import oracle_hit_ratio

SECTION = "## Prefill/decode disaggregation in virtual time (DES)"
SEEDED = (PREFILL_HEAVY, "gsp")  # workloads a seed draws anew
# What makes two rows the same measurement (a rerun replaces, never mixes).
ROW_KEY = (
    "workload",
    "router",
    "engines",
    "gpus_per_node",
    "link_gbps",
    "nvlink_gbps",
    "split",
    "seed",
    "requests",
    "offered_rps",
    "placement_blind",
)
GROUP_KEY = (
    "engines",
    "gpus_per_node",
    "link_gbps",
    "nvlink_gbps",
    "placement_blind",
    "workload",
    "seed",
    "requests",
    "offered_rps",
)


def links_for(
    link_gbps: float, nvlink_gbps: float, gpus_per_node: int
) -> dict[LinkClass, LinkCost]:
    """The physical links, which the router is also told (an operator renders them)."""
    links = {LinkClass.SAME_ZONE: LinkCost(bandwidth_gbps=link_gbps, latency_ms=0.0)}
    if gpus_per_node > 0:
        links[LinkClass.SAME_NODE] = LinkCost(bandwidth_gbps=nvlink_gbps, latency_ms=0.0)
    return links


def pd_spec(
    mode: str, links: dict[LinkClass, LinkCost], settings: Mapping[str, Any]
) -> PDSpec | None:
    """The router's ``pd`` section per mode, as the HTTP benchmark renders it."""
    if mode == "aggregated":
        return None
    base: dict[str, Any] = {"connector": "nixl", "links": links}
    if mode == "disaggregated":
        base["aggregate_max_uncached_tokens"] = 0
    elif mode == FLEX:
        base["aggregate_max_uncached_tokens"] = FLEX_AGGREGATE_MAX
    return PDSpec.model_validate({**base, **settings})


def fleet_label(row: Mapping[str, Any]) -> str:
    n, gpn = int(row["engines"]), int(row.get("gpus_per_node") or 0)
    if gpn > 0:
        nodes = -(-n // gpn)
        blind = ", router blind to placement" if row.get("placement_blind") else ""
        return (
            f"{n} GPUs, {nodes} node{'s' if nodes > 1 else ''} x {gpn} "
            f"(NVLink {row['nvlink_gbps']:g} / NIC {row['link_gbps']:g} GB/s{blind})"
        )
    return f"{n} GPUs, placement unknown ({row['link_gbps']:g} GB/s)"


def splits_for(args: argparse.Namespace, sized: int, engines: int) -> list[int]:
    """``--prefill`` values (a comma list here), else the sized split."""
    if not args.prefill:
        return [sized]
    out = [int(x) for x in csv_list(str(args.prefill))]
    bad = [p for p in out if not 1 <= p < engines]
    if bad:
        raise SystemExit(f"bench pd: --prefill {bad} must leave at least one decode engine")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every workload x seed: aggregated once, the P/D modes at every split asked for."""
    modes = [m for m in csv_list(args.modes) if m in KVPLANE_MODES]
    skipped = [m for m in csv_list(args.modes) if m not in KVPLANE_MODES]
    if skipped:
        print(f"bench pd --mode des: {', '.join(skipped)} run over HTTP only; skipped")
    profile = PROFILES[args.profile]
    links = links_for(args.pd_link_gbps, args.nvlink_gbps, args.gpus_per_node)
    topology = Topology(args.gpus_per_node, router_sees_nodes=not args.placement_blind)
    seeds = [int(s) for s in csv_list(args.seeds)]
    settings = {
        "conditional": parse_settings(args.conditional_set),
        FLEX: parse_settings(args.flex_set),
    }
    rows: list[dict[str, Any]] = []
    for wname in csv_list(args.workloads):
        # the generated workloads vary with the seed (prompts, order, arrivals); the
        # Mooncake trace is fixed
        for seed in seeds if wname in SEEDED else seeds[:1]:
            wl = build(wname, limit_for(args, wname), rate_for(args, wname), trace_path(args), seed)
            hit = oracle_hit_ratio(wl, args.block_size)
            sized = split_for(wl, profile, args.engines, hit)
            print(f"{wname} seed {seed}: {wl.description}; sized {sized.why()}", flush=True)
            for mode in modes:
                # every engine `both`: no split (0); else each P/D split asked for
                both = mode in ("aggregated", FLEX)
                for p in [0] if both else splits_for(args, sized.prefill, args.engines):
                    spec = pd_spec(mode, links, settings.get(mode, {}))
                    res = run_des_pd(
                        wl,
                        roles_for(mode, args.engines, p),
                        spec,
                        name=mode,
                        topology=topology,
                        profile=args.profile,
                        block_size=args.block_size,
                        seed=seed,
                    )
                    row = res.record.to_json()
                    row.update(
                        {
                            "split": f"{p}:{args.engines - p}" if p else f"{args.engines} both",
                            "sized_split": sized.label,
                            "seed": seed,
                            "gpus_per_node": args.gpus_per_node,
                            "placement_blind": bool(args.placement_blind),
                            "link_gbps": args.pd_link_gbps,
                            "nvlink_gbps": args.nvlink_gbps if args.gpus_per_node else None,
                            "requests": len(wl.requests),
                        }
                    )
                    rows.append(row)
                    _print_row(row)
    return _finish(args, rows)


def _print_row(r: Mapping[str, Any]) -> None:
    share = r.get("disaggregated_share")
    print(
        f"{r['workload']:>14} s{r['seed']} {r['router']:<17} {r['split']:>8}  ttft p50/p90 "
        f"{r['ttft_p50_ms'] or 0:.0f}/{r['ttft_p90_ms'] or 0:.0f} ms  itl p50/p99 "
        f"{r['itl_p50_ms'] or 0:.1f}/{r.get('itl_p99_ms') or 0:.1f} ms  gap p99 "
        f"{r.get('token_gap_p99_ms') or 0:.0f} ms  err {r['errors']}  disagg "
        f"{'-' if share is None else f'{share:.2f}'}",
        flush=True,
    )


def groups(rows: Sequence[Mapping[str, Any]]) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    out: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r.get(k) for k in GROUP_KEY), []).append(r)
    return out


def check_targets(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The project's P/D targets (``pd_report.check_targets``) per fleet, workload, seed and
    P/D split: the conditional row against the aggregated and disaggregated rows of
    the same group (conditional-flex has no split: it goes with every one)."""
    out: list[dict[str, Any]] = []
    for members in groups(rows).values():
        shared = [r for r in members if r["router"] in ("aggregated", FLEX)]
        splits = dict.fromkeys(r["split"] for r in members if r not in shared) or {"": None}
        for split in splits:
            sub = [*shared, *(r for r in members if r["split"] == split and r not in shared)]
            for t in pd_report.check_targets(sub):
                if t["mode"] == FLEX and split != next(iter(splits)):
                    continue  # one verdict per flex row
                first = sub[0]
                t["fleet"] = fleet_label(first)
                t["seed"] = first["seed"]
                t["split"] = split if t["mode"] == "conditional" else first.get("split")
                out.append(t)
    return out


def merge(old: Sequence[Mapping[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of ``old`` not measured again by ``new``, then ``new``."""
    fresh = {tuple(r.get(k) for k in ROW_KEY) for r in new}
    kept = [dict(r) for r in old if tuple(r.get(k) for k in ROW_KEY) not in fresh]
    return kept + list(new)


def ratio_to_aggregated(rows: Sequence[Mapping[str, Any]], r: Mapping[str, Any], key: str) -> str:
    agg = next(
        (
            a
            for a in groups(rows)[tuple(r.get(k) for k in GROUP_KEY)]
            if a["router"] == "aggregated"
        ),
        None,
    )
    if agg is None or not agg.get(key) or r.get(key) is None:
        return "–"
    return f"{float(r[key]) / float(agg[key]):.3f}"


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    head = (
        "| fleet | workload | seed | mode | P:D | TTFT p50 / p90 ms | × aggregated p90 "
        "| ITL p50 / p99 ms | × aggregated p99 | token gap p99 ms | disagg share |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        share = r.get("disaggregated_share")
        lines.append(
            f"| {fleet_label(r)} | {r['workload']} | {r['seed']} | {r['router']} | "
            f"{r['split']} | {fmt(r['ttft_p50_ms'], 0)} / {fmt(r['ttft_p90_ms'], 0)} | "
            f"{ratio_to_aggregated(rows, r, 'ttft_p90_ms')} | {fmt(r['itl_p50_ms'], 1)} / "
            f"{fmt(r.get('itl_p99_ms'), 1)} | {ratio_to_aggregated(rows, r, 'itl_p99_ms')} | "
            f"{fmt(r.get('token_gap_p99_ms'), 1)} | {'–' if share is None else f'{share:.2f}'} |"
        )
    return head + "\n".join(lines) + "\n"


def render_markdown(doc: Mapping[str, Any], json_path: str) -> str:
    lines = [
        SECTION,
        "",
        f"Rows of {doc['date']} from the commands below (raw: `{json_path}`); virtual time, "
        "so a rerun gives the same figures. " + pd_report.MODES_LEGEND,
        "",
        *(f"- `{c}`" for c in doc.get("commands", [])),
        "",
        table(doc["runs"]),
    ]
    targets = doc.get("targets") or []
    if targets:
        lines += [
            "Targets (per fleet, workload, seed and P:D split):",
            "",
            "| fleet | workload | seed | P:D | target | value | result |",
            "|---|---|---|---|---|---|---|",
        ]
        for t in targets:
            res = "PASS" if t["pass"] else "**FAIL**"
            lines.append(
                f"| {t['fleet']} | {t['workload']} | {t['seed']} | {t['split']} | "
                f"{t['target']} | {t['value']} | {res} |"
            )
        lines.append("")
    for note in doc.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip("\n") + "\n"


NOTES = (
    "Engines: the simulator's EngineCore (the H100 timing model of docs/simulator.md); "
    "router: kvplane's own P/D choice, index and load accounting. A handoff is vLLM's "
    "NixlConnector flow: prefill leg with max_tokens 1, blocks held, the decode engine "
    "pulls what it lacks over the pair's link (transfers into an engine queue per link), "
    "then decodes.",
    "ITL is each request's mean gap between its first and last token (vLLM bench's TPOT), "
    "p50/p99 over requests; token gap p99 is over every gap of every request.",
    "Why the figures come out as they do: bench/HISTORY.md, P/D points.",
)


def _finish(args: argparse.Namespace, rows: list[dict[str, Any]]) -> dict[str, Any]:
    date = _dt.date.today().isoformat()
    command = "kvplane bench pd " + " ".join(shlex.quote(a) for a in args.argv_echo)
    print(table(rows))
    targets = check_targets(rows)
    for t in targets:
        print(
            f"{'PASS' if t['pass'] else 'FAIL'}  {t['fleet']} {t['workload']} seed {t['seed']} "
            f"{t['split']}: {t['target']} = {t['value']}"
        )
    doc: dict[str, Any] = {"date": date, "commands": [command], "runs": rows, "targets": targets}
    if args.no_write:
        return doc
    out_dir, md = results_dir(args.out_dir)
    json_path = out_dir / f"pd-des-{date}.json"
    if json_path.exists():
        old = json.loads(json_path.read_text())
        doc["runs"] = merge(old.get("runs", []), rows)
        doc["commands"] = [*(c for c in old.get("commands", []) if c != command), command]
    doc["targets"] = check_targets(doc["runs"])
    doc["machine"] = machine_info()
    doc["versions"] = versions(("kvplane",))
    doc["notes"] = list(NOTES)
    json_path.write_text(json.dumps(doc, indent=1) + "\n")
    update_markdown(md, render_markdown(doc, bench_relative(json_path)), SECTION)
    print(f"wrote {json_path} and {md}")
    return doc
