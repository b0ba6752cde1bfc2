"""NVIDIA Dynamo as a peer of `kvplane bench routing`, for real: Dynamo 1.6.1 from PyPI
(scripts/setup-dynamo.sh, cached), its selection service over kvplane's simulated
engines, and its own mocker engines behind its real frontend.

Figures are not checked (a loaded 2-core machine says nothing about speed): Dynamo must
index the engines' KV events, book and free its load, and every run must complete with
the documented rows."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from kvplane.bench import routing
from kvplane.bench.peers.dynamo import ensure_dynamo
from kvplane.bench.peers.dynamo_proxy import Tokenizer, write_token_table
from kvplane.bench.procs import HOST, default_tokenizer_dir, spawn, venv_bin
from kvplane.bench.routers import EngineEndpoint, ModelFacts, start_router
from kvplane.workload.traces import PromptBuilder, TraceRequest

pytestmark = pytest.mark.timeout(900)

MODEL = "sim-llama-3.1-8b"


@pytest.fixture(scope="module", autouse=True)
def dynamo_installed() -> None:
    ensure_dynamo()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def _until(cond: Any, what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_dynamo_selects_on_the_engines_kv_events_and_books_its_load(tmp_path: Path) -> None:
    """Dynamo's selection service indexes the simulated engines' vLLM events: a prompt
    sent twice goes to the engine holding it, which reports it cached; the proxy's tokens
    are the engines'; every engine is registered with its real budget and KV capacity;
    reservations are freed when responses end."""
    tok_dir = default_tokenizer_dir()
    describe = tmp_path / "fleet.json"
    argv = [venv_bin("kvplane"), "sim", "--tokenizer", str(tok_dir)]
    argv += ["--engines", "2", "--model", MODEL, "--block-size", "64", "--describe", str(describe)]
    fleet = spawn("sim", argv, tmp_path)
    try:
        rows = _until(lambda: describe.exists() and json.loads(describe.read_text()), "fleet")
        engines = [EngineEndpoint(e["name"], e["url"], e["kv_events"], e["replay"]) for e in rows]
        info = _until(
            lambda: urllib.request.urlopen(engines[0].url + "/metrics", timeout=5).read(),
            "engine metrics",
        )
        facts = ModelFacts(MODEL, tok_dir, 64, 131072, 131072, 30000.0, 5.0, kv_blocks=6720)
        assert b'num_gpu_blocks="6720"' in info  # what the peer registers is the engine's
        peer = start_router("dynamo", facts, engines, tmp_path, time_scale=1.0)
        try:
            _until(lambda: _ready(peer.port), "the proxy")
            builder = PromptBuilder(tok_dir)
            req = TraceRequest(0.0, "s", 1500, 8, (7, 8, 9), 512)
            text = builder.text(req)
            assert Tokenizer(tok_dir).encode_sync(text) == builder.token_ids(req)
            client = OpenAI(base_url=f"http://{HOST}:{peer.port}/v1", api_key="none")
            pods, cached = [], []
            for _ in range(2):
                raw = client.completions.with_raw_response.create(
                    model=MODEL, prompt=text, max_tokens=8, temperature=0.0
                )
                pods.append(raw.headers["x-bench-backend"])
                assert float(raw.headers["x-bench-overhead-ms"]) > 0
                usage = raw.parse().usage
                assert usage is not None and usage.prompt_tokens == 1500
                details = usage.prompt_tokens_details
                cached.append(details.cached_tokens if details else None)
                time.sleep(0.5)  # let the engine's BlockStored events reach Dynamo
            assert pods[0] == pods[1] and cached == [0, 1472]
            selector = peer.procs[0]
            base = next(a for a in selector.argv if a.isdigit())
            workers = _get(f"http://{HOST}:{base}/workers")
            records = workers if isinstance(workers, list) else workers.get("workers", [])
            assert {(w["max_num_batched_tokens"], w["total_kv_blocks"]) for w in records} == {
                (8192, 6720)
            }

            def idle() -> bool:
                loads = _get(f"http://{HOST}:{base}/loads")
                return all(
                    w["active_requests"] == 0 and w["potential_prefill_tokens"] == 0
                    for m in loads
                    for w in m["loads"]
                )

            _until(idle, "Dynamo's reservations to be freed")
        finally:
            peer.stop()
    finally:
        fleet.stop()


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/health", timeout=5) as r:
            return int(r.status) == 200
    except OSError:
        return False


def _doc(out: Path) -> dict[str, Any]:
    (path,) = sorted(out.glob("routing-*.json"))
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


def test_bench_routing_runs_dynamo_defaults_and_a_setting_with_floor_and_goodput(
    tmp_path: Path,
) -> None:
    argv = ["--workloads", "gsp", "--routers", "kvplane,dynamo,dynamo-predict5", "--quick"]
    argv += ["--limit", "16", "--time-scale", "1", "--out-dir", str(tmp_path), "--no-progress"]
    argv += ["--rate-scale", "0.5", "--sweep", "3", "--sweep-routers", "kvplane,@best-dynamo"]
    argv += ["--tag", "dynamo-test"]
    assert routing.main(argv) == 0
    doc = _doc(tmp_path)
    rows = doc["runs"]
    base = [r for r in rows if r["load_factor"] == 1.0]
    assert [r["router"] for r in base] == ["kvplane", "dynamo", "dynamo-predict5"]
    swept = [r["router"] for r in rows if r["load_factor"] == 3.0]
    assert swept[0] == "kvplane" and swept[1] in ("dynamo", "dynamo-predict5")
    for r in rows:
        assert r["errors"] == 0 and r["requests"] == 16
        assert r["floor_p50_ms"] <= r["floor_p90_ms"] <= r["floor_p99_ms"]
        assert r["slo_ms"] == pytest.approx(10 * r["floor_p90_ms"], rel=1e-3)
        assert r["prefill_tokens_computed"] > 0
    assert base[2]["dynamo settings"] == "DYN_ROUTER_PREDICTED_TTL_SECS=5"
    assert {g["router"] for g in doc["goodput"]} >= {"kvplane"}
    assert any("Dynamo" in t["target"] for t in doc["targets"])
    assert "## Routing quality: dynamo-test" in (tmp_path / "RESULTS.md").read_text()


def test_dynamo_frontend_and_kvplane_over_dynamos_mockers(tmp_path: Path) -> None:
    """The mocker fleet: kvplane routes through Dynamo's direct-mode frontend (a header
    names the mocker) and reads the mockers' ZMQ events; Dynamo's real KV frontend routes
    over the same mockers, and names the worker it chose; the floor comes from the
    mocker's own measured timing."""
    argv = ["--fleet", "dynamo-mocker", "--workloads", "multi-round-qa", "--quick"]
    argv += ["--shape", "multi-round-qa:users=4,rounds=4", "--limit", "16"]
    argv += ["--routers", "kvplane,dynamo-frontend", "--time-scale", "1", "--no-progress"]
    argv += ["--rate-scale", "0.5", "--out-dir", str(tmp_path)]
    assert routing.main(argv) == 0
    doc = _doc(tmp_path)
    grid = doc["mocker_floor_grid"]
    assert len(grid["ms"]) == len(grid["new"]) and all(
        len(r) == len(grid["cached"]) for r in grid["ms"]
    )
    assert grid["ms"][-1][0] > grid["ms"][0][0] > 0  # longer prompts take longer
    for r in doc["runs"]:
        assert r["errors"] == 0 and r["fleet"] == "dynamo-mocker"
        assert r["hit_ratio"] is not None and r["imbalance"] is not None
        assert r["floor_p90_ms"] > 0
    kv = next(r for r in doc["runs"] if r["router"] == "kvplane")
    assert kv["frontend_cpu_s"] > 0  # the direct frontend's share of kvplane's path
    assert kv["oracle_hit_ratio"] > 0.5
    assert kv["hit_ratio"] > 0.5  # kvplane's index learned from the mockers' events


async def test_the_proxy_looks_up_the_runs_prompts_and_tokenizes_others(tmp_path: Path) -> None:
    """The token table holds the engines' ids of the prompts the run sends (as the
    engines' tokenizer makes them); a prompt not in it is tokenized."""
    tok_dir = default_tokenizer_dir()
    builder = PromptBuilder(tok_dir)
    reqs = [TraceRequest(0.0, "s", 700, 1, (i, i + 1), 512) for i in (1, 5)]
    table = write_token_table(
        tmp_path / "t.bin", ((builder.text(r), builder.token_ids(r)) for r in reqs)
    )
    tok = Tokenizer(tok_dir, table)
    for r in reqs:
        assert await tok.encode(builder.text(r)) == builder.token_ids(r)
    other = TraceRequest(0.0, "s", 300, 1, (9,), 512)
    assert await tok.encode(builder.text(other)) == builder.token_ids(other)
