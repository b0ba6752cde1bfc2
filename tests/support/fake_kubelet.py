"""Pods that look Running and Ready without a kubelet: bound to a node no kubelet (nor
kwok) manages, their status written as a kubelet would, with a loopback IP (kwok pods get
10.244.x addresses that must never be dialled from the host)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from support.k8s_cluster import K8sCluster


def fake_kubelet_node(cluster: K8sCluster, name: str) -> None:
    node = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(node))


def ready_pod(
    cluster: K8sCluster, ns: str, name: str, node: str, labels: Mapping[str, str]
) -> None:
    """A pod on ``node``, Running and Ready at 127.0.0.1."""
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": dict(labels)},
        "spec": {"nodeName": node, "containers": [{"name": "engine", "image": "vllm"}]},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "podIPs": [{"ip": "127.0.0.1"}],
            "hostIP": "127.0.0.1",
            "startTime": now,
            "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": now}],
        }
    }
    cluster.kubectl(
        "patch",
        "pod",
        name,
        "-n",
        ns,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps(status),
    )
