"""Index garbage collection driven by Kubernetes: when an engine pod goes away, its
residency stops counting within seconds, and the collector then sweeps it out of Redis.

Real parts throughout: a vLLM engine on loopback, a Redis server, the local
kube-apiserver, and the indexer following the pod through Kubernetes discovery.
The pod is bound to a node no kubelet (nor kwok) manages, and its status is
written the way a kubelet would, with the engine's loopback address as its IP;
kwok pods get 10.244.x addresses that must never be dialled from the host.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import redis
from kvplane.router.config import KubernetesDiscoverySpec
from kvplane.router.discovery_k8s import KubernetesDiscovery
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.redis_gc import collect, dead_slots
from kvplane.router.index.redis_layout import SLOT_MUL
from kvplane.router.kvevents.service import Indexer
from support.fake_kubelet import fake_kubelet_node, ready_pod
from support.k8s_cluster import K8sCluster
from support.redis_server import RedisServer
from support.vllm_fixtures import EngineFactory

from kvplane.local.vllm_engines import VllmEngine

pytestmark = [pytest.mark.k8s, pytest.mark.vllm]

GEN = "gc-test"


def engine_pod(cluster: K8sCluster, ns: str, name: str, node: str) -> None:
    ready_pod(cluster, ns, name, node, {"kvplane.io/pool": "gc", "kvplane.io/role": "decode"})


def slot_of(r: redis.Redis, pod: str) -> int | None:
    value = r.hget(f"kvp:{{{GEN}}}:pods", pod)
    return None if value is None else int(bytes(value).split(b"\x1f")[0])  # type: ignore[arg-type]


def entries_of(r: redis.Redis, slot: int) -> int:
    """Holder entries of ``slot`` in every bucket of the generation."""
    n = 0
    for key in r.scan_iter(match=f"kvp:{GEN}:".encode() + b"{*}??", count=1000):
        for value in r.hvals(key):
            raw = bytes(value) if isinstance(value, bytes) else value.encode()
            cells = [raw[i : i + 2] for i in range(0, len(raw), 2)]
            n += sum(int.from_bytes(c, "big") // SLOT_MUL == slot for c in cells)
    return n


def test_engine_pod_deletion_removes_its_residency(
    k8s_cluster: K8sCluster,
    k8s_namespace: str,
    vllm_engine_factory: EngineFactory,
    redis_server: RedisServer,
) -> None:
    ns, c = k8s_namespace, k8s_cluster
    [engine] = vllm_engine_factory(["gc0"])
    node = f"{ns}-node"
    fake_kubelet_node(c, node)
    try:
        _scenario(c, ns, node, engine, redis_server)
    finally:  # other tests list nodes and expect only kwok's fully described ones
        c.kubectl("delete", "node", node, "--wait=false", check=False)


def _scenario(
    c: K8sCluster, ns: str, node: str, engine: VllmEngine, redis_server: RedisServer
) -> None:
    events_port = int(engine.events_endpoint.rsplit(":", 1)[1])
    replay_port = int(engine.replay_endpoint.rsplit(":", 1)[1])
    engine_pod(c, ns, "engine-0", node)
    r = redis.Redis.from_url(redis_server.url)
    spec = KubernetesDiscoverySpec(
        namespace=ns,
        selector="kvplane.io/pool=gc,kvplane.io/role",
        http_port=engine.port,
        kv_events_port=events_port,
        replay_port=replay_port,
    )

    async def scenario() -> None:
        index = RedisIndex(redis_server.url, GEN, timeout_s=2.0)
        indexer = Indexer(index, generation=GEN, block_size=32)
        await indexer.start()

        async def follow() -> None:
            async for backends in KubernetesDiscovery(spec, str(c.kubeconfig)).watch():
                await indexer.set_backends(backends)

        follower = asyncio.create_task(follow())
        try:
            import httpx

            async with httpx.AsyncClient(timeout=60) as http:
                for _ in range(100):  # until the indexer has subscribed and indexed
                    await http.post(
                        f"{engine.url}/v1/completions",
                        json={
                            "model": "tiny",
                            "prompt": "garbage collection " * 40,
                            "max_tokens": 1,
                        },
                    )
                    slot = slot_of(r, "engine-0")
                    if slot is not None and entries_of(r, slot):
                        break
                    await asyncio.sleep(0.2)
            slot = slot_of(r, "engine-0")
            assert slot is not None and entries_of(r, slot), "the engine's blocks never came"
            assert "engine-0" in await index.incarnations()
            c.kubectl("delete", "pod", "engine-0", "-n", ns, "--grace-period=0", "--force")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if "engine-0" not in await index.incarnations():
                    break
                await asyncio.sleep(0.2)
            else:
                raise AssertionError("the deleted pod's residency still counts")
            assert slot in await dead_slots(index)
            await collect(index, grace_s=0)
            assert entries_of(r, slot) == 0, "the collector left the dead pod's entries"
        finally:
            follower.cancel()
            await indexer.stop()
            await index.close()

    asyncio.run(scenario())
