"""pytest fixtures for the offline Kubernetes control plane (support.k8s_cluster).

Register with ``pytest_plugins = ["support.k8s_fixtures"]``. The binaries must have been
built with ``scripts/setup-k8s.sh``; the fixture only checks for them.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import pytest
from support.k8s_cluster import K8sCluster, running_cluster


@pytest.fixture(scope="session")
def k8s_cluster() -> Iterator[K8sCluster]:
    """One control plane per test session: 2 fake GPU nodes (8 x nvidia.com/gpu each,
    zones zone-a/zone-b) and 1 plain node, all Ready; admin kubeconfig in ``.kubeconfig``."""
    with running_cluster() as cluster:
        yield cluster


@pytest.fixture
def k8s_namespace(k8s_cluster: K8sCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace per test (named after it), deleted afterwards without waiting."""
    base = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{base or 't'}-{secrets.token_hex(3)}"
    k8s_cluster.kubectl("create", "namespace", name)
    # Pods are rejected until the namespace's "default" ServiceAccount exists.
    k8s_cluster.wait_until(
        f"ServiceAccount {name}/default",
        lambda: (
            k8s_cluster.kubectl("get", "sa", "default", "-n", name, check=False).returncode == 0
        ),
        timeout_s=30,
        component="kube-controller-manager",
        interval_s=0.2,
    )
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)
