"""The operator (kopf, in-process) against a real kube-apiserver, controller-manager,
scheduler and kwok GPU nodes: objects created, pods Running, status conditions,
scaling, rolling on a generation change, drift repair, P/D, deletion cascade."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kopf.testing import KopfRunner
from support.k8s_cluster import K8sCluster

pytestmark = pytest.mark.k8s

CRDS = Path(__file__).resolve().parents[1] / "crds"
MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}


@pytest.fixture(scope="module")
def operator(k8s_cluster: K8sCluster) -> Iterator[KopfRunner]:
    k8s_cluster.kubectl("apply", "-f", str(CRDS))
    for plural in ("inferencepools", "prefillpools", "decodepools", "kvcachetiers"):
        k8s_cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{plural}.kvplane.io", "--timeout=60s"
        )
    args = ["run", "--all-namespaces", "--standalone", "-m", "kvplane.operator.handlers"]
    with k8s_cluster.activated(), KopfRunner(args, timeout=600) as runner:
        yield runner
    assert runner.exception is None, runner.output[-4000:]


def apply(cluster: K8sCluster, ns: str, kind: str, name: str, spec: dict[str, Any]) -> None:
    manifest = {
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def get(cluster: K8sCluster, ns: str, kind: str, name: str) -> dict[str, Any] | None:
    out = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else None


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any]:
    for c in (obj or {}).get("status", {}).get("conditions", []):
        if c["type"] == type_:
            return dict(c)
    return {}


def ready(cluster: K8sCluster, ns: str, name: str) -> bool:
    return condition(get(cluster, ns, "inferencepool", name), "Ready").get("status") == "True"


def deployments(cluster: K8sCluster, ns: str) -> dict[str, dict[str, Any]]:
    items = cluster.kubectl_json("get", "deployments", "-n", ns)["items"]
    return {d["metadata"]["name"]: d for d in items}


def test_aggregated_pool_comes_up_and_reports_status(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    ns, c = k8s_namespace, k8s_cluster
    apply(c, ns, "InferencePool", "llama", {"model": MODEL, "router": {"replicas": 1}})
    apply(
        c,
        ns,
        "DecodePool",
        "main",
        {"poolRef": {"name": "llama"}, "replicas": 2, "gpusPerReplica": 1},
    )
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=90)
    names = set(deployments(c, ns))
    assert {"llama-decode-main", "llama-router", "llama-indexer", "llama-redis"} <= names
    pool = get(c, ns, "inferencepool", "llama")
    assert pool is not None
    status = pool["status"]
    assert status["mode"] == "aggregated"
    assert status["routerEndpoint"] == f"http://llama-router.{ns}.svc:8000"
    assert status["observedGeneration"] == pool["metadata"]["generation"]
    assert status["generationTag"]
    assert {"name": "main", "role": "decode", "replicas": 2, "readyReplicas": 2} in status["pools"]
    decode = get(c, ns, "decodepool", "main")
    assert decode is not None and decode["status"]["readyReplicas"] == 2
    pods = c.kubectl_json("get", "pods", "-n", ns, "-l", "kvplane.io/role=decode")["items"]
    assert len(pods) == 2 and all(p["status"]["phase"] == "Running" for p in pods)
    assert all(p["spec"]["nodeName"].startswith("kwok-gpu") for p in pods)
    engine = deployments(c, ns)["llama-decode-main"]
    assert "kvplane.io/finalizer" not in pool["metadata"].get("finalizers", []), (
        "no finalizer without cleanup outside Kubernetes"
    )
    owner = engine["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "InferencePool" and owner["controller"] is True
    args = " ".join(engine["spec"]["template"]["spec"]["containers"][0]["args"])
    assert "--kv-events-config" in args and "--enable-prefix-caching" in args
    # the managed Redis' password: made once by the operator, owned by the pool
    secret = c.kubectl_json("get", "secret", "llama-redis-auth", "-n", ns)
    password = base64.b64decode(secret["data"]["password"]).decode()
    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    assert len(password) >= 32 and conf == f"requirepass {password}\n"
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"

    # scaling follows the DecodePool
    apply(c, ns, "DecodePool", "main", {"poolRef": {"name": "llama"}, "replicas": 3})
    c.wait_until(
        "3 ready decode replicas",
        lambda: (
            (get(c, ns, "decodepool", "main") or {}).get("status", {}).get("readyReplicas") == 3
        ),
        timeout_s=60,
    )
    again = c.kubectl_json("get", "secret", "llama-redis-auth", "-n", ns)
    assert again["data"] == secret["data"], "reconciles keep the password"

    # a model identity change rolls the engines to a new generation
    old_tag = status["generationTag"]
    apply(
        c,
        ns,
        "InferencePool",
        "llama",
        {"model": {**MODEL, "revision": "v2"}, "router": {"replicas": 1}},
    )

    def rolled() -> bool:
        p = get(c, ns, "inferencepool", "llama") or {}
        tag = p.get("status", {}).get("generationTag")
        dep = deployments(c, ns)["llama-decode-main"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        return bool(tag and tag != old_tag and labels.get("kvplane.io/generation") == tag)

    c.wait_until("new generation rolled", rolled, timeout_s=60)
    c.wait_until("Ready after the roll", lambda: ready(c, ns, "llama"), timeout_s=90)

    # drift repair: a deleted owned object comes back
    c.kubectl("delete", "deployment", "llama-router", "-n", ns)
    c.wait_until("router recreated", lambda: "llama-router" in deployments(c, ns), timeout_s=60)

    # deletion cascades through owner references
    c.kubectl("delete", "inferencepool", "llama", "-n", ns)
    c.wait_until("owned objects collected", lambda: not deployments(c, ns), timeout_s=90)


def test_prefill_decode_pool_is_disaggregated(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    ns, c = k8s_namespace, k8s_cluster
    apply(c, ns, "InferencePool", "pd", {"model": MODEL, "router": {"replicas": 1}})
    apply(
        c,
        ns,
        "PrefillPool",
        "p",
        {"poolRef": {"name": "pd"}, "replicas": 1, "kvTransfer": {"connector": "nixl"}},
    )
    apply(
        c,
        ns,
        "DecodePool",
        "d",
        {"poolRef": {"name": "pd"}, "replicas": 1, "kvTransfer": {"connector": "nixl"}},
    )
    c.wait_until("P/D pool Ready", lambda: ready(c, ns, "pd"), timeout_s=90)
    pool = get(c, ns, "inferencepool", "pd")
    assert pool is not None and pool["status"]["mode"] == "disaggregated"
    deps = deployments(c, ns)
    for name in ("pd-prefill", "pd-decode-d"):
        args = " ".join(deps[name]["spec"]["template"]["spec"]["containers"][0]["args"])
        assert "NixlConnector" in args


def test_missing_references_are_reported_as_degraded(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    ns, c = k8s_namespace, k8s_cluster
    apply(c, ns, "InferencePool", "broken", {"model": MODEL, "kvCacheTiers": [{"name": "nope"}]})

    def degraded() -> bool:
        cond = condition(get(c, ns, "inferencepool", "broken"), "Degraded")
        return cond.get("status") == "True"

    c.wait_until("Degraded", degraded, timeout_s=60)
    msg = condition(get(c, ns, "inferencepool", "broken"), "Degraded")["message"]
    assert "KVCacheTier nope not found" in msg and "no DecodePool" in msg
    assert condition(get(c, ns, "inferencepool", "broken"), "Ready")["status"] == "False"


def test_external_index_residency_is_removed_with_the_pool(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str, redis_server: Any
) -> None:
    """The only finalizer: a pool whose index is an external Redis cleans its keys there."""
    import redis as redis_lib

    ns, c = k8s_namespace, k8s_cluster
    apply(
        c,
        ns,
        "InferencePool",
        "ext",
        {"model": MODEL, "index": {"external": {"url": redis_server.url}}},
    )
    apply(c, ns, "DecodePool", "d", {"poolRef": {"name": "ext"}, "replicas": 1})
    c.wait_until("Ready", lambda: ready(c, ns, "ext"), timeout_s=90)
    pool = get(c, ns, "inferencepool", "ext")
    assert pool is not None and "kvplane.io/finalizer" in pool["metadata"]["finalizers"]
    tag = pool["status"]["generationTag"]
    r = redis_lib.Redis.from_url(redis_server.url)
    r.hset(f"kvp:{{{tag}}}:pods", "pod-a", "0\x1f1")  # the pods table
    bucket = f"kvp:{tag}:".encode() + b"{\x81\x82}\x83\x84"  # a chunk bucket
    r.hset(bucket, b"\x00" * 8, b"\x00\x01")
    r.set("unrelated", "1")
    c.kubectl("delete", "inferencepool", "ext", "-n", ns, "--wait=true", timeout_s=90)
    assert not list(r.scan_iter(f"kvp:{{{tag}}}:*")) and not r.exists(bucket)
    assert r.get("unrelated") == b"1"
