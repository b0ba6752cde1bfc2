"""``kvplane bench tokenize``: what the router's tokenizer costs on a workload's prompts.

The router encodes every prompt before it can route it, so the encode sits on the
request's path and competes with the engines for CPU. Each prompt of the workload is
encoded twice, interleaved so that both see the machine in the same state: once with
the prefix reuse cache off (a plain encode) and once with it on (``PromptTokenizer``
as the router runs it: the cached prefix's ids are taken, the rest is encoded, and
the whole prompt is recorded for later prompts). For the longest prompts and a few
length quantiles, the reuse cache's bookkeeping (recording a prompt's cuts) is timed
apart from the encode: it must stay a small, constant share of the encode at every
length. Prompts are the same texts the routing benchmark sends (``PromptBuilder``).
"""

from __future__ import annotations

import argparse
import json
import time
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvplane.bench.procs import (
    bench_relative,
    default_tokenizer_dir,
    machine_info,
    results_dir,
    update_markdown,
    versions,
)
from kvplane.router.token_reuse import PrefixTokenCache, chunk_hashes
from kvplane.router.tokens import PromptTokenizer
from kvplane.workload.results import percentile
from kvplane.workload.traces import PromptBuilder, build_workload

HEADING = "## Router tokenization (`kvplane bench tokenize`)"


@dataclass(frozen=True, slots=True)
class Pass:
    """One way of encoding every prompt: seconds in all and per prompt."""

    total_s: float
    p50_ms: float
    p99_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Pass:
        ms = [s * 1000.0 for s in seconds]
        return cls(sum(seconds), percentile(ms, 50), percentile(ms, 99), max(ms))


@dataclass(frozen=True, slots=True)
class Recording:
    """One prompt's encode against recording its cuts in the reuse cache."""

    tokens: int
    encode_ms: float
    record_ms: float

    @property
    def share(self) -> float:
        return self.record_ms / self.encode_ms if self.encode_ms else 0.0


def _timed(fn: Any, *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def record_costs(tok: PromptTokenizer, texts: Sequence[str], picks: int) -> list[Recording]:
    """Encode and cut-recording times of the longest prompts and of length quantiles."""
    by_len = sorted(texts, key=len)
    n = len(by_len)
    chosen = {by_len[int(q * (n - 1))] for q in (0.5, 0.9, 0.99)} | set(by_len[-picks:])
    out: list[Recording] = []
    rust = tok.hf.backend_tokenizer
    for text in sorted(chosen, key=len):
        encode_s, encs = _timed(rust.encode_batch, [text], False)
        enc = encs[0]
        cache = PrefixTokenCache(1 << 40, 64)
        hashes = chunk_hashes(text)
        record_s, _ = _timed(cache.add, hashes, enc, array("I", enc.ids), len(text))
        out.append(Recording(len(enc.ids), encode_s * 1000.0, record_s * 1000.0))
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    tokenizer = Path(args.tokenizer) if args.tokenizer else default_tokenizer_dir()
    builder = PromptBuilder(tokenizer)
    wl = build_workload(
        args.workload, trace=None, limit=args.limit, start=0, rate_scale=1.0, seed=args.seed
    )
    texts = [builder.text(r) for r in wl.requests]
    plain = PromptTokenizer(tokenizer, reuse_max_tokens=0)
    reuse = PromptTokenizer(tokenizer)
    off: list[float] = []
    on: list[float] = []
    tokens = 0
    for text in texts:
        s_off, ids = _timed(plain.encode, text, True)
        s_on, ids_on = _timed(reuse.encode, text, True)
        if ids_on != ids:
            raise SystemExit("bench tokenize: the reuse cache changed a prompt's ids")
        off.append(s_off)
        on.append(s_on)
        tokens += len(ids)
    hits, misses = reuse.reuse_stats
    recordings = record_costs(plain, texts, args.longest)
    return {
        "workload": args.workload,
        "prompts": len(texts),
        "tokens": tokens,
        "reuse_hits": hits,
        "reuse_misses": misses,
        "off": asdict(Pass.of(off)),
        "on": asdict(Pass.of(on)),
        "recordings": [asdict(r) | {"share": round(r.share, 4)} for r in recordings],
    }


def markdown(record: dict[str, Any], json_link: str) -> str:
    r = record["result"]
    off, on = r["off"], r["on"]
    lines = [
        HEADING,
        "",
        f"`{record['command']}` ({record['date']}, {record['machine']['nproc']} cores, load "
        f"average {record['machine']['loadavg_start'][0]:.2f} at start; figures: `{json_link}`). "
        f"{r['prompts']:,} {r['workload']} prompts, {r['tokens']:,} tokens; each encoded "
        "with the reuse cache off and on, interleaved. Reuse lookups found a cached prefix "
        f"for {r['reuse_hits']:,} of {r['reuse_hits'] + r['reuse_misses']:,} prompts.",
        "",
        "| reuse cache | total s | tokens/s | per prompt p50 / p99 / max ms |",
        "|---|---|---|---|",
    ]
    for name, p in (("off", off), ("on", on)):
        rate = r["tokens"] / p["total_s"] if p["total_s"] else 0.0
        lines.append(
            f"| {name} | {p['total_s']:.2f} | {rate:,.0f} | "
            f"{p['p50_ms']:.1f} / {p['p99_ms']:.1f} / {p['max_ms']:.1f} |"
        )
    lines += [
        "",
        "Recording a prompt's cuts in the reuse cache, beside its encode:",
        "",
        "| prompt tokens | encode ms | record ms | record / encode |",
        "|---|---|---|---|",
    ]
    for rec in r["recordings"]:
        lines.append(
            f"| {rec['tokens']:,} | {rec['encode_ms']:.1f} | {rec['record_ms']:.1f} | "
            f"{rec['share']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="mooncake")
    p.add_argument("--limit", type=int, default=1000, help="prompts (the first of the trace)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default=None, help="default: the benchmarks' DeepSeek tokenizer")
    p.add_argument(
        "--longest", type=int, default=3, help="longest prompts whose recording is timed"
    )
    p.add_argument("--out-dir", default=None, help="default: bench/results of the checkout")
    p.add_argument("--no-write", action="store_true")


def run(args: argparse.Namespace) -> int:
    started = datetime.now(UTC)
    machine = machine_info()
    result = measure(args)
    command = "kvplane bench tokenize " + " ".join(
        f"--{k.replace('_', '-')} {v}"
        for k, v in (("workload", args.workload), ("limit", args.limit))
    )
    record = {
        "command": command,
        "date": f"{started:%Y-%m-%d}",
        "machine": machine,
        "versions": versions(),
        "result": result,
    }
    if args.no_write:
        print(markdown(record, "not written"))
        return 0
    folder, md = results_dir(args.out_dir)
    path = folder / f"tokenize-{args.workload}-{started:%Y-%m-%d}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    text = markdown(record, bench_relative(path))
    update_markdown(md, text, HEADING)
    print(text)
    return 0
