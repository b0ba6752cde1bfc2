"""A host tier the engines publish no KV events for (``unreported_tier``), end to end.

Dynamo's mocker offloads to its host tier as vLLM's native CPU offload does, but its KV
events carry no ``medium`` and no host-tier events at all: a prefix that left HBM is
invisible to an index fed by them, though the mocker still serves it from the host tier.
Two real mockers (Dynamo 1.6.1 from PyPI) with a small HBM and a host tier behind one
real direct-mode ``dynamo.frontend``; two kvplane routers follow their events, one told
of the tier. Once a prompt's blocks are pushed out of its pod's HBM, the router told of
the tier still sees them in DRAM there and sends the prompt back, where the mocker
finds them cached; the other router sees them nowhere."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvplane.router.config import RouterConfig
from support.mockers import direct_fleet
from support.router_server import RunningRouter, deepseek_tokenizer_dir, serve_router

pytestmark = pytest.mark.timeout(600)

MODEL = "sim-llama-3.1-8b"
BLOCK = 64
HBM_BLOCKS = 64  # 4,096 tokens
HOST_BLOCKS = 1024


def _config(backends: list[dict[str, object]], tok: Path, tier: bool) -> RouterConfig:
    extra = {"unreported_tier": {"tier": "dram", "blocks": HOST_BLOCKS}} if tier else {}
    return RouterConfig.model_validate(
        {
            "model": {"name": MODEL, "tokenizer": str(tok), "block_size": BLOCK},
            "backends": backends,
            "auth": {"route_headers": True, "open_admin": True},  # explain, on loopback
            **extra,
        }
    )


def _text(rng: random.Random, words: int) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(words))


def _terms(router: RunningRouter, body: dict[str, Any], pod: str) -> dict[str, Any]:
    exp = httpx.post(f"{router.url}/kvplane/explain", json=body, timeout=30).json()
    return next(c for c in exp["candidates"] if c["pod"] == pod)


def _wait(router: RunningRouter, body: dict[str, Any], pod: str, want: dict[str, int]) -> None:
    """Poll until the router's index shows ``pod`` holding what ``want`` says (bounded)."""
    deadline = time.monotonic() + 60
    held: dict[str, int] = {}
    while time.monotonic() < deadline:
        held = _terms(router, body, pod).get("resident_blocks", {})
        if all(held.get(tier, 0) == n for tier, n in want.items()):
            return
        time.sleep(0.1)
    raise AssertionError(f"{pod} holds {held}, not {want}")


def test_a_prefix_in_an_unreported_host_tier_is_routed_to(tmp_path: Path) -> None:
    tok = deepseek_tokenizer_dir(tmp_path / "tok")
    fleet = direct_fleet(MODEL, tok, tmp_path, kv_blocks=HBM_BLOCKS, host_blocks=HOST_BLOCKS)
    try:
        backends: list[dict[str, object]] = [
            {
                "name": e.name,
                "url": e.url,
                "headers": dict(e.headers),
                "kv_events": e.kv_events,
                "replay": e.replay,
            }
            for e in fleet.endpoints
        ]
        rng = random.Random(5)
        body = {"model": MODEL, "prompt": _text(rng, 600), "max_tokens": 2}
        with (
            serve_router(_config(backends, tok, tier=True)) as told,
            serve_router(_config(backends, tok, tier=False)) as blind,
        ):
            first = httpx.post(f"{told.url}/v1/completions", json=body, timeout=60)
            assert first.status_code == 200, first.text
            pod = first.headers["x-kvplane-pod"]
            blocks = first.json()["usage"]["prompt_tokens"] // BLOCK
            assert blocks >= 8
            _wait(told, body, pod, {"hbm": blocks})
            _wait(blind, body, pod, {"hbm": blocks})
            # other prompts sent to that mocker directly push the prompt out of its HBM
            url = f"{fleet.direct_url}/v1/completions"
            headers = next(dict(e.headers) for e in fleet.endpoints if e.name == pod)
            for _ in range(3):
                filler = {"model": MODEL, "prompt": _text(rng, 600), "max_tokens": 2}
                r = httpx.post(url, json=filler, headers=headers, timeout=60)
                assert r.status_code == 200, r.text
            _wait(told, body, pod, {"hbm": 0, "dram": blocks})
            _wait(blind, body, pod, {"hbm": 0, "dram": 0})
            # the told router predicts a load from DRAM there; the blind one, a recompute
            assert _terms(told, body, pod)["loaded_tokens"]["dram"] == blocks * BLOCK
            assert _terms(blind, body, pod)["cached_tokens"] == 0
            again = httpx.post(f"{told.url}/v1/completions", json=body, timeout=60)
            assert again.status_code == 200, again.text
            assert again.headers["x-kvplane-pod"] == pod
            cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == blocks * BLOCK, (cached, blocks)
    finally:
        fleet.stop()
