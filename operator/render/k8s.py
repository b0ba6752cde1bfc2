"""Small builders for the Kubernetes objects every renderer emits.

Kept dumb on purpose: they fix the shape (apiVersion, metadata layout, owner-free
objects the controller adopts) so the renderers only say what differs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from kvplane.types import Json


def metadata(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    annotations: Mapping[str, str] | None = None,
) -> Json:
    meta: Json = {"name": name, "namespace": namespace, "labels": dict(labels)}
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


def port(name: str, number: int) -> Json:
    return {"name": name, "containerPort": number, "protocol": "TCP"}


def http_probe(path: str, port_name: str, *, period: int, failures: int, timeout: int = 5) -> Json:
    return {
        "httpGet": {"path": path, "port": port_name},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def tcp_probe(port_name: str, *, period: int, failures: int) -> Json:
    return {
        "tcpSocket": {"port": port_name},
        "periodSeconds": period,
        "timeoutSeconds": 3,
        "failureThreshold": failures,
    }


def deployment(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    pod_labels: Mapping[str, str],
    pod_spec: Json,
    *,
    replicas: int | None,
    strategy: Json,
    annotations: Mapping[str, str] | None = None,
    pod_annotations: Mapping[str, str] | None = None,
) -> Json:
    template_meta: Json = {"labels": dict(pod_labels)}
    if pod_annotations:
        template_meta["annotations"] = dict(pod_annotations)
    spec: Json = {
        "selector": {"matchLabels": dict(selector)},
        "strategy": strategy,
        "template": {"metadata": template_meta, "spec": pod_spec},
    }
    if replicas is not None:  # None: an autoscaler owns the field, so we never send it
        spec = {"replicas": replicas, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(name, namespace, labels, annotations),
        "spec": spec,
    }


RECREATE: Json = {"type": "Recreate"}


def service(
    name: str,
    namespace: str,
    labels: Mapping[str, str],
    selector: Mapping[str, str],
    ports: Sequence[tuple[str, int, str]],
    *,
    service_type: str = "ClusterIP",
) -> Json:
    """``ports``: (name, service port, target container port name)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(name, namespace, labels),
        "spec": {
            "type": service_type,
            "selector": dict(selector),
            "ports": [
                {"name": n, "port": p, "targetPort": target, "protocol": "TCP"}
                for n, p, target in ports
            ],
        },
    }


def config_map(
    name: str, namespace: str, labels: Mapping[str, str], data: Mapping[str, str]
) -> Json:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(name, namespace, labels),
        "data": dict(data),
    }


def content_hash(text: str) -> str:
    """Pod-template annotation value: a changed ConfigMap rolls the pods that read it."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]
