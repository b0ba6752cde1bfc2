"""The engine simulator's HTTP/ZMQ surface against real clients: the official OpenAI
SDK, a ZMQ SUB/DEALER with kvplane's own event decoder, prometheus_client's parser,
kvplane's router, and the unmodified vllm-router and sglang-router binaries."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from kvplane.router.config import RouterConfig
from kvplane.router.engine_stats import parse_metrics
from kvplane.router.kvevents.decode import decode_batch, decode_message, parse_replay
from kvplane.router.kvevents.model import BlockStored
from prometheus_client.parser import text_string_to_metric_families
from support.router_server import (
    chat_tokenizer_dir,
    serve_router,
    wait_resident,
)

from kvplane.local.ports import free_port
from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet
from kvplane.sim.hashing import block_hashes, external_hash

BLOCK = 32
TIMEOUT = 10.0
VENV_BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fleet(tokenizer_dir: Path) -> Iterator[SimFleet]:
    cfg = FleetConfig(tokenizer=str(tokenizer_dir), engines=2, model="tiny", profile="cpu-tiny")
    with running_fleet(cfg) as f:
        yield f


def unique(words: int = 120) -> str:
    """A prompt prefix no other test shares (so hit counts are this test's own)."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"w{i % 97}" for i in range(words))


def sim_stats(url: str) -> dict[str, Any]:
    out: dict[str, Any] = httpx.get(f"{url}/sim/stats", timeout=TIMEOUT).json()
    return out


# ---- the OpenAI surface -------------------------------------------------------------------


def test_openai_sync_client_completions_and_chat(fleet: SimFleet) -> None:
    e0 = fleet.engines[0]
    client = openai.OpenAI(base_url=f"{e0.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
    prefix = unique()
    first = client.completions.create(model="tiny", prompt=prefix + " one", max_tokens=5)
    assert first.choices[0].text == " ok" * 5 and first.choices[0].finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 5
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny", prompt=prefix + " two", max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached > 0 and cached % BLOCK == 0
    assert cached <= again.usage.prompt_tokens - 1

    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prefix}], max_completion_tokens=3
    )
    assert chat.choices[0].message.content == " ok" * 3
    assert chat.usage is not None and chat.usage.completion_tokens == 3

    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=1)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4

    stream = client.completions.create(
        model="tiny",
        prompt=prefix,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " ok" * 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_openai_async_client_streams_chat_until_done(fleet: SimFleet) -> None:
    e1 = fleet.engines[1]
    client = openai.AsyncOpenAI(
        base_url=f"{e1.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT
    )
    try:
        stream = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": unique(10)}],
            max_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == " ok" * 3
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 3
        plain = await client.completions.create(model="tiny", prompt="hello", max_tokens=2, n=2)
        assert sorted(c.index for c in plain.choices) == [0, 1]
        assert plain.usage is not None and plain.usage.completion_tokens == 4
    finally:
        await client.close()


def test_raw_stream_ends_with_done_and_coalesces_by_stream_interval(
    fleet: SimFleet, tokenizer_dir: Path
) -> None:
    with httpx.stream(
        "POST",
        f"{fleet.engines[0].url}/v1/completions",
        json={"model": "tiny", "prompt": "a", "max_tokens": 3, "stream": True},
        timeout=TIMEOUT,
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        body = b"".join(r.iter_raw())
    assert body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 4

    cfg = FleetConfig(
        tokenizer=str(tokenizer_dir), engines=1, model="tiny", profile="cpu-tiny",
        stream_interval=4, kv_events=False,
    )  # fmt: skip
    with running_fleet(cfg, tokenizer=fleet.tokenizer) as small:
        with httpx.stream(
            "POST",
            f"{small.engines[0].url}/v1/completions",
            json={"model": "tiny", "prompt": "a", "max_tokens": 10, "stream": True},
            timeout=TIMEOUT,
        ) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: {")]
        texts = [json.loads(e[6:])["choices"][0]["text"] for e in events]
        # the first token at once, then every 4 tokens, the rest at the end
        assert [t.count("ok") for t in texts] == [1, 4, 4, 1]


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", b"{bad", 400, "body"),
        ("/v1/completions", b'{"model": "tiny"}', 400, "prompt"),
        ("/v1/completions", b'{"model": "nope", "prompt": "x"}', 404, "model"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", b'{"prompt": [999999999]}', 400, None),
        ("/v1/chat/completions", b'{"model": "tiny"}', 400, "body.messages"),
    ],
)
def test_bad_requests_get_vllm_shaped_errors(
    fleet: SimFleet, path: str, body: bytes, status: int, param: str | None
) -> None:
    r = httpx.post(fleet.engines[0].url + path, content=body, timeout=TIMEOUT)
    assert r.status_code == status
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["param"] == param and err["message"]


def test_prompt_over_max_model_len_is_a_400_and_max_tokens_is_cut(fleet: SimFleet) -> None:
    url = fleet.engines[0].url
    n = fleet.engines[0].max_model_len
    too_long = httpx.post(
        f"{url}/v1/completions", json={"prompt": [7] * (n + 1), "max_tokens": 1}, timeout=TIMEOUT
    )
    assert too_long.status_code == 400
    assert "maximum context length" in too_long.json()["error"]["message"]
    cut = httpx.post(
        f"{url}/v1/completions", json={"prompt": [7] * (n - 3), "max_tokens": 10}, timeout=30
    )
    assert cut.status_code == 200 and cut.json()["usage"]["completion_tokens"] == 3


def test_info_routes(fleet: SimFleet, tokenizer_dir: Path) -> None:
    e0 = fleet.engines[0]
    with httpx.Client(base_url=e0.url, timeout=TIMEOUT) as c:
        assert c.get("/health").status_code == 200
        models = c.get("/v1/models").json()
        assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 8192
        assert c.get("/version").json()["version"]
        tok = c.post("/tokenize", json={"prompt": "hello world"}).json()
        assert tok["count"] == len(tok["tokens"]) == 2
        chat = c.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == fleet.tokenizer.encode_chat(
            [{"role": "user", "content": "hi"}], _opts()
        )
        assert c.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == (
            "hello world"
        )
        sources = c.get("/kv_event_sources").json()
        assert sources["0"]["endpoint"] == e0.events_endpoint
        assert sources["0"]["replay_endpoint"] == e0.replay_endpoint
        info = c.get("/get_server_info").json()
        assert info["kv_block_size"] == BLOCK and info["model_path"] == str(tokenizer_dir)
        render = c.post("/v1/completions/render", json={"prompt": "hello world"}).json()
        assert render[0]["token_ids"] == tok["tokens"]
        assert c.get("/nope").status_code == 404


def _opts() -> Any:
    from kvplane.router.tokens import ChatOptions

    return ChatOptions()


def test_client_disconnect_aborts_the_request(fleet: SimFleet) -> None:
    e1 = fleet.engines[1]
    before = sim_stats(e1.url)["aborted"]
    with httpx.stream(
        "POST",
        f"{e1.url}/v1/completions",
        json={"prompt": unique(5), "max_tokens": 5000, "stream": True},
        timeout=TIMEOUT,
    ) as r:
        next(r.iter_lines())  # the first token arrived; now hang up
    deadline = time.monotonic() + TIMEOUT
    while sim_stats(e1.url)["aborted"] == before:
        assert time.monotonic() < deadline, "the engine never aborted the request"
        time.sleep(0.05)
    assert sim_stats(e1.url)["num_running"] == 0


# ---- KV events ----------------------------------------------------------------------------


def test_kv_events_decode_with_kvplane_and_replay(fleet: SimFleet) -> None:
    e0 = fleet.engines[0]
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    assert e0.events_endpoint and e0.replay_endpoint
    sub.connect(e0.events_endpoint)
    try:
        prompt = unique(200)
        ids = httpx.post(f"{e0.url}/tokenize", json={"prompt": prompt}).json()["tokens"]
        want = [external_hash(h) for h in block_hashes(ids, BLOCK)]
        assert len(want) >= 2
        stored: list[BlockStored] = []
        seqs: list[int] = []
        deadline = time.monotonic() + TIMEOUT
        # a slow joiner misses messages sent before the subscription is up: resend
        while sum(len(s.block_hashes) for s in stored) < len(want):
            assert time.monotonic() < deadline, "no BlockStored for the prompt"
            if not stored:
                r = httpx.post(f"{e0.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200
            while sub.poll(200):
                env, batch = decode_message(sub.recv_multipart())
                assert env.topic == b"kv@e0@tiny"
                seqs.append(env.seq)
                for ev in batch.events:
                    if isinstance(ev, BlockStored) and set(ev.block_hashes) & set(want):
                        stored.append(ev)
        got = [h for s in stored for h in s.block_hashes]
        assert got[: len(want)] == want  # vLLM's hashes, in order
        assert stored[0].parent_block_hash is None or stored[0].parent_block_hash not in want
        for prev, nxt in itertools.pairwise(stored):
            assert nxt.parent_block_hash == prev.block_hashes[-1]  # chained
        assert all(s.block_size == BLOCK and s.medium == "GPU" for s in stored)
        assert stored[0].token_ids[:BLOCK] == ids[:BLOCK]
        assert seqs == sorted(seqs)

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(e0.replay_endpoint)
        try:
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed: list[int] = []
            while True:
                pub = e0.publisher
                assert pub is not None
                assert dealer.poll(int(TIMEOUT * 1000)), (
                    f"replay stalled after {len(replayed)} batches: service running "
                    f"{pub.replay_serving}, {pub.replays_served} replays served"
                )
                env_r = parse_replay(dealer.recv_multipart())
                if env_r is None:
                    break
                decode_batch(env_r.payload)
                replayed.append(env_r.seq)
            assert replayed == list(range(replayed[0], replayed[0] + len(replayed)))
            assert replayed[0] == 0 and set(seqs) <= set(replayed)
        finally:
            dealer.close()
    finally:
        sub.close()


# ---- metrics ------------------------------------------------------------------------------

VLLM_NAMES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_success",
    "vllm:num_preemptions",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:e2e_request_latency_seconds",
)


def test_metrics_parse_with_prometheus_client(fleet: SimFleet) -> None:
    e0 = fleet.engines[0]
    prefix = unique()
    for tail in ("a", "b"):
        r = httpx.post(f"{e0.url}/v1/completions", json={"prompt": prefix + tail, "max_tokens": 3})
        assert r.status_code == 200
    text = httpx.get(f"{e0.url}/metrics", timeout=TIMEOUT).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(VLLM_NAMES) <= set(families)
    for fam in families.values():
        if fam.name == "vllm:cache_config_info":  # an info gauge: engine and config only
            continue
        for s in fam.samples:
            if s.name.endswith("_created") or "le" in s.labels:
                continue
            assert s.labels.get("model_name") == "tiny" and s.labels.get("engine") == "0"

    def value(name: str, **labels: str) -> float:
        fam = families[name]
        return sum(s.value for s in fam.samples if labels.items() <= s.labels.items())

    assert value("vllm:prefix_cache_hits") > 0
    assert value("vllm:prefix_cache_queries") >= value("vllm:prefix_cache_hits")
    assert value("vllm:request_success", finished_reason="length") >= 2
    ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples]
    assert any(s.name.endswith("_count") and s.value >= 2 for s in ttft)
    assert families["vllm:num_requests_running"].type == "gauge"
    assert families["vllm:prompt_tokens"].type == "counter"
    # the router reads the engine's KV capacity from its cache config, as from vLLM's:
    # what the simulator reports it can hold (the null block excluded)
    labels = families["vllm:cache_config_info"].samples[0].labels
    capacity = int(labels["kv_cache_size_tokens"])
    assert parse_metrics(text).kv_capacity_tokens == capacity
    assert capacity == (int(labels["num_gpu_blocks"]) - 1) * int(labels["block_size"])


# ---- routers ------------------------------------------------------------------------------


def test_kvplane_router_sends_the_follow_up_to_the_prefix_holder(
    fleet: SimFleet, tokenizer_dir: Path
) -> None:
    config = RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tokenizer_dir),
                "block_size": BLOCK,
                "max_model_len": 8192,
            },
            "backends": fleet.backends(),
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 0.2,
            "cost": {"tentative_ttl_s": 0.01},  # residency below comes from the events
        }
    )
    with serve_router(config) as router:
        prefix = unique(600)
        first = {"model": "tiny", "prompt": prefix + " First?", "max_tokens": 2}
        r1 = httpx.post(f"{router.url}/v1/completions", json=first, timeout=TIMEOUT)
        assert r1.status_code == 200, r1.text
        pod = r1.headers["x-kvplane-pod"]
        blocks = int(r1.headers["x-kvplane-prompt-tokens"]) // BLOCK
        wait_resident(router, first, pod, blocks, TIMEOUT)
        follow = {"model": "tiny", "prompt": prefix + " Second, other?", "max_tokens": 2}
        r2 = httpx.post(f"{router.url}/v1/completions", json=follow, timeout=TIMEOUT)
        assert r2.status_code == 200
        assert r2.headers["x-kvplane-pod"] == pod
        assert r2.headers["x-kvplane-reason"] == "cache_hit"
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= (blocks - 2) * BLOCK > 0


@contextlib.contextmanager
def subprocess_router(argv: list[str], port: int, log: Path) -> Iterator[str]:
    """A third-party router on ``port``, healthy and with its workers registered."""
    env = {**os.environ, "NO_COLOR": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"router exited:\n{log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"router not ready:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def send_a_handful(url: str, log: Path) -> None:
    """Completions and chats through a router; bounded retries while it registers workers."""
    prefix = unique(100)
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", {"model": "tiny", "prompt": prefix + f" q{i}", "max_tokens": 2})
        for i in range(4)
    ]
    bodies += [
        (
            "/v1/chat/completions",
            {"model": "tiny", "messages": [{"role": "user", "content": prefix}], "max_tokens": 2},
        ),
        (
            "/v1/completions",
            {"model": "tiny", "prompt": prefix, "max_tokens": 3, "stream": True},
        ),
    ]
    for path, body in bodies:
        deadline = time.monotonic() + 30
        while True:
            r = httpx.post(url + path, json=body, timeout=TIMEOUT)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)  # workers still being registered
        assert r.status_code == 200, f"{path}: {r.status_code} {r.text}\n{log.read_text()[-2000:]}"
        if body.get("stream"):
            assert r.text.rstrip().endswith("data: [DONE]")
        else:
            assert r.json()["usage"]["completion_tokens"] == body["max_tokens"]


def _tool(name: str) -> str:
    path = VENV_BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed")
    return found


def test_vllm_router_kv_aware_routes_through_the_fleet(fleet: SimFleet, tmp_path: Path) -> None:
    port = free_port()
    argv = [_tool("vllm-router"), "--host", "127.0.0.1", "--port", str(port), "--worker-urls"]
    argv += [e.url for e in fleet.engines]
    argv += ["--policy", "kv_aware", "--prometheus-port", str(free_port())]
    argv += ["--log-level", "warning"]
    before = sum(sim_stats(e.url)["requests"] for e in fleet.engines)
    with subprocess_router(argv, port, tmp_path / "vllm-router.log") as url:
        send_a_handful(url, tmp_path / "vllm-router.log")
    stats = [sim_stats(e.url) for e in fleet.engines]
    assert sum(s["requests"] for s in stats) - before >= 6
    # kv_aware discovers the workers' event sources and tokenizes through render
    assert all(s["http_requests"].get("GET /kv_event_sources", 0) >= 1 for s in stats)
    assert sum(s["http_requests"].get("POST /v1/completions/render", 0) for s in stats) >= 1


def test_sglang_router_cache_aware_routes_through_the_fleet(
    fleet: SimFleet, tmp_path: Path
) -> None:
    port = free_port()
    argv = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls"]
    argv += [e.url for e in fleet.engines]
    argv += ["--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warn"]
    try:
        import sglang_router  # noqa: F401
    except ImportError:
        pytest.skip("sglang-router is not installed")
    before = sum(sim_stats(e.url)["requests"] for e in fleet.engines)
    with subprocess_router(argv, port, tmp_path / "sglang-router.log") as url:
        send_a_handful(url, tmp_path / "sglang-router.log")
    stats = [sim_stats(e.url) for e in fleet.engines]
    assert sum(s["requests"] for s in stats) - before >= 6
    assert all(s["http_requests"].get("GET /get_server_info", 0) >= 1 for s in stats)


# ---- prefill/decode disaggregation ---------------------------------------------------------


@contextlib.contextmanager
def pd_fleet(fleet: SimFleet, tokenizer_dir: Path, connector: str) -> Iterator[SimFleet]:
    cfg = FleetConfig(
        tokenizer=str(tokenizer_dir),
        engines=2,
        model="tiny",
        profile="cpu-tiny",
        roles=("prefill", "decode"),
        kv_connector=connector,
        names=("p0", "d0"),
    )
    with running_fleet(cfg, tokenizer=fleet.tokenizer) as f:
        yield f


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return sum(s.value for s in fams[name].samples if s.name.endswith("_total"))


def check_handoff(prefill: str, decode: str, prompt_tokens: int) -> None:
    """The decode engine received the prompt's KV and computed only its last block."""
    d = sim_stats(decode)
    assert d["transferred_tokens"] >= (prompt_tokens - 1) // BLOCK * BLOCK - BLOCK > 0
    assert d["prefill_tokens_computed"] <= BLOCK
    assert metric(decode, "vllm:external_prefix_cache_hits") == d["transferred_tokens"]
    p = sim_stats(prefill)
    assert p["prefill_tokens_computed"] >= prompt_tokens - BLOCK
    deadline = time.monotonic() + TIMEOUT
    while sim_stats(prefill)["pinned_requests"]:  # pulled: the prefill frees its blocks
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_nixl_handoff_prefill_then_decode(fleet: SimFleet, tokenizer_dir: Path) -> None:
    from kvplane.router.pd import protocols as pr

    with pd_fleet(fleet, tokenizer_dir, "nixl") as f:
        p0, d0 = f.engines
        body = {
            "model": "tiny",
            "prompt": unique(300),
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        first = httpx.post(f"{p0.url}/v1/completions", json=pr.nixl_prefill_body(body))
        assert first.status_code == 200, first.text
        params = pr.kv_transfer_params(first.json())
        assert params is not None and params["remote_engine_id"] == p0.cfg.engine_id
        assert params["do_remote_prefill"] is True and params["remote_block_ids"][0]
        assert first.json()["usage"]["completion_tokens"] == 1
        assert sim_stats(p0.url)["pinned_requests"] == 1

        with httpx.stream(
            "POST", f"{d0.url}/v1/completions", json=pr.nixl_decode_body(body, params)
        ) as r:
            assert r.status_code == 200
            chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " ok" * 4
        usage = chunks[-1]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= usage["prompt_tokens"] - BLOCK
        check_handoff(p0.url, d0.url, usage["prompt_tokens"])

        # what a real engine refuses: a pulled handle again, an unknown engine, wrong roles
        again = httpx.post(
            f"{d0.url}/v1/completions", json={**pr.nixl_decode_body(body, params), "stream": False}
        )
        assert again.status_code == 500 and again.json()["error"]["code"] == 500
        bogus = {**params, "remote_engine_id": "nope", "remote_port": 1}
        r = httpx.post(f"{d0.url}/v1/completions", json=pr.nixl_decode_body(body, bogus))
        assert r.status_code == 500 and "unknown remote engine" in r.json()["error"]["message"]
        r = httpx.post(f"{p0.url}/v1/completions", json=pr.nixl_decode_body(body, params))
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
        r = httpx.post(f"{d0.url}/v1/completions", json=pr.nixl_prefill_body(body))
        assert r.status_code == 400
        partial = {k: v for k, v in params.items() if k != "remote_request_id"}
        r = httpx.post(f"{d0.url}/v1/completions", json=pr.nixl_decode_body(body, partial))
        assert r.status_code == 400 and "remote_request_id" in r.json()["error"]["message"]
        # a prompt under one block: no handle, as vLLM
        short = httpx.post(
            f"{p0.url}/v1/completions", json=pr.nixl_prefill_body({"prompt": "hi"})
        ).json()
        assert short["kv_transfer_params"] is None


async def test_mooncake_handoff_concurrent_legs(fleet: SimFleet, tokenizer_dir: Path) -> None:
    import asyncio

    from kvplane.router.pd import protocols as pr

    with pd_fleet(fleet, tokenizer_dir, "mooncake") as f:
        p0, d0 = f.engines
        assert p0.bootstrap_port is not None and d0.bootstrap_port is None
        addr = pr.bootstrap_addr(p0.url, p0.bootstrap_port)
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            ids = pr.mooncake_engine_ids((await c.get(f"{addr}/query")).json())
            assert ids == {0: p0.cfg.engine_id}
            messages = [{"role": "user", "content": unique(300)}]
            body: dict[str, Any] = {"model": "tiny", "messages": messages, "max_tokens": 3}
            xfer = pr.transfer_id(uuid.uuid4().hex)
            # the decode leg first: it waits for its prefill, matched by transfer_id
            decode = asyncio.ensure_future(
                c.post(
                    f"{d0.url}/v1/chat/completions",
                    json=pr.mooncake_decode_body(body, xfer, addr, ids[0]),
                )
            )
            await asyncio.sleep(0.1)
            prefill = await c.post(
                f"{p0.url}/v1/chat/completions", json=pr.mooncake_prefill_body(body, xfer)
            )
            assert prefill.status_code == 200 and prefill.json()["kv_transfer_params"] is None
            answer = await decode
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == " ok" * 3
        check_handoff(p0.url, d0.url, answer.json()["usage"]["prompt_tokens"])


async def test_sglang_handoff_same_body_to_both(fleet: SimFleet, tokenizer_dir: Path) -> None:
    import asyncio

    from kvplane.router.pd import protocols as pr

    with pd_fleet(fleet, tokenizer_dir, "sglang") as f:
        p0, d0 = f.engines
        assert p0.bootstrap_port is not None
        plain = {"model": "tiny", "prompt": unique(300), "max_tokens": 5}
        body = pr.sglang_body(plain, pr.host_of(p0.url), p0.bootstrap_port, pr.bootstrap_room())
        async with httpx.AsyncClient(timeout=TIMEOUT) as c:
            prefill, decode = await asyncio.gather(
                c.post(f"{p0.url}/v1/completions", json=body),
                c.post(f"{d0.url}/v1/completions", json=body),
            )
            assert prefill.status_code == 200 and decode.status_code == 200, decode.text
            assert prefill.json()["usage"]["completion_tokens"] == 1  # it only prefills
            assert decode.json()["usage"]["completion_tokens"] == 5
            check_handoff(p0.url, d0.url, decode.json()["usage"]["prompt_tokens"])
            # disaggregated SGLang servers need the bootstrap fields
            r = await c.post(f"{d0.url}/v1/completions", json=plain)
            assert r.status_code == 400 and "bootstrap" in r.json()["error"]["message"]


def test_kvplane_router_disaggregates_over_the_sim(fleet: SimFleet, tokenizer_dir: Path) -> None:
    with pd_fleet(fleet, tokenizer_dir, "nixl") as f:
        p0, d0 = f.engines
        config = RouterConfig.model_validate(
            {
                "model": {
                    "name": "tiny",
                    "tokenizer": str(tokenizer_dir),
                    "block_size": BLOCK,
                    "max_model_len": 8192,
                    "kv_bytes_per_token": f.profile.kv_bytes_per_token,
                },
                "backends": f.backends(),
                "auth": {"open_admin": True},  # loopback: explain, every header
                "scrape_interval_s": 0.2,
                "pd": {"connector": "nixl", "aggregate_max_uncached_tokens": 0},
            }
        )
        with serve_router(config) as router:
            body = {"model": "tiny", "prompt": unique(400), "max_tokens": 3}
            r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=TIMEOUT)
            assert r.status_code == 200, r.text
            assert r.headers["x-kvplane-pd"] == "disaggregated"
            assert r.headers["x-kvplane-prefill-pod"] == "p0"
            assert r.headers["x-kvplane-decode-pod"] == "d0"
            assert r.json()["usage"]["completion_tokens"] == 3
            check_handoff(p0.url, d0.url, r.json()["usage"]["prompt_tokens"])
