"""Deployment artifacts: the Helm chart (charts/kvplane), the kustomize bases (config/),
the Dockerfile, and the operator running with nothing but the chart's RBAC.

Rendering, lint, dashboards, kustomize and the Dockerfile need no cluster (only the helm
and kubectl binaries of scripts/setup-k8s.sh); the tests marked ``k8s`` install the chart
into the local control plane (docs/k8s-test-env.md).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from kopf.testing import KopfRunner
from kvplane.router.index.base import Blocks
from kvplane.router.index.redis import RedisIndex
from kvplane.router.tiers import Tier
from support.k8s_cluster import K8sCluster, K8sError, find_bin_dir

from kvplane.local import redis as local_redis
from kvplane.types import Json

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "kvplane"
CRDS = REPO / "crds"
CONFIG = REPO / "config"
SGLANG_METRICS = Path(__file__).parent / "data" / "sglang-metrics.txt"
VLLM_METRICS = Path(__file__).parent / "data" / "vllm-0.32-metrics.txt"
MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}
RELEASE = "kvp"


# --- tools -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    try:
        return find_bin_dir()
    except K8sError as exc:
        pytest.skip(f"helm/kubectl not built: {exc}")


@pytest.fixture(scope="module")
def tool_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """helm and kubectl without a cluster: private helm dirs, no kubeconfig."""
    home = tmp_path_factory.mktemp("helm")
    env = dict(os.environ)
    env.update(
        HELM_CACHE_HOME=str(home / "cache"),
        HELM_CONFIG_HOME=str(home / "config"),
        HELM_DATA_HOME=str(home / "data"),
        KUBECONFIG=str(home / "none.kubeconfig"),
    )
    return env


Tool = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def tool(bin_dir: Path, tool_env: dict[str, str]) -> Tool:
    def run(name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(bin_dir / name), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=tool_env,
            check=False,
            cwd=REPO,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{name} {' '.join(args)}:\n{proc.stderr}\n{proc.stdout}")
        return proc

    return run


def set_args(values: dict[str, str]) -> list[str]:
    return [a for k, v in values.items() for a in ("--set", f"{k}={v}")]


Render = Callable[..., list[Json]]


@pytest.fixture(scope="module")
def render(tool: Tool) -> Render:
    """``helm template`` with ``--set`` values, as parsed objects."""

    def template(
        namespace: str = "kvplane-system", set_json: tuple[str, ...] = (), **values: str
    ) -> list[Json]:
        json_args = [a for v in set_json for a in ("--set-json", v)]
        out = tool(
            "helm", "template", RELEASE, str(CHART), "-n", namespace, *set_args(values), *json_args
        ).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    return template


def find(objs: list[Json], kind: str, name: str | None = None) -> list[Json]:
    return [
        o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
    ]


def one(objs: list[Json], kind: str, name: str | None = None) -> Json:
    found = find(objs, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} {name or ''}"
    return found[0]


def env_of(container: Json) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", []) if "value" in e}


# Value sets every lint/render test covers: the modes that change the RBAC shape.
MODES: dict[str, dict[str, str]] = {
    "cluster-wide": {},
    "namespaced": {"watchNamespaces": "{team-a,team-b}"},
    "cluster-wide-peering": {"operator.replicas": "2"},
    "namespaced-peering": {"operator.replicas": "3", "watchNamespaces": "{team-a}"},
    "everything": {
        "redis.enabled": "true",
        "samples.enabled": "true",
        "imagePullSecrets[0].name": "regcred",
        "nodeSelector.pool": "system",
        "tolerations[0].key": "dedicated",
        "tolerations[0].operator": "Exists",
        "dashboards.annotations.grafana_folder": "kvplane",
    },
    "minimal": {"dashboards.enabled": "false", "rbac.create": "false"},
    "redis-cluster": {
        "redis.enabled": "true",
        "redis.cluster.enabled": "true",
        "redis.cluster.shards": "5",
        "redis.cluster.storage": "64Mi",
    },
}


# --- one source of truth -------------------------------------------------------------------


@pytest.mark.parametrize("copy", ["charts/kvplane/crds", "config/crd"])
def test_crd_copies_are_the_generated_crds(copy: str) -> None:
    """Helm installs charts/kvplane/crds/, kustomize config/crd/; both must be exactly the
    generated crds/ (refresh: cp crds/*.yaml <copy>/)."""
    generated = sorted(p.name for p in CRDS.glob("*.yaml"))
    copied = sorted(p.name for p in (REPO / copy).glob("kvplane.io_*.yaml"))
    assert copied == generated, f"run: cp crds/*.yaml {copy}/"
    for name in generated:
        assert (REPO / copy / name).read_bytes() == (CRDS / name).read_bytes(), (
            f"{copy}/{name} differs from crds/{name}: run cp crds/*.yaml {copy}/"
        )


def test_samples_are_one_file_and_valid() -> None:
    from kvplane.operator import api

    chart_example = CHART / "examples" / "inferencepool.yaml"
    assert (CONFIG / "samples" / "inferencepool.yaml").read_bytes() == chart_example.read_bytes()
    docs = [d for d in yaml.safe_load_all(chart_example.read_text()) if d]
    assert [d["kind"] for d in docs] == ["InferencePool", "DecodePool"]
    pool = api.InferencePoolSpec.model_validate(docs[0]["spec"])
    decode = api.EnginePoolSpec.model_validate(docs[1]["spec"])
    assert decode.pool_ref.name == docs[0]["metadata"]["name"]
    assert pool.model.kv_bytes() == 131072


# --- helm lint / template ------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_helm_lint_is_clean(tool: Tool, mode: str) -> None:
    out = tool("helm", "lint", "--strict", str(CHART), *set_args(MODES[mode])).stdout
    assert "1 chart(s) linted, 0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out, out


@pytest.mark.parametrize("mode", list(MODES))
def test_helm_template_renders_valid_objects(render: Render, mode: str) -> None:
    objs = render(**MODES[mode])
    for o in objs:
        assert {"apiVersion", "kind", "metadata"} <= set(o), o
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", o["metadata"]["name"])
        assert len(o["metadata"]["name"]) <= 63 or o["kind"] == "CustomResourceDefinition"
    text = json.dumps(objs)
    assert '"*"' not in text, "no wildcards anywhere"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"operator.replicas": "-1"}, "'/operator/replicas': minimum"),
        ({"image.pullPolicy": "Sometimes"}, "'/image/pullPolicy': value must be one of"),
        ({"watchNamespaces": "{Not_A_Namespace}"}, "'Not_A_Namespace' does not match pattern"),
        ({"resyncSeconds": "0"}, "'/resyncSeconds': exclusiveMinimum"),
        ({"operator.logLevel": "chatty"}, "'/operator/logLevel': value must be one of"),
        ({"redis.maxMemoryMiB": "lots"}, "'/redis/maxMemoryMiB': got string, want integer"),
        ({"dashboards.enabled": "yes-please"}, "'/dashboards/enabled': got string"),
        ({"operatr.replicas": "2"}, "additional properties 'operatr' not allowed"),
    ],
)
def test_values_schema_rejects_bad_values(tool: Tool, values: dict[str, str], message: str) -> None:
    for command in ("template", "lint"):
        args = [RELEASE] if command == "template" else []
        proc = tool("helm", command, *args, str(CHART), *set_args(values), check=False)
        assert proc.returncode != 0, f"helm {command} accepted {values}"
        assert "schema" in (proc.stderr + proc.stdout).lower()
        assert message in proc.stderr + proc.stdout


def test_operator_deployment_is_hardened(render: Render) -> None:
    objs = render()
    dep = one(objs, "Deployment")
    assert dep["spec"]["replicas"] == 1
    assert dep["spec"]["strategy"] == {"type": "Recreate"}, "never two standalone operators"
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == one(objs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 65532
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert c["image"] == "ghcr.io/kvplane/kvplane:0.1.0"  # appVersion
    assert c["args"] == ["--log-level", "info", "operator", "--health-port", "8080"]
    probe = c["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert {"name": "health", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert probe["port"] == "health"
    assert c["resources"]["requests"] and c["resources"]["limits"]["memory"]
    assert env_of(c) == {
        "KVPLANE_IMAGE": "ghcr.io/kvplane/kvplane:0.1.0",
        "KVPLANE_RESYNC_SECONDS": "30",
        "KVPLANE_DISCOVERY_CLUSTERROLE": DISCOVERY,
        "KVPLANE_WATCH_NAMESPACES": "",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    assert {"name": "tmp", "mountPath": "/tmp"} in c["volumeMounts"]
    assert not find(objs, "CustomResourceDefinition"), "kvplane CRDs live in crds/"
    assert not find(objs, "ClusterKopfPeering") and not find(objs, "KopfPeering")


def test_values_reach_the_operator(render: Render) -> None:
    objs = render(
        set_json=("resyncSeconds=12.5",),
        **{
            "image.repository": "registry.example/kvplane",
            "image.tag": "dev-1",
            "image.pullPolicy": "Always",
            "imagePullSecrets[0].name": "regcred",
            "watchNamespaces": "{team-a,team-b}",
            "operator.logLevel": "debug",
            "operator.resources.requests.cpu": "2",
            "nodeSelector.pool": "system",
            "tolerations[0].key": "dedicated",
            "tolerations[0].operator": "Exists",
        },
    )
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["image"] == "registry.example/kvplane:dev-1" and c["imagePullPolicy"] == "Always"
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["nodeSelector"] == {"pool": "system"}
    assert pod["tolerations"] == [{"key": "dedicated", "operator": "Exists"}]
    assert c["resources"]["requests"]["cpu"] == 2
    assert c["args"][:2] == ["--log-level", "debug"]
    env = env_of(c)
    assert env["KVPLANE_IMAGE"] == "registry.example/kvplane:dev-1"
    assert env["KVPLANE_RESYNC_SECONDS"] == "12.5"
    assert env["KVPLANE_WATCH_NAMESPACES"] == "team-a,team-b"


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]])
def test_replicas_enable_kopf_peering(render: Render, watch: list[str]) -> None:
    values = {"operator.replicas": "2"}
    if watch:
        values["watchNamespaces"] = "{" + ",".join(watch) + "}"
    objs = render(**values)
    dep = one(objs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    pod = dep["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    name = env_of(c)["KVPLANE_PEERING"]
    assert name == f"kvplane-system-{RELEASE}-kvplane"
    pod_id = next(e for e in c["env"] if e["name"] == "POD_ID")
    assert pod_id["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert pod["affinity"]["podAntiAffinity"], "replicas spread over nodes"
    crds = {c["metadata"]["name"]: c for c in find(objs, "CustomResourceDefinition")}
    assert set(crds) == {"kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    assert crds["kopfpeerings.kopf.dev"]["spec"]["scope"] == "Namespaced"
    assert crds["clusterkopfpeerings.kopf.dev"]["spec"]["scope"] == "Cluster"
    for crd in crds.values():
        assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    if watch:
        peerings = find(objs, "KopfPeering")
        assert sorted(p["metadata"]["namespace"] for p in peerings) == watch
    else:
        peerings = find(objs, "ClusterKopfPeering")
        assert len(peerings) == 1 and "namespace" not in peerings[0]["metadata"]
    for p in peerings:
        assert p["metadata"]["name"] == name
        assert p["metadata"]["annotations"]["helm.sh/hook"] == "post-install,post-upgrade"
    rules = all_rules(objs)
    plural = "kopfpeerings" if watch else "clusterkopfpeerings"
    assert ("kopf.dev", plural, "patch") in rules
    assert not find(
        render(**values, **{"peering.installCRDs": "false"}), "CustomResourceDefinition"
    )


# --- RBAC ------------------------------------------------------------------------------------


Rule = tuple[str, str, str]  # (apiGroup, resource, verb); "resource:name" when named


def expand(rules: list[Json]) -> set[Rule]:
    out = set()
    for r in rules:
        assert set(r) <= {"apiGroups", "resources", "verbs", "resourceNames"}, r  # no URLs
        names = r.get("resourceNames")
        assert names is None or r["verbs"] == ["bind"], "only bind is limited by name"
        for g in r["apiGroups"]:
            for res in r["resources"]:
                for v in r["verbs"]:
                    for name in names or [None]:
                        out.add((g, f"{res}:{name}" if name else res, v))
    return out


DISCOVERY = f"kvplane-system-{RELEASE}-kvplane-discovery"


def operator_roles(objs: list[Json]) -> list[Json]:
    """The operator's (Cluster)Roles: all but the discovery ClusterRole it binds."""
    return [
        o
        for o in find(objs, "ClusterRole") + find(objs, "Role")
        if not o["metadata"]["name"].endswith("-discovery")
    ]


def all_rules(objs: list[Json]) -> set[Rule]:
    rules: set[Rule] = set()
    for o in operator_roles(objs):
        rules |= expand(o["rules"])
    return rules


# What the operator does, from the code (controller.py, informer.py, reconcile.py,
# handlers.py, router/kube.py) and kopf. The RBAC tests below prove it is enough; this
# list proves it is no more.
RENDERED = {
    ("apps", "deployments"),
    ("", "services"),
    ("", "configmaps"),
    ("", "serviceaccounts"),
    ("autoscaling", "horizontalpodautoscalers"),
    ("networking.k8s.io", "networkpolicies"),
    ("rbac.authorization.k8s.io", "rolebindings"),
    ("inference.networking.k8s.io", "inferencepools"),  # GIE's, with spec.gateway
}


def namespaced_rules(discovery: str = DISCOVERY) -> set[Rule]:
    return (
        {("kvplane.io", "inferencepools", v) for v in ("get", "list", "watch", "patch")}
        | {
            ("kvplane.io", r, v)
            for r in ("prefillpools", "decodepools", "kvcachetiers")
            for v in ("list", "watch")
        }
        | {("kvplane.io", r, "patch") for r in ("prefillpools", "decodepools")}  # the planner
        | {
            ("kvplane.io", f"{r}/status", "patch")
            for r in ("inferencepools", "prefillpools", "decodepools", "kvcachetiers")
        }
        | {(g, r, v) for g, r in RENDERED for v in ("list", "watch", "create", "patch", "delete")}
        | {("rbac.authorization.k8s.io", f"clusterroles:{discovery}", "bind")}
        | {("", "events", "create")}
        | {("", "secrets", "create")}  # the managed Redis' password, made once
    )


SECRETS: set[Rule] = {("", "secrets", "get")}
KOPF_CLUSTER_RULES: set[Rule] = {
    ("apiextensions.k8s.io", "customresourcedefinitions", "list"),
    ("apiextensions.k8s.io", "customresourcedefinitions", "watch"),
}


def test_cluster_wide_rbac_is_exactly_what_the_operator_needs(render: Render) -> None:
    """No Secret read, no Role, no pods: the operator binds one ClusterRole for discovery."""
    objs = render()
    (role,) = operator_roles(objs)
    assert not find(objs, "Role") and not find(objs, "RoleBinding")
    assert expand(role["rules"]) == namespaced_rules() | KOPF_CLUSTER_RULES
    binding = one(objs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    sa = one(objs, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["name"], "namespace": "kvplane-system"}
    ]
    # cluster-scoped names carry the release namespace: two releases never collide
    assert role["metadata"]["name"] == f"kvplane-system-{RELEASE}-kvplane"
    discovery = one(objs, "ClusterRole", DISCOVERY)
    assert expand(discovery["rules"]) == {("", "pods", v) for v in ("get", "list", "watch")}
    (c,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert env_of(c)["KVPLANE_DISCOVERY_CLUSTERROLE"] == DISCOVERY
    opted_in = render(**{"rbac.readSecrets": "true"})
    assert all_rules(opted_in) == namespaced_rules() | KOPF_CLUSTER_RULES | SECRETS


def test_namespaced_rbac_is_a_role_per_watched_namespace(render: Render) -> None:
    """The namespaced mode: Secrets are readable, in the watched namespaces only."""
    objs = render(watchNamespaces="{team-a,team-b}")
    (cluster,) = [o for o in operator_roles(objs) if o["kind"] == "ClusterRole"]
    assert expand(cluster["rules"]) == KOPF_CLUSTER_RULES | {
        ("", "namespaces", "list"),
        ("", "namespaces", "watch"),
    }
    roles = find(objs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert expand(role["rules"]) == namespaced_rules() | SECRETS
    bindings = find(objs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"][0]["namespace"] == "kvplane-system"
        assert b["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": "Role",
            "name": roles[0]["metadata"]["name"],
        }


def test_rbac_and_service_account_can_be_left_out(render: Render) -> None:
    objs = render(**{"rbac.create": "false", "serviceAccount.create": "false"})
    assert not {o["kind"] for o in objs} & {
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ServiceAccount",
    }
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "default"


# --- the rest of the chart ---------------------------------------------------------------------


def test_optional_redis_and_samples(render: Render) -> None:
    assert not find(render(), "Service")
    objs = render(**{"redis.enabled": "true", "samples.enabled": "true"}, namespace="ml")
    redis = one(objs, "Deployment", f"{RELEASE}-kvplane-redis")
    pod = redis["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["args"][c["args"].index("--maxmemory") + 1] == "1024mb"
    svc = one(objs, "Service", f"{RELEASE}-kvplane-redis")
    assert svc["spec"]["ports"][0]["port"] == 6379
    pool = one(objs, "InferencePool")
    decode = one(objs, "DecodePool")
    assert pool["metadata"]["namespace"] == decode["metadata"]["namespace"] == "ml"
    assert decode["spec"]["poolRef"]["name"] == pool["metadata"]["name"]
    assert pool["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE


def test_optional_redis_requires_a_generated_password(render: Render) -> None:
    objs = render(**{"redis.enabled": "true"})
    secret = one(objs, "Secret", f"{RELEASE}-kvplane-redis-auth")
    password = base64.b64decode(secret["data"]["password"]).decode()
    conf = base64.b64decode(secret["data"]["redis.conf"]).decode()
    assert len(password) == 32 and f"requirepass {password}" in conf
    (c,) = one(objs, "Deployment", f"{RELEASE}-kvplane-redis")["spec"]["template"]["spec"][
        "containers"
    ]
    assert c["args"][:2] == ["redis-server", "/etc/kvplane-redis/redis.conf"]
    assert "--protected-mode" not in c["args"] and password not in json.dumps(c)
    assert c["env"][0]["name"] == "REDISCLI_AUTH"


def test_optional_redis_cluster(render: Render) -> None:
    objs = render(**MODES["redis-cluster"], namespace="ml")
    name = f"{RELEASE}-kvplane-redis"
    sts = one(objs, "StatefulSet", name)
    assert sts["spec"]["replicas"] == 5 and sts["spec"]["serviceName"] == f"{name}-nodes"
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--cluster-enabled") + 1] == "yes"
    claim = sts["spec"]["volumeClaimTemplates"][0]
    assert claim["spec"]["resources"]["requests"]["storage"] == "64Mi"
    headless = one(objs, "Service", f"{name}-nodes")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"]
    job = one(objs, "Job", f"{name}-create")
    (j,) = job["spec"]["template"]["spec"]["containers"]
    nodes = env_of(j)["NODES"].split()
    assert nodes == [f"{name}-{i}.{name}-nodes.ml.svc:6379" for i in range(5)]
    assert not find(objs, "Deployment", name)


def test_the_cluster_job_forms_a_cluster_the_index_uses(render: Render, tmp_path: Path) -> None:
    """The Job's script, run against three redis-servers in cluster mode with the chart's
    password config: the cluster forms, a second run leaves it alone, and the index
    spreads over its nodes."""
    objs = render(**MODES["redis-cluster"])
    script = one(objs, "Job")["spec"]["template"]["spec"]["containers"][0]["args"][0]
    secret = one(objs, "Secret")
    password = base64.b64decode(secret["data"]["password"]).decode()
    conf = tmp_path / "redis.conf"
    conf.write_bytes(base64.b64decode(secret["data"]["redis.conf"]))
    with local_redis.running(3, form=False, config_file=str(conf), password=password) as nodes:
        env = {**os.environ, "REDISCLI_AUTH": password}
        env["NODES"] = " ".join(f"127.0.0.1:{p}" for p in nodes.ports)
        for _ in range(2):  # forms the cluster, then finds it formed
            done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True)
            assert done.returncode == 0, done.stdout + done.stderr

        async def use() -> None:
            index = RedisIndex(nodes.url, "chart", password=password)
            keys = list(range(1 << 40, (1 << 40) + 64 * 16, 16))
            try:
                await index.begin_incarnation("a", "1")
                await index.store("a", "1", Blocks.of_prompt(keys), Tier.HBM)
                assert (await index.lookup(keys, ["a"]))["a"][Tier.HBM] == len(keys)
                assert index.nodes.cluster and index.nodes.count == 3
            finally:
                await index.close()

        asyncio.run(use())


def dashboard_files() -> dict[str, Json]:
    files = sorted((CHART / "dashboards").glob("*.json"))
    return {p.stem: json.loads(p.read_text()) for p in files}


def test_dashboards_are_configmaps_for_the_grafana_sidecar(render: Render) -> None:
    boards = dashboard_files()
    assert set(boards) == {"router", "engines", "engines-sglang", "pd", "tiers"}
    cms = {c["metadata"]["name"]: c for c in find(render(), "ConfigMap")}
    assert set(cms) == {f"{RELEASE}-kvplane-dashboard-{n}" for n in boards}
    for name, board in boards.items():
        cm = cms[f"{RELEASE}-kvplane-dashboard-{name}"]
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert json.loads(cm["data"][f"kvplane-{name}.json"]) == board
        assert board["uid"].startswith("kvplane-") and board["panels"]
    custom = render(
        **{
            "dashboards.label": "my_dashboards",
            "dashboards.labelValue": "kvplane",
            "dashboards.namespace": "monitoring",
        }
    )
    for cm in find(custom, "ConfigMap"):
        assert cm["metadata"]["labels"]["my_dashboards"] == "kvplane"
        assert "grafana_dashboard" not in cm["metadata"]["labels"]
        assert cm["metadata"]["namespace"] == "monitoring"
    assert not find(render(**{"dashboards.enabled": "false"}), "ConfigMap")


def exprs(board: Json) -> list[str]:
    out = []
    for panel in board["panels"]:
        out += [t["expr"] for t in panel.get("targets", [])]
    return out


_FUNCTION_OR_KEYWORD = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring"}
_KEYWORDS |= {"group_left", "group_right"}


def promql_metrics(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names in matchers or grouping clauses, or range durations."""
    assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    s = re.sub(r"\{[^}]*\}", "", s)
    s = re.sub(r"\[[^\]]*\]", "", s)
    s = _FUNCTION_OR_KEYWORD.sub("", s)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("(") or m.group(0) in _KEYWORDS:
            continue
        names.add(m.group(0))
    return names


def test_promql_metric_extraction() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, pod) (rate(a_bucket{pool=~"$pool"}'
        "[$__rate_interval]))) / on (pod) group_left b:c_total offset 5m"
    )
    assert promql_metrics(expr) == {"a_bucket", "b:c_total"}


def known_metrics() -> set[str]:
    """Every series name kvplane, vLLM 0.32 and SGLang export."""
    from kvplane.router.telemetry import RouterMetrics, indexer_blocks
    from prometheus_client import CollectorRegistry

    suffixes = {
        "counter": ("_total", "_created"),
        "histogram": ("_bucket", "_sum", "_count", "_created"),
        "gauge": ("",),
    }
    names: set[str] = set()
    indexer_registry = CollectorRegistry()
    indexer_blocks(indexer_registry)
    for registry in (RouterMetrics("p", "m").registry, indexer_registry):
        for family in registry.collect():
            names |= {family.name + s for s in suffixes[family.type]}
    indexer = (REPO / "router" / "indexer_main.py").read_text()
    for name in re.findall(r'CounterMetricFamily\(\s*"(kvplane_\w+)"', indexer):
        names.add(name + "_total")
    for page in (VLLM_METRICS, SGLANG_METRICS):
        for line in page.read_text().splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def test_dashboard_queries_name_only_real_metrics() -> None:
    known = known_metrics()
    assert "kvplane_router_decisions_total" in known and "vllm:prefix_cache_hits_total" in known
    for name, board in dashboard_files().items():
        queries = exprs(board)
        assert queries, name
        variables = [
            v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"
        ]
        used: set[str] = set()
        for expr in queries:
            metrics = promql_metrics(expr)
            assert metrics, expr
            used |= metrics
        for q in variables:
            m = re.fullmatch(r"label_values\((\w[\w:]*)(\{[^}]*\})?, *\w+\)", q)
            assert m, q
            used.add(m.group(1))
        unknown = used - known
        assert not unknown, f"dashboard {name} queries metrics nobody exports: {unknown}"


def test_dashboards_show_what_operators_need() -> None:
    boards = dashboard_files()
    router = " ".join(exprs(boards["router"]))
    for needed in (
        "sum by (reason) (rate(kvplane_router_decisions_total",
        "kvplane_router_predicted_cached_tokens_total",
        "kvplane_router_reported_cached_tokens_total",
        "kvplane_router_index_lookup_seconds_bucket",
        "kvplane_router_tokenize_seconds_bucket",
        "kvplane_router_added_latency_seconds_bucket",
        "kvplane_router_backend_ttft_seconds_bucket",
        "kvplane_router_backend_healthy",
    ):
        assert needed in router, needed
    engines = " ".join(exprs(boards["engines"]))
    for needed in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:time_to_first_token_seconds_bucket",
    ):
        assert needed in engines, needed
    assert re.search(
        r"rate\(vllm:prefix_cache_hits_total[^/]*/ *sum\(rate\(vllm:prefix_cache_queries_total",
        engines,
    ), "prefix cache hit rate = hits / queries"
    sglang = " ".join(exprs(boards["engines-sglang"]))
    for needed in ("sglang:num_queue_reqs", "sglang:token_usage", "sglang:cached_tokens_total"):
        assert needed in sglang, needed
    assert "vllm:" not in sglang
    pd = " ".join(exprs(boards["pd"]))
    for needed in (
        "kvplane_router_pd_decisions_total",
        "kvplane_router_pd_pairs_total",
        "kvplane_router_pd_predicted_transfer_bytes_total",
        "kvplane_router_pd_predicted_transfer_seconds_bucket",
        "kvplane_router_pd_leg_failures_total",
    ):
        assert needed in pd, needed
    tiers = " ".join(exprs(boards["tiers"]))
    for needed in (
        "kvplane_router_tier_hit_tokens_total",
        "kvplane_router_tier_loads_total",
        "kvplane_router_tier_load_seconds_bucket",
        'kvplane_indexer_blocks_total{event="removed"}',
    ):
        assert needed in tiers, needed
    assert "kvplane_router_predicted_ttft_seconds_bucket" in router
    for board in boards.values():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                assert target["datasource"]["uid"] == "${datasource}"


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]])
def test_pod_monitors_scrape_what_the_dashboards_group_by(render: Render, watch: list[str]) -> None:
    """Off by default; on, one PodMonitor per component of the pools the operator renders,
    with the routers' own pod label (the backend) honoured."""
    assert not find(render(), "PodMonitor")
    values = {
        "monitoring.podMonitors.enabled": "true",
        "monitoring.podMonitors.labels.release": "kps",
    }
    if watch:
        values["watchNamespaces"] = "{" + ",".join(watch) + "}"
    monitors = {m["metadata"]["name"]: m for m in find(render(**values), "PodMonitor")}
    assert set(monitors) == {f"{RELEASE}-kvplane-{c}" for c in ("engines", "routers", "indexers")}
    from kvplane.operator.render import names

    for component, roles, port, honor in (
        ("engines", ["prefill", "decode"], names.PORT_HTTP, False),
        ("routers", ["router"], names.PORT_HTTP, True),
        ("indexers", ["indexer"], names.PORT_METRICS, False),
    ):
        m = monitors[f"{RELEASE}-kvplane-{component}"]
        assert m["apiVersion"] == "monitoring.coreos.com/v1"
        assert m["metadata"]["labels"]["release"] == "kps"
        spec = m["spec"]
        assert spec["namespaceSelector"] == ({"matchNames": watch} if watch else {"any": True})
        exprs_ = {e["key"]: e["values"] for e in spec["selector"]["matchExpressions"]}
        assert exprs_[names.LABEL_ROLE] == roles
        assert exprs_[names.APP_PART_OF] == [names.PART_OF]
        (endpoint,) = spec["podMetricsEndpoints"]
        assert endpoint["port"] == port and endpoint["path"] == "/metrics"
        assert endpoint["honorLabels"] is honor


# --- kustomize ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kustomized(tool: Tool) -> list[Json]:
    out = tool("kubectl", "kustomize", str(CONFIG / "default")).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_kustomize_default_builds(kustomized: list[Json], tool: Tool) -> None:
    kinds = sorted(o["kind"] for o in kustomized)
    assert kinds == sorted(
        ["Namespace", "ServiceAccount", "ClusterRoleBinding", "Deployment"]
        + ["ClusterRole"] * 2  # the operator's, and the discovery role it binds
        + ["CustomResourceDefinition"] * 4
    )
    for o in kustomized:
        if o["kind"] in ("ServiceAccount", "Deployment"):
            assert o["metadata"]["namespace"] == "kvplane-system"
    binding = one(kustomized, "ClusterRoleBinding")
    discovery = one(kustomized, "ClusterRole", "kvplane-discovery")
    assert expand(discovery["rules"]) == {("", "pods", v) for v in ("get", "list", "watch")}
    sa = one(kustomized, "ServiceAccount")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "kvplane-system"}
    ]
    pod = one(kustomized, "Deployment")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    crds = {c["metadata"]["name"]: c for c in find(kustomized, "CustomResourceDefinition")}
    for path in CRDS.glob("*.yaml"):
        generated = yaml.safe_load(path.read_text())
        assert crds[generated["metadata"]["name"]]["spec"] == generated["spec"]
    samples = tool("kubectl", "kustomize", str(CONFIG / "samples")).stdout
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(samples) if d)
    assert kinds == ["DecodePool", "InferencePool"]


def test_kustomize_rbac_equals_the_chart(kustomized: list[Json], render: Render) -> None:
    """The same rules; each names its own discovery ClusterRole."""
    chart = render()
    assert all_rules(kustomized) == namespaced_rules("kvplane-discovery") | KOPF_CLUSTER_RULES
    assert all_rules(chart) == namespaced_rules(DISCOVERY) | KOPF_CLUSTER_RULES


def test_kustomize_manager_is_the_chart_operator(kustomized: list[Json], render: Render) -> None:
    """Same pod spec as the chart's default render, apart from the names of the
    ServiceAccount and of the discovery ClusterRole."""
    ours = one(kustomized, "Deployment")["spec"]
    chart = one(render(), "Deployment")["spec"]
    for spec in (ours, chart):
        spec["template"]["spec"].pop("serviceAccountName")
        (c,) = spec["template"]["spec"]["containers"]
        c["env"] = [e for e in c["env"] if e["name"] != "KVPLANE_DISCOVERY_CLUSTERROLE"]
        spec.pop("selector")
        spec["template"]["metadata"].pop("labels")
    assert ours == chart


# --- Dockerfile and wheel ------------------------------------------------------------------------

Instruction = tuple[int, str, str]  # (stage, INSTRUCTION, arguments)


def dockerfile() -> list[Instruction]:
    text = (REPO / "Dockerfile").read_text()
    logical = re.sub(r"\\\n", " ", text)
    out: list[Instruction] = []
    stage = -1
    for line in logical.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        out.append((stage, op, " ".join(args.split())))
    return out


def test_dockerfile_invariants() -> None:
    ins = dockerfile()
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for s, op, a in ins if op == "ARG" and s < 0}
    froms = [a for _, op, a in ins if op == "FROM"]
    assert len(froms) >= 2, "multi-stage"
    base = [re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], f.split()[0]) for f in froms]
    assert set(base) == {"python:3.11-slim"}
    final = len(froms) - 1
    in_final = [(op, a) for s, op, a in ins if s == final]
    users = [a for op, a in in_final if op == "USER"]
    assert users, "the final stage sets USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) == 65532, "numeric non-root USER (runAsNonRoot checks it)"
    entry = [a for op, a in in_final if op == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["kvplane"]
    env = " ".join(a for op, a in in_final if op == "ENV")
    assert re.search(r"PATH=/opt/kvplane/bin:", env), "the venv's python3 and kvplane first"
    # the final stage has no sources and no build tools: only the built virtualenv
    copies = [a for op, a in in_final if op == "COPY"]
    assert copies == ["--from=build /opt/kvplane /opt/kvplane"]
    assert not [a for op, a in in_final if op == "RUN" and "pip" in a]
    runs = " ".join(a for _, op, a in ins if op == "RUN")
    assert "[operator]" in runs, "the operator needs kopf and kubernetes"
    assert "pip wheel --no-deps" in runs
    dev = json.dumps(dev_requirements())
    assert "[dev" not in runs and ",dev" not in runs
    for pkg in ("pytest", "mypy", "ruff", "vllm-router", "openai"):
        assert pkg in dev and pkg not in runs


def dev_requirements() -> list[str]:
    """The dev extra, with the extras it names (``kvplane[peers,...]``) spelled out."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    out: list[str] = []
    for req in extras["dev"]:
        named = re.fullmatch(r"kvplane\[([\w,]+)\]", req)
        out += [r for e in named.group(1).split(",") for r in extras[e]] if named else [req]
    return out


def build_context() -> list[str]:
    """The sources the build stage copies into the image."""
    sources: list[str] = []
    for stage, op, a in dockerfile():
        if stage == 0 and op == "COPY" and not a.startswith("--from"):
            *srcs, _dest = a.split()
            sources += [s.rstrip("/") for s in srcs]
    return sources


def test_dockerignore_admits_exactly_the_build_context() -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "deny everything, then admit the build context"
    admitted = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    assert admitted == set(build_context())


def test_the_image_wheel_builds_with_the_packages(tmp_path: Path) -> None:
    """Build the wheel from exactly what the Dockerfile copies (as its build stage does)."""
    ctx = tmp_path / "ctx"
    ctx.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for src in build_context():
        path = REPO / src
        if path.is_dir():
            shutil.copytree(path, ctx / src, ignore=ignore)
        else:
            shutil.copy(path, ctx / src)
    out = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    proc = subprocess.run(
        [*pip, "--wheel-dir", str(out), str(ctx)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    (wheel,) = out.glob("kvplane-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta_dir = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = z.read(f"{meta_dir}/METADATA").decode()
        entry_points = z.read(f"{meta_dir}/entry_points.txt").decode()
    for needed in (
        "kvplane/cli.py",
        "kvplane/router/app.py",
        "kvplane/router/kube.py",
        "kvplane/operator/handlers.py",
        "kvplane/operator/api.py",
        "kvplane/operator/render/__init__.py",
        "kvplane/operator/render/router.py",
    ):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("tests/", "operator/", "router/"))]
    assert "kvplane = kvplane.cli:main" in entry_points
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    operator_extra = [r for r in requires if 'extra == "operator"' in r]
    assert any("kopf" in r for r in operator_extra)
    # the Kubernetes client is the router's too (pod discovery)
    assert any("kubernetes_asyncio" in r and "extra ==" not in r for r in requires)
    for r in requires:
        if any(f"Requires-Dist: {pkg}" in r for pkg in ("pytest", "mypy", "ruff")):
            assert 'extra == "dev"' in r, r


# --- against the cluster -------------------------------------------------------------------------


def helm_install(cluster: K8sCluster, ns: str, *values: str, command: str = "install") -> None:
    cluster.helm(
        command, RELEASE, str(CHART), "-n", ns, "--wait", "--timeout=90s", *values, timeout_s=150
    )


def pods_running(cluster: K8sCluster, ns: str, selector: str, count: int) -> bool:
    pods = cluster.kubectl_json("get", "pods", "-n", ns, "-l", selector)["items"]
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return len(live) == count and all(p["status"].get("phase") == "Running" for p in live)


@pytest.mark.k8s
def test_helm_install_upgrade_uninstall(k8s_cluster: K8sCluster, k8s_namespace: str) -> None:
    c, ns = k8s_cluster, k8s_namespace
    name = f"{RELEASE}-kvplane"
    operator = "app.kubernetes.io/component=operator"
    helm_install(c, ns, "--set", "redis.enabled=true", "--set", "samples.enabled=true")
    c.wait_until("operator pod Running", lambda: pods_running(c, ns, operator, 1), timeout_s=60)
    assert pods_running(c, ns, "app.kubernetes.io/component=redis", 1)
    for plural in ("inferencepools", "prefillpools", "decodepools", "kvcachetiers"):
        c.kubectl("get", "crd", f"{plural}.kvplane.io")
    assert c.kubectl_json("get", "inferencepool", "llama-8b", "-n", ns)["spec"]["router"]
    cms = c.kubectl_json("get", "configmaps", "-n", ns, "-l", "grafana_dashboard=1")["items"]
    assert len(cms) == len(list((CHART / "dashboards").glob("*.json")))  # one per board
    dep = c.kubectl_json("get", "deployment", name, "-n", ns)
    env = env_of(dep["spec"]["template"]["spec"]["containers"][0])
    assert env["KVPLANE_RESYNC_SECONDS"] == "30"

    helm_install(c, ns, "--reuse-values", "--set", "resyncSeconds=7", command="upgrade")
    after = c.kubectl_json("get", "deployment", name, "-n", ns)
    assert (
        env_of(after["spec"]["template"]["spec"]["containers"][0])["KVPLANE_RESYNC_SECONDS"] == "7"
    )
    assert after["metadata"]["generation"] > dep["metadata"]["generation"]
    c.wait_until("rolled operator Running", lambda: pods_running(c, ns, operator, 1), timeout_s=60)
    history = json.loads(c.helm("history", RELEASE, "-n", ns, "-o", "json").stdout)
    assert [h["revision"] for h in history] == [1, 2]

    c.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout=60s")
    gone = c.kubectl("get", "deployment", name, "-n", ns, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr
    cluster_role = c.kubectl("get", "clusterrole", f"{ns}-{name}", check=False)
    assert cluster_role.returncode != 0
    assert not c.kubectl_json("get", "inferencepools", "-n", ns)["items"]
    # helm never deletes what it installed from crds/
    c.kubectl("get", "crd", "inferencepools.kvplane.io")


@pytest.fixture
def watched_namespace(k8s_cluster: K8sCluster, k8s_namespace: str) -> Iterator[str]:
    """A second namespace: the operator's release lives in k8s_namespace, watches this."""
    name = f"{k8s_namespace[:50]}-w"
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


@pytest.fixture
def password_redis() -> Iterator[tuple[str, str]]:
    """A redis-server with a password: (url, password)."""
    from support.redis_server import start_redis

    server = start_redis()
    password = "s3cret-index"
    subprocess.run(
        ["redis-cli", "-p", str(server.port), "config", "set", "requirepass", password],
        check=True,
        capture_output=True,
    )
    try:
        yield server.url, password
    finally:
        server.stop()


def get(cluster: K8sCluster, ns: str, kind: str, name: str) -> Json | None:
    out = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json", check=False)
    return dict(json.loads(out.stdout)) if out.returncode == 0 else None


def ready(cluster: K8sCluster, ns: str, name: str) -> bool:
    pool = get(cluster, ns, "inferencepool", name) or {}
    conditions = pool.get("status", {}).get("conditions", [])
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def apply_cr(cluster: K8sCluster, ns: str, kind: str, name: str, spec: Json) -> None:
    manifest = {
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def exercise_operator(c: K8sCluster, ns: str, redis: tuple[str, str]) -> None:
    """Everything the operator does to a pool: create every kind of owned object (an
    autoscaled pool has an HPA), read a tier, report status, prune (an external index
    removes the managed Redis, fixed replicas the HPA), and delete (an external index's
    cleanup reads the password Secret)."""
    url, password = redis
    c.kubectl(
        "create", "secret", "generic", "index", f"--from-literal=password={password}", "-n", ns
    )
    apply_cr(
        c,
        ns,
        "KVCacheTier",
        "host-dram",
        {"tier": "dram", "backend": "native", "capacityPerPod": "64Gi", "bandwidthGbps": 50},
    )
    spec = {"model": MODEL, "router": {"replicas": 1}, "kvCacheTiers": [{"name": "host-dram"}]}
    apply_cr(c, ns, "InferencePool", "llama", spec)
    autoscaled = {"poolRef": {"name": "llama"}, "autoscaling": {"minReplicas": 1, "maxReplicas": 2}}
    apply_cr(c, ns, "DecodePool", "main", autoscaled)
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=120)
    pool = get(c, ns, "inferencepool", "llama")
    assert pool is not None
    assert pool["status"]["routerEndpoint"] == f"http://llama-router.{ns}.svc:8000"
    binding = c.kubectl_json("get", "rolebinding", "llama-router", "-n", ns)
    assert binding["roleRef"]["kind"] == "ClusterRole"
    assert binding["roleRef"]["name"].endswith("-discovery")
    decode = get(c, ns, "decodepool", "main")
    assert decode is not None and decode["status"]["readyReplicas"] == 1
    assert get(c, ns, "horizontalpodautoscaler", "llama-decode-main") is not None

    external = {"url": url, "passwordSecretRef": {"name": "index", "key": "password"}}
    apply_cr(c, ns, "InferencePool", "llama", {**spec, "index": {"external": external}})
    apply_cr(c, ns, "DecodePool", "main", {"poolRef": {"name": "llama"}, "replicas": 1})

    def pruned() -> bool:
        return (
            get(c, ns, "deployment", "llama-redis") is None
            and get(c, ns, "horizontalpodautoscaler", "llama-decode-main") is None
            and ready(c, ns, "llama")
        )

    c.wait_until("managed Redis pruned", pruned, timeout_s=90)
    assert get(c, ns, "service", "llama-redis") is None
    c.kubectl("delete", "inferencepool", "llama", "-n", ns, "--wait=true", timeout_s=90)


FORBIDDEN = re.compile(r"forbidden|Not enough permissions|\b403 ", re.IGNORECASE)


def denials(runner: KopfRunner) -> list[str]:
    return [line[:400] for line in runner.output.splitlines() if FORBIDDEN.search(line)]


@contextlib.contextmanager
def operator_env(c: K8sCluster, kubeconfig: Path) -> Iterator[None]:
    """The installed operator's KVPLANE_* environment (the chart's settings, such as
    its discovery ClusterRole), for the operator running in this process."""
    ns = yaml.safe_load(kubeconfig.read_text())["contexts"][0]["context"]["namespace"]
    dep = c.kubectl_json("get", "deployment", f"{RELEASE}-kvplane", "-n", ns)
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    env = {k: v for k, v in env_of(container).items() if k.startswith("KVPLANE_")}
    env.pop("KVPLANE_PEERING", None)  # kopf's arguments say it
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_operator(
    c: K8sCluster, kubeconfig: Path, args: list[str], scenario: Callable[[], None]
) -> KopfRunner:
    """Run the scenario against an in-process operator; a failure names the requests
    RBAC denied (the output is only readable once the operator has stopped)."""
    failure: K8sError | None = None
    with (
        c.activated(kubeconfig),
        operator_env(c, kubeconfig),
        KopfRunner(args, timeout=300) as runner,
    ):
        try:
            scenario()
        except K8sError as exc:
            failure = exc
    if failure is not None:
        lines = "\n".join(denials(runner)[:10]) or runner.output[-6000:]
        raise AssertionError(f"{failure}\nRBAC denials or the operator's last words:\n{lines}")
    return runner


def assert_no_rbac_errors(runner: KopfRunner) -> None:
    assert runner.exception is None, runner.output[-4000:]
    assert runner.exit_code == 0, runner.output[-4000:]
    assert not denials(runner), "\n".join(denials(runner)[:20])
    assert "Traceback" not in runner.output, runner.output[-4000:]


def can_i(c: K8sCluster, kubeconfig: Path, *args: str) -> bool:
    out = c.kubectl("auth", "can-i", *args, kubeconfig=kubeconfig, check=False)
    return out.stdout.strip() == "yes"


def kopf_peering_crds_installed(c: K8sCluster) -> bool:
    return c.kubectl("get", "crd", "kopfpeerings.kopf.dev", check=False).returncode == 0


@pytest.mark.k8s
def test_operator_works_with_only_the_namespaced_chart_rbac(
    k8s_cluster: K8sCluster,
    k8s_namespace: str,
    watched_namespace: str,
    password_redis: tuple[str, str],
) -> None:
    """Namespaced mode with peering: release in one namespace, watching another."""
    c, ns, watched = k8s_cluster, k8s_namespace, watched_namespace
    install_crds = "false" if kopf_peering_crds_installed(c) else "true"
    values = ["--set", f"watchNamespaces={{{watched}}}", "--set", "operator.replicas=2"]
    helm_install(c, ns, *values, "--set", f"peering.installCRDs={install_crds}")
    sa = f"{RELEASE}-kvplane"
    peering = f"{ns}-{RELEASE}-kvplane"
    c.kubectl("get", "kopfpeering", peering, "-n", watched)
    kubeconfig = c.service_account_kubeconfig(ns, sa)
    try:
        assert can_i(c, kubeconfig, "create", "deployments", "-n", watched)
        assert not can_i(c, kubeconfig, "create", "deployments", "-n", ns)
        assert not can_i(c, kubeconfig, "list", "inferencepools", "-A")
        assert not can_i(c, kubeconfig, "create", "pods", "-n", watched)
        assert not can_i(c, kubeconfig, "list", "secrets", "-n", watched)

        args = ["run", "--namespace", watched, "--peering", peering, "--verbose"]
        args += ["-m", "kvplane.operator.handlers"]
        runner = run_operator(
            c, kubeconfig, args, lambda: exercise_operator(c, watched, password_redis)
        )
        assert_no_rbac_errors(runner)
        assert f"Keep-alive in {peering!r} in {watched!r}: ok" in runner.output
    finally:
        c.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout=60s", check=False)


@pytest.mark.k8s
def test_operator_works_with_only_the_cluster_wide_chart_rbac(
    k8s_cluster: K8sCluster, k8s_namespace: str, password_redis: tuple[str, str]
) -> None:
    """Cluster-wide mode, with Secret reads for the external index's password."""
    c, ns = k8s_cluster, k8s_namespace
    helm_install(c, ns, "--set", "rbac.readSecrets=true")
    kubeconfig = c.service_account_kubeconfig(ns, f"{RELEASE}-kvplane")
    try:
        assert can_i(c, kubeconfig, "list", "inferencepools", "-A")
        assert not can_i(c, kubeconfig, "create", "pods", "-n", ns)
        assert not can_i(c, kubeconfig, "list", "nodes")
        assert not can_i(c, kubeconfig, "create", "roles", "-n", ns)
        assert not can_i(c, kubeconfig, "bind", "clusterroles/cluster-admin")
        args = ["run", "--all-namespaces", "--standalone", "--verbose"]
        args += ["-m", "kvplane.operator.handlers"]
        runner = run_operator(c, kubeconfig, args, lambda: exercise_operator(c, ns, password_redis))
        assert_no_rbac_errors(runner)
    finally:
        c.helm("uninstall", RELEASE, "-n", ns, "--wait", "--timeout=60s", check=False)


@pytest.mark.k8s
def test_kustomize_install_passes_restricted_pod_security(k8s_cluster: K8sCluster) -> None:
    """config/default applies, and its namespace enforces the restricted Pod Security
    Standard, which the operator pod meets."""
    c = k8s_cluster
    build = c.kubectl("kustomize", str(CONFIG / "default")).stdout
    docs = [d for d in yaml.safe_load_all(build) if d and d["kind"] != "CustomResourceDefinition"]
    text = "\n---\n".join(yaml.safe_dump(d) for d in docs)
    c.kubectl("apply", "--server-side", "-f", "-", input=text)
    try:
        c.wait_until(
            "kustomize operator pod Running",
            lambda: pods_running(c, "kvplane-system", "app.kubernetes.io/component=operator", 1),
            timeout_s=60,
        )
    finally:
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
            f.write(text)
            f.flush()
            c.kubectl("delete", "-f", f.name, "--wait=false", "--ignore-not-found", check=False)
