"""kvplane beside the Gateway API Inference Extension on a real kube-apiserver: GIE's
CRD (vendored from its v1.6.0 release) and kvplane's installed together, the GIE
InferencePool the operator renders accepted by GIE's schema, and every resource
reachable by a name that means one thing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvplane.operator.api import InferencePoolSpec
from kvplane.operator.render.gateway import GIE_API_VERSION
from kvplane.operator.render.pool import inference_pool_objects
from support.k8s_cluster import K8sCluster

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[1]
GIE_CRD = ROOT / "third_party" / "gateway-api-inference-extension"
GIE_CRD_NAME = "inferencepools.inference.networking.k8s.io"
KVPLANE_KINDS = ("inferencepools", "prefillpools", "decodepools", "kvcachetiers")
MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}


@pytest.fixture(scope="module")
def both(k8s_cluster: K8sCluster) -> Iterator[K8sCluster]:
    """Both CRD sets; GIE's is removed afterwards, so other modules' plain
    ``inferencepool`` keeps naming kvplane's."""
    c = k8s_cluster
    c.kubectl("apply", "-f", str(ROOT / "crds"))
    c.kubectl("apply", "-f", str(GIE_CRD / "inference.networking.k8s.io_inferencepools.yaml"))
    for crd in (*(f"{k}.kvplane.io" for k in KVPLANE_KINDS), GIE_CRD_NAME):
        c.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    try:
        yield c
    finally:
        c.kubectl("delete", "crd", GIE_CRD_NAME, "--ignore-not-found", "--wait=true", timeout_s=90)


def apply(c: K8sCluster, ns: str, manifest: dict[str, Any]) -> None:
    c.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(manifest))


def names(c: K8sCluster, ns: str, resource: str) -> list[tuple[str, str]]:
    """(apiVersion, name) of what ``kubectl get <resource>`` lists."""
    items = c.kubectl_json("get", resource, "-n", ns)["items"]
    return sorted((i["apiVersion"], i["metadata"]["name"]) for i in items)


def test_rendered_gie_pool_is_accepted_and_every_name_means_one_thing(
    both: K8sCluster, k8s_namespace: str
) -> None:
    c, ns = both, k8s_namespace
    spec = {"model": MODEL, "gateway": {"failureMode": "FailOpen"}}
    apply(
        c,
        ns,
        {
            "apiVersion": "kvplane.io/v1alpha1",
            "kind": "InferencePool",
            "metadata": {"name": "llama"},
            "spec": spec,
        },
    )
    rendered = inference_pool_objects(
        "llama",
        ns,
        InferencePoolSpec.model_validate(spec),
        prefill=None,
        decodes={},
        tiers=[],
        default_image="kvplane:test",
    )
    gie = [o for o in rendered if o["apiVersion"] == GIE_API_VERSION]
    assert len(gie) == 1
    apply(c, ns, gie[0])  # GIE's own schema and CEL rules accept it
    got = c.kubectl_json("get", "inferencepools.inference.networking.k8s.io", "llama", "-n", ns)
    ref = got["spec"]["endpointPickerRef"]
    assert ref == {
        "group": "",
        "kind": "Service",
        "name": "llama-epp",
        "port": {"number": 9002},
        "failureMode": "FailOpen",
    }
    assert got["spec"]["selector"]["matchLabels"]["kvplane.io/role"] == "decode"
    picker_svc = next(
        o for o in rendered if o["kind"] == "Service" and o["metadata"]["name"] == "llama-epp"
    )
    assert picker_svc["spec"]["ports"][0]["appProtocol"] == "kubernetes.io/h2c"

    kv = ("kvplane.io/v1alpha1", "llama")
    gateway = (GIE_API_VERSION, "llama")
    # what a GIE user types is GIE's (API groups of equal priority sort by name)
    assert names(c, ns, "inferencepools") == [gateway]
    assert names(c, ns, "inferencepool") == [gateway]
    assert names(c, ns, "infpool") == [gateway]
    # kvplane's by its short name, its category and its full name
    assert names(c, ns, "ipool") == [kv]
    assert kv in names(c, ns, "kvplane") and gateway not in names(c, ns, "kvplane")
    assert names(c, ns, "inferencepools.kvplane.io") == [kv]
    for short, full in (
        ("ppool", "prefillpools"),
        ("dpool", "decodepools"),
        ("kvtier", "kvcachetiers"),
    ):
        resources = c.kubectl("api-resources", "-o", "name").stdout.split()
        assert f"{full}.kvplane.io" in resources
        out = c.kubectl("get", short, "-n", ns, check=False)
        assert out.returncode == 0, out.stderr


def test_short_names_and_categories_do_not_collide(both: K8sCluster) -> None:
    """Every short name of either CRD set resolves to exactly one resource."""
    table = both.kubectl("api-resources", "--no-headers", "-o", "wide").stdout.splitlines()
    short: dict[str, list[str]] = {}
    for line in table:
        cols = line.split()
        if len(cols) < 5 or not any(g in line for g in ("kvplane.io", "inference.networking")):
            continue
        name, shortnames = cols[0], cols[1]
        if "," in shortnames or shortnames in ("ipool", "ppool", "dpool", "kvtier", "infpool"):
            for s in shortnames.split(","):
                short.setdefault(s, []).append(name)
    assert short and all(len(v) == 1 for v in short.values()), short


def test_the_informer_waits_for_gies_crd_without_polling(k8s_cluster: K8sCluster) -> None:
    """Without GIE's CRD the operator's informer counts its InferencePool as synced and
    empty, then learns of the CRD from a watch of CRDs (no request while none comes) and
    from then on caches GIE's pools."""
    import asyncio
    import time

    from kvplane.operator.informer import Informer, Watched
    from kvplane.router.kube import Kube

    c = k8s_cluster
    kind = "InferencePool.inference.networking.k8s.io"
    c.kubectl("delete", "crd", GIE_CRD_NAME, "--ignore-not-found", "--wait=true", timeout_s=90)
    ns = f"gie-late-{int(time.time() * 1000) % 100000}"
    c.kubectl("create", "namespace", ns)

    async def run() -> None:
        client = await Kube.connect(str(c.kubeconfig))
        informer = Informer(client, [Watched(kind)], None, lambda *_: None)
        informer.start()
        try:
            await asyncio.wait_for(informer.synced.wait(), 60)
            assert informer.objects(kind) == []
            await asyncio.to_thread(install_and_create)
            deadline = time.monotonic() + 90
            while not informer.objects(kind, ns):
                assert time.monotonic() < deadline, "GIE's pool never reached the cache"
                await asyncio.sleep(0.1)
        finally:
            await informer.stop()
            await client.close()

    def install_and_create() -> None:
        c.kubectl("apply", "-f", str(GIE_CRD / "inference.networking.k8s.io_inferencepools.yaml"))
        c.kubectl("wait", "--for=condition=Established", f"crd/{GIE_CRD_NAME}", "--timeout=60s")
        pool = {
            "apiVersion": GIE_API_VERSION,
            "kind": "InferencePool",
            "metadata": {"name": "late", "namespace": ns},
            "spec": {
                "selector": {"matchLabels": {"app": "x"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "epp", "port": {"number": 9002}},
            },
        }
        c.kubectl("apply", "-f", "-", input=json.dumps(pool))

    try:
        asyncio.run(run())
    finally:
        c.kubectl("delete", "crd", GIE_CRD_NAME, "--ignore-not-found", "--wait=true", timeout_s=90)
