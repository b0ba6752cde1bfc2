"""Backends from Kubernetes: the Ready pods of the pool, followed by a watch.

A pod is a backend while it is Running, Ready, has an IP and is not being
deleted; scale-up, scale-down, readiness flips and restarts all arrive as watch
events. A watch that expires (410 Gone) or breaks is re-listed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from kvplane.router.config import Backend, BackendRole, KubernetesDiscoverySpec
from kvplane.router.kube import KubeClient

log = logging.getLogger("kvplane.router.discovery")

ROLE_LABEL = "kvplane.io/role"
ZONE_LABEL = "topology.kubernetes.io/zone"
# the operator's engine roles; a pod labelled prefill serves only prefill legs
_ENGINE_ROLES = (BackendRole.PREFILL.value, BackendRole.DECODE.value)


def pod_backend(pod: dict[str, Any], spec: KubernetesDiscoverySpec) -> Backend | None:
    """The backend a pod stands for, or None while it cannot take traffic."""
    meta, status = pod.get("metadata", {}), pod.get("status", {})
    ip = status.get("podIP")
    if meta.get("deletionTimestamp") or status.get("phase") != "Running" or not ip:
        return None
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", [])
    )
    if not ready:
        return None
    labels: dict[str, str] = meta.get("labels", {})
    host = f"[{ip}]" if ":" in ip else ip
    out_labels = {"node": pod.get("spec", {}).get("nodeName", "")}
    if ROLE_LABEL in labels:
        out_labels["role"] = labels[ROLE_LABEL]
    if ZONE_LABEL in labels:
        out_labels["zone"] = labels[ZONE_LABEL]
    role = labels.get(ROLE_LABEL, "")
    return Backend(
        name=meta["name"],
        role=BackendRole(role) if role in _ENGINE_ROLES else BackendRole.BOTH,
        url=f"http://{host}:{spec.http_port}",
        kv_events=f"tcp://{host}:{spec.kv_events_port}" if spec.kv_events_port else None,
        replay=f"tcp://{host}:{spec.replay_port}" if spec.replay_port else None,
        topic=spec.topic,
        labels=out_labels,
    )


class KubernetesDiscovery:
    def __init__(self, client: KubeClient, spec: KubernetesDiscoverySpec) -> None:
        self._client = client
        self._spec = spec
        self._path = f"/api/v1/namespaces/{spec.namespace}/pods"
        self._params = {"labelSelector": spec.selector}

    def _backends(self, pods: dict[str, dict[str, Any]]) -> list[Backend]:
        out = [pod_backend(p, self._spec) for p in pods.values()]
        return sorted((b for b in out if b is not None), key=lambda b: b.name)

    async def watch(self) -> AsyncIterator[list[Backend]]:
        backoff = 0.5
        last: list[Backend] | None = None
        while True:
            try:
                listed = await self._client.list(self._path, self._params)
                pods = {p["metadata"]["name"]: p for p in listed.get("items", [])}
                version = listed["metadata"]["resourceVersion"]
                current = self._backends(pods)
                if current != last:
                    last = current
                    yield current
                params = {**self._params, "resourceVersion": version}
                async for event in self._client.watch(self._path, params):
                    kind, obj = event.get("type"), event.get("object", {})
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: the version expired; re-list
                    if kind == "BOOKMARK":
                        continue
                    name = obj["metadata"]["name"]
                    if kind == "DELETED":
                        pods.pop(name, None)
                    else:
                        pods[name] = obj
                    current = self._backends(pods)
                    if current != last:
                        last = current
                        yield current
                backoff = 0.5
            except (httpx.HTTPError, KeyError, ValueError) as exc:
                log.warning("pod discovery failed (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)
