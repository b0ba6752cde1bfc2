"""The Kubernetes client kvplane's discovery and operator use (``kvplane.router.kube``,
on kubernetes_asyncio), against the real local API server: in-cluster credentials whose
projected token rotates, and a pod watch that resumes without re-listing."""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from kvplane.router import kube
from kvplane.router.config import Backend, KubernetesDiscoverySpec
from kvplane.router.discovery_k8s import KubernetesDiscovery
from support.fake_kubelet import fake_kubelet_node, ready_pod
from support.k8s_cluster import K8sCluster

pytestmark = pytest.mark.k8s

LABELS = {"kvplane.io/pool": "kube", "kvplane.io/role": "decode"}
RBAC = """
apiVersion: v1
kind: ServiceAccount
metadata: {{name: router, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: router, namespace: {ns}}}
rules:
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: router, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: router}}
subjects: [{{kind: ServiceAccount, name: router, namespace: {ns}}}]
"""


@pytest.fixture
def node(k8s_cluster: K8sCluster, k8s_namespace: str) -> Iterator[str]:
    name = f"{k8s_namespace}-node"
    fake_kubelet_node(k8s_cluster, name)
    yield name
    k8s_cluster.kubectl("delete", "node", name, "--wait=false", check=False)


async def until(it: AsyncIterator[list[Backend]], names: set[str]) -> None:
    """Consume discovery until its backends are ``names`` (the test's timeout bounds it)."""
    async for backends in it:
        if {b.name for b in backends} == names:
            return


def spec(ns: str, watch_timeout_s: float = 300.0) -> KubernetesDiscoverySpec:
    return KubernetesDiscoverySpec(
        namespace=ns, selector="kvplane.io/pool=kube", watch_timeout_s=watch_timeout_s
    )


@pytest.mark.timeout(300)
def test_watch_resumes_from_its_version_without_relisting(
    k8s_cluster: K8sCluster, k8s_namespace: str, node: str
) -> None:
    """The watch reconnects every second (its client timeout) and keeps following the
    pods from its last resourceVersion: one list in all."""
    ns, c = k8s_namespace, k8s_cluster
    ready_pod(c, ns, "p0", node, LABELS)
    discovery = KubernetesDiscovery(spec(ns, watch_timeout_s=1.0), str(c.kubeconfig))

    async def scenario() -> None:
        it = discovery.watch()
        await until(it, {"p0"})
        for i in range(1, 4):
            await asyncio.sleep(1.5)  # outlive a watch connection before the next change
            await asyncio.to_thread(ready_pod, c, ns, f"p{i}", node, LABELS)
            await until(it, {f"p{j}" for j in range(i + 1)})
        await asyncio.to_thread(c.kubectl, "delete", "pod", "p0", "-n", ns, "--wait=false")
        await until(it, {"p1", "p2", "p3"})

    asyncio.run(scenario())
    assert discovery.lists == 1


@pytest.fixture
def in_cluster(k8s_cluster: K8sCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process as a pod would see the cluster: the service host and port in its
    env, a service-account directory with the CA and a token file."""
    sa = tmp_path / "serviceaccount"
    sa.mkdir()
    shutil.copy(k8s_cluster.ca_file, sa / "ca.crt")
    host, port = k8s_cluster.server.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setattr(kube, "SA_DIR", sa)
    return sa


@pytest.mark.timeout(400)
def test_a_rotated_projected_token_is_read_again(
    k8s_cluster: K8sCluster, k8s_namespace: str, in_cluster: Path
) -> None:
    """The kubelet rewrites a projected token before it expires. A long-lived client
    keeps working after the token it started with is revoked (bound to a Secret that is
    then deleted), because it reads the file again: within the library's refresh period
    (a minute, as client-go's)."""
    ns, c = k8s_namespace, k8s_cluster
    c.apply(RBAC.format(ns=ns))
    token_file = in_cluster / "token"

    def issue(secret: str) -> str:
        c.kubectl("create", "secret", "generic", secret, "-n", ns)
        token = c.kubectl(
            "create", "token", "router", "-n", ns, "--duration=3600s",
            "--bound-object-kind=Secret", f"--bound-object-name={secret}",
        ).stdout.strip()  # fmt: skip
        tmp = token_file.with_suffix(".new")
        tmp.write_text(token)
        os.replace(tmp, token_file)  # as the kubelet swaps the projected file
        return token

    first = issue("token-1")
    assert kube.in_cluster()

    def works(token: str) -> bool:
        who = c.kubectl("auth", "whoami", kubeconfig=c.kubeconfig_for_token(token), check=False)
        return who.returncode == 0

    async def scenario() -> None:
        client = await kube.Kube.connect()
        try:
            assert await client.list("Pod", ns) == []
            await asyncio.to_thread(issue, "token-2")
            await asyncio.to_thread(c.kubectl, "delete", "secret", "token-1", "-n", ns)
            # the API server sees the Secret gone through its informers: wait for it
            await asyncio.to_thread(
                c.wait_until, "the first token refused", lambda: not works(first), timeout_s=60
            )
            while True:  # refused until the file is read again; bounded by the timeout
                try:
                    await client.list("Pod", ns)
                    return
                except kube.KubeAPIError as exc:
                    assert exc.status == 401, exc
                    await asyncio.sleep(1.0)
        finally:
            await client.close()

    asyncio.run(scenario())


CREATOR = """
apiVersion: v1
kind: ServiceAccount
metadata: {{name: creator, namespace: {ns}}}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {{name: creator, namespace: {ns}}}
rules:
- apiGroups: [""]
  resources: [secrets]
  verbs: [create]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {{name: creator, namespace: {ns}}}
roleRef: {{apiGroup: rbac.authorization.k8s.io, kind: Role, name: creator}}
subjects: [{{kind: ServiceAccount, name: creator, namespace: {ns}}}]
"""


@pytest.mark.timeout(120)
def test_create_needs_only_create_and_never_overwrites(
    k8s_cluster: K8sCluster, k8s_namespace: str, tmp_path: Path
) -> None:
    """How the operator makes a managed Redis' password Secret: with the ``create`` verb
    alone (no Secret can be read), and a second create leaves the first one's data."""
    ns, c = k8s_namespace, k8s_cluster
    c.apply(CREATOR.format(ns=ns))
    token = c.kubectl("create", "token", "creator", "-n", ns).stdout.strip()

    def secret(value: str) -> dict[str, object]:
        meta = {"name": "made-once", "namespace": ns}
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "stringData": {"k": value}}

    async def scenario() -> tuple[bool, bool]:
        client = await kube.Kube.connect(str(c.kubeconfig_for_token(token)))
        try:
            return await client.create(secret("first")), await client.create(secret("second"))
        finally:
            await client.close()

    assert asyncio.run(scenario()) == (True, False)
    made = c.kubectl_json("get", "secret", "made-once", "-n", ns)
    assert made["data"] == {"k": "Zmlyc3Q="}  # base64 of "first"
