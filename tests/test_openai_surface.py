"""The rest of vLLM's OpenAI surface through the router: ``/v1/embeddings`` and
``/v1/responses`` with the official ``openai`` client (streamed and not, continued by
``previous_response_id``), ``/tokenize``, ``/detokenize``, ``/v1/score`` and
``/v1/rerank`` with httpx (the client has no method for them), against simulated
engines that keep stored responses in their own process, as vLLM does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvplane.router.config import RouterConfig
from kvplane.router.responses import MemoryHomes, ResponseTap
from support.redis_server import RedisServer, start_redis
from support.router_server import RunningRouter, chat_tokenizer_dir, serve_router

from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet

TIMEOUT = 10.0
GENERATION_TIMEOUT = 90.0  # a whole context's worth of decode steps, on a busy machine
PODS = 3


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fleet(tokenizer_dir: Path) -> Iterator[SimFleet]:
    cfg = FleetConfig(tokenizer=str(tokenizer_dir), engines=PODS, model="tiny", pooling=True)
    with running_fleet(cfg) as f:
        yield f


def config(tok: Path, fleet: SimFleet, policy: str = "cost", **extra: Any) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {"name": "tiny", "tokenizer": str(tok), "block_size": 32},
            "backends": fleet.backends(),
            "policy": policy,
            "auth": {"open_admin": True},  # loopback: every header
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


@pytest.fixture(scope="module")
def router(tokenizer_dir: Path, fleet: SimFleet) -> Iterator[RunningRouter]:
    with serve_router(config(tokenizer_dir, fleet)) as r:
        yield r


@pytest.fixture(scope="module")
def round_robin(tokenizer_dir: Path, fleet: SimFleet) -> Iterator[RunningRouter]:
    """A router that would send each request to the next pod: a continued response
    reaches the pod that stored it only if the router pins it there."""
    with serve_router(config(tokenizer_dir, fleet, "round_robin")) as r:
        yield r


def client(router: RunningRouter) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The OpenAI error object of a 4xx answer (its shape checked)."""
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# ---- /v1/embeddings -----------------------------------------------------------------


def test_embeddings_with_the_openai_client_are_routed_by_load(router: RunningRouter) -> None:
    raw = client(router).embeddings.with_raw_response.create(
        model="tiny", input=["the cat sat", "on the mat", "the cat sat"]
    )
    assert raw.headers["x-kvplane-reason"] == "least_loaded"
    out = raw.parse()
    assert [d.index for d in out.data] == [0, 1, 2]
    assert out.data[0].embedding == out.data[2].embedding  # equal input, equal vector
    assert out.data[0].embedding != out.data[1].embedding
    assert len(out.data[0].embedding) == 32
    assert out.usage.prompt_tokens == out.usage.total_tokens > 0
    short = client(router).embeddings.create(model="tiny", input="hello", dimensions=8)
    assert len(short.data[0].embedding) == 8


def test_embeddings_without_input_are_a_400_in_openai_shape(router: RunningRouter) -> None:
    r = httpx.post(f"{router.url}/v1/embeddings", json={"model": "tiny"}, timeout=TIMEOUT)
    assert r.status_code == 400
    assert error_of(r)["param"] == "input"
    with pytest.raises(openai.NotFoundError):  # an unknown model: the router's 404
        client(router).embeddings.create(model="other", input="x")


def test_an_engine_without_pooling_answers_its_own_404(tokenizer_dir: Path) -> None:
    """A generative vLLM serves no embeddings: its 404 reaches the client as it is."""
    cfg = FleetConfig(tokenizer=str(tokenizer_dir), engines=1, model="tiny")
    with running_fleet(cfg) as generative, serve_router(config(tokenizer_dir, generative)) as r:
        with pytest.raises(openai.NotFoundError):
            client(r).embeddings.create(model="tiny", input="x")
        assert client(r).responses.create(model="tiny", input="x", max_output_tokens=1).id


# ---- /v1/responses ------------------------------------------------------------------


def test_previous_response_id_lands_on_the_pod_that_stored_it(
    round_robin: RunningRouter, fleet: SimFleet
) -> None:
    c = client(round_robin)
    firsts = [
        c.responses.with_raw_response.create(
            model="tiny", input=f"conversation {i}: hello", max_output_tokens=3
        )
        for i in range(PODS)
    ]
    homes = [f.headers["x-kvplane-pod"] for f in firsts]
    assert sorted(homes) == sorted(e.cfg.name for e in fleet.engines)  # one per pod
    for first, home in zip(firsts, homes, strict=True):
        parsed = first.parse()
        assert parsed.id.startswith("resp_") and parsed.output_text == " ok" * 3
        assert parsed.usage is not None
        seen = parsed.usage.input_tokens
        for _ in range(2):  # round robin would move each turn to the next pod
            follow = c.responses.with_raw_response.create(
                model="tiny",
                input="and then?",
                previous_response_id=parsed.id,
                max_output_tokens=2,
            )
            assert follow.headers["x-kvplane-pod"] == home
            assert follow.headers["x-kvplane-reason"] == "previous_response"
            parsed = follow.parse()
            assert parsed.previous_response_id is not None
            # the engine rendered the stored conversation, then the new turn
            assert parsed.usage is not None and parsed.usage.input_tokens > seen
            seen = parsed.usage.input_tokens


def test_only_the_storing_engine_knows_a_response(router: RunningRouter, fleet: SimFleet) -> None:
    """Why the pinning matters: vLLM's store is per process; another engine answers 404."""
    made = client(router).responses.with_raw_response.create(
        model="tiny", input="remember me", max_output_tokens=1
    )
    home = made.headers["x-kvplane-pod"]
    rid = made.parse().id
    other = next(e for e in fleet.engines if e.cfg.name != home)
    body = {"model": "tiny", "input": "again", "previous_response_id": rid}
    r = httpx.post(f"{other.url}/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == 404
    assert error_of(r)["message"] == f"Response with id '{rid}' not found."


def test_streamed_response_is_recorded_from_its_events(router: RunningRouter) -> None:
    c = client(router)
    with c.responses.with_streaming_response.create(
        model="tiny", input="stream me", max_output_tokens=4, stream=True
    ) as raw:
        home = raw.headers["x-kvplane-pod"]
        events = list(raw.parse())
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "response.output_text.delta" in types
    done = events[-1]
    assert done.type == "response.completed"
    assert done.response.output_text == " ok" * 4
    stream = c.responses.create(
        model="tiny",
        input="more",
        previous_response_id=done.response.id,
        stream=True,
        max_output_tokens=2,
    )
    follow = [e for e in stream if e.type == "response.completed"]
    assert follow and follow[0].response.previous_response_id == done.response.id
    again = c.responses.with_raw_response.create(
        model="tiny", input="more", previous_response_id=follow[0].response.id, max_output_tokens=1
    )
    assert again.headers["x-kvplane-pod"] == home


def test_retrieve_goes_to_the_storing_pod(router: RunningRouter) -> None:
    """GET /v1/responses/{id} is served where the response is stored."""
    c = client(router)
    made = c.responses.create(model="tiny", input="keep", max_output_tokens=1)
    assert c.responses.retrieve(made.id) == made
    with pytest.raises(openai.NotFoundError) as exc:
        c.responses.retrieve("resp_unknown")
    assert "Response with id 'resp_unknown' not found." in str(exc.value)


def test_unknown_or_unstored_previous_response_is_a_404(router: RunningRouter) -> None:
    c = client(router)
    with pytest.raises(openai.NotFoundError) as exc:
        c.responses.create(model="tiny", input="hi", previous_response_id="resp_nope")
    assert "Response with id 'resp_nope' not found." in str(exc.value)
    unstored = c.responses.create(model="tiny", input="hi", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="tiny", input="hi", previous_response_id=unstored.id)


def test_a_response_whose_pod_left_is_a_404(router: RunningRouter) -> None:
    """The map names a pod the pool no longer has (seeded: removing a static backend
    from a running router is not possible); the request is not sent anywhere."""
    homes = router.router.homes
    assert homes is not None
    asyncio.run(homes.put("resp_orphan", "a-pod-that-left"))  # memory: no loop of its own
    body = {"model": "tiny", "input": "hi", "previous_response_id": "resp_orphan"}
    r = httpx.post(f"{router.url}/v1/responses", json=body, timeout=TIMEOUT)
    assert r.status_code == 404
    assert error_of(r)["param"] == "previous_response_id"


def test_bad_responses_requests_are_400s(router: RunningRouter) -> None:
    url = f"{router.url}/v1/responses"
    for body, param in (
        ({"model": "tiny"}, "input"),
        ({"model": "tiny", "input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"model": "tiny", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x"}, "model"),
    ):
        r = httpx.post(url, json=body, timeout=TIMEOUT)
        assert r.status_code == 400, body
        assert error_of(r)["param"] == param


def test_responses_share_a_prefix_like_chats(router: RunningRouter) -> None:
    """A response's instructions and input are its prompt: the second of two that share
    a long instruction goes where the first one's blocks are."""
    c = client(router)
    instructions = "You are terse. " + " ".join(f"rule{i}" for i in range(300))
    first = c.responses.with_raw_response.create(
        model="tiny", instructions=instructions, input="one", max_output_tokens=1
    )
    assert int(first.headers["x-kvplane-prompt-tokens"]) > 300
    second = c.responses.with_raw_response.create(
        model="tiny", instructions=instructions, input="two", max_output_tokens=1
    )
    assert second.headers["x-kvplane-pod"] == first.headers["x-kvplane-pod"]
    assert second.headers["x-kvplane-reason"] == "cache_hit"


def test_router_replicas_share_the_map_through_a_redis_index(
    tokenizer_dir: Path, fleet: SimFleet, redis_server: RedisServer
) -> None:
    """A response made through one replica is continued through another: the map is in
    the index's Redis. The replicas are round robin, so only the map can agree."""
    index = {"backend": "redis", "url": redis_server.url, "lookup_timeout_ms": 2000}
    cfg = config(tokenizer_dir, fleet, "round_robin", index=index)
    with serve_router(cfg, embedded_indexer=False) as a, serve_router(cfg, False) as b:
        for i in range(PODS):
            made = client(a).responses.with_raw_response.create(
                model="tiny", input=f"replicas {i}", max_output_tokens=1
            )
            home, rid = made.headers["x-kvplane-pod"], made.parse().id
            follow = client(b).responses.with_raw_response.create(
                model="tiny", input="next", previous_response_id=rid, max_output_tokens=1
            )
            assert follow.headers["x-kvplane-pod"] == home
            assert follow.headers["x-kvplane-reason"] == "previous_response"


def test_a_redis_that_cannot_answer_is_a_503_for_ids_this_replica_never_saw(
    tokenizer_dir: Path, fleet: SimFleet
) -> None:
    """The replica's own map still continues what it relayed; an id only Redis could
    name is a 503, not a 404 (the response may well exist)."""
    server = start_redis()
    index = {"backend": "redis", "url": server.url, "lookup_timeout_ms": 2000}
    index["io_timeout_ms"] = 500
    cfg = config(tokenizer_dir, fleet, index=index)
    try:
        with serve_router(cfg, embedded_indexer=False) as r:
            c = client(r)
            made = c.responses.with_raw_response.create(
                model="tiny", input="before the outage", max_output_tokens=1
            )
            home, rid = made.headers["x-kvplane-pod"], made.parse().id
            server.stop()
            follow = c.responses.with_raw_response.create(
                model="tiny", input="after", previous_response_id=rid, max_output_tokens=1
            )
            assert follow.headers["x-kvplane-pod"] == home
            body = {"model": "tiny", "input": "x", "previous_response_id": "resp_elsewhere"}
            refused = httpx.post(f"{r.url}/v1/responses", json=body, timeout=TIMEOUT)
            assert refused.status_code == 503
            assert "cannot answer" in error_of(refused)["message"]
    finally:
        server.stop()


# ---- tokenize, detokenize, score, rerank ----------------------------------------------


def test_tokenize_and_detokenize_round_trip(router: RunningRouter) -> None:
    r = httpx.post(
        f"{router.url}/tokenize", json={"model": "tiny", "prompt": "hello world"}, timeout=TIMEOUT
    )
    assert r.status_code == 200, r.text
    tok = r.json()
    assert list(tok) == ["count", "max_model_len", "tokens", "token_strs"]
    assert tok["count"] == len(tok["tokens"]) > 0
    d = httpx.post(f"{router.url}/detokenize", json={"tokens": tok["tokens"]}, timeout=TIMEOUT)
    assert d.status_code == 200 and d.json()["prompt"].endswith("hello world")
    bad = httpx.post(f"{router.url}/detokenize", json={"model": "tiny"}, timeout=TIMEOUT)
    assert bad.status_code == 400 and error_of(bad)["param"] == "tokens"


def test_score_and_rerank(router: RunningRouter) -> None:
    score = {"model": "tiny", "queries": "a cat", "documents": ["a cat", "stock prices"]}
    for path in ("/v1/score", "/score"):
        r = httpx.post(f"{router.url}{path}", json=score, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        data = r.json()["data"]
        assert [d["object"] for d in data] == ["score", "score"]
        assert data[0]["score"] > data[1]["score"]
    docs = ["stock prices", "a cat", "the cat"]
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        rerank = {"model": "tiny", "query": "a cat", "documents": docs, "top_n": 2}
        r = httpx.post(f"{router.url}{path}", json=rerank, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvplane-reason"] == "least_loaded"
        results = r.json()["results"]
        assert len(results) == 2 and results[0]["document"]["text"] == "a cat"
    r = httpx.post(f"{router.url}/v1/rerank", json={"model": "tiny"}, timeout=TIMEOUT)
    assert r.status_code == 400 and error_of(r)["param"] == "query"


def test_the_schema_lists_every_forwarded_route(router: RunningRouter) -> None:
    paths = httpx.get(f"{router.url}/openapi.json", timeout=TIMEOUT).json()["paths"]
    for path in (*FIELDS, "/score", "/rerank", "/v2/rerank"):
        assert "requestBody" in paths[path]["post"], path
    assert "get" in paths["/v1/responses/{response_id}"]
    assert "post" in paths["/v1/responses/{response_id}/cancel"]


# ---- the response map ------------------------------------------------------------------


async def test_the_response_map_is_bounded_in_entries_and_time() -> None:
    now = [0.0]
    homes = MemoryHomes(max_entries=2, ttl_s=10.0, clock=lambda: now[0])
    await homes.put("a", "p0")
    await homes.put("b", "p1")
    assert await homes.get("a") == "p0"  # a is now the most recently used
    await homes.put("c", "p2")
    assert len(homes) == 2 and await homes.get("b") is None
    now[0] = 9.0
    assert await homes.get("c") == "p2"  # a lookup renews the TTL
    now[0] = 15.0
    assert await homes.get("a") is None and await homes.get("c") == "p2"


async def test_the_tap_finds_the_id_in_a_stream_cut_anywhere() -> None:
    event = {"response": {"id": "resp_x", "status": "in_progress"}, "type": "response.created"}
    wire = b"event: response.created\ndata: " + json.dumps(event).encode() + b"\n\n"
    for cut in range(1, len(wire)):
        homes = MemoryHomes(10, 60.0)
        tap = ResponseTap(homes, stream=True, pod=lambda: "p0")
        await tap(wire[:cut])
        await tap(wire[cut:])
        assert await homes.get("resp_x") == "p0"


# ---- hostile bodies ---------------------------------------------------------------------

FIELDS = {
    "/v1/embeddings": ("input", "dimensions", "messages"),
    "/v1/responses": ("input", "instructions", "previous_response_id", "max_output_tokens"),
    "/tokenize": ("prompt", "messages", "add_special_tokens"),
    "/detokenize": ("tokens",),
    "/v1/score": ("queries", "documents", "data_1", "data_2"),
    "/v1/rerank": ("query", "documents", "top_n"),
}
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


@pytest.mark.parametrize("path", sorted(FIELDS))
def test_hostile_bodies_get_4xx_in_openai_shape(router: RunningRouter, path: str) -> None:
    """Neither the router nor the engine fails (5xx) on any body; every refusal is an
    OpenAI error object."""
    fields = FIELDS[path]
    bodies = st.one_of(
        st.binary(max_size=200),
        st.dictionaries(st.sampled_from(fields), json_values, max_size=3).map(
            lambda d: json.dumps({"model": "tiny", **d}).encode()
        ),
    )

    @settings(max_examples=60, deadline=None, database=None)
    @given(content=bodies)
    def prop(content: bytes) -> None:
        # a valid body may ask for the longest answer the context allows (a large
        # max_output_tokens): 8k tokens of 2 ms steps on the simulated engine
        r = httpx.post(
            router.url + path,
            content=content,
            headers={"content-type": "application/json"},
            timeout=GENERATION_TIMEOUT,
        )
        assert r.status_code < 500, (content[:200], r.status_code, r.text[:300])
        if r.status_code >= 400:
            error_of(r)

    prop()
