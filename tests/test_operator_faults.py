"""The operator under faults and at rest, on the real control plane: two replicas under
kopf peering (only the active one writes, and the standby takes over), a kube-apiserver
restart (the first requests get 429 while storage initialises), and the cost of a pool
at rest (no request). Operators run as their own ServiceAccounts, so the API server's
audit log (support.k8s_cluster) says who asked for what."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.k8s_cluster import K8sCluster

from kvplane.local.ports import free_port

pytestmark = pytest.mark.k8s

REPO = Path(__file__).resolve().parents[1]
CRDS = REPO / "crds"
CHART = REPO / "charts" / "kvplane"
MODEL = {"servedName": "llama", "source": "meta-llama/Llama-3.1-8B", "kvBytesPerToken": 131072}
PEERING = "kvplane"


@pytest.fixture(scope="module")
def cluster(k8s_cluster: K8sCluster) -> K8sCluster:
    c = k8s_cluster
    c.kubectl("apply", "-f", str(CRDS))
    if c.kubectl("get", "crd", "kopfpeerings.kopf.dev", check=False).returncode != 0:
        crds = c.helm(
            "template", "x", str(CHART), "--show-only", "templates/peering-crds.yaml",
            "--set", "operator.replicas=2",
        ).stdout  # fmt: skip
        c.kubectl("create", "-f", "-", input=crds)
    for crd in ("inferencepools.kvplane.io", "kopfpeerings.kopf.dev"):
        c.kubectl("wait", "--for=condition=Established", f"crd/{crd}", "--timeout=60s")
    return c


def apply(c: K8sCluster, ns: str, kind: str, name: str, spec: dict[str, Any]) -> None:
    manifest = {
        "apiVersion": "kvplane.io/v1alpha1",
        "kind": kind,
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }
    c.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def ready(c: K8sCluster, ns: str, name: str) -> bool:
    out = c.kubectl("get", "inferencepool", name, "-n", ns, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conds = json.loads(out.stdout).get("status", {}).get("conditions", [])
    return any(x["type"] == "Ready" and x["status"] == "True" for x in conds)


def exists(c: K8sCluster, ns: str, kind: str, name: str) -> bool:
    return c.kubectl("get", kind, name, "-n", ns, check=False).returncode == 0


def create_pool(c: K8sCluster, ns: str) -> None:
    apply(c, ns, "InferencePool", "llama", {"model": MODEL, "router": {"replicas": 1}})
    apply(c, ns, "DecodePool", "d", {"poolRef": {"name": "llama"}, "replicas": 1})


@dataclass
class Replica:
    """``kvplane operator`` in a process of its own, as a ServiceAccount."""

    user: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def start_replica(cluster: K8sCluster, k8s_namespace: str, tmp_path: Path) -> Iterator[Any]:
    """Starts ``kvplane operator`` processes watching the test's namespace, each as a
    ServiceAccount bound to cluster-admin (this test is about who writes, not RBAC)."""
    ns, started = k8s_namespace, []

    def start(name: str, *args: str, env: dict[str, str] | None = None) -> Replica:
        cluster.kubectl("create", "serviceaccount", name, "-n", ns)
        cluster.kubectl(
            "create", "clusterrolebinding", f"{ns}-{name}", "--clusterrole=cluster-admin",
            f"--serviceaccount={ns}:{name}",
        )  # fmt: skip
        kubeconfig = cluster.service_account_kubeconfig(ns, name)
        log = tmp_path / f"{name}.log"
        full_env = {
            **cluster.env(kubeconfig),
            "KVPLANE_WATCH_NAMESPACES": ns,
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        full_env.pop("POD_ID", None)
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "kvplane.cli", "--log-level", "info", "operator",
                 "--health-port", str(free_port()), *args],
                stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=REPO,
            )  # fmt: skip
        replica = Replica(f"system:serviceaccount:{ns}:{name}", proc, log)
        started.append((name, replica))
        return replica

    yield start
    for name, replica in started:
        if replica.proc.poll() is None:
            replica.proc.terminate()
            try:
                replica.proc.wait(30)
            except subprocess.TimeoutExpired:
                replica.proc.kill()
                replica.proc.wait(10)
        cluster.kubectl("delete", "clusterrolebinding", f"{ns}-{name}", check=False)


NOT_OURS = {"kopfpeerings", "events"}  # kopf's keep-alives and Events


def writes(c: K8sCluster, user: str) -> list[dict[str, Any]]:
    """The requests of ``user`` that changed something the operator renders or reports."""
    return [
        e
        for e in c.audit_events(user)
        if e["verb"] in ("create", "update", "patch", "delete")
        and e.get("objectRef", {}).get("resource") not in NOT_OURS
    ]


def keepalives(c: K8sCluster, user: str) -> int:
    return sum(
        e["verb"] == "patch" and e.get("objectRef", {}).get("resource") == "kopfpeerings"
        for e in c.audit_events(user)
    )


def kopf_paused(output: str) -> bool:
    """Whether kopf's last word on peering paused the replica (it starts paused)."""
    return output.rfind("Pausing operations") >= output.rfind("Resuming operations")


def test_only_the_active_replica_writes_and_a_standby_takes_over(
    cluster: K8sCluster, k8s_namespace: str, start_replica: Any
) -> None:
    c, ns = cluster, k8s_namespace
    c.apply(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}},
        namespace=ns,
    )
    # a pass every second and a keep-alive every few: a standby that wrote would show
    env = {"KVPLANE_RESYNC_SECONDS": "1", "KVPLANE_PEERING_LIFETIME_SECONDS": "10"}
    a = start_replica("op-a", "--peering", PEERING, env=env)
    b = start_replica("op-b", "--peering", PEERING, env=env)

    def peers() -> int:
        peering = c.kubectl_json("get", "kopfpeering", PEERING, "-n", ns)
        return len(peering.get("status") or {})

    # the first replica up may be alone and active for a moment; the pool comes after
    c.wait_until("both replicas in the peering", lambda: peers() == 2, timeout_s=60)
    create_pool(c, ns)
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=120)
    writers = {r.user for r in (a, b) if writes(c, r.user)}
    assert len(writers) == 1, writers
    leader, standby = (a, b) if a.user in writers else (b, a)

    # drift while both run: repaired, and still only by the leader
    c.kubectl("delete", "service", "llama-router", "-n", ns)
    c.wait_until("Service repaired", lambda: exists(c, ns, "service", "llama-router"), timeout_s=60)
    seen = keepalives(c, standby.user)
    c.wait_until(
        "three more keep-alives of the standby",
        lambda: keepalives(c, standby.user) >= seen + 3,
        timeout_s=120,
    )
    assert not writes(c, standby.user), [
        (e["verb"], e["objectRef"]) for e in writes(c, standby.user)
    ]
    assert kopf_paused(standby.output()), "kopf kept the standby paused"

    # the leader goes; the standby resumes, and repairs what it finds
    leader.proc.send_signal(signal.SIGTERM)
    leader.proc.wait(60)
    c.kubectl("delete", "service", "llama-router", "-n", ns)
    c.wait_until(
        "Service repaired by the new leader",
        lambda: exists(c, ns, "service", "llama-router"),
        timeout_s=120,
    )
    created = [e for e in writes(c, standby.user) if e["objectRef"].get("resource") == "services"]
    assert created, standby.output()[-3000:]
    assert not kopf_paused(standby.output())
    assert ready(c, ns, "llama")


def test_an_api_server_restart_loses_no_repair(
    cluster: K8sCluster, k8s_namespace: str, start_replica: Any
) -> None:
    """Right after a kube-apiserver restart the custom resources answer 429 while their
    storage initialises: a Deployment deleted then still comes back, with no periodic
    pass to rely on."""
    c, ns = cluster, k8s_namespace
    op = start_replica("op", "--namespace", ns, env={"KVPLANE_RESYNC_SECONDS": "3600"})
    create_pool(c, ns)
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=120)
    c.restart_component("kube-apiserver")
    c.wait_api_ready()
    c.kubectl("delete", "deployment", "llama-router", "-n", ns)
    c.wait_until(
        "router Deployment back",
        lambda: exists(c, ns, "deployment", "llama-router"),
        timeout_s=180,
    )
    c.wait_until("Ready again", lambda: ready(c, ns, "llama"), timeout_s=120)
    assert op.proc.poll() is None, op.output()[-3000:]


def test_a_pool_at_rest_costs_no_request(
    cluster: K8sCluster, k8s_namespace: str, start_replica: Any
) -> None:
    """Once a pool is Ready, the operator makes no request at all (its watches stay
    open), although it passes over every pool each second: while its peering
    keep-alive, the clock here, ticks three times."""
    c, ns = cluster, k8s_namespace
    c.apply(
        {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}},
        namespace=ns,
    )
    env = {"KVPLANE_RESYNC_SECONDS": "1", "KVPLANE_PEERING_LIFETIME_SECONDS": "10"}
    op = start_replica("op", "--peering", PEERING, env=env)
    create_pool(c, ns)
    c.wait_until("pool Ready", lambda: ready(c, ns, "llama"), timeout_s=120)

    def requests() -> list[tuple[str, str]]:
        return [
            (e["verb"], e.get("objectRef", {}).get("resource", ""))
            for e in c.audit_events(op.user)
            if e.get("objectRef", {}).get("resource") != "kopfpeerings"
        ]

    # the last status writes of the rollout may still be on their way: one keep-alive
    c.wait_until("a keep-alive", lambda: keepalives(c, op.user) >= 1, timeout_s=60)
    before, ticks = requests(), keepalives(c, op.user)
    c.wait_until(
        "three keep-alives at rest", lambda: keepalives(c, op.user) >= ticks + 3, timeout_s=120
    )
    assert requests() == before, requests()[len(before) :]
