"""Kubernetes API access for pod discovery, the index GC and the operator.

Built on ``kubernetes_asyncio``, the async port of the official Python client: it
re-reads the in-cluster projected service-account token as the kubelet rotates it,
takes kubeconfigs with token, client-certificate, exec-plugin or OIDC users, resumes
watches from their last resourceVersion (``watch.Watch``), and applies arbitrary
manifests through its dynamic client. kvplane works on plain dicts (the operator
renders them), so this module only maps kinds to the dynamic client's resources.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, cast

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio.dynamic import DynamicClient
from kubernetes_asyncio.dynamic.resource import Resource

from kvplane.types import Json

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")  # a pod's service account

# kind -> apiVersion, for the objects kvplane reads and renders
API_VERSIONS: Final[dict[str, str]] = {
    "Deployment": "apps/v1",
    "Service": "v1",
    "ConfigMap": "v1",
    "Secret": "v1",
    "ServiceAccount": "v1",
    "Pod": "v1",
    "HorizontalPodAutoscaler": "autoscaling/v2",
    "Role": "rbac.authorization.k8s.io/v1",
    "RoleBinding": "rbac.authorization.k8s.io/v1",
    "InferencePool": "kvplane.io/v1alpha1",
    "PrefillPool": "kvplane.io/v1alpha1",
    "DecodePool": "kvplane.io/v1alpha1",
    "KVCacheTier": "kvplane.io/v1alpha1",
}


def in_cluster() -> bool:
    return (SA_DIR / "token").is_file() and "KUBERNETES_SERVICE_HOST" in os.environ


async def api_client(kubeconfig: str | None = None) -> k8s.ApiClient:
    """In-cluster credentials when running in a pod (the token re-read as it rotates),
    else the kubeconfig's current context (``$KUBECONFIG`` or ``~/.kube/config``)."""
    cfg = k8s.Configuration()
    if kubeconfig is None and in_cluster():
        # untyped in the library
        kconfig.load_incluster_config(  # type: ignore[no-untyped-call]
            client_configuration=cfg,
            try_refresh_token=True,
            token_filename=str(SA_DIR / "token"),
            cert_filename=str(SA_DIR / "ca.crt"),
        )
    else:
        # $KUBECONFIG read now (the library reads it once, at import)
        path = kubeconfig or os.environ.get("KUBECONFIG")
        await kconfig.load_kube_config(config_file=path, client_configuration=cfg)
    return k8s.ApiClient(cfg)


class Kube:
    """The calls kvplane makes, on plain dicts, through one ``ApiClient``."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.api = api
        self._dynamic: DynamicClient | None = None
        self._resources: dict[str, Resource] = {}
        # API discovery is cached per client, not in a file another cluster may have left
        self._cache_dir = tempfile.mkdtemp(prefix="kvplane-discovery-")

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        return cls(await api_client(kubeconfig))

    async def _resource(self, kind: str) -> tuple[DynamicClient, Resource]:
        if self._dynamic is None:
            cache = os.path.join(self._cache_dir, "discovery.json")
            self._dynamic = await DynamicClient(self.api, cache_file=cache)
        res = self._resources.get(kind)
        if res is None:
            res = self._resources[kind] = await self._dynamic.resources.get(
                api_version=API_VERSIONS[kind], kind=kind
            )
        return self._dynamic, res

    async def get(self, kind: str, namespace: str, name: str) -> Json | None:
        dyn, res = await self._resource(kind)
        resp = await dyn.get(res, name=name, namespace=namespace, serialize=False)
        return await _body(resp, missing_ok=True)

    async def list(
        self, kind: str, namespace: str | None = None, label_selector: str | None = None
    ) -> list[Json]:
        """Objects of ``kind`` in ``namespace`` (every namespace when None)."""
        dyn, res = await self._resource(kind)
        resp = await dyn.get(
            res, namespace=namespace, label_selector=label_selector, serialize=False
        )
        body = await _body(resp)
        items: list[Json] = (body or {}).get("items") or []
        return items

    async def apply(self, obj: Json, manager: str) -> Json:
        """Server-side apply: the manager owns exactly the fields it sends."""
        dyn, res = await self._resource(obj["kind"])
        meta = obj["metadata"]
        resp = await dyn.server_side_apply(
            res,
            body=obj,
            name=meta["name"],
            namespace=meta.get("namespace"),
            field_manager=manager,
            force_conflicts=True,
            serialize=False,
        )
        return await _body(resp) or {}

    async def patch_status(self, kind: str, namespace: str, name: str, status: Json) -> None:
        """Merge-patch the status subresource."""
        dyn, res = await self._resource(kind)
        resp = await dyn.patch(
            cast(Resource, res.status),  # the status subresource (attribute of the resource)
            body={"metadata": {"name": name}, "status": status},
            name=name,
            namespace=namespace,
            content_type="application/merge-patch+json",
            serialize=False,
        )
        await _body(resp)

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        dyn, res = await self._resource(kind)
        resp = await dyn.delete(
            res,
            name=name,
            namespace=namespace,
            propagation_policy="Background",
            serialize=False,
        )
        return await _body(resp, missing_ok=True) is not None

    async def close(self) -> None:
        await self.api.close()
        shutil.rmtree(self._cache_dir, ignore_errors=True)


class KubeAPIError(Exception):
    """The API server answered with an error status."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


async def _body(resp: Any, missing_ok: bool = False) -> Json | None:
    """A raw response's JSON body; None for a 404 when ``missing_ok``. (The dynamic
    client returns unchecked responses when it does not deserialize them.)"""
    status = int(resp.status)
    if status == 404 and missing_ok:
        resp.release()
        return None
    if not 200 <= status < 300:
        raise KubeAPIError(status, await resp.text())
    body: Json = await resp.json()
    return body


def api_error_status(exc: BaseException) -> int | None:
    """The HTTP status of an API error (None for anything else)."""
    status: Any = getattr(exc, "status", None)
    return status if isinstance(status, int) else None


async def credentials(kubeconfig: str | None = None) -> Credentials:
    """The current credentials, for clients that connect on their own (kopf): read
    anew on every call, so a rotated token or an exec plugin's new one is picked up."""
    async with await api_client(kubeconfig) as api:
        cfg = api.configuration
        if cfg.refresh_api_key_hook is not None:  # in-cluster: the token file as of now
            cfg.refresh_api_key_hook(cfg)
        bearer = str(cfg.api_key.get("BearerToken") or cfg.api_key.get("authorization") or "")
        return Credentials(
            server=cfg.host,
            ca_path=cfg.ssl_ca_cert,
            insecure=not cfg.verify_ssl,
            token=bearer.removeprefix("Bearer ").strip() or None,
            certificate_path=cfg.cert_file,
            private_key_path=cfg.key_file,
        )


@dataclass(frozen=True, slots=True)
class Credentials:
    server: str
    ca_path: str | None
    insecure: bool
    token: str | None
    certificate_path: str | None
    private_key_path: str | None
