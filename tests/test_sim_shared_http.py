"""The simulator's shared store in HTTP mode (``kvplane sim --store-blocks``), end to end
through kvplane's router: an engine writes its blocks to the store, the store's KV
events (vLLM's remote-store medium) go out on that engine's own ZMQ stream, the router
indexes them as the pool's store, the explain endpoint offers them to the other pod
as a load, and that pod really loads them (its cached tokens and external hits)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvplane.router.config import RouterConfig
from prometheus_client.parser import text_string_to_metric_families
from support.router_server import deepseek_tokenizer_dir, serve_router

from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet
from kvplane.sim.kvcache import Link
from kvplane.sim.main import router_config_yaml

TIMEOUT = 20.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    tok = deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    cfg = FleetConfig(
        tokenizer=str(tok),
        engines=2,
        model="tiny",
        profile="cpu-tiny",
        store_blocks=4096,
        store_link=Link(25.0, 1.0),
        store_write_through=True,  # as LMCache and Mooncake Store connectors save KV
    )
    with running_fleet(cfg) as f:
        yield f


def external_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=TIMEOUT).text
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:external_prefix_cache_hits":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no vllm:external_prefix_cache_hits")


def explain(url: str, body: dict[str, Any]) -> dict[str, dict[str, Any]]:
    r = httpx.post(f"{url}/kvplane/explain", json=body, timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    return {c["pod"]: c for c in r.json()["candidates"]}


def test_a_block_one_engine_stored_is_a_load_for_the_other(fleet: SimFleet) -> None:
    doc = yaml.safe_load(router_config_yaml(fleet))
    assert doc["shared_stores"] == [
        {"name": "sim-store", "link": {"bandwidth_gbps": 25.0, "latency_ms": 1.0}}
    ]
    doc["auth"] = {"open_admin": True, "route_headers": True}  # loopback: explain, headers
    doc["scrape_interval_s"] = 0.2
    doc["cost"] = {"tentative_ttl_s": 0.01}  # residency below comes from the events
    config = RouterConfig.model_validate(doc)
    writer, reader = fleet.engines
    prompt = f"[{uuid.uuid4().hex}] " + " ".join(f"w{i % 89}" for i in range(400))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    with serve_router(config) as router:
        direct = httpx.post(f"{writer.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert direct.status_code == 200, direct.text
        # the store's events reach the router on the writer's stream: the reader is
        # offered the prefix as a load from the pool's store (bounded wait)
        deadline = time.monotonic() + TIMEOUT
        offer: dict[str, Any] = {}
        while time.monotonic() < deadline:
            offer = explain(router.url, body)[reader.cfg.name]
            if offer.get("loaded_tokens", {}).get("remote", 0) > 0:
                break
            time.sleep(0.1)
        assert offer.get("shared_store") == "sim-store", offer
        loaded = offer["loaded_tokens"]["remote"]
        assert loaded > 0
        assert offer["loaded_ms"]["remote"] > 0
        # and the reader really loads it from the store
        before = external_hits(reader.url)
        r = httpx.post(f"{reader.url}/v1/completions", json=body, timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= loaded
        assert external_hits(reader.url) - before >= loaded


def test_the_sim_cli_configures_a_store_and_peers(tmp_path: Path) -> None:
    import argparse

    from kvplane.sim.main import add_arguments, fleet_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--tokenizer", str(tmp_path), "--store-blocks", "64", "--peer-gbps", "40"]
    )
    cfg = fleet_config(args)
    assert cfg.store_blocks == 64 and cfg.peer_link == Link(40.0, 0.2)
    assert cfg.store_link == Link(25.0, 1.0) and cfg.store_policy == "lru"
