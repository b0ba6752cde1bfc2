"""The operator (kopf, in-process) against a real kube-apiserver, controller-manager,
scheduler and kwok GPU nodes: objects created, pods Running, status conditions,
scaling, rolling on a generation change, drift repair, P/D, deletion cascade; one pool
never harming another (residency, failures), names at the API's limits, statuses of
engine pools and tiers, transient API errors, one roll at creation."""

from __future__ import annotations

import base64
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
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


def degraded(cluster: K8sCluster, ns: str, kind: str, name: str, text: str = "") -> bool:
    cond = condition(get(cluster, ns, kind, name), "Degraded")
    return cond.get("status") == "True" and text in cond.get("message", "")


@pytest.fixture
def other_namespace(k8s_cluster: K8sCluster) -> Iterator[str]:
    """A second namespace, named to list before the test's own (``a-...``)."""
    name = f"a-{secrets.token_hex(4)}"
    k8s_cluster.kubectl("create", "namespace", name)
    k8s_cluster.wait_until(
        f"ServiceAccount {name}/default",
        lambda: (
            k8s_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0
        ),
        timeout_s=30,
    )
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


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


def selector_string(selector: dict[str, Any]) -> str:
    parts = [f"{k}={v}" for k, v in selector.get("matchLabels", {}).items()]
    for e in selector.get("matchExpressions", []):
        assert e["operator"] == "In"
        parts.append(f"{e['key']} in ({','.join(e['values'])})")
    return ",".join(parts)


def selected_pods(cluster: K8sCluster, ns: str, selector: dict[str, Any]) -> set[str]:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", selector_string(selector))
    return {p["metadata"]["labels"]["kvplane.io/role"] for p in pods["items"]}


def test_network_policies_select_the_pools_pods(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """On the API server's own label selection: the engines' policy guards the engine
    pods and admits router and indexer pods to the KV event ports; Redis admits them."""
    ns, c = k8s_namespace, k8s_cluster
    apply(c, ns, "InferencePool", "llama", {"model": MODEL, "router": {"replicas": 1}})
    apply(c, ns, "DecodePool", "main", {"poolRef": {"name": "llama"}, "replicas": 1})
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=90)
    engines = c.kubectl_json("get", "networkpolicy", "llama-engines", "-n", ns)["spec"]
    assert selected_pods(c, ns, engines["podSelector"]) == {"decode"}
    events, http, peers = engines["ingress"]
    assert {p["port"] for p in events["ports"]} == {5557, 5558}
    assert selected_pods(c, ns, events["from"][0]["podSelector"]) == {"router", "indexer"}
    assert {p["port"] for p in http["ports"]} == {8000}
    assert selected_pods(c, ns, http["from"][0]["podSelector"]) == {"router"}
    assert "ports" not in peers and selected_pods(c, ns, peers["from"][0]["podSelector"]) == {
        "decode"
    }
    redis = c.kubectl_json("get", "networkpolicy", "llama-redis", "-n", ns)["spec"]
    assert selected_pods(c, ns, redis["podSelector"]) == {"redis"}
    assert selected_pods(c, ns, redis["ingress"][0]["from"][0]["podSelector"]) == {
        "router",
        "indexer",
    }


def test_router_indexer_and_redis_pass_the_restricted_pod_security_standard(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """In a namespace that enforces the restricted standard, the API server admits the
    router, indexer and Redis pods (engines run as their images need, so not there)."""
    ns, c = k8s_namespace, k8s_cluster
    c.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    apply(c, ns, "InferencePool", "llama", {"model": MODEL, "router": {"replicas": 1}})
    apply(c, ns, "DecodePool", "main", {"poolRef": {"name": "llama"}, "replicas": 1})

    def running() -> set[str]:
        pods = c.kubectl_json("get", "pods", "-n", ns)["items"]
        return {
            p["metadata"]["labels"]["kvplane.io/role"]
            for p in pods
            if p["status"].get("phase") == "Running"
        }

    c.wait_until(
        "router, indexer and Redis pods Running",
        lambda: {"router", "indexer", "redis"} <= running(),
        timeout_s=90,
    )


def test_same_model_in_two_namespaces_keeps_separate_residency(
    operator: KopfRunner,
    k8s_cluster: K8sCluster,
    k8s_namespace: str,
    other_namespace: str,
    redis_server: Any,
) -> None:
    """Two pools of one model and one name, in two namespaces, on one external Redis:
    each has its own generation tag, and deleting one removes only its keys."""
    import redis as redis_lib

    c = k8s_cluster
    spec = {
        "model": MODEL,
        "router": {"replicas": 1},
        "index": {"external": {"url": redis_server.url}},
    }
    for ns in (k8s_namespace, other_namespace):
        apply(c, ns, "InferencePool", "llama", spec)
        apply(c, ns, "DecodePool", "d", {"poolRef": {"name": "llama"}, "replicas": 1})
    c.wait_until(
        "both Ready",
        lambda: ready(c, k8s_namespace, "llama") and ready(c, other_namespace, "llama"),
        timeout_s=90,
    )
    tags = {}
    for ns in (k8s_namespace, other_namespace):
        pool = get(c, ns, "inferencepool", "llama")
        assert pool is not None
        tags[ns] = pool["status"]["generationTag"]
        config = c.kubectl_json("get", "configmap", "llama-router", "-n", ns)["data"]
        # parsed, not matched as text: a tag of twelve decimal digits is dumped quoted
        assert yaml.safe_load(config["router.yaml"])["model"]["generation"] == tags[ns]
    assert tags[k8s_namespace] != tags[other_namespace]
    r = redis_lib.Redis.from_url(redis_server.url)
    for tag in tags.values():
        r.hset(f"kvp:{{{tag}}}:inc", "pod-a", "1")
        r.hset(f"kvp:{{{tag}}}:b:abc", "pod-a\x1f1\x1fhbm", "0")
    c.kubectl(
        "delete", "inferencepool", "llama", "-n", other_namespace, "--wait=true", timeout_s=90
    )
    assert not list(r.scan_iter(f"kvp:{{{tags[other_namespace]}}}:*"))
    assert len(list(r.scan_iter(f"kvp:{{{tags[k8s_namespace]}}}:*"))) == 2
    assert ready(c, k8s_namespace, "llama")


def test_a_failing_pool_leaves_the_others_repaired(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str, other_namespace: str
) -> None:
    """A pool whose Services the API server refuses (a quota of none, in a namespace
    that lists first) is Degraded with the reason and retried on its own back-off; a
    Service deleted from a pool in another namespace comes back."""
    c, bad, good = k8s_cluster, other_namespace, k8s_namespace
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-services"},
        "spec": {"hard": {"services": "0"}},
    }
    c.apply(quota, namespace=bad)
    c.wait_until(
        "quota counted",
        lambda: (
            "services"
            in c.kubectl_json("get", "resourcequota", "no-services", "-n", bad)
            .get("status", {})
            .get("hard", {})
        ),
        timeout_s=30,
    )
    for ns in (bad, good):
        apply(c, ns, "InferencePool", "llama", {"model": MODEL, "router": {"replicas": 1}})
        apply(c, ns, "DecodePool", "d", {"poolRef": {"name": "llama"}, "replicas": 1})
    c.wait_until("the good pool Ready", lambda: ready(c, good, "llama"), timeout_s=90)
    c.wait_until(
        "the bad pool Degraded",
        lambda: degraded(c, bad, "inferencepool", "llama", "exceeded quota"),
        timeout_s=90,
    )
    cond = condition(get(c, bad, "inferencepool", "llama"), "Degraded")
    assert cond["reason"] == "ApplyRefused" and "cannot apply Service" in cond["message"]
    assert deployments(c, bad), "what the API server accepts is still applied"

    c.kubectl("delete", "service", "llama-router", "-n", good)
    c.wait_until(
        "the good pool's Service back",
        lambda: get(c, good, "service", "llama-router") is not None,
        timeout_s=60,
    )
    assert degraded(c, bad, "inferencepool", "llama", "exceeded quota")


def test_names_longer_than_a_label_are_reconciled(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """A valid custom-resource name longer than a label value or a Service name: every
    object gets a shortened, hashed name and label, and the pool becomes Ready."""
    from kvplane.operator.render import names as N

    ns, c = k8s_namespace, k8s_cluster
    name = "llama-" + "x" * 64
    apply(c, ns, "InferencePool", name, {"model": MODEL, "router": {"replicas": 1}})
    apply(c, ns, "DecodePool", "d" * 70, {"poolRef": {"name": name}, "replicas": 1})
    c.wait_until("long-named pool Ready", lambda: ready(c, ns, name), timeout_s=90)
    router = N.router_name(name)
    pool = get(c, ns, "inferencepool", name)
    assert pool is not None
    assert pool["status"]["routerEndpoint"] == f"http://{router}.{ns}.svc:8000"
    assert get(c, ns, "service", router) is not None
    assert all(len(d) <= 63 for d in deployments(c, ns))
    assert (get(c, ns, "decodepool", "d" * 70) or {}).get("status", {}).get("readyReplicas") == 1


def test_engine_pools_and_tiers_report_status(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """An engine pool whose poolRef names no pool says so; a tier says whether it is in
    use and valid for each pool that uses it."""
    ns, c = k8s_namespace, k8s_cluster
    apply(c, ns, "DecodePool", "lost", {"poolRef": {"name": "nope"}, "replicas": 1})
    c.wait_until(
        "orphan DecodePool Degraded",
        lambda: degraded(c, ns, "decodepool", "lost", "InferencePool nope"),
        timeout_s=60,
    )
    assert condition(get(c, ns, "decodepool", "lost"), "Degraded")["reason"] == "PoolNotFound"
    dram = {"tier": "dram", "backend": "native", "capacityPerPod": "64Gi", "bandwidthGbps": 50}
    apply(c, ns, "KVCacheTier", "dram", dram)
    apply(c, ns, "KVCacheTier", "dram2", dram)

    def tier(name: str) -> dict[str, Any]:
        return dict((get(c, ns, "kvcachetier", name) or {}).get("status") or {})

    c.wait_until("tier status", lambda: tier("dram").get("ready") is True, timeout_s=60)
    assert condition({"status": tier("dram")}, "InUse")["status"] == "False"

    tiers = [{"name": "dram"}, {"name": "dram2"}]
    spec = {"model": MODEL, "router": {"replicas": 1}, "kvCacheTiers": tiers}
    apply(c, ns, "InferencePool", "llama", spec)
    c.wait_until(
        "two dram tiers invalid for the pool",
        lambda: tier("dram").get("ready") is False,
        timeout_s=60,
    )
    assert "more than one dram tier" in condition({"status": tier("dram")}, "Ready")["message"]
    assert tier("dram2")["pools"] == ["llama"]
    apply(c, ns, "InferencePool", "llama", {**spec, "kvCacheTiers": [{"name": "dram"}]})
    apply(c, ns, "DecodePool", "lost", {"poolRef": {"name": "llama"}, "replicas": 1})
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=90)
    c.wait_until(
        "tiers updated",
        lambda: tier("dram").get("ready") is True and tier("dram2").get("pools") == [],
        timeout_s=60,
    )
    assert condition({"status": tier("dram")}, "InUse")["message"] == "used by InferencePool llama"
    assert condition(get(c, ns, "decodepool", "lost"), "Degraded")["status"] == "False"


def test_a_pool_created_with_all_its_parts_rolls_out_once(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """InferencePool, DecodePool, PrefillPool and tier applied together: rendered once,
    disaggregated from the start, so no Deployment is rolled a second time."""
    import yaml

    ns, c = k8s_namespace, k8s_cluster
    dram = {"tier": "dram", "backend": "native", "capacityPerPod": "64Gi", "bandwidthGbps": 50}
    nixl = {"connector": "nixl"}
    docs = [
        (
            "InferencePool",
            "pd",
            {"model": MODEL, "router": {"replicas": 1}, "kvCacheTiers": [{"name": "dram"}]},
        ),
        ("DecodePool", "d", {"poolRef": {"name": "pd"}, "replicas": 1, "kvTransfer": nixl}),
        ("PrefillPool", "p", {"poolRef": {"name": "pd"}, "replicas": 1, "kvTransfer": nixl}),
        ("KVCacheTier", "dram", dram),
    ]
    manifests = [
        {"apiVersion": "kvplane.io/v1alpha1", "kind": k, "metadata": {"name": n}, "spec": s}
        for k, n, s in docs
    ]
    c.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(manifests))
    c.wait_until("P/D pool Ready", lambda: ready(c, ns, "pd"), timeout_s=90)
    pool = get(c, ns, "inferencepool", "pd")
    assert pool is not None and pool["status"]["mode"] == "disaggregated"
    deps = deployments(c, ns)
    for name in ("pd-decode-d", "pd-prefill", "pd-router", "pd-indexer"):
        assert deps[name]["metadata"]["generation"] == 1, f"{name} was rolled again"


WEBHOOK = "admissionregistration.k8s.io/v1"


def test_transient_api_errors_are_retried(
    operator: KopfRunner, k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """While a webhook the API server cannot reach refuses Deployments (500), a deleted
    Deployment cannot come back: the pool says why, and its reconcile keeps retrying
    with back-off until the webhook is gone, when the Deployment returns."""
    ns, c = k8s_namespace, k8s_cluster
    apply(c, ns, "InferencePool", "llama", {"model": MODEL, "router": {"replicas": 1}})
    apply(c, ns, "DecodePool", "d", {"poolRef": {"name": "llama"}, "replicas": 1})
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=90)
    hook = {
        "apiVersion": WEBHOOK,
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"unreachable-{ns}"},
        "webhooks": [
            {
                "name": "unreachable.kvplane.test",
                "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                "rules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE", "UPDATE"],
                        "resources": ["deployments"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 2,
            }
        ],
    }
    c.apply(hook)
    try:
        c.kubectl("delete", "deployment", "llama-router", "-n", ns)
        c.wait_until(
            "the pool Degraded by the failing webhook",
            lambda: degraded(c, ns, "inferencepool", "llama", "failed calling webhook"),
            timeout_s=120,
        )
        cond = condition(get(c, ns, "inferencepool", "llama"), "Degraded")
        assert cond["reason"] == "ReconcileFailed"
    finally:
        c.kubectl("delete", "validatingwebhookconfiguration", f"unreachable-{ns}", check=False)
    c.wait_until(
        "router Deployment back", lambda: "llama-router" in deployments(c, ns), timeout_s=120
    )
    c.wait_until("Ready again", lambda: ready(c, ns, "llama"), timeout_s=90)


def test_every_rendered_object_reads_back_as_applied(
    k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    """What lets a pool at rest cost nothing: each object of every render scenario,
    applied to the API server and read back (defaults filled in, quantities
    canonicalised), still covers what was applied, so the operator never re-applies it."""
    import asyncio

    from kvplane.operator.compare import covers
    from kvplane.operator.render import inference_pool_objects
    from kvplane.router.kube import Kube, kind_key
    from test_render import OPERATOR_IMAGE, POOL, SCENARIOS

    ns = k8s_namespace

    async def scenario() -> None:
        client = await Kube.connect(str(k8s_cluster.kubeconfig))
        try:
            for s in SCENARIOS:
                objects = inference_pool_objects(
                    POOL,
                    ns,
                    s.spec(),
                    prefill=s.prefill_spec(),
                    decodes=s.decode_specs(),
                    tiers=s.tier_specs(),
                    default_image=OPERATOR_IMAGE,
                )
                for obj in objects:
                    await client.apply(obj, "kvplane-test")
                for obj in objects:
                    live = await client.get(kind_key(obj), ns, obj["metadata"]["name"])
                    assert live is not None and covers(live, obj), (s.name, obj["kind"], obj)
        finally:
            await client.close()

    # the gateway scenario renders GIE's InferencePool: its CRD, for this test only (other
    # modules' plain `inferencepool` names kvplane's)
    gie = "inferencepools.inference.networking.k8s.io"
    crd = Path(__file__).resolve().parents[1] / "third_party" / "gateway-api-inference-extension"
    k8s_cluster.kubectl("apply", "-f", str(crd / "inference.networking.k8s.io_inferencepools.yaml"))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{gie}", "--timeout=60s")
    try:
        asyncio.run(scenario())
    finally:
        k8s_cluster.kubectl("delete", "crd", gie, "--wait=true", timeout_s=90)
