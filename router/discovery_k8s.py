"""Backends from Kubernetes: the Ready pods of the pool, followed by a watch.

A pod is a backend while it is Running, Ready, has an IP and is not being
deleted; scale-up, scale-down, readiness flips and restarts all arrive as watch
events. The watch resumes from its last resourceVersion when the server ends it
(``kubernetes_asyncio``'s ``Watch``); only a version that expired (410 Gone) or a
broken connection costs a re-list.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import watch
from kubernetes_asyncio.client.exceptions import ApiException
from kvplane.router.backoff import Backoff
from kvplane.router.config import Backend, BackendRole, KubernetesDiscoverySpec
from kvplane.router.errors import describe
from kvplane.router.kube import api_client

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
    """``kubeconfig``: None for in-cluster credentials (or ``$KUBECONFIG``)."""

    def __init__(self, spec: KubernetesDiscoverySpec, kubeconfig: str | None = None) -> None:
        self._spec = spec
        self._kubeconfig = kubeconfig
        self.lists = 0  # full lists made (once, plus one per expired version or broken watch)

    def _backends(self, pods: dict[str, dict[str, Any]]) -> list[Backend]:
        out = [pod_backend(p, self._spec) for p in pods.values()]
        return sorted((b for b in out if b is not None), key=lambda b: b.name)

    async def _list(self, api: k8s.ApiClient) -> tuple[dict[str, dict[str, Any]], str]:
        self.lists += 1
        listed = await k8s.CoreV1Api(api).list_namespaced_pod(
            self._spec.namespace, label_selector=self._spec.selector
        )
        items = api.sanitize_for_serialization(listed.items)
        return {p["metadata"]["name"]: p for p in items}, listed.metadata.resource_version

    async def watch(self) -> AsyncIterator[list[Backend]]:
        async with await api_client(self._kubeconfig) as api:
            async for backends in self._follow(api):
                yield backends

    async def _follow(self, api: k8s.ApiClient) -> AsyncIterator[list[Backend]]:
        core = k8s.CoreV1Api(api)
        backoff = Backoff(0.5, 10.0)
        last: list[Backend] | None = None
        while True:
            try:
                pods, version = await self._list(api)
                current = self._backends(pods)
                if current != last:
                    last = current
                    yield current
                async with watch.Watch() as w:
                    stream = w.stream(
                        core.list_namespaced_pod,
                        self._spec.namespace,
                        label_selector=self._spec.selector,
                        resource_version=version,
                        allow_watch_bookmarks=True,
                        _request_timeout=self._spec.watch_timeout_s,
                    )
                    async for event in stream:
                        kind, obj = event["type"], event["raw_object"]
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
                backoff.reset()
            except (TimeoutError, ApiException, aiohttp.ClientError, KeyError) as exc:
                delay = backoff.next()
                log.warning("pod discovery failed (%s); retrying in %.1fs", describe(exc), delay)
                await asyncio.sleep(delay)
