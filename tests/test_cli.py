"""The `kvplane` command: every subcommand has --help; bad configs fail clearly."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

KVPLANE = str(Path(sys.executable).parent / "kvplane")


@pytest.mark.parametrize(
    "args", [[], ["router"], ["indexer"], ["demo"], ["bench"], ["bench", "overhead"]]
)
def test_help(args: list[str]) -> None:
    out = subprocess.run([KVPLANE, *args, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage: kvplane" in out.stdout


def test_router_rejects_an_invalid_config(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: m, tokenizer: /t, block_size: 0}\npolicy: fastest\n")
    out = subprocess.run(
        [KVPLANE, "router", "--config", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "invalid config" in out.stderr
    assert "block_size" in out.stderr and "policy" in out.stderr
    assert "Traceback" not in out.stderr


def test_workers_need_a_shared_index(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {name: m, tokenizer: /t}\n")
    out = subprocess.run(
        [KVPLANE, "router", "--config", str(cfg), "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "redis" in out.stderr
