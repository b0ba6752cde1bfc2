"""Handing backends the prompt's token ids (``forward_tokens``, kvplane.router.token_forward).

The end-to-end test runs the real parts: two of Dynamo's mockers (Dynamo 1.6.1 from
PyPI) behind one real direct-mode ``dynamo.frontend``, kvplane's router in front with
``forward_tokens: dynamo``. It shows that the frontend serves the router's ids instead of
rendering and encoding the prompt itself (a router told of another chat template is
answered in that template's token count) and that, with the same template, the ids are
the frontend's own: the same chat sent to the frontend directly, which encodes it
itself, finds the router's request's blocks cached on the mocker."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from kvplane.router.app import build_router
from kvplane.router.config import RouterConfig, TokenForwarding
from kvplane.router.pipeline import DEFER_TAIL_CHARS, PROBE_PROMPT_CHARS
from kvplane.router.request import parse_request
from kvplane.router.token_forward import forwardable, with_token_ids
from support.mockers import direct_fleet
from support.router_server import chat_tokenizer_dir, serve_router

pytestmark = pytest.mark.timeout(600)

MODEL = "sim-llama-3.1-8b"
DYNAMO = TokenForwarding.DYNAMO


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _sent(body: dict[str, Any], kind: str, tokens: list[int]) -> Any:
    raw = _raw(body)
    return msgspec.json.decode(with_token_ids(DYNAMO, parse_request(raw, kind), raw, tokens))


def test_the_ids_go_in_nvext_beside_what_the_client_sent() -> None:
    chat = {"model": "m", "messages": [{"role": "user", "content": "hé"}], "temperature": 0.5}
    out = _sent(chat, "chat", [1, 2, 3])
    assert out == {**chat, "nvext": {"token_data": [1, 2, 3]}}
    # the client's own nvext fields stay; its token_data is replaced by the router's ids
    asked = {**chat, "nvext": {"extra_fields": ["worker_id"], "token_data": [9]}}
    out = _sent(asked, "chat", [1, 2, 3])
    assert out["nvext"] == {"extra_fields": ["worker_id"], "token_data": [1, 2, 3]}
    one = {"model": "m", "prompt": ["only one"], "max_tokens": 1}
    assert _sent(one, "completions", [4, 5])["nvext"] == {"token_data": [4, 5]}


def test_what_the_router_did_not_encode_from_text_goes_as_sent() -> None:
    for body in (
        {"model": "m", "prompt": ["a batch", "of two"]},  # routed by its first prompt only
        {"model": "m", "prompt": [1, 2, 3]},  # ids already: nothing to spare the engine
        {"model": "m", "prompt": "x", "nvext": "not an object"},  # the frontend's 400
    ):
        raw = _raw(body)
        req = parse_request(raw, "completions")
        assert with_token_ids(DYNAMO, req, raw, [7]) is raw
    raw = _raw({"model": "m", "input": "x"})
    assert not forwardable(parse_request(raw, "embeddings"))
    chat = _raw({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert with_token_ids(TokenForwarding.OFF, parse_request(chat, "chat"), chat, [7]) is chat


async def test_a_short_tail_is_encoded_up_front_and_a_long_prompt_held_nowhere_goes_as_text(
    tmp_path: Path,
) -> None:
    """With ``forward_tokens``, a conversation's next turn (a cached prefix and a new
    tail) is encoded whole before it goes, so that its ids can go with it; a long new
    prompt no pod holds is still encoded after the answer and sent as text."""
    tok = chat_tokenizer_dir(tmp_path / "tok")
    for form, short_deferred in ((TokenForwarding.OFF, True), (DYNAMO, False)):
        cfg = _config([{"name": "a", "url": "http://127.0.0.1:1"}], tok, None)
        router = build_router(cfg.model_copy(update={"forward_tokens": form}))
        router.pool.set_backends(cfg.backends)
        try:
            history = " ".join(f"turn {i}: what was said then." for i in range(200))
            follow = history + " and now" + " a longer question" * (DEFER_TAIL_CHARS // 15)
            assert DEFER_TAIL_CHARS < len(follow) - len(history) < len(follow) // 4
            assert len(history) < PROBE_PROMPT_CHARS  # a first prompt the router encodes whole
            for prompt, deferred in ((history, False), (follow, short_deferred)):
                req = parse_request(_raw({"model": MODEL, "prompt": prompt}), "completions")
                routed = await router.route(req)
                assert routed.prompt.partial is deferred, (form, len(prompt))
                sent = router.body_for(req, req_raw := _raw(req.body), routed)
                if form is DYNAMO and not deferred:
                    ids = msgspec.json.decode(sent)["nvext"]["token_data"]
                    assert ids == router.tokenizer.encode(prompt, True)
                else:
                    assert sent is req_raw
            new = "".join(f"fresh text {i}, " for i in range(1200))
            assert len(new) > 2 * PROBE_PROMPT_CHARS
            req = parse_request(_raw({"model": MODEL, "prompt": new}), "completions")
            routed = await router.route(req)
            assert routed.prompt.partial, form
            assert router.body_for(req, raw := _raw(req.body), routed) is raw
        finally:
            router.tokenizer.close()


def _config(backends: list[dict[str, object]], tok: Path, template: str | None) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": MODEL,
                "tokenizer": str(tok),
                "block_size": 64,
                "chat_template": template,
            },
            "backends": backends,
            "forward_tokens": "dynamo",
            "auth": {"route_headers": True},
        }
    )


def _usage(r: httpx.Response) -> tuple[int, int]:
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {})["cached_tokens"]


def test_dynamos_frontend_serves_the_routers_ids(tmp_path: Path) -> None:
    tok = chat_tokenizer_dir(tmp_path / "tok")
    fleet = direct_fleet(MODEL, tok, tmp_path)
    try:
        backends: list[dict[str, object]] = [
            {"name": e.name, "url": e.url, "headers": dict(e.headers)} for e in fleet.endpoints
        ]
        ids = {b["name"]: b["headers"] for b in backends}

        def chat(text: str) -> dict[str, Any]:
            return {
                "model": MODEL,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": 2,
                "nvext": {"extra_fields": ["worker_id"]},
            }

        # the router's ids are what the engine computes: with another template than the
        # frontend's, the prompt is as long as the router's rendering makes it
        other = "{% for m in messages %}" + "[kvplane] " * 40 + "{{ m['content'] }}{% endfor %}"
        body = chat("the same words " * 20)
        direct = httpx.post(
            f"{fleet.direct_url}/v1/chat/completions",
            json=body,
            headers=ids["m0"],  # type: ignore[arg-type]
            timeout=60,
        )
        own, _ = _usage(direct)
        with serve_router(_config(backends, tok, other)) as router:
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
            routed, _ = _usage(r)
            expected = router.router.tokenizer.encode(
                router.router.tokenizer.render_chat(*_chat_args(body)), False
            )
        assert routed == len(expected) and routed > own + 40 * 2, (routed, own)

        # with the frontend's own template the ids are its own: the same chat sent to the
        # frontend, which then encodes it itself, finds the router's blocks on that mocker
        body = chat("a long shared document, read twice: " * 120)
        with serve_router(_config(backends, tok, None)) as router:
            r = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
            prompt, _ = _usage(r)
            pod = r.headers["x-kvplane-pod"]
        assert prompt > 4 * 64
        again = httpx.post(
            f"{fleet.direct_url}/v1/chat/completions",
            json=body,
            headers=ids[pod],  # type: ignore[arg-type]
            timeout=60,
        )
        same, cached = _usage(again)
        assert same == prompt and cached == prompt // 64 * 64, (prompt, cached)
    finally:
        fleet.stop()


def _chat_args(body: dict[str, Any]) -> tuple[Any, Any]:
    req = parse_request(_raw(body), "chat")
    return req.messages, req.chat
