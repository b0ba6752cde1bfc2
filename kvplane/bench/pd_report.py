"""P/D benchmark output: decision mix, targets, the side-by-side table, the RESULTS.md section.

Pure functions over run rows (plain dicts: ``RunRecord.to_json`` plus the P/D keys
written by :mod:`kvplane.bench.pd`), so a saved JSON file re-renders without a rerun.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from kvplane.bench.routing_report import fmt

SECTION = "## Prefill/decode disaggregation"
MODES = ("aggregated", "disaggregated", "conditional", "conditional-flex", "vllm-router-pd")
CONDITIONAL_MODES = ("conditional", "conditional-flex")
MODES_LEGEND = (
    "Modes: `aggregated`: every engine `both`, the cost policy; `disaggregated`: P prefill "
    "+ D decode engines, every prompt handed off; `conditional`: the same P/D fleet, a "
    "per-request choice between a handoff and prefilling on the decode pod; "
    "`conditional-flex`: every engine `both` over NIXL (kv_both), each request prefilled "
    "where it decodes or on another pod, by cost; `vllm-router-pd`: vllm-router's P/D mode "
    "on the P/D fleet."
)
PREFILL_HEAVY = "prefill-heavy"
# A run whose simulated engines resynced their timeline more often than this (a step
# that started over 100 ms of wall time late, because the shared machine was busy)
# measured the machine as much as the fleet: its targets are marked untrusted.
MAX_RESYNCS = 20
TTFT_SLACK = 1.05  # conditional TTFT p90 <= 1.05 x the better of aggregated, disaggregated
ITL_RATIO = 0.7  # conditional ITL p99 <= 0.7 x aggregated under prefill-heavy load
DECISIONS_FAMILY = "kvplane_router_pd_decisions"


def decision_counts(metrics_text: str) -> dict[str, float]:
    """``kvplane_router_pd_decisions_total`` by reason, from a router's /metrics text."""
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != DECISIONS_FAMILY:
            continue
        for s in fam.samples:
            if s.name.endswith("_total"):
                reason = s.labels.get("reason", "")
                out[reason] = out.get(reason, 0.0) + float(s.value)
    return out


def decision_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, int]:
    """Decisions taken between two scrapes (reasons with none left out)."""
    out = {k: round(v - before.get(k, 0.0)) for k, v in after.items()}
    return {k: v for k, v in sorted(out.items()) if v > 0}


def disaggregated_share(decisions: Mapping[str, int]) -> float | None:
    total = sum(decisions.values())
    return decisions.get("disaggregated", 0) / total if total else None


def histogram(metrics_text: str, family: str) -> dict[float, float]:
    """A histogram's cumulative bucket counts by upper bound (``le``), summed over series."""
    out: dict[float, float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != family:
            continue
        for s in fam.samples:
            if s.name.endswith("_bucket"):
                le = float(s.labels["le"])
                out[le] = out.get(le, 0.0) + float(s.value)
    return dict(sorted(out.items()))


def merge_delta(
    before: Sequence[Mapping[float, float]], after: Sequence[Mapping[float, float]]
) -> dict[float, float]:
    """Cumulative buckets observed between two scrapes, summed over engines."""
    out: dict[float, float] = {}
    for b0, b1 in zip(before, after, strict=True):
        for le, n in b1.items():
            out[le] = out.get(le, 0.0) + n - b0.get(le, 0.0)
    return dict(sorted(out.items()))


def bucket_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """Prometheus' ``histogram_quantile``: linear within the bucket that holds rank q."""
    items = sorted(buckets.items())
    if not items or items[-1][1] <= 0:
        return None
    rank = q * items[-1][1]
    lo_le, lo_n = 0.0, 0.0
    for le, n in items:
        if n >= rank:
            if math.isinf(le):
                return lo_le
            return lo_le + (le - lo_le) * ((rank - lo_n) / (n - lo_n) if n > lo_n else 1.0)
        lo_le, lo_n = le, n
    return lo_le


def share_above(buckets: Mapping[float, float], bound: float) -> float | None:
    """Fraction of observations above ``bound`` (which must be a bucket bound)."""
    total = max(buckets.values(), default=0.0)
    if total <= 0 or bound not in buckets:
        return None
    return (total - buckets[bound]) / total


def _row(runs: Sequence[Mapping[str, Any]], workload: str, mode: str) -> Mapping[str, Any] | None:
    return next((r for r in runs if r["workload"] == workload and r["router"] == mode), None)


def _usable(r: Mapping[str, Any] | None, key: str) -> bool:
    return r is not None and r.get(key) is not None and not r.get("errors")


def check_targets(runs: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The project's P/D targets per workload, for each conditional mode run (``conditional``
    on the P/D fleet, ``conditional-flex`` on a fleet of ``both`` pods): TTFT p90 within
    5% of the better of aggregated and always-disaggregated; under prefill-heavy load,
    ITL p99 at least 30% below aggregated. A mode with errors cannot be the reference,
    and a conditional mode with errors fails."""
    out: list[dict[str, Any]] = []
    for wl in dict.fromkeys(r["workload"] for r in runs):
        agg = _row(runs, wl, "aggregated")
        dis = _row(runs, wl, "disaggregated")
        for mode in CONDITIONAL_MODES:
            cond = _row(runs, wl, mode)
            if cond is None or cond.get("ttft_p90_ms") is None:
                continue

            refs = [r for r in (agg, dis) if r is not None and _usable(r, "ttft_p90_ms")]
            if refs:
                best = min(refs, key=lambda r: float(r["ttft_p90_ms"]))
                _target(
                    out,
                    cond,
                    f"TTFT p90 <= {TTFT_SLACK:g} x best of aggregated and disaggregated "
                    f"({best['router']})",
                    float(cond["ttft_p90_ms"]) / float(best["ttft_p90_ms"]),
                    TTFT_SLACK,
                    *refs,
                )
            if wl == PREFILL_HEAVY and _usable(agg, "itl_p99_ms") and cond.get("itl_p99_ms"):
                assert agg is not None
                _target(
                    out,
                    cond,
                    f"ITL p99 <= {ITL_RATIO:g} x aggregated",
                    float(cond["itl_p99_ms"]) / float(agg["itl_p99_ms"]),
                    ITL_RATIO,
                    agg,
                )
    return out


def _target(
    out: list[dict[str, Any]],
    cond: Mapping[str, Any],
    text: str,
    ratio: float,
    limit: float,
    *refs: Mapping[str, Any],
) -> None:
    """One target of a conditional mode's run, against the reference runs ``refs``."""
    out.append(
        {
            "workload": cond["workload"],
            "mode": cond["router"],
            "target": f"{cond['router']} {text}",
            "value": round(ratio, 3),
            "pass": ratio <= limit and not cond.get("errors"),
            **_trust(cond, *refs),
        }
    )


def _trust(*runs: Mapping[str, Any]) -> dict[str, Any]:
    worst = max(int(r.get("lag_resyncs") or 0) for r in runs)
    return {"max_resyncs": worst, "trusted": worst <= MAX_RESYNCS}


def verdict(t: Mapping[str, Any]) -> str:
    """PASS / FAIL, qualified when the runs compared were disturbed by the machine."""
    word = "PASS" if t["pass"] else "FAIL"
    if t.get("trusted", True):
        return word
    return f"{word} (untrusted: up to {t['max_resyncs']} timeline resyncs per run)"


def _mix(r: Mapping[str, Any]) -> str:
    share = r.get("disaggregated_share")
    if share is None:
        return "–"
    return f"{share:.2f}"


def _percent(x: Any) -> str:
    return "–" if x is None else f"{100.0 * float(x):.1f}%"


def table(runs: Sequence[Mapping[str, Any]]) -> str:
    head = (
        "| workload | mode | P:D | TTFT p50 / p90 / p99 ms | ITL p50 / p99 ms "
        "| token gap p99 ms | token gaps > 100 ms | req/s | errors | disagg share "
        "| prefill / decode busy | resyncs |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in runs:
        rows.append(
            f"| {r['workload']} | {r['router']} | {r.get('split', '–')} | "
            f"{fmt(r['ttft_p50_ms'], 0)} / {fmt(r['ttft_p90_ms'], 0)} / "
            f"{fmt(r['ttft_p99_ms'], 0)} | {fmt(r['itl_p50_ms'], 1)} / "
            f"{fmt(r.get('itl_p99_ms'), 1)} | {fmt(r.get('token_gap_p99_ms'), 1)} | "
            f"{_percent(r.get('stalled_token_share'))} | "
            f"{fmt(r['throughput_rps'], 2)} | {r['errors']} | {_mix(r)} | "
            f"{fmt(r.get('prefill_busy'), 2)} / {fmt(r.get('decode_busy'), 2)} | "
            f"{r.get('lag_resyncs', '–')} |"
        )
    return head + "\n".join(rows) + "\n"


def decisions_lines(runs: Sequence[Mapping[str, Any]]) -> list[str]:
    out = []
    for r in runs:
        dec = r.get("decisions")
        if dec:
            mix = ", ".join(f"{k} {v}" for k, v in dec.items())
            out.append(f"- {r['workload']} / {r['router']}: {mix}")
    return out


def render_markdown(doc: Mapping[str, Any], json_path: str) -> str:
    setup = doc.get("setup", {})
    lines = [
        SECTION,
        "",
        f"`{doc.get('command', 'kvplane bench pd')}` on {doc.get('date', '?')} "
        f"(raw: `{json_path}`).",
        "",
        "Setup: " + ", ".join(f"{k} {v}" for k, v in setup.items()) + ".",
        "",
    ]
    for w in doc.get("workloads", []):
        lines.append(f"- **{w['name']}**: {w['description']}. {w['split_reason']}")
    lines += ["", MODES_LEGEND, "", table(doc["runs"])]
    targets = doc.get("targets") or []
    if targets:
        lines += ["Targets:", "", "| workload | target | value | result |", "|---|---|---|---|"]
        for t in targets:
            res = verdict(t) if t["pass"] else f"**{verdict(t)}**"
            lines.append(f"| {t['workload']} | {t['target']} | {t['value']} | {res} |")
        lines.append("")
    dec = decisions_lines(doc["runs"])
    if dec:
        lines += ["Decisions (kvplane P/D router, `kvplane_router_pd_decisions_total`):", ""]
        lines += [*dec, ""]
    for note in doc.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip("\n") + "\n"
