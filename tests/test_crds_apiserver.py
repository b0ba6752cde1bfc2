"""crds/ served by a real kube-apiserver: defaults applied, bad objects rejected
with clear messages (OpenAPI ranges and enums, CEL rules)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.k8s_cluster import K8sCluster

pytestmark = pytest.mark.k8s

CRDS = Path(__file__).resolve().parents[1] / "crds"


@pytest.fixture(scope="module")
def crds(k8s_cluster: K8sCluster) -> K8sCluster:
    k8s_cluster.kubectl("apply", "-f", str(CRDS))
    for plural in ("inferencepools", "prefillpools", "decodepools", "kvcachetiers"):
        k8s_cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{plural}.kvplane.io", "--timeout=60s"
        )
    return k8s_cluster


def obj(kind: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name},
        "spec": spec,
    }


def create(cluster: K8sCluster, ns: str, manifest: dict[str, Any]) -> tuple[bool, str]:
    import json

    out = cluster.kubectl("create", "-n", ns, "-f", "-", input=json.dumps(manifest), check=False)
    return out.returncode == 0, out.stderr


MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}


def test_valid_objects_get_server_side_defaults(crds: K8sCluster, k8s_namespace: str) -> None:
    ok, err = create(crds, k8s_namespace, obj("InferencePool", "llama", {"model": MODEL}))
    assert ok, err
    got = crds.kubectl_json("get", "inferencepool", "llama", "-n", k8s_namespace)["spec"]
    assert got["engine"]["kind"] == "vllm" and got["engine"]["blockSize"] == 16
    assert got["router"]["replicas"] == 2 and got["router"]["policy"] == "cost"
    ok, err = create(
        crds, k8s_namespace, obj("DecodePool", "d", {"poolRef": {"name": "llama"}, "replicas": 2})
    )
    assert ok, err
    adapters = [{"name": "sql-lora", "source": "/adapters/sql"}, {"name": "b", "source": "o/b"}]
    lora = {"model": {**MODEL, "loraAdapters": adapters, "maxLoras": 2}}
    ok, err = create(crds, k8s_namespace, obj("InferencePool", "lora", lora))
    assert ok, err
    ok, err = create(
        crds,
        k8s_namespace,
        obj(
            "KVCacheTier",
            "dram",
            {"tier": "dram", "backend": "native", "capacityPerPod": "64Gi", "bandwidthGbps": 50},
        ),
    )
    assert ok, err
    listed = crds.kubectl("get", "kvplane", "-n", k8s_namespace).stdout
    assert "llama" in listed and "dram" in listed, "short category `kvplane` lists them all"


def test_long_names_and_tensor_parallel_pools_are_accepted(
    crds: K8sCluster, k8s_namespace: str
) -> None:
    """Names longer than a label (the operator hashes them) and gpusPerReplica equal to
    the tensor parallel size are valid."""
    long_name = "a" + "-long-pool-name" * 5  # 76 characters
    ok, err = create(crds, k8s_namespace, obj("InferencePool", long_name, {"model": MODEL}))
    assert ok, err
    tp4 = {"poolRef": {"name": long_name}, "gpusPerReplica": 4, "tensorParallelSize": 4}
    ok, err = create(crds, k8s_namespace, obj("DecodePool", "tp4", tp4))
    assert ok, err


@pytest.mark.parametrize(
    ("manifest", "message"),
    [
        (
            obj("InferencePool", "a", {"model": {"servedName": "m", "source": "s"}}),
            "set exactly one of shape and kvBytesPerToken",
        ),
        (
            obj("InferencePool", "b", {"model": MODEL, "engine": {"kind": "trt"}}),
            'Unsupported value: "trt"',
        ),
        (
            obj("InferencePool", "c", {"model": MODEL, "engine": {"blockSize": 0}}),
            "should be greater than or equal to 1",
        ),
        (
            obj(
                "InferencePool",
                "d",
                {"model": MODEL, "index": {"managed": {}, "external": {"url": "redis://r:6379"}}},
            ),
            "managed and external exclude each other",
        ),
        (
            obj("InferencePool", "e", {"model": MODEL, "index": {"external": {"url": "http://x"}}}),
            "should match",
        ),
        (obj("InferencePool", "f", {"model": MODEL, "bogus": 1}), "unknown field"),
        (
            obj(
                "DecodePool",
                "g",
                {"poolRef": {"name": "x"}, "replicas": 1, "autoscaling": {"maxReplicas": 3}},
            ),
            "set replicas or autoscaling, not both",
        ),
        (
            obj(
                "DecodePool",
                "h",
                {"poolRef": {"name": "x"}, "autoscaling": {"minReplicas": 4, "maxReplicas": 3}},
            ),
            "maxReplicas must be >= minReplicas",
        ),
        (
            obj(
                "PrefillPool",
                "i",
                {"poolRef": {"name": "x"}, "gpusPerReplica": 4, "tensorParallelSize": 2},
            ),
            "gpusPerReplica must equal tensorParallelSize",
        ),
        (
            obj("DecodePool", "i2", {"poolRef": {"name": "x"}, "gpusPerReplica": 8}),
            "gpusPerReplica must equal tensorParallelSize",
        ),
        (
            obj("InferencePool", "1llama", {"model": MODEL}),
            "an InferencePool name must start with a letter",
        ),
        (
            obj("InferencePool", "llama.v2", {"model": MODEL}),
            "an InferencePool name must start with a letter",
        ),
        (
            obj(
                "PrefillPool", "j", {"poolRef": {"name": "x"}, "kvTransfer": {"connector": "nccl"}}
            ),
            'Unsupported value: "nccl"',
        ),
        (
            obj("KVCacheTier", "k", {"tier": "nvme", "backend": "lmcache", "bandwidthGbps": 5}),
            "nvme tiers use LMCache local disk and need a volume",
        ),
        (
            obj("KVCacheTier", "l", {"tier": "remote", "backend": "native", "bandwidthGbps": 5}),
            "remote tiers use mooncake, lmcacheServer, redis or s3 and need a url",
        ),
        (
            obj("KVCacheTier", "m", {"tier": "hbm", "backend": "lmcache", "bandwidthGbps": 1}),
            "backend must be native",
        ),
        (obj("KVCacheTier", "n", {"tier": "dram", "bandwidthGbps": 0}), "should be greater than 0"),
        (
            obj(
                "KVCacheTier",
                "s3-no-region",
                {"tier": "remote", "backend": "s3", "url": "s3://b/kv", "bandwidthGbps": 1},
            ),
            "s3 tiers need a region",
        ),
        (
            obj(
                "KVCacheTier",
                "lmcache-arc",
                {"tier": "dram", "backend": "lmcache", "evictionPolicy": "arc", "bandwidthGbps": 5},
            ),
            "evictionPolicy arc is honoured only by vLLM's native CPU offload",
        ),
        (
            obj(
                "KVCacheTier",
                "native-lfu",
                {"tier": "dram", "backend": "native", "evictionPolicy": "lfu", "bandwidthGbps": 5},
            ),
            "lfu only by LMCache's local tiers",
        ),
        (
            obj(
                "KVCacheTier",
                "dram-cachegen",
                {"tier": "dram", "compression": "cachegen", "bandwidthGbps": 5},
            ),
            "compression applies only to remote tiers",
        ),
        (
            obj("KVCacheTier", "o", {"tier": "dram", "bandwidthGbps": 5, "capacityPerPod": "lots"}),
            "should match",
        ),
        (
            obj(
                "InferencePool",
                "lora-twice",
                {"model": {**MODEL, "loraAdapters": [{"name": "a", "source": "/a"}] * 2}},
            ),
            "Duplicate value",
        ),
        (
            obj(
                "InferencePool",
                "lora-base",
                {"model": {**MODEL, "loraAdapters": [{"name": "llama", "source": "/a"}]}},
            ),
            "an adapter's name differs from servedName",
        ),
        (
            obj("InferencePool", "lora-none", {"model": {**MODEL, "maxLoras": 2}}),
            "maxLoras needs loraAdapters",
        ),
        (
            obj(
                "InferencePool",
                "lora-comma",
                {"model": {**MODEL, "loraAdapters": [{"name": "a,b", "source": "/a"}]}},
            ),
            "should match",
        ),
    ],
    ids=lambda v: v["metadata"]["name"] if isinstance(v, dict) else "",
)
def test_invalid_objects_are_rejected_with_a_clear_message(
    crds: K8sCluster, k8s_namespace: str, manifest: dict[str, Any], message: str
) -> None:
    ok, err = create(crds, k8s_namespace, manifest)
    assert not ok
    assert message in err, err
