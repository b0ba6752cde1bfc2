"""Faults that used to cost requests (router/proxy.py): a stalled engine whose /health is
fine, a non-streamed generation past the read timeout, requests an engine refuses by
closing the connection (a poisoned request vs a sick pod), an engine answering 500, and
a client that leaves a non-streamed request. The real router on loopback; the engines
are small real HTTP servers that can be told to fail (support/fake_engine.py), since
real vLLM cannot be made to produce these faults on demand."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from kvplane.router.config import RouterConfig
from support.fake_engine import FakeEngine, RawEngine, serve_engines, serve_raw
from support.router_server import deepseek_tokenizer_dir, serve_router


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def config(tok: Path, engines: list[FakeEngine | RawEngine], **extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {"name": "tiny", "tokenizer": str(tok), "block_size": 16},
            "backends": [{"name": e.name, "url": e.url} for e in engines],
            "policy": "round_robin",
            "auth": {"route_headers": True},
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def complete(url: str, prompt: str, stream: bool = False, timeout: float = 30) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)


def test_a_stalled_engine_is_demoted_with_back_off_while_its_health_is_fine(
    tokenizer_dir: Path,
) -> None:
    stalled, good = FakeEngine("stalled", mode="stall"), FakeEngine("good")
    try:
        with (
            serve_engines(stalled, good),
            serve_router(
                config(tokenizer_dir, [stalled, good], first_byte_timeout_s=2, demote_first_s=5)
            ) as r,
        ):
            state = r.router.pool.states["stalled"]
            for i in range(6):  # the first on the stalled pod moves on, then it is out
                resp = complete(r.url, f"p{i}", stream=True)
                assert resp.status_code == 200 and resp.headers["x-kvplane-pod"] == "good"
                assert resp.text.rstrip().endswith("data: [DONE]")
            assert stalled.requests == 1, "demoted: the scraper's good /health did not undo it"
            assert state.healthy and state.demotions is not None
            # back after its back-off; stalling again doubles it
            wait_until(lambda: state.demoted_until <= time.monotonic(), "back in rotation")
            for i in range(3):
                assert complete(r.url, f"q{i}", stream=True).status_code == 200
            assert stalled.requests == 2
            assert state.demotions.current_s == pytest.approx(20.0)  # 5 s, then 10, next 20
    finally:
        stalled.released.set()


def test_a_non_streamed_request_that_times_out_is_not_retried_nor_held_against_the_pod(
    tokenizer_dir: Path,
) -> None:
    """The engine took it and is generating: another pod would generate it all again."""
    a, b = FakeEngine("a", mode="stall"), FakeEngine("b", mode="stall")
    try:
        with (
            serve_engines(a, b),
            serve_router(config(tokenizer_dir, [a, b], read_timeout_s=0.5)) as r,
        ):
            resp = complete(r.url, "a long generation")
            assert resp.status_code == 504, resp.text
            assert "read_timeout_s" in resp.json()["error"]["message"]
            assert a.requests + b.requests == 1
            for state in r.router.pool.states.values():
                assert state.healthy and state.demoted_until == 0.0
    finally:
        a.released.set()
        b.released.set()


def test_poisoned_requests_do_not_take_healthy_pods_out(tokenizer_dir: Path) -> None:
    """A request that engines refuse by closing the connection is judged by the second
    refusal: it gets a 502 and no pod is held responsible."""
    e0, e1 = RawEngine("e0", close_marker=b"POISON"), RawEngine("e1", close_marker=b"POISON")
    with serve_raw(e0), serve_raw(e1):  # noqa: SIM117 (the config needs their ports)
        with serve_router(config(tokenizer_dir, [e0, e1], scrape_interval_s=5.0)) as r:
            for i in range(10):
                bad = complete(r.url, f"POISON {i}")
                assert bad.status_code == 502 and "refused by 2 backends" in bad.text
                ok = complete(r.url, f"fine {i}")
                assert ok.status_code == 200, ok.text
            for state in r.router.pool.states.values():
                assert state.healthy and state.demoted_until == 0.0


def test_a_pod_that_drops_requests_other_pods_serve_is_demoted(tokenizer_dir: Path) -> None:
    sick, good = RawEngine("sick", close_all=True), RawEngine("good")
    with (
        serve_raw(sick),
        serve_raw(good),
        serve_router(config(tokenizer_dir, [sick, good], demote_first_s=60)) as r,
    ):
        for i in range(6):
            resp = complete(r.url, f"p{i}")
            assert resp.status_code == 200 and resp.headers["x-kvplane-pod"] == "good"
        assert sick.requests == 1


def test_an_engine_answering_500_is_demoted(tokenizer_dir: Path) -> None:
    bad, good = FakeEngine("bad", mode="fail500"), FakeEngine("good")
    with (
        serve_engines(bad, good),
        serve_router(config(tokenizer_dir, [bad, good], demote_first_s=60)) as r,
    ):
        for i in range(6):
            resp = complete(r.url, f"p{i}")
            assert resp.status_code == 200 and resp.headers["x-kvplane-pod"] == "good"
        assert bad.requests == 1, "demoted: later requests pay no extra attempt"


def test_a_request_every_engine_answers_with_500_gets_the_engines_answer(
    tokenizer_dir: Path,
) -> None:
    a, b = FakeEngine("a", mode="fail500"), FakeEngine("b", mode="fail500")
    with serve_engines(a, b), serve_router(config(tokenizer_dir, [a, b])) as r:
        resp = complete(r.url, "x")
        assert resp.status_code == 500 and resp.json()["error"]["message"] == "engine failed"
        for state in r.router.pool.states.values():
            assert state.demoted_until == 0.0


def test_a_client_leaving_a_non_streamed_request_aborts_it_upstream(tokenizer_dir: Path) -> None:
    engine = RawEngine("slow", generate_s=60)
    with serve_raw(engine), serve_router(config(tokenizer_dir, [engine])) as r:
        with pytest.raises(httpx.ReadTimeout):
            complete(r.url, "write a long story", timeout=1.0)
        wait_until(lambda: engine.aborted == 1, "the engine saw the client leave")
        wait_until(lambda: r.router.pool.states["slow"].inflight == 0, "the pod is free")
