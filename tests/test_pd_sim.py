"""P/D end to end through the simulator: kvplane's router in front of a simulated
fleet of two prefill and two decode engines speaking NIXL, Mooncake or SGLang
(kvplane/sim/pd.py), driven with the official openai client.

The simulated decode engine really waits for the KV it lacks to cross the modeled
link, counts it (``/sim/stats`` ``transferred_tokens``) and publishes the received
blocks as KV events, so the router's index learns that the decode pod now holds the
prompt."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kvplane.router.config import RouterConfig
from support.router_server import RunningRouter, chat_tokenizer_dir, serve_router

from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet

BLOCK = 32  # the cpu-tiny profile's block size
TIMEOUT = 30.0
NAMES = ("p0", "p1", "d0", "d1")
ROLES = ("prefill", "prefill", "decode", "decode")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@contextlib.contextmanager
def pd_stack(tokenizer_dir: Path, connector: str) -> Iterator[tuple[SimFleet, RunningRouter]]:
    cfg = FleetConfig(
        tokenizer=str(tokenizer_dir),
        engines=len(NAMES),
        model="tiny",
        profile="cpu-tiny",
        roles=ROLES,
        kv_connector=connector,
        names=NAMES,
    )
    with running_fleet(cfg) as fleet:
        link = {"bandwidth_gbps": cfg.pd_link_gbps, "latency_ms": 0.0}
        config = RouterConfig.model_validate(
            {
                "model": {
                    "name": "tiny",
                    "tokenizer": str(tokenizer_dir),
                    "block_size": BLOCK,
                    "max_model_len": 8192,
                    "kv_bytes_per_token": fleet.profile.kv_bytes_per_token,
                },
                "backends": fleet.backends(),
                "auth": {"open_admin": True},  # loopback: explain, every header
                "scrape_interval_s": 0.5,
                "pd": {
                    "connector": connector,
                    "aggregate_max_uncached_tokens": 64,
                    "links": {"same_node": link, "same_zone": link, "cross_zone": link},
                },
            }
        )
        with serve_router(config) as router:
            yield fleet, router


def stats(fleet: SimFleet, name: str) -> dict[str, Any]:
    (engine,) = [e for e in fleet.engines if e.cfg.name == name]
    out: dict[str, Any] = httpx.get(f"{engine.url}/sim/stats", timeout=TIMEOUT).json()
    return out


def unique(words: int = 300) -> str:
    return f"[{uuid.uuid4().hex}] " + " ".join(f"w{i % 97}" for i in range(words))


@pytest.mark.parametrize("connector", ("nixl", "mooncake", "sglang"))
def test_router_serves_the_sim_fleet_through_prefill_decode_pairs(
    tokenizer_dir: Path, connector: str
) -> None:
    with pd_stack(tokenizer_dir, connector) as (fleet, router):
        oc = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        prompt = unique()
        raw = oc.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=3)
        h = raw.headers
        assert h["x-kvplane-pd"] == "disaggregated" and h["x-kvplane-pd-connector"] == connector
        p, d = h["x-kvplane-prefill-pod"], h["x-kvplane-decode-pod"]
        assert p in ("p0", "p1") and d in ("d0", "d1")
        comp = raw.parse()
        assert comp.usage is not None and comp.usage.completion_tokens == 3
        n = comp.usage.prompt_tokens
        # the decode engine received the prompt's KV over the link and computed at most
        # its last block; the prefill engine computed the prompt
        ds = stats(fleet, d)
        assert ds["transferred_tokens"] >= (n - 1) // BLOCK * BLOCK - BLOCK > 0
        assert ds["prefill_tokens_computed"] <= BLOCK
        assert stats(fleet, p)["prefill_tokens_computed"] >= n - BLOCK

        # streaming chat through a pair
        chunks = oc.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": unique()}],
            max_tokens=4,
            stream=True,
            stream_options={"include_usage": True},
        )
        usage = None
        pieces = 0
        for c in chunks:
            pieces += sum(1 for ch in c.choices if ch.delta.content)
            usage = c.usage or usage
        assert pieces >= 1 and usage is not None and usage.completion_tokens == 4

        # the same prompt again: vLLM decode pods now hold it (the received blocks were
        # published as KV events), so one of them serves it alone; an SGLang decode
        # server only takes handed-off requests
        again = oc.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=2)
        if connector == "sglang":
            assert again.headers["x-kvplane-pd"] == "disaggregated"
        else:
            assert again.headers["x-kvplane-reason"] == "aggregated_resident_on_decode"
            assert again.headers["x-kvplane-pod"] == d
            u = again.parse().usage
            assert u is not None and u.prompt_tokens_details is not None
            assert (u.prompt_tokens_details.cached_tokens or 0) >= n - BLOCK

        # short: under aggregate_max_uncached_tokens (64) but over one block (the sim's
        # prefill side hands off whole blocks only)
        short_prompt = unique(12)
        short = oc.completions.with_raw_response.create(
            model="tiny", prompt=short_prompt, max_tokens=2
        )
        assert BLOCK < int(short.headers["x-kvplane-prompt-tokens"]) <= 64
        expected = "disaggregated" if connector == "sglang" else "aggregated_short_prompt"
        assert short.headers["x-kvplane-reason"] == expected

        text = httpx.get(f"{router.url}/metrics", timeout=TIMEOUT).text
        decisions = [ln for ln in text.splitlines() if ln.startswith("kvplane_router_pd_decisions")]
        assert any('reason="disaggregated"' in ln for ln in decisions), decisions


def test_an_idle_prefill_pod_serves_a_prompt_it_holds_through_the_router(
    tokenizer_dir: Path,
) -> None:
    """NIXL prefill engines are kv_both: a plain request runs there in full. p0 computed
    the prompt (its KV events told the router) and no decode pod holds it, so the
    router sends the request to p0 alone rather than hand it off."""
    with pd_stack(tokenizer_dir, "nixl") as (fleet, router):
        prompt = unique()
        (p0,) = [e for e in fleet.engines if e.cfg.name == "p0"]
        warm = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        assert httpx.post(f"{p0.url}/v1/completions", json=warm, timeout=TIMEOUT).is_success
        for _ in range(100):  # bounded: until p0's KV events reached the index
            e = httpx.post(f"{router.url}/kvplane/explain", json=warm, timeout=TIMEOUT).json()
            if e["reason"] == "aggregated_resident_on_prefill":
                break
            asyncio.run(asyncio.sleep(0.05))
        assert e["reason"] == "aggregated_resident_on_prefill" and e["chosen"]["decode"] == "p0"

        oc = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=TIMEOUT)
        raw = oc.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=3)
        assert raw.headers["x-kvplane-reason"] == "aggregated_resident_on_prefill"
        assert raw.headers["x-kvplane-pod"] == "p0"
        u = raw.parse().usage
        assert u is not None and u.completion_tokens == 3 and u.prompt_tokens_details is not None
        assert (u.prompt_tokens_details.cached_tokens or 0) >= u.prompt_tokens - BLOCK
        assert stats(fleet, "d0")["transferred_tokens"] == 0
        assert stats(fleet, "d1")["transferred_tokens"] == 0


def test_decode_choice_spreads_running_requests(tokenizer_dir: Path) -> None:
    """Concurrent long prompts land on both decode pods (decode balances its load)."""
    with pd_stack(tokenizer_dir, "nixl") as (_, router):

        async def burst() -> list[str]:
            async with httpx.AsyncClient(timeout=TIMEOUT) as client:
                body = {"model": "tiny", "max_tokens": 16}
                rs = await asyncio.gather(
                    *(
                        client.post(
                            f"{router.url}/v1/completions", json={**body, "prompt": unique()}
                        )
                        for _ in range(6)
                    )
                )
            assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
            return [r.headers["x-kvplane-decode-pod"] for r in rs]

        pods = asyncio.run(burst())
        assert set(pods) == {"d0", "d1"}, pods
