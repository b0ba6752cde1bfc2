"""Kubernetes API access for pod discovery, the index GC and the operator.

Built on ``kubernetes_asyncio``, the async port of the official Python client: it
re-reads the in-cluster projected service-account token as the kubelet rotates it,
takes kubeconfigs with token, client-certificate, exec-plugin or OIDC users, resumes
watches from their last resourceVersion (``watch.Watch``), and applies arbitrary
manifests through its dynamic client. kvplane works on plain dicts (the operator
renders them), so this module only maps kinds to the dynamic client's resources.

Every call retries what the API server means as "try again" (429, 5xx such as
``storage is (re)initializing`` after a restart, a reset connection) with a doubling
back-off, a bounded number of times; every call kvplane makes is idempotent (reads,
server-side apply, merge patches, deletes), so a retry never doubles an effect.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import logging
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as kconfig
from kubernetes_asyncio.dynamic import DynamicClient
from kubernetes_asyncio.dynamic.exceptions import ResourceNotFoundError
from kubernetes_asyncio.dynamic.resource import Resource
from kvplane.router.backoff import Backoff

from kvplane.types import Json

log = logging.getLogger("kvplane.kube")

T = TypeVar("T")

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
    "NetworkPolicy": "networking.k8s.io/v1",
    "KopfPeering": "kopf.dev/v1",
    "ClusterKopfPeering": "kopf.dev/v1",
    "InferencePool": "kvplane.io/v1alpha1",
    "PrefillPool": "kvplane.io/v1alpha1",
    "DecodePool": "kvplane.io/v1alpha1",
    "KVCacheTier": "kvplane.io/v1alpha1",
    "CustomResourceDefinition": "apiextensions.k8s.io/v1",
    # the Gateway API Inference Extension's pool, named apart from kvplane's own kind
    "InferencePool.inference.networking.k8s.io": "inference.networking.k8s.io/v1",
}


def kind_key(obj: Json) -> str:
    """The key of an object's kind in ``API_VERSIONS``: its kind, qualified by its API
    group where another group's kind has the same name (GIE's InferencePool)."""
    kind, version = str(obj["kind"]), str(obj.get("apiVersion", ""))
    if API_VERSIONS.get(kind, version) == version:
        return kind
    return f"{kind}.{version.rpartition('/')[0]}"


def not_served(exc: BaseException) -> bool:
    """The API server serves no such kind (its CRD is not installed)."""
    return isinstance(exc, ResourceNotFoundError)


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


# Attempts of one call before its error reaches the caller (about 15 s of back-off).
ATTEMPTS: Final = 6
REQUEST_TIMEOUT_S: Final = 60.0


class Kube:
    """The calls kvplane makes, on plain dicts, through one ``ApiClient``.

    ``requests`` counts the HTTP requests made (retries included; watches apart, in
    ``watches``) and ``writes`` those that change something (applies, status
    patches, deletes)."""

    def __init__(self, api: k8s.ApiClient) -> None:
        self.api = api
        self.requests = 0
        self.writes = 0
        self.watches = 0
        self._dynamic: DynamicClient | None = None
        self._resources: dict[str, Resource] = {}
        # API discovery is cached per client, not in a file another cluster may have left
        self._cache_dir = tempfile.mkdtemp(prefix="kvplane-discovery-")

    @classmethod
    async def connect(cls, kubeconfig: str | None = None) -> Kube:
        return cls(await api_client(kubeconfig))

    async def _resource(self, kind: str) -> tuple[DynamicClient, Resource]:
        """The dynamic client and the resource of ``kind`` (API discovery, cached)."""
        res = self._resources.get(kind)
        if self._dynamic is not None and res is not None:
            return self._dynamic, res

        async def discover() -> tuple[DynamicClient, Resource]:
            if self._dynamic is None:
                cache = os.path.join(self._cache_dir, "discovery.json")
                self._dynamic = await DynamicClient(self.api, cache_file=cache)
            api_version, name = API_VERSIONS[kind], kind.partition(".")[0]
            found = await self._dynamic.resources.get(api_version=api_version, kind=name)
            self._resources[kind] = found
            return self._dynamic, found

        return await self._call(discover)

    async def _call(self, request: Callable[[], Awaitable[T]], *, write: bool = False) -> T:
        """``request()`` until it succeeds, fails for good, or runs out of attempts."""
        backoff = Backoff(0.25, 8.0)
        for attempt in range(1, ATTEMPTS + 1):
            self.requests += 1
            self.writes += write
            try:
                return await request()
            except Exception as exc:
                if attempt == ATTEMPTS or not is_transient(exc):
                    raise
                delay = max(backoff.next(), retry_after(exc))
                log.info("transient API error (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def get(self, kind: str, namespace: str, name: str) -> Json | None:
        dyn, res = await self._resource(kind)

        async def request() -> Json | None:
            resp = await dyn.get(
                res,
                name=name,
                namespace=namespace,
                serialize=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            return await _body(resp, missing_ok=True)

        return await self._call(request)

    async def list(
        self, kind: str, namespace: str | None = None, label_selector: str | None = None
    ) -> list[Json]:
        """Objects of ``kind`` in ``namespace`` (every namespace when None)."""
        items, _ = await self.list_versioned(kind, namespace, label_selector)
        return items

    async def list_versioned(
        self, kind: str, namespace: str | None = None, label_selector: str | None = None
    ) -> tuple[builtins.list[Json], str]:
        """Objects of ``kind`` and the list's resourceVersion (where a watch resumes)."""
        dyn, res = await self._resource(kind)

        async def request() -> Json:
            resp = await dyn.get(
                res,
                namespace=namespace,
                label_selector=label_selector,
                serialize=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            return await _body(resp) or {}

        body = await self._call(request)
        items: list[Json] = body.get("items") or []
        return items, str((body.get("metadata") or {}).get("resourceVersion", ""))

    async def watch(
        self,
        kind: str,
        namespace: str | None,
        resource_version: str,
        *,
        label_selector: str | None = None,
        timeout_s: float = 300.0,
    ) -> AsyncIterator[tuple[str, Json]]:
        """(type, object) events after ``resource_version`` until the server ends the
        watch (after ``timeout_s``); bookmarks come as ``("BOOKMARK", object)`` so the
        caller can resume from them. Raises :class:`KubeAPIError` 410 when the version
        has expired (the caller lists again)."""
        dyn, res = await self._resource(kind)
        params: list[tuple[str, str]] = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(int(timeout_s))),
        ]
        if label_selector:
            params.append(("labelSelector", label_selector))
        self.watches += 1
        resp = await dyn.request(
            "GET",
            res.path(namespace=namespace),
            query_params=params,
            serialize=False,
            _request_timeout=timeout_s + REQUEST_TIMEOUT_S,
        )
        try:
            status = int(resp.status)
            if not 200 <= status < 300:
                raise KubeAPIError(status, await resp.text())
            while True:
                line = await resp.content.readline()
                if not line:
                    return
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    err = event.get("object") or {}
                    raise KubeAPIError(int(err.get("code", 500)), json.dumps(err))
                yield str(event["type"]), event["object"]
        finally:
            resp.release()

    async def apply(self, obj: Json, manager: str) -> Json:
        """Server-side apply: the manager owns exactly the fields it sends."""
        dyn, res = await self._resource(kind_key(obj))
        meta = obj["metadata"]

        async def request() -> Json:
            resp = await dyn.server_side_apply(
                res,
                body=obj,
                name=meta["name"],
                namespace=meta.get("namespace"),
                field_manager=manager,
                force_conflicts=True,
                serialize=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            return await _body(resp) or {}

        return await self._call(request, write=True)

    async def create(self, obj: Json) -> bool:
        """Create ``obj``; False if it exists already (left as it is)."""
        dyn, res = await self._resource(obj["kind"])
        meta = obj["metadata"]

        async def request() -> bool:
            resp = await dyn.create(
                res,
                body=obj,
                namespace=meta.get("namespace"),
                serialize=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            try:
                await _body(resp)
            except KubeAPIError as exc:
                if exc.status == 409:
                    return False
                raise
            return True

        return await self._call(request, write=True)

    async def patch_status(self, kind: str, namespace: str, name: str, status: Json) -> None:
        """Merge-patch the status subresource."""
        dyn, res = await self._resource(kind)

        async def request() -> None:
            resp = await dyn.patch(
                cast(Resource, res.status),  # the status subresource (attribute of the resource)
                body={"metadata": {"name": name}, "status": status},
                name=name,
                namespace=namespace,
                content_type="application/merge-patch+json",
                serialize=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            await _body(resp)

        await self._call(request, write=True)

    async def delete(self, kind: str, namespace: str, name: str) -> bool:
        dyn, res = await self._resource(kind)

        async def request() -> bool:
            resp = await dyn.delete(
                res,
                name=name,
                namespace=namespace,
                propagation_policy="Background",
                serialize=False,
                _request_timeout=REQUEST_TIMEOUT_S,
            )
            return await _body(resp, missing_ok=True) is not None

        return await self._call(request, write=True)

    async def close(self) -> None:
        await self.api.close()
        shutil.rmtree(self._cache_dir, ignore_errors=True)


class KubeAPIError(Exception):
    """The API server answered with an error status; ``message`` is its Status
    message (what a user should read), ``retry_after_s`` its Retry-After."""

    def __init__(self, status: int, body: str, retry_after_s: float = 0.0) -> None:
        self.status = status
        self.message = _status_message(body)
        self.retry_after_s = retry_after_s
        super().__init__(f"HTTP {status}: {self.message}")


def _status_message(body: str) -> str:
    try:
        parsed = json.loads(body)
    except ValueError:
        return body[:500]
    message = parsed.get("message") if isinstance(parsed, dict) else None
    return str(message)[:1000] if message else body[:500]


def is_transient(exc: BaseException) -> bool:
    """An error worth retrying as is: the server asked to come back (429), failed on
    its side (5xx: a restarting API server, an unreachable webhook), or the
    connection broke or timed out."""
    status = api_error_status(exc)
    if status is not None:
        return status == 429 or status >= 500
    return isinstance(
        exc, aiohttp.ClientConnectionError | aiohttp.ClientPayloadError | TimeoutError
    )


def retry_after(exc: BaseException) -> float:
    return exc.retry_after_s if isinstance(exc, KubeAPIError) else 0.0


async def _body(resp: Any, missing_ok: bool = False) -> Json | None:
    """A raw response's JSON body; None for a 404 when ``missing_ok``. (The dynamic
    client returns unchecked responses when it does not deserialize them.)"""
    status = int(resp.status)
    if status == 404 and missing_ok:
        resp.release()
        return None
    if not 200 <= status < 300:
        try:
            wait = float(resp.headers.get("Retry-After", 0))
        except ValueError:
            wait = 0.0
        raise KubeAPIError(status, await resp.text(), min(wait, 30.0))
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
