"""The offline Kubernetes test control plane works: kubectl, fake GPU nodes, scheduling,
garbage collection, CRDs with CEL validation, ServiceAccount tokens + RBAC, helm."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
from kopf.testing import KopfRunner
from support.k8s_cluster import GPU_RESOURCE, K8sCluster

# Harmless if tests/conftest.py registers the plugin too (pytest loads it once).
pytestmark = pytest.mark.k8s


def _pods(cluster: K8sCluster, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "get", "pods", "-n", namespace, "-l", selector
    )["items"]
    return items


def test_kubectl_version_and_gpu_nodes(k8s_cluster: K8sCluster) -> None:
    version = k8s_cluster.kubectl_json("version")
    server, client = version["serverVersion"], version["clientVersion"]
    assert re.fullmatch(r"v1\.\d+\.\d+", server["gitVersion"]), server
    assert server["gitVersion"] == client["gitVersion"] == k8s_cluster.version
    assert server["major"] == "1" and server["minor"] == server["gitVersion"].split(".")[1]

    text = k8s_cluster.kubectl("get", "nodes", "-L", "topology.kubernetes.io/zone").stdout
    assert re.search(r"kwok-gpu-0\s+Ready", text) and re.search(r"kwok-gpu-1\s+Ready", text)

    nodes = {n["metadata"]["name"]: n for n in k8s_cluster.kubectl_json("get", "nodes")["items"]}
    gpu = {name for name, n in nodes.items() if n["status"]["allocatable"].get(GPU_RESOURCE)}
    assert gpu == set(k8s_cluster.gpu_nodes) == {"kwok-gpu-0", "kwok-gpu-1"}
    zones = set()
    for name in gpu:
        node = nodes[name]
        assert node["status"]["capacity"][GPU_RESOURCE] == "8"
        assert node["metadata"]["labels"]["nvidia.com/gpu.present"] == "true"
        zones.add(node["metadata"]["labels"]["topology.kubernetes.io/zone"])
        ready = [c for c in node["status"]["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        assert not node["spec"].get("taints")
    assert zones == {"zone-a", "zone-b"}


def test_gpu_deployment_runs_and_delete_cascades(
    k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    ns, app = k8s_namespace, "gpu-worker"
    k8s_cluster.apply(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": app, "labels": {"app": app}},
            "spec": {
                "replicas": 2,
                "selector": {"matchLabels": {"app": app}},
                "template": {
                    "metadata": {"labels": {"app": app}},
                    "spec": {
                        "containers": [
                            {
                                "name": "engine",
                                "image": "registry.invalid/kvplane/fake-engine:0",
                                "resources": {"limits": {GPU_RESOURCE: "1"}},
                            }
                        ]
                    },
                },
            },
        },
        namespace=ns,
    )

    def running() -> bool:
        pods = _pods(k8s_cluster, ns, f"app={app}")
        return len(pods) == 2 and all(
            p["status"].get("phase") == "Running" and p["status"].get("podIP") for p in pods
        )

    k8s_cluster.wait_until("2 Running GPU pods", running, timeout_s=90, component="kwok")
    nodes = {n["metadata"]["name"]: n for n in k8s_cluster.kubectl_json("get", "nodes")["items"]}
    for pod in _pods(k8s_cluster, ns, f"app={app}"):
        node = nodes[pod["spec"]["nodeName"]]
        assert pod["spec"]["nodeName"] in k8s_cluster.gpu_nodes
        cidr = ipaddress.ip_network(node["spec"]["podCIDR"])
        assert ipaddress.ip_address(pod["status"]["podIP"]) in cidr
        assert pod["metadata"]["ownerReferences"][0]["kind"] == "ReplicaSet"
    (rs,) = k8s_cluster.kubectl_json("get", "rs", "-n", ns, "-l", f"app={app}")["items"]
    assert rs["metadata"]["ownerReferences"][0]["kind"] == "Deployment"

    # kwok's pod IPs are valid endpoint addresses (not loopback): a Service gets them.
    k8s_cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": app},
            "spec": {"selector": {"app": app}, "ports": [{"port": 8000}]},
        },
        namespace=ns,
    )
    pod_ips = {p["status"]["podIP"] for p in _pods(k8s_cluster, ns, f"app={app}")}

    def endpoints_ready() -> bool:
        slices = k8s_cluster.kubectl_json(
            "get", "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={app}"
        )["items"]
        ready = {
            addr
            for sl in slices
            for ep in sl.get("endpoints") or []
            if ep.get("conditions", {}).get("ready")
            for addr in ep["addresses"]
        }
        return ready == pod_ips

    k8s_cluster.wait_until("EndpointSlice with both pod IPs", endpoints_ready, timeout_s=30)

    # Default (background) cascade: the garbage collector removes the ReplicaSet, which
    # removes the pods; kwok completes their deletion.
    k8s_cluster.kubectl("delete", "deployment", app, "-n", ns)

    def gone() -> bool:
        left = k8s_cluster.kubectl_json("get", "rs,pods", "-n", ns, "-l", f"app={app}")
        return not left["items"]

    k8s_cluster.wait_until(
        "ReplicaSet and pods garbage-collected",
        gone,
        timeout_s=60,
        component="kube-controller-manager",
    )


def test_gpu_capacity_is_enforced(k8s_cluster: K8sCluster, k8s_namespace: str) -> None:
    k8s_cluster.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "too-big"},
            "spec": {
                "containers": [
                    {
                        "name": "engine",
                        "image": "registry.invalid/kvplane/fake-engine:0",
                        "resources": {"limits": {GPU_RESOURCE: "9"}},
                    }
                ]
            },
        },
        namespace=k8s_namespace,
    )
    message = ""

    def unschedulable() -> bool:
        nonlocal message
        pod = k8s_cluster.kubectl_json("get", "pod", "too-big", "-n", k8s_namespace)
        for c in pod["status"].get("conditions", []):
            if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable":
                message = c.get("message", "")
                return True
        return False

    k8s_cluster.wait_until("scheduler verdict", unschedulable, timeout_s=60)
    assert f"Insufficient {GPU_RESOURCE}" in message


CRD = """\
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.envtest.kvplane.io
spec:
  group: envtest.kvplane.io
  scope: Namespaced
  names: {kind: Widget, plural: widgets, singular: widget}
  versions:
    - name: v1
      served: true
      storage: true
      subresources: {status: {}}
      schema:
        openAPIV3Schema:
          type: object
          properties:
            spec:
              type: object
              required: [minReplicas, maxReplicas]
              properties:
                minReplicas: {type: integer, minimum: 0}
                maxReplicas: {type: integer}
              x-kubernetes-validations:
                - rule: "self.minReplicas <= self.maxReplicas"
                  message: "minReplicas must not exceed maxReplicas"
"""


def _widget(name: str, lo: int, hi: int) -> str:
    return json.dumps(
        {
            "apiVersion": "envtest.kvplane.io/v1",
            "kind": "Widget",
            "metadata": {"name": name},
            "spec": {"minReplicas": lo, "maxReplicas": hi},
        }
    )


@pytest.fixture(scope="module")
def widget_crd(k8s_cluster: K8sCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Widget CRD, applied with ``kubectl apply -f`` and Established."""
    crd = tmp_path_factory.mktemp("crd") / "crd.yaml"
    crd.write_text(CRD)
    k8s_cluster.kubectl("apply", "-f", str(crd))
    try:
        k8s_cluster.kubectl(
            "wait",
            "--for=condition=Established",
            "crd/widgets.envtest.kvplane.io",
            "--timeout=60s",
        )
        yield "widgets.envtest.kvplane.io"
    finally:
        k8s_cluster.kubectl("delete", "-f", str(crd), "--wait=false", check=False)


def test_crd_with_cel_validation(
    k8s_cluster: K8sCluster, k8s_namespace: str, widget_crd: str
) -> None:
    ns = ["-n", k8s_namespace]
    k8s_cluster.kubectl("apply", *ns, "-f", "-", input=_widget("ok", 1, 3))
    bad = k8s_cluster.kubectl("apply", *ns, "-f", "-", input=_widget("bad", 5, 2), check=False)
    assert bad.returncode != 0
    assert "minReplicas must not exceed maxReplicas" in bad.stderr, bad.stderr
    served = k8s_cluster.kubectl_json("get", "widgets", *ns)["items"]
    assert [w["metadata"]["name"] for w in served] == ["ok"]


OPERATOR = """\
import kopf


@kopf.on.create("envtest.kvplane.io", "v1", "widgets")
def seen(spec, patch, **_):
    patch.metadata.annotations["envtest.kvplane.io/seen-max"] = str(spec["maxReplicas"])
"""


# What a namespaced kopf operator needs. kopf watches CRDs and namespaces cluster-wide even
# with --namespace; without the ClusterRole its observers get 403s (docs/k8s-test-env.md).
KOPF_RBAC = """\
apiVersion: v1
kind: ServiceAccount
metadata: {{name: kopf, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: widget-operator, namespace: {ns}}}
rules:
  - apiGroups: [envtest.kvplane.io]
    resources: [widgets]
    verbs: [get, list, watch, patch]
  - apiGroups: ["", events.k8s.io]
    resources: [events]
    verbs: [create, patch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: kopf-widget-operator, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: widget-operator}}
subjects: [{{kind: ServiceAccount, name: kopf, namespace: {ns}}}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {{name: {ns}-kopf}}
rules:
  - apiGroups: [apiextensions.k8s.io]
    resources: [customresourcedefinitions]
    verbs: [list, watch]
  - apiGroups: [""]
    resources: [namespaces]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {{name: {ns}-kopf}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: {ns}-kopf}}
subjects: [{{kind: ServiceAccount, name: kopf, namespace: {ns}}}]
"""


@contextlib.contextmanager
def _fresh_registry() -> Iterator[kopf.OperatorRegistry]:
    """A registry of its own (other tests in this process registered kvplane's
    handlers), restored afterwards: KopfRunner makes it the process default."""
    previous = kopf.get_default_registry()
    registry = kopf.OperatorRegistry()
    kopf.on.login(registry=registry)(kopf.login_with_kubeconfig)  # needs no client library
    try:
        yield registry
    finally:
        kopf.set_default_registry(previous)


def test_kopf_operator_with_service_account_rbac(
    k8s_cluster: K8sCluster, k8s_namespace: str, widget_crd: str, tmp_path: Path
) -> None:
    """kopf (in-process, KopfRunner) logs in with a ServiceAccount token limited to a Role."""
    ns = k8s_namespace
    k8s_cluster.apply(KOPF_RBAC.format(ns=ns))
    operator = tmp_path / "operator.py"
    operator.write_text(OPERATOR)
    kubeconfig = k8s_cluster.service_account_kubeconfig(ns, "kopf")

    def annotated() -> bool:
        w = k8s_cluster.kubectl_json("get", "widget", "w1", "-n", ns)
        return bool(w["metadata"].get("annotations", {}).get("envtest.kvplane.io/seen-max") == "4")

    args = ["run", "--standalone", f"--namespace={ns}", "--verbose", str(operator)]
    with (
        k8s_cluster.activated(kubeconfig),
        _fresh_registry() as registry,
        KopfRunner(args, timeout=60, registry=registry) as runner,
    ):
        k8s_cluster.kubectl("apply", "-n", ns, "-f", "-", input=_widget("w1", 1, 4))
        k8s_cluster.wait_until("kopf handler annotation", annotated, timeout_s=30)
    k8s_cluster.kubectl("delete", f"clusterrolebinding/{ns}-kopf", f"clusterrole/{ns}-kopf")
    assert runner.exit_code == 0, runner.output
    assert "Handler 'seen' succeeded" in runner.output
    assert "Forbidden" not in runner.output


def test_service_account_token_gets_only_its_rbac(
    k8s_cluster: K8sCluster, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    k8s_cluster.kubectl("create", "serviceaccount", "operator", "-n", ns)
    sa_kubeconfig = k8s_cluster.service_account_kubeconfig(ns, "operator")

    who = k8s_cluster.kubectl_json("auth", "whoami", kubeconfig=sa_kubeconfig)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{ns}:operator"
    denied = k8s_cluster.kubectl("get", "pods", "-n", ns, kubeconfig=sa_kubeconfig, check=False)
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()

    k8s_cluster.kubectl(
        "create", "role", "pod-reader", "--verb=get,list,watch", "--resource=pods", "-n", ns
    )
    k8s_cluster.kubectl(
        "create",
        "rolebinding",
        "operator-reads-pods",
        "--role=pod-reader",
        f"--serviceaccount={ns}:operator",
        "-n",
        ns,
    )

    def allowed() -> bool:
        proc = k8s_cluster.kubectl("get", "pods", "-n", ns, kubeconfig=sa_kubeconfig, check=False)
        return proc.returncode == 0

    k8s_cluster.wait_until("RoleBinding to take effect", allowed, timeout_s=30)
    cluster_wide = k8s_cluster.kubectl("get", "pods", "-A", kubeconfig=sa_kubeconfig, check=False)
    assert cluster_wide.returncode != 0 and "forbidden" in cluster_wide.stderr.lower()


def test_helm_version_and_install(
    k8s_cluster: K8sCluster, k8s_namespace: str, tmp_path: Path
) -> None:
    short = k8s_cluster.helm("version", "--short").stdout.strip()
    assert re.fullmatch(r"v3\.\d+\.\d+(\+g?[0-9a-f]*)?", short), short

    chart = tmp_path / "probe"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text(
        "apiVersion: v2\nname: probe\nversion: 0.1.0\nkubeVersion: '>=1.29.0-0'\n"
    )
    (chart / "templates" / "cm.yaml").write_text(
        textwrap.dedent(
            """\
            apiVersion: v1
            kind: ConfigMap
            metadata:
              name: {{ .Release.Name }}-probe
            data:
              kubeVersion: {{ .Capabilities.KubeVersion.Version | quote }}
            """
        )
    )
    # Offline rendering uses the Kubernetes version stamped into helm, not v1.20.
    offline = k8s_cluster.helm("template", "p", str(chart)).stdout
    minor = k8s_cluster.version.split(".")[1]
    assert f'kubeVersion: "v1.{minor}.0"' in offline, offline

    k8s_cluster.helm("install", "p", str(chart), "-n", k8s_namespace, "--wait", "--timeout=60s")
    cm = k8s_cluster.kubectl_json("get", "configmap", "p-probe", "-n", k8s_namespace)
    assert cm["data"]["kubeVersion"] == k8s_cluster.version
    k8s_cluster.helm("uninstall", "p", "-n", k8s_namespace)
