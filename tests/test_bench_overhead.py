"""The overhead benchmark's harness: no-op engine, prompt generator, result schema.

Functional, not timed: it checks that the pieces say what they claim, and runs a
tiny matrix end to end (one size, one vllm-router policy, a handful of requests).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplane.bench import overhead, procs
from kvplane.bench.overhead import PromptFactory, count_tokens, load_counter
from kvplane.local.ports import free_ports

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return procs.default_tokenizer_dir()


@pytest.fixture(scope="module")
def counter(tokenizer_dir: Path) -> object:
    return load_counter(tokenizer_dir)


@pytest.fixture(scope="module")
def noop(tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    port, zport = free_ports(2)
    argv = [sys.executable, "-m", "kvplane.bench.noop_backend", "--port", str(port)]
    argv += ["--kv-events-port", str(zport), "--tokenizer", str(tokenizer_dir)]
    proc = procs.spawn("noop", argv, tmp_path_factory.mktemp("noop"))
    try:
        assert procs.wait_ready(proc, port, 30, None), proc.tail()
        yield port
    finally:
        proc.stop()


def _get_json(port: int, path: str) -> object:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


def test_noop_backend_speaks_openai(noop: int) -> None:
    import openai

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{noop}/v1", api_key="-", max_retries=0, timeout=5
    )
    c = client.completions.create(model="noop", prompt="hello there", max_tokens=3)
    assert c.object == "text_completion" and c.choices[0].finish_reason == "length"
    assert c.usage is not None and c.usage.completion_tokens == 3
    chat = client.chat.completions.create(
        model="noop", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=2
    )
    assert [ch.index for ch in chat.choices] == [0, 1]
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content
    chunks = list(
        client.chat.completions.create(
            model="noop",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == " ok" * 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    streamed = list(client.completions.create(model="noop", prompt="x", max_tokens=2, stream=True))
    assert streamed[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list()] == ["noop"]


def test_noop_backend_side_endpoints(noop: int, counter: object) -> None:
    with urllib.request.urlopen(f"http://127.0.0.1:{noop}/metrics", timeout=5) as r:
        metrics = r.read().decode()
    from prometheus_client.parser import text_string_to_metric_families

    samples = {s.name: s for fam in text_string_to_metric_families(metrics) for s in fam.samples}
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
    ):
        assert samples[name].value == 0.0
        assert samples[name].labels == {"model_name": "noop", "engine": "0"}
    info = _get_json(noop, "/get_server_info")
    assert isinstance(info, dict) and info["kv_block_size"] == 16 and info["model_id"] == "noop"
    sources = _get_json(noop, "/kv_event_sources")
    assert isinstance(sources, dict) and sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
    prompt = "The quick brown fox jumps over the lazy dog."
    req = urllib.request.Request(
        f"http://127.0.0.1:{noop}/v1/completions/render",
        data=json.dumps({"model": "noop", "prompt": prompt}).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=5) as r:
        rendered = json.loads(r.read())
    assert len(rendered[0]["token_ids"]) == count_tokens(counter, prompt)


def test_prompts_have_the_requested_lengths_and_shared_prefixes(counter: object) -> None:
    f = PromptFactory(counter, seed=1)
    for target in (1024, 8192, 32768):
        for text in (f.fresh(target), f.fresh(target)):
            n = count_tokens(counter, text)
            assert abs(n - target) <= 0.03 * target, (target, n)
    fresh = [f.fresh(1024) for _ in range(20)]
    assert len(set(fresh)) == 20
    # a fresh prompt shares no real prefix with another: they differ in the first line
    assert all(a[:40] != b[:40] for a, b in itertools.pairwise(fresh))

    session = f.session(8192)
    assert session.root.startswith(session.prefix)
    shared = [f.shared(session, 8192) for _ in range(5)]
    assert len(set(shared)) == 5
    for text in shared:
        assert text.startswith(session.prefix)
        n = count_tokens(counter, text)
        assert abs(n - 8192) <= 0.03 * 8192
        # the repeated part is ~95% of the prompt, counted as tokens
        assert 0.9 <= count_tokens(counter, session.prefix) / n < 0.99


def test_markdown_section_is_replaced_and_others_kept(tmp_path: Path) -> None:
    md = tmp_path / "RESULTS.md"
    md.write_text("# Results\n\n## Other\nkeep me\n\n## Router overhead\nold\n\n## Last\nalso\n")
    overhead.update_markdown(md, "## Router overhead\n\nnew table\n")
    text = md.read_text()
    assert "keep me" in text and "also" in text and "new table" in text and "old" not in text
    assert text.index("## Other") < text.index("## Router overhead") < text.index("## Last")
    overhead.update_markdown(tmp_path / "fresh.md", "## Router overhead\n\nx\n")
    assert "## Router overhead" in (tmp_path / "fresh.md").read_text()


def _vllm_router() -> str | None:
    cmd = procs.venv_bin("vllm-router")
    return cmd if shutil.which(cmd) else None


@pytest.mark.skipif(_vllm_router() is None, reason="vllm-router (PyPI) not installed")
def test_tiny_run_writes_the_result_schema(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    args = parser.parse_args(
        [
            "--sizes=1k",
            "--routers=vllm-router-round_robin",
            "--requests=6",
            "--warmup=2",
            "--sessions=2",
            "--rps-step-s=0.3",
            "--rps-max-steps=2",
            # a step passes on no errors alone: this checks the schema and the search,
            # not the latency of a shared machine
            "--p99-bound-ms=5000",
            f"--results-dir={tmp_path}",
            f"--results-md={tmp_path / 'RESULTS.md'}",
        ]
    )
    t0 = time.monotonic()
    doc = overhead.run(args)
    assert time.monotonic() - t0 < 90

    files = list(tmp_path.glob("overhead-*.json"))
    assert len(files) == 1
    on_disk = json.loads(files[0].read_text())
    assert [(r["regime"], r["prompt_tokens"]) for r in on_disk["runs"]] == [
        ("fresh", 1024),
        ("shared", 1024),
    ]
    for r in on_disk["runs"]:
        assert r["router"] in overhead.ROUTERS
        for key in ("added_p50_ms", "added_p99_ms", "max_rps", "tokenize_p50_ms"):
            assert isinstance(r[key], int | float), (key, r[key])
        assert r["errors"] == 0 and r["pairs"] == 6 and r["tokenize_p50_ms"] > 0
        assert r["max_rps"] > 0
    assert on_disk["machine"]["nproc"] >= 1 and on_disk["command"].startswith("kvplane bench")
    assert "vllm-router-round_robin" in on_disk["commands"]
    assert {t["status"] for t in on_disk["targets"]} == {"n/a"}  # no 8K cell, no kvplane
    assert doc["runs"] == on_disk["runs"]
    assert "| vllm-router-round_robin | fresh | 1024 |" in (tmp_path / "RESULTS.md").read_text()


def test_spawned_processes_are_stopped(tmp_path: Path) -> None:
    proc = procs.spawn("sleep", [sys.executable, "-c", "import time; time.sleep(60)"], tmp_path)
    assert proc.alive()
    proc.stop(timeout=5)
    assert not proc.alive()


def test_kvplane_worker_variants_get_their_own_process_count_and_index(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    assert parser.parse_args(["--kvplane-workers=1,2"]).kvplane_workers == [1, 2]
    for bad in ("0", "2,2", "a"):
        with pytest.raises(SystemExit):
            parser.parse_args([f"--kvplane-workers={bad}"])
    specs = overhead.router_specs(
        ["kvplane", "vllm-router-round_robin"],
        [1001, 1002],
        tmp_path,
        tmp_path,
        "kvplane",
        "vllm-router",
        [1, 2, 4],
        None,
        "redis://127.0.0.1:6400",
    )
    assert [s.name for s in specs] == [
        "kvplane",
        "kvplane-w2",
        "kvplane-w4",
        "vllm-router-round_robin",
    ]
    one, two = specs[:2]
    assert "--workers" not in one.argv
    assert two.argv[two.argv.index("--workers") + 1] == "2"
    assert "backend: memory" in (tmp_path / "kvplane-router.yaml").read_text()
    # one Redis database per variant: their tentative marks do not meet
    assert "url: redis://127.0.0.1:6400/1" in (tmp_path / "kvplane-w2-router.yaml").read_text()
    assert "url: redis://127.0.0.1:6400/2" in (tmp_path / "kvplane-w4-router.yaml").read_text()
    with pytest.raises(SystemExit):
        overhead.router_specs(["kvplane"], [1], tmp_path, tmp_path, "k", "v", [2], None)


def test_targets_are_checked_per_kvplane_variant() -> None:
    def row(router: str, regime: str, p50: float, rps: float) -> dict[str, object]:
        return {
            "router": router,
            "regime": regime,
            "prompt_tokens": 8192,
            "added_p50_ms": p50,
            "added_p99_ms": 2 * p50,
            "max_rps": rps,
            "tokenize_p50_ms": 30.0,
        }

    runs = [
        row("kvplane", "fresh", 30.0, 25.0),
        row("kvplane-w2", "fresh", 31.0, 45.0),
        row("vllm-router-kv_aware", "fresh", 35.0, 39.0),
        row("kvplane", "shared", 1.5, 300.0),
        row("kvplane-w2", "shared", 3.0, 250.0),
        row("vllm-router-kv_aware", "shared", 35.0, 39.0),
    ]
    status = {t["target"]: t["status"] for t in overhead.check_targets(runs)}
    assert status["fresh 8K: max req/s >= vllm-router kv_aware"] == "FAIL"
    assert status["fresh 8K: max req/s >= vllm-router kv_aware [kvplane-w2]"] == "PASS"
    assert status["shared 8K: added p50 <= 2 ms"] == "PASS"
    assert status["shared 8K: added p50 <= 2 ms [kvplane-w2]"] == "FAIL"
    assert len(status) == 10


@pytest.mark.timeout(240)
def test_tiny_run_with_kvplane_workers_on_redis(tmp_path: Path) -> None:
    """kvplane as one process and as two worker processes on a Redis index the
    benchmark starts; both answer every request, and nothing is written."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server not installed")
    parser = argparse.ArgumentParser()
    overhead.add_arguments(parser)
    args = parser.parse_args(
        [
            "--sizes=1k",
            "--regimes=shared",
            "--routers=kvplane",
            "--kvplane-workers=1,2",
            "--requests=4",
            "--warmup=1",
            "--sessions=1",
            "--rps-step-s=0.3",
            "--rps-max-steps=1",
            f"--results-dir={tmp_path}",
            f"--results-md={tmp_path / 'RESULTS.md'}",
            "--no-write",
        ]
    )
    doc = overhead.run(args)
    assert [r["router"] for r in doc["runs"]] == ["kvplane", "kvplane-w2"]
    for r in doc["runs"]:
        assert r["errors"] == 0 and r["pairs"] == 4 and r["max_rps"] is not None
    assert "--workers 2" in doc["commands"]["kvplane-w2"]
    assert "backend: redis" in doc["kvplane_configs"]["kvplane-w2"]
    assert doc["redis"].split()[0].endswith("redis-server")
    assert "`kvplane-w2`: 2 uvicorn worker processes, Redis index" in overhead.render_markdown(
        {**doc, "date": "d", "command": "c", "machine": _machine()}
    )
    assert list(tmp_path.iterdir()) == []


def _machine() -> dict[str, object]:
    return {"nproc": 2, "cpu_model": "x", "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}
