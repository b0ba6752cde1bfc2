"""A minimal async Kubernetes API client (httpx): just what discovery needs.

The router only lists and watches pods, so it talks to the API server directly
instead of carrying a full client: in-cluster service-account credentials, or a
kubeconfig (token or client certificate) for running outside the cluster.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass(frozen=True)
class KubeAuth:
    server: str
    ssl: ssl.SSLContext | bool
    token: str | None = None


def _data_file(data_b64: str, suffix: str) -> str:
    f = tempfile.NamedTemporaryFile("wb", suffix=suffix, delete=False)  # noqa: SIM115
    with f:
        f.write(base64.b64decode(data_b64))
    return f.name


def load_auth(kubeconfig: str | None = None) -> KubeAuth:
    """In-cluster credentials when running in a pod, else the current kubeconfig context."""
    if (
        kubeconfig is None
        and (SA_DIR / "token").is_file()
        and "KUBERNETES_SERVICE_HOST" in os.environ
    ):
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        ctx = ssl.create_default_context(cafile=str(SA_DIR / "ca.crt"))
        return KubeAuth(f"https://{host}:{port}", ctx, (SA_DIR / "token").read_text().strip())
    path = kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    cfg: dict[str, Any] = yaml.safe_load(Path(path).read_text())
    ctx_name = cfg.get("current-context")
    context = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == context["user"])
    verify: ssl.SSLContext | bool = True
    if cluster.get("insecure-skip-tls-verify"):
        verify = False
    else:
        ca = cluster.get("certificate-authority") or (
            _data_file(cluster["certificate-authority-data"], ".crt")
            if "certificate-authority-data" in cluster
            else None
        )
        verify = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    cert = user.get("client-certificate") or (
        _data_file(user["client-certificate-data"], ".crt")
        if "client-certificate-data" in user
        else None
    )
    key = user.get("client-key") or (
        _data_file(user["client-key-data"], ".key") if "client-key-data" in user else None
    )
    if cert and key:
        if not isinstance(verify, ssl.SSLContext):
            ctx = ssl.create_default_context()
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
            verify = ctx
        verify.load_cert_chain(cert, key)
    return KubeAuth(cluster["server"], verify, user.get("token"))


class KubeClient:
    def __init__(self, auth: KubeAuth) -> None:
        headers = {"Authorization": f"Bearer {auth.token}"} if auth.token else {}
        self._http = httpx.AsyncClient(
            base_url=auth.server, verify=auth.ssl, headers=headers, timeout=httpx.Timeout(30.0)
        )

    async def list(self, path: str, params: dict[str, str]) -> dict[str, Any]:
        r = await self._http.get(path, params=params)
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    async def watch(
        self, path: str, params: dict[str, str], timeout_s: int = 300
    ) -> AsyncIterator[dict[str, Any]]:
        """Watch events (``{"type", "object"}``) until the server ends the stream."""
        query = {
            **params,
            "watch": "1",
            "timeoutSeconds": str(timeout_s),
            "allowWatchBookmarks": "true",
        }
        timeout = httpx.Timeout(timeout_s + 30.0, connect=10.0)
        async with self._http.stream("GET", path, params=query, timeout=timeout) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)

    async def get(self, path: str) -> dict[str, Any] | None:
        r = await self._http.get(path)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    async def apply(self, path: str, manifest: dict[str, Any], manager: str) -> dict[str, Any]:
        """Server-side apply: the manager owns exactly the fields it sends."""
        r = await self._http.patch(
            path,
            params={"fieldManager": manager, "force": "true"},
            content=json.dumps(manifest),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    async def patch_status(self, path: str, status: dict[str, Any]) -> None:
        """Merge-patch the status subresource."""
        r = await self._http.patch(
            f"{path}/status",
            content=json.dumps({"status": status}),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        r.raise_for_status()

    async def delete(self, path: str) -> bool:
        r = await self._http.delete(path, params={"propagationPolicy": "Background"})
        if r.status_code == 404:
            return False
        r.raise_for_status()
        return True

    async def aclose(self) -> None:
        await self._http.aclose()


# kind -> (API prefix, plural) for the objects the operator renders
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "ConfigMap": ("/api/v1", "configmaps"),
    "Secret": ("/api/v1", "secrets"),
    "ServiceAccount": ("/api/v1", "serviceaccounts"),
    "Pod": ("/api/v1", "pods"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "Role": ("/apis/rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1", "rolebindings"),
    "InferencePool": ("/apis/kvplane.io/v1alpha1", "inferencepools"),
    "PrefillPool": ("/apis/kvplane.io/v1alpha1", "prefillpools"),
    "DecodePool": ("/apis/kvplane.io/v1alpha1", "decodepools"),
    "KVCacheTier": ("/apis/kvplane.io/v1alpha1", "kvcachetiers"),
}


def object_path(kind: str, namespace: str, name: str | None = None) -> str:
    prefix, plural = RESOURCES[kind]
    base = f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{base}/{name}" if name else base
