"""One reconcile of an InferencePool: read, render, apply, prune, report.

Every trigger (the pool, its engine pools, its tiers, its Deployments, the
resync timer) ends here, so the outcome never depends on which event came
first. Rendering is pure (``desired.py``); this module is the I/O around it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any

from kvplane.operator import api
from kvplane.operator.conditions import Workload, pool_conditions, workload_of
from kvplane.operator.desired import EnginePool, desired_objects
from kvplane.operator.render import stores
from kvplane.operator.settings import FIELD_MANAGER, MANAGED_BY, OperatorSettings
from kvplane.router.kube import Kube, api_error_status
from pydantic import ValidationError

log = logging.getLogger("kvplane.operator")

POOL_LABEL = "kvplane.io/pool"
PRUNABLE = (
    "Deployment",
    "HorizontalPodAutoscaler",
    "Service",
    "ConfigMap",
    "ServiceAccount",
    "Role",
    "RoleBinding",
)


@dataclass
class Inputs:
    ipool: dict[str, Any]
    spec: api.InferencePoolSpec
    pools: list[EnginePool] = field(default_factory=list)
    pool_objects: dict[str, dict[str, Any]] = field(default_factory=dict)  # "Kind/name" -> obj
    tiers: list[api.KVCacheTierSpec] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def gather(client: Kube, namespace: str, name: str) -> Inputs | None:
    """The InferencePool and everything it is made of; None if it is gone."""
    ipool = await client.get("InferencePool", namespace, name)
    if ipool is None or ipool["metadata"].get("deletionTimestamp"):
        return None
    inputs = Inputs(ipool, api.InferencePoolSpec.model_validate(ipool["spec"]))
    for kind, role in (("PrefillPool", "prefill"), ("DecodePool", "decode")):
        for item in await client.list(kind, namespace):
            try:
                spec = api.EnginePoolSpec.model_validate(item["spec"])
            except ValidationError as exc:
                inputs.problems.append(f"{kind} {item['metadata']['name']}: {exc}")
                continue
            if spec.pool_ref.name == name:
                inputs.pools.append(EnginePool(item["metadata"]["name"], role, spec))
                inputs.pool_objects[f"{kind}/{item['metadata']['name']}"] = item
    inputs.pools.sort(key=lambda p: (p.role, p.name))
    refs = inputs.spec.pools
    if refs is not None:
        named = {(p.role, p.name) for p in inputs.pools}
        wanted = {("decode", r.name) for r in refs.decode}
        if refs.prefill is not None:
            wanted.add(("prefill", refs.prefill.name))
        for role, pool in sorted(wanted - named):
            inputs.problems.append(f"spec.pools names {role} pool {pool}, whose poolRef differs")
    if not any(p.role == "decode" for p in inputs.pools):
        inputs.problems.append("no DecodePool has poolRef " + name)
    if sum(p.role == "prefill" for p in inputs.pools) > 1:
        inputs.problems.append("more than one PrefillPool references this pool")
    for ref in inputs.spec.kv_cache_tiers:
        tier = await client.get("KVCacheTier", namespace, ref.name)
        if tier is None:
            inputs.problems.append(f"KVCacheTier {ref.name} not found")
        else:
            inputs.tiers.append(api.KVCacheTierSpec.model_validate(tier["spec"]))
    return inputs


def _owner(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": api.API_VERSION,
        "kind": obj["kind"],
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


async def _apply_all(
    client: Kube, namespace: str, inputs: Inputs, desired: list[dict[str, Any]]
) -> None:
    owner = _owner(inputs.ipool)
    for obj in desired:
        obj["metadata"]["namespace"] = namespace
        obj["metadata"]["ownerReferences"] = [owner]
        await client.apply(obj, FIELD_MANAGER)


async def _ensure_index_secret(client: Kube, namespace: str, inputs: Inputs) -> None:
    """The managed Redis' password, made once: a random one, never rendered (rendering is
    pure), kept for the pool's life (the Secret is the pool's, deleted with it)."""
    if stores.managed_redis(inputs.spec) is None:
        return
    name = inputs.ipool["metadata"]["name"]
    if await client.get("Secret", namespace, stores.index_secret_name(name)) is not None:
        return
    secret = stores.index_secret(name, namespace, secrets.token_urlsafe(32))
    secret["metadata"]["ownerReferences"] = [_owner(inputs.ipool)]
    await client.apply(secret, FIELD_MANAGER)
    log.info("created the index password of %s/%s", namespace, name)


async def _prune(client: Kube, namespace: str, name: str, desired: list[dict[str, Any]]) -> None:
    """Delete what this pool created earlier and no longer wants (a removed tier's store)."""
    keep = {(o["kind"], o["metadata"]["name"]) for o in desired}
    selector = f"{POOL_LABEL}={name},app.kubernetes.io/managed-by={MANAGED_BY}"
    for kind in PRUNABLE:
        for item in await client.list(kind, namespace, selector):
            if (kind, item["metadata"]["name"]) not in keep:
                log.info("pruning %s %s/%s", kind, namespace, item["metadata"]["name"])
                await client.delete(kind, namespace, item["metadata"]["name"])


async def _workloads(
    client: Kube, namespace: str, desired: list[dict[str, Any]]
) -> dict[str, Workload]:
    out = {}
    for obj in desired:
        if obj["kind"] != "Deployment":
            continue
        name = obj["metadata"]["name"]
        live = await client.get("Deployment", namespace, name)
        # an autoscaled Deployment's size is whatever its HPA last chose
        wanted = obj["spec"].get("replicas", ((live or {}).get("spec") or {}).get("replicas", 1))
        out[name] = workload_of(live, name, int(wanted))
    return out


async def reconcile(client: Kube, settings: OperatorSettings, namespace: str, name: str) -> None:
    inputs = await gather(client, namespace, name)
    if inputs is None:
        return
    generation = int(inputs.ipool["metadata"].get("generation", 0))
    desired: list[dict[str, Any]] = []
    try:
        rendered = desired_objects(
            name, namespace, inputs.spec, inputs.pools, inputs.tiers, settings.image
        )
        desired = rendered.objects
    except ValueError as exc:  # render errors are spec problems the schema cannot see
        inputs.problems.append(f"cannot render: {exc}")
        rendered = None
    if desired:
        await _ensure_index_secret(client, namespace, inputs)
        await _apply_all(client, namespace, inputs, desired)
        await _prune(client, namespace, name, desired)
    workloads = await _workloads(client, namespace, desired)
    previous = inputs.ipool.get("status", {}).get("conditions", [])
    now = _now()
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "conditions": pool_conditions(
            list(workloads.values()), inputs.problems, generation, previous, now
        ),
        "mode": "disaggregated" if any(p.role == "prefill" for p in inputs.pools) else "aggregated",
        "pools": [],
    }
    if rendered is not None:
        status["generationTag"] = rendered.generation
        status["routerEndpoint"] = rendered.router_endpoint
    for pool in inputs.pools:
        kind = "PrefillPool" if pool.role == "prefill" else "DecodePool"
        deployment = rendered.engine_deployments.get(pool.name) if rendered else None
        wl = workloads.get(deployment or "", Workload(pool.name, 0, 0, 0, False))
        status["pools"].append(
            {
                "name": pool.name,
                "role": pool.role,
                "replicas": wl.desired,
                "readyReplicas": wl.ready,
            }
        )
        own = inputs.pool_objects[f"{kind}/{pool.name}"]
        own_status = {
            "observedGeneration": int(own["metadata"].get("generation", 0)),
            "replicas": wl.desired,
            "readyReplicas": wl.ready,
            "generationTag": rendered.generation if rendered else None,
            "conditions": pool_conditions(
                [wl],
                [],
                int(own["metadata"].get("generation", 0)),
                own.get("status", {}).get("conditions", []),
                now,
            ),
        }
        await client.patch_status(kind, namespace, pool.name, own_status)
    await client.patch_status("InferencePool", namespace, name, status)


class Reconciler:
    """Serialises and coalesces reconciles per pool: a burst of triggers while one
    runs results in exactly one more run."""

    def __init__(self, client: Kube, settings: OperatorSettings) -> None:
        self.client = client
        self.settings = settings
        self._running: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._dirty: set[tuple[str, str]] = set()

    async def trigger(self, namespace: str, name: str) -> None:
        key = (namespace, name)
        if key in self._running:
            self._dirty.add(key)
            return
        task = asyncio.create_task(self._loop(key), name=f"reconcile-{namespace}/{name}")
        self._running[key] = task
        await asyncio.shield(task)

    async def _loop(self, key: tuple[str, str]) -> None:
        try:
            for _ in range(100):  # bounded: a pool rewritten faster than this is broken
                self._dirty.discard(key)
                try:
                    await reconcile(self.client, self.settings, *key)
                except Exception as exc:
                    if api_error_status(exc) != 409:  # a conflict resolves on the next run
                        log.error("reconcile %s/%s: %s", *key, exc)
                        raise
                if key not in self._dirty:
                    return
        finally:
            self._running.pop(key, None)
