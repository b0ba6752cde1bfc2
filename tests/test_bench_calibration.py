"""The GPU calibration script (run for real, on the CPU, with a tiny decoder) and the
comparison of its figures with the simulator's timing model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvplane.bench
from kvplane.bench.calibration import fit_prefill, points
from kvplane.local.tiny_model import ensure_vllm_venv, vllm_python
from kvplane.sim.profiles import LLAMA_8B_H100
from kvplane.sim.timing import load_ms, step_ms

SCRIPT = Path(kvplane.bench.__file__).parent / "calibrate_gpu.py"  # needs torch: run, not imported


def test_fit_recovers_the_rate_and_the_attention_coefficient() -> None:
    rate, coeff = 37_000.0, 0.9e-6
    forwards = {str(n): n * 1000.0 / rate + coeff * n * n / 2 for n in (256, 1024, 4096, 8192)}
    fit = fit_prefill(
        {"forward_ms": forwards, "prompt_ms": {"32768": 32768 / 37.0 + coeff * 2**29}}
    )
    assert fit is not None
    assert fit.points == 4  # 256 is below the floor's reach and left out
    assert fit.tokens_per_s == pytest.approx(rate, rel=1e-6)
    assert fit.attn_coeff == pytest.approx(coeff, rel=1e-6)
    assert fit_prefill({"forward_ms": {"1": 5.0, "2048": 60.0}}) is None


def test_every_measured_quantity_meets_the_models_prediction_of_the_same_work() -> None:
    figures = {
        "forward_ms": {"1": 8.0, "8192": 250.0},
        "chunk_tokens": 8192,
        "chunk_ms": {"32768": 700.0},
        "decode_context": 256,
        "decode_ms": {"100": 10.0},
        "kv_bytes_per_token": LLAMA_8B_H100.kv_bytes_per_token,
        "h2d_gbps": {"512": 50.0},
    }
    got = {p.what: p for p in points(figures, LLAMA_8B_H100)}
    assert got["forward of 8,192 prompt tokens"].model == step_ms(LLAMA_8B_H100, [(8192, 0)], [])
    assert got["chunk of 8,192 after 32,768 cached"].model == step_ms(
        LLAMA_8B_H100, [(8192, 32768)], []
    )
    assert got["decode step, 100 x 257 context"].model == step_ms(LLAMA_8B_H100, [], [257] * 100)
    load = got["load of 512 tokens from pinned host memory"]
    assert load.model == load_ms(LLAMA_8B_H100, 512)
    assert load.measured == pytest.approx(512 * LLAMA_8B_H100.kv_bytes_per_token / 50e9 * 1000)
    assert got["forward of 1 prompt tokens"].ratio == pytest.approx(5.5 / 8.0, rel=1e-3)


@pytest.mark.vllm
def test_the_script_runs_with_torch_alone_and_its_figures_feed_the_comparison(
    tmp_path: Path,
) -> None:
    ensure_vllm_venv()  # the one venv here with torch; the script imports nothing else
    out = tmp_path / "figures.json"
    subprocess.run(
        [str(vllm_python()), "-I", str(SCRIPT), "--tiny", "--device", "cpu", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    figures = json.loads(out.read_text())
    assert figures["shape"]["layers"] == 2  # the tiny decoder
    for key in ("forward_ms", "prompt_ms", "chunk_ms", "decode_ms"):
        assert figures[key] and all(v > 0 for v in figures[key].values()), key
    report = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvplane.cli",
            "bench",
            "calibration",
            str(out),
            "--profile",
            "cpu-tiny",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "| forward of 64 prompt tokens |" in report
    assert "| chunk of 32 after 64 cached |" in report
