"""kopf wiring: credentials, peering, the controller's life, and the one finalizer.

kopf logs in, runs the peering that makes one replica active, and runs the cleanup
of a pool's residency in an external Redis before the pool goes. Everything else
(watching, reconciling, retrying, the periodic pass) is the controller's
(``controller.py``), which kopf starts and stops.
"""

from __future__ import annotations

import base64
import logging
import os
from typing import Any

import kopf
from kvplane.operator import api, planner_hook
from kvplane.operator.controller import Controller
from kvplane.operator.peering import Peering
from kvplane.operator.settings import OperatorSettings
from kvplane.router.index.redis import forget_generation
from kvplane.router.kube import Kube, api_error_status, credentials

log = logging.getLogger("kvplane.operator")

GROUP, VERSION = api.GROUP, api.VERSION


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


def peering_of(settings: kopf.OperatorSettings) -> Peering:
    """This replica in kopf's peering, as kopf was told (``--standalone`` or
    ``--peering NAME``; kopf's identity is ``POD_ID`` when set)."""
    p = settings.peering
    if p.standalone:
        return Peering(None)
    if not p.mandatory:
        log.warning("no --standalone or --peering: running as if standalone")
        return Peering(None)
    return Peering(p.name, p.priority, os.environ.get("POD_ID"), p.clusterwide)


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
    ours = OperatorSettings.from_env()
    settings.peering.lifetime = ours.peering_lifetime_s
    memo.client = await Kube.connect()
    memo.controller = Controller(memo.client, ours, peering_of(settings))
    await memo.controller.start()
    memo.planner = planner_hook.start(memo.client, memo.controller)


@kopf.on.cleanup()
async def cleanup(*_: Any, **kw: Any) -> None:
    kw["memo"].planner.cancel()
    await kw["memo"].controller.stop()
    await kw["memo"].client.close()


def _external_index(spec: Any, **_: Any) -> bool:
    return bool((spec.get("index") or {}).get("external"))


@kopf.on.delete(GROUP, VERSION, "inferencepools", when=_external_index)
async def forget_external_residency(*_: Any, **kw: Any) -> None:
    """The one cleanup outside Kubernetes: a pool's residency in an external Redis
    (a managed Redis goes away with its Deployment). Only such pools get a finalizer.
    The generation tag names the pool, so only this pool's keys go."""
    tag = (kw.get("status") or {}).get("generationTag")
    external = kw["spec"]["index"]["external"]
    if not tag:
        return
    password = None
    ref = external.get("passwordSecretRef")
    if ref:
        client: Kube = kw["memo"].client
        try:
            secret = await client.get("Secret", kw["namespace"], ref["name"])
        except Exception as exc:
            if api_error_status(exc) != 403:
                raise  # kopf retries
            # The chart grants Secret reads only where asked (rbac.readSecrets, or the
            # watched namespaces): without it the keys stay until Redis evicts them.
            raise kopf.PermanentError(
                f"may not read Secret {ref['name']} for the index password; residency "
                f"keys of generation {tag} stay in {external['url']} until evicted"
            ) from exc
        data = ((secret or {}).get("data") or {}).get(ref["key"])
        password = base64.b64decode(data).decode() if data else None
    removed = await forget_generation(external["url"], tag, password)
    log.info("removed %d residency keys of generation %s from %s", removed, tag, external["url"])
