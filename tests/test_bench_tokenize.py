"""``kvplane bench tokenize`` on a small slice: the figures it prints and records."""

from __future__ import annotations

import json
from pathlib import Path

from kvplane.cli import main


def test_tokenize_bench_records_both_passes_and_the_cut_recording(tmp_path: Path) -> None:
    out = tmp_path / "results"
    argv = ["bench", "tokenize", "--workload", "mooncake", "--limit", "12", "--longest", "2"]
    assert main([*argv, "--out-dir", str(out)]) == 0
    [path] = out.glob("tokenize-mooncake-*.json")
    result = json.loads(path.read_text())["result"]
    assert result["prompts"] == 12 and result["tokens"] > 12 * 1000
    for name in ("off", "on"):
        p = result[name]
        assert 0 < p["p50_ms"] <= p["p99_ms"] <= p["max_ms"] <= 1000 * p["total_s"], name
    assert result["reuse_hits"] + result["reuse_misses"] == 12
    recordings = result["recordings"]
    assert len(recordings) >= 2
    assert all(r["encode_ms"] > 0 and r["record_ms"] > 0 for r in recordings)
    assert recordings == sorted(recordings, key=lambda r: r["tokens"])
    section = (out / "RESULTS.md").read_text()
    assert "## Router tokenization (`kvplane bench tokenize`)" in section
    assert "| on |" in section and "record / encode" in section
