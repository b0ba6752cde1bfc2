"""One reconcile of an InferencePool (or of a namespace's tiers and orphan pools):
read from the cache, render, compare, write what differs, prune, report.

Every trigger (the pool, its engine pools, its tiers, its owned objects changing,
the periodic pass) ends here, so the outcome never depends on which event came
first. Inputs and live objects come from the informer's cache, rendering is pure
(``desired.py``, remembered until an input's generation changes) and so is the
comparison (``compare.py``): a pool at rest makes no request. Every write goes
through :class:`Writer`, which refuses once this replica is no longer the active one.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvplane.operator import api
from kvplane.operator.compare import covers
from kvplane.operator.conditions import Problem, Workload, condition, pool_conditions, workload_of
from kvplane.operator.desired import EnginePool, Rendered, desired_objects
from kvplane.operator.informer import Informer
from kvplane.operator.render import stores
from kvplane.operator.render.tiers import RenderError, plan_tiers, store_address
from kvplane.operator.settings import FIELD_MANAGER, OperatorSettings
from kvplane.operator.workqueue import RETRY, Result
from kvplane.router.kube import Kube, KubeAPIError, is_transient, kind_key
from pydantic import ValidationError

from kvplane.types import Json

log = logging.getLogger("kvplane.operator")

# What the operator renders, watches (by the managed-by label) and prunes.
PRUNABLE = (
    "Deployment",
    "HorizontalPodAutoscaler",
    "Service",
    "ConfigMap",
    "ServiceAccount",
    "RoleBinding",
    "NetworkPolicy",
    "InferencePool.inference.networking.k8s.io",  # GIE's, with spec.gateway
)
ENGINE_KINDS = {"prefill": "PrefillPool", "decode": "DecodePool"}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _generation(obj: Json) -> int:
    return int(obj["metadata"].get("generation", 0))


def _error(exc: Exception) -> str:
    return exc.message if isinstance(exc, KubeAPIError) else str(exc) or type(exc).__name__


# --- inputs ---------------------------------------------------------------------------


@dataclass
class Inputs:
    ipool: Json
    spec: api.InferencePoolSpec | None  # None: the stored spec does not validate
    pools: list[EnginePool] = field(default_factory=list)
    pool_objects: dict[str, Json] = field(default_factory=dict)  # "Kind/name" -> object
    tiers: list[tuple[Json, api.KVCacheTierSpec]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    # a new pool is not rendered while one of these is missing (so that it rolls out
    # once, from the complete set); missing tiers also freeze an existing pool
    waiting_for: list[str] = field(default_factory=list)
    missing_tiers: bool = False

    @property
    def fingerprint(self) -> tuple[Any, ...]:
        """Changes whenever a rendered input's spec does (generations, not versions:
        status writes do not count)."""
        meta = self.ipool["metadata"]
        return (
            meta["uid"],
            _generation(self.ipool),
            tuple(
                (k, o["metadata"]["uid"], _generation(o))
                for k, o in sorted(self.pool_objects.items())
            ),
            tuple(
                (t["metadata"]["name"], t["metadata"]["uid"], _generation(t)) for t, _ in self.tiers
            ),
        )


def gather(cache: Informer, namespace: str, name: str) -> Inputs | None:
    """The InferencePool and everything it is made of, from the cache; None if gone."""
    ipool = cache.get("InferencePool", namespace, name)
    if ipool is None or ipool["metadata"].get("deletionTimestamp"):
        return None
    try:
        spec = api.InferencePoolSpec.model_validate(ipool["spec"])
    except ValidationError as exc:
        problem = Problem("InvalidSpec", f"spec does not validate: {exc}")
        return Inputs(ipool, None, problems=[problem])
    inputs = Inputs(ipool, spec)
    for role, kind in ENGINE_KINDS.items():
        for item in cache.objects(kind, namespace):
            if ((item.get("spec") or {}).get("poolRef") or {}).get("name") != name:
                continue
            item_name = item["metadata"]["name"]
            try:
                pool_spec = api.EnginePoolSpec.model_validate(item["spec"])
            except ValidationError as exc:
                inputs.problems.append(Problem("InvalidReferences", f"{kind} {item_name}: {exc}"))
                continue
            inputs.pools.append(EnginePool(item_name, role, pool_spec))
            inputs.pool_objects[f"{kind}/{item_name}"] = item
    inputs.pools.sort(key=lambda p: (p.role, p.name))
    refs = spec.pools
    if refs is not None:
        named = {(p.role, p.name) for p in inputs.pools}
        wanted = {("decode", r.name) for r in refs.decode}
        if refs.prefill is not None:
            wanted.add(("prefill", refs.prefill.name))
        for role, pool in sorted(wanted - named):
            exists = cache.get(ENGINE_KINDS[role], namespace, pool) is not None
            why = "whose poolRef differs" if exists else "which does not exist"
            inputs.problems.append(
                Problem("InvalidReferences", f"spec.pools names {role} pool {pool}, {why}")
            )
            inputs.waiting_for.append(f"{role} pool {pool}")
    if not any(p.role == "decode" for p in inputs.pools):
        inputs.problems.append(Problem("InvalidReferences", "no DecodePool has poolRef " + name))
        inputs.waiting_for.append("a DecodePool")
    if sum(p.role == "prefill" for p in inputs.pools) > 1:
        inputs.problems.append(
            Problem("InvalidReferences", "more than one PrefillPool references this pool")
        )
    for ref in spec.kv_cache_tiers:
        tier = cache.get("KVCacheTier", namespace, ref.name)
        if tier is None:
            inputs.problems.append(
                Problem("InvalidReferences", f"KVCacheTier {ref.name} not found")
            )
            inputs.waiting_for.append(f"KVCacheTier {ref.name}")
            inputs.missing_tiers = True
            continue
        try:
            inputs.tiers.append((tier, api.KVCacheTierSpec.model_validate(tier["spec"])))
        except ValidationError as exc:
            inputs.problems.append(Problem("InvalidReferences", f"KVCacheTier {ref.name}: {exc}"))
            inputs.missing_tiers = True
    return inputs


# --- writes ---------------------------------------------------------------------------


class Paused(Exception):
    """This replica is not the active one (kopf peering): it must not write."""


@dataclass
class Writer:
    """The operator's writes, each refused unless this replica is the active one."""

    client: Kube
    active: Callable[[], bool]

    def _check(self) -> None:
        if not self.active():
            raise Paused

    async def apply(self, obj: Json) -> None:
        self._check()
        await self.client.apply(obj, FIELD_MANAGER)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        self._check()
        await self.client.delete(kind, namespace, name)

    async def create(self, obj: Json) -> bool:
        """Create ``obj`` unless it exists (never overwrites); True if created."""
        self._check()
        return await self.client.create(obj)

    async def status(self, obj: Json, kind: str, status: Json) -> bool:
        """Patch ``status`` unless the cached object already says it; True if written."""
        if covers(obj.get("status") or {}, status):
            return False
        self._check()
        meta = obj["metadata"]
        try:
            await self.client.patch_status(kind, meta["namespace"], meta["name"], status)
        except KubeAPIError as exc:
            if exc.status == 404:  # deleted meanwhile: nothing left to report on
                return False
            raise
        return True


# --- reconcile ------------------------------------------------------------------------


def _owner(obj: Json) -> Json:
    meta = obj["metadata"]
    return {
        "apiVersion": api.API_VERSION,
        "kind": obj.get("kind", "InferencePool"),
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


@dataclass
class Reconcile:
    cache: Informer
    writer: Writer
    settings: OperatorSettings
    # pool -> (fingerprint, rendered objects or None, render problems)
    _rendered: dict[tuple[str, str], tuple[Any, Rendered | None, list[Problem]]] = field(
        default_factory=dict
    )
    # pools (by uid) whose managed Redis' password Secret is known to exist
    _secrets: set[str] = field(default_factory=set)

    def _render(self, inputs: Inputs) -> tuple[Rendered | None, list[Problem]]:
        meta = inputs.ipool["metadata"]
        key = (meta["namespace"], meta["name"])
        memo = self._rendered.get(key)
        if memo is not None and memo[0] == inputs.fingerprint:
            return memo[1], memo[2]
        rendered, problems = None, []
        assert inputs.spec is not None
        try:
            rendered = desired_objects(
                meta["name"],
                meta["namespace"],
                inputs.spec,
                inputs.pools,
                [t for _, t in inputs.tiers],
                self.settings,
            )
            owner = _owner(inputs.ipool)
            for obj in rendered.objects:
                obj["metadata"]["ownerReferences"] = [owner]
        except ValueError as exc:  # render errors are spec problems the schema cannot see
            problems.append(Problem("InvalidSpec", f"cannot render: {exc}"))
        self._rendered[key] = (inputs.fingerprint, rendered, problems)
        return rendered, problems

    def forget(self, namespace: str, name: str) -> None:
        self._rendered.pop((namespace, name), None)

    async def _ensure_index_secret(self, inputs: Inputs) -> None:
        """The managed Redis' password, made once: a random one, never rendered (rendering
        is pure, and a render would rotate it), so neither watched nor pruned: it is only
        created (``create`` is the one Secret verb this needs: no Secret is read) and goes
        with the pool (owner reference). Asked once per pool and process, so a pool at
        rest makes no request."""
        meta = inputs.ipool["metadata"]
        if inputs.spec is None or stores.managed_redis(inputs.spec) is None:
            return
        if meta["uid"] in self._secrets:
            return
        secret = stores.index_secret(meta["name"], meta["namespace"], secrets.token_urlsafe(32))
        secret["metadata"]["ownerReferences"] = [_owner(inputs.ipool)]
        if await self.writer.create(secret):
            log.info("created the index password of %s/%s", meta["namespace"], meta["name"])
        self._secrets.add(meta["uid"])

    async def pool(self, namespace: str, name: str, settle_left_s: float) -> Result:
        """``settle_left_s``: how long until the pool's inputs have been quiet long
        enough for its first render."""
        inputs = gather(self.cache, namespace, name)
        if inputs is None:
            self.forget(namespace, name)
            return None
        ipool = inputs.ipool
        owned = {
            (kind, obj["metadata"]["name"]): obj
            for kind, obj in self.cache.owned(ipool["metadata"]["uid"])
            if kind in PRUNABLE
        }
        fresh = not owned and not (ipool.get("status") or {}).get("generationTag")
        if fresh and settle_left_s > 0:
            return settle_left_s
        problems = list(inputs.problems)
        rendered: Rendered | None = None
        if inputs.spec is not None:
            rendered, render_problems = self._render(inputs)
            problems += render_problems
        hold = inputs.missing_tiers or (fresh and bool(inputs.waiting_for))
        retry = False
        if rendered is not None and not hold:
            try:
                await self._ensure_index_secret(inputs)
                refused = await self._apply(rendered.objects, owned)
                problems += refused
                retry = bool(refused)
                await self._prune(rendered.objects, owned)
            except Paused:
                raise
            except Exception as exc:
                problems.append(Problem("ReconcileFailed", f"reconcile failed: {_error(exc)}"))
                log.warning("reconcile %s/%s failed: %s", namespace, name, exc)
                retry = True
        await self._statuses(inputs, rendered if not hold else None, problems)
        return RETRY if retry else None

    async def _apply(
        self, desired: list[Json], owned: dict[tuple[str, str], Json]
    ) -> list[Problem]:
        """Apply what the cache does not already show; the objects the API server
        refuses (4xx) are problems, the rest still get applied."""
        refused = []
        for obj in desired:
            meta = obj["metadata"]
            kind = kind_key(obj)
            live = owned.get((kind, meta["name"])) or self.cache.get(
                kind, meta["namespace"], meta["name"]
            )
            if live is not None and covers(live, obj):
                continue
            try:
                await self.writer.apply(obj)
            except KubeAPIError as exc:
                if is_transient(exc):
                    raise
                refused.append(
                    Problem(
                        "ApplyRefused", f"cannot apply {obj['kind']} {meta['name']}: {exc.message}"
                    )
                )
        return refused

    async def _prune(self, desired: list[Json], owned: dict[tuple[str, str], Json]) -> None:
        """Delete what this pool created earlier and no longer wants (a removed tier's
        store, a deleted DecodePool's Deployment)."""
        keep = {(kind_key(o), o["metadata"]["name"]) for o in desired}
        for (kind, name), obj in owned.items():
            if (kind, name) not in keep:
                log.info("pruning %s %s/%s", kind, obj["metadata"]["namespace"], name)
                await self.writer.delete(kind, obj["metadata"]["namespace"], name)

    def _workloads(self, namespace: str, rendered: Rendered | None) -> dict[str, Workload]:
        out = {}
        for obj in rendered.objects if rendered else []:
            if obj["kind"] != "Deployment":
                continue
            name = obj["metadata"]["name"]
            live = self.cache.get("Deployment", namespace, name)
            # an autoscaled Deployment's size is whatever its HPA last chose
            wanted = obj["spec"].get(
                "replicas", ((live or {}).get("spec") or {}).get("replicas", 1)
            )
            out[name] = workload_of(live, name, int(wanted))
        return out

    async def _statuses(
        self, inputs: Inputs, rendered: Rendered | None, problems: list[Problem]
    ) -> None:
        ipool = inputs.ipool
        namespace = ipool["metadata"]["namespace"]
        workloads = self._workloads(namespace, rendered)
        generation = _generation(ipool)
        now = _now()
        previous = (ipool.get("status") or {}).get("conditions", [])
        status: Json = {
            "observedGeneration": generation,
            "conditions": pool_conditions(
                list(workloads.values()), problems, generation, previous, now
            ),
            "mode": "disaggregated"
            if any(p.role == "prefill" for p in inputs.pools)
            else "aggregated",
            "pools": [],
        }
        if rendered is not None:
            status["generationTag"] = rendered.generation
            status["routerEndpoint"] = rendered.router_endpoint
        for pool in inputs.pools:
            kind = ENGINE_KINDS[pool.role]
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
            own_generation = _generation(own)
            own_status: Json = {
                "observedGeneration": own_generation,
                "replicas": wl.desired,
                "readyReplicas": wl.ready,
                "conditions": pool_conditions(
                    [wl],
                    [],
                    own_generation,
                    (own.get("status") or {}).get("conditions", []),
                    now,
                ),
            }
            if rendered is not None:
                own_status["generationTag"] = rendered.generation
            await self.writer.status(own, kind, own_status)
        await self.writer.status(ipool, "InferencePool", status)

    async def namespace(self, namespace: str) -> Result:
        """Status of what no pool reconcile reports: KVCacheTiers (in use, valid) and
        engine pools whose poolRef names no InferencePool."""
        pools = {p["metadata"]["name"]: p for p in self.cache.objects("InferencePool", namespace)}
        now = _now()
        for kind in ENGINE_KINDS.values():
            for item in self.cache.objects(kind, namespace):
                ref = ((item.get("spec") or {}).get("poolRef") or {}).get("name", "")
                if ref in pools:
                    continue
                generation = _generation(item)
                problem = Problem(
                    "PoolNotFound", f"poolRef names InferencePool {ref}, which does not exist"
                )
                status = {
                    "observedGeneration": generation,
                    "replicas": 0,
                    "readyReplicas": 0,
                    "conditions": pool_conditions(
                        [],
                        [problem],
                        generation,
                        (item.get("status") or {}).get("conditions", []),
                        now,
                    ),
                }
                await self.writer.status(item, kind, status)
        tiers = self.cache.objects("KVCacheTier", namespace)
        specs = {}
        for tier in tiers:
            try:
                specs[tier["metadata"]["name"]] = api.KVCacheTierSpec.model_validate(tier["spec"])
            except ValidationError:
                continue
        for tier in tiers:
            status = tier_status(tier, list(pools.values()), specs, now)
            await self.writer.status(tier, "KVCacheTier", status)
        return None


def tier_status(
    tier: Json, pools: list[Json], specs: dict[str, api.KVCacheTierSpec], now: str
) -> Json:
    """A KVCacheTier's status: which pools use it (``InUse``), and whether it is valid
    (``Ready``): its spec, and beside each pool's other tiers (one tier per kind).
    ``specs``: the namespace's valid tiers by name."""
    name = tier["metadata"]["name"]
    generation = _generation(tier)
    previous = (tier.get("status") or {}).get("conditions", [])
    users = sorted(
        p["metadata"]["name"]
        for p in pools
        if any(r.get("name") == name for r in (p.get("spec") or {}).get("kvCacheTiers") or [])
    )
    problems: list[str] = []
    endpoints: list[str] = []
    try:
        spec = api.KVCacheTierSpec.model_validate(tier["spec"])
        if spec.url is not None:
            endpoints.append(store_address(spec).hostport)
    except (ValidationError, RenderError) as exc:
        problems.append(str(exc))
        spec = None
    if spec is not None:
        for pool in pools:
            if pool["metadata"]["name"] not in users:
                continue
            refs = [r.get("name") for r in pool["spec"].get("kvCacheTiers") or []]
            others = [specs[r] for r in refs if r != name and r in specs]
            try:
                plan_tiers([spec, *others])
            except RenderError as exc:
                problems.append(f"InferencePool {pool['metadata']['name']}: {exc}")
    valid = not problems
    return {
        "observedGeneration": generation,
        "ready": valid,
        "endpoints": endpoints,
        "pools": users,
        "conditions": [
            condition(
                "Ready",
                valid,
                "Valid" if valid else "Invalid",
                "usable by engines" if valid else "; ".join(problems),
                generation,
                previous,
                now,
            ),
            condition(
                "InUse",
                bool(users),
                "Referenced" if users else "Unreferenced",
                ("used by InferencePool " + ", ".join(users))
                if users
                else "no InferencePool uses it",
                generation,
                previous,
                now,
            ),
        ],
    }
