"""kopf wiring: every event that can change what an InferencePool should look
like triggers the same reconcile (``reconcile.py``)."""

from __future__ import annotations

import asyncio
import base64
import logging
from typing import Any

import kopf
from kvplane.operator import api, planner_hook
from kvplane.operator.reconcile import POOL_LABEL, Reconciler
from kvplane.operator.settings import MANAGED_BY, OperatorSettings
from kvplane.router.index.redis import forget_generation
from kvplane.router.kube import Kube, credentials

log = logging.getLogger("kvplane.operator")

GROUP, VERSION = api.GROUP, api.VERSION
_settings = OperatorSettings.from_env()


def _reconciler(kw: dict[str, Any]) -> Reconciler:
    reconciler: Reconciler = kw["memo"].reconciler
    return reconciler


@kopf.on.login()
async def login(*_: Any, **__: Any) -> kopf.ConnectionInfo:
    """kopf connects with the credentials ``kvplane.router.kube`` loads (in-cluster
    with the token as rotated now, or any kubeconfig user: token, certificate, exec,
    OIDC); kopf logs in again when the API server rejects them."""
    c = await credentials()
    return kopf.ConnectionInfo(
        server=c.server,
        ca_path=c.ca_path,
        insecure=c.insecure,
        scheme="Bearer" if c.token else None,
        token=c.token,
        certificate_path=c.certificate_path,
        private_key_path=c.private_key_path,
    )


@kopf.on.startup()
async def startup(*_: Any, **kw: Any) -> None:
    settings: kopf.OperatorSettings = kw["settings"]
    memo: kopf.Memo = kw["memo"]
    settings.persistence.finalizer = f"{GROUP}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    memo.reconciler = Reconciler(await Kube.connect(), _settings)
    memo.resync = asyncio.create_task(_resync_loop(memo.reconciler), name="kvplane-resync")
    memo.planner = planner_hook.start(memo.reconciler.client, [*_settings.namespaces] or [None])


async def _resync_loop(reconciler: Reconciler) -> None:
    """Drift repair: re-apply every pool (server-side apply is idempotent). A plain
    loop rather than a kopf timer, because kopf timers put a finalizer on every
    object, and a finalizer is only warranted for cleanup outside Kubernetes."""
    namespaces: list[str | None] = [*_settings.namespaces] or [None]
    while True:
        await asyncio.sleep(_settings.resync_s)
        for ns in namespaces:
            try:
                for item in await reconciler.client.list("InferencePool", ns):
                    meta = item["metadata"]
                    await reconciler.trigger(meta["namespace"], meta["name"])
            except Exception:  # keep repairing the others; the next round retries
                log.exception("resync failed")


@kopf.on.cleanup()
async def cleanup(*_: Any, **kw: Any) -> None:
    kw["memo"].resync.cancel()
    kw["memo"].planner.cancel()
    await _reconciler(kw).client.close()


@kopf.on.create(GROUP, VERSION, "inferencepools")
@kopf.on.update(GROUP, VERSION, "inferencepools")
@kopf.on.resume(GROUP, VERSION, "inferencepools")
async def pool_changed(*_: Any, **kw: Any) -> None:
    await _reconciler(kw).trigger(kw["namespace"], kw["name"])


@kopf.on.event(GROUP, VERSION, "prefillpools")
@kopf.on.event(GROUP, VERSION, "decodepools")
async def engine_pool_event(*_: Any, **kw: Any) -> None:
    parent = ((kw.get("spec") or {}).get("poolRef") or {}).get("name")
    if parent:
        await _reconciler(kw).trigger(kw["namespace"], parent)


@kopf.on.event(GROUP, VERSION, "kvcachetiers")
async def tier_event(*_: Any, **kw: Any) -> None:
    reconciler = _reconciler(kw)
    namespace = kw["namespace"]
    for item in await reconciler.client.list("InferencePool", namespace):
        refs = item.get("spec", {}).get("kvCacheTiers", [])
        if any(r.get("name") == kw["name"] for r in refs):
            await reconciler.trigger(namespace, item["metadata"]["name"])


@kopf.on.event("apps", "v1", "deployments", labels={"app.kubernetes.io/managed-by": MANAGED_BY})
async def owned_deployment_event(*_: Any, **kw: Any) -> None:
    """A rollout progressed (status) or someone edited or deleted our Deployment."""
    pool = (kw.get("labels") or {}).get(POOL_LABEL)
    if pool:
        await _reconciler(kw).trigger(kw["namespace"], pool)


def _external_index(spec: Any, **_: Any) -> bool:
    return bool((spec.get("index") or {}).get("external"))


@kopf.on.delete(GROUP, VERSION, "inferencepools", when=_external_index)
async def forget_external_residency(*_: Any, **kw: Any) -> None:
    """The one cleanup outside Kubernetes: a pool's residency in an external Redis
    (a managed Redis goes away with its Deployment). Only such pools get a finalizer."""
    tag = (kw.get("status") or {}).get("generationTag")
    external = kw["spec"]["index"]["external"]
    if not tag:
        return
    password = None
    ref = external.get("passwordSecretRef")
    if ref:
        secret = await _reconciler(kw).client.get("Secret", kw["namespace"], ref["name"])
        data = ((secret or {}).get("data") or {}).get(ref["key"])
        password = base64.b64decode(data).decode() if data else None
    removed = await forget_generation(external["url"], tag, password)
    log.info("removed %d residency keys of generation %s from %s", removed, tag, external["url"])
