"""The operator's side of the P:D planner (``planner.py``): for every InferencePool with
``spec.planner``, every ``intervalSeconds`` it scrapes the pool's router, plans from the
workload seen since the last scrape, publishes the plan in ``status.plan`` and as
``kvplane_planner_*`` metrics, and with ``mode: apply`` sets ``spec.replicas`` of the
pool's PrefillPool and DecodePool (server-side apply, field manager
``kvplane-planner``; pools with ``autoscaling`` are left to their HPA).

The simulation runs in a worker process, so the operator's event loop never waits on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

import httpx
from kvplane.operator.api import (
    API_VERSION,
    InferencePoolSpec,
    PlannerMode,
    PlanStatus,
)
from kvplane.operator.planner import (
    Budget,
    Observation,
    Plan,
    PlannerSetup,
    Sample,
    Targets,
    observe,
    recommend,
    sample,
)
from kvplane.router.config import PDSpec
from kvplane.router.kube import Kube
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from kvplane.types import Json

if TYPE_CHECKING:
    from kvplane.operator.controller import Controller

log = logging.getLogger("kvplane.operator.planner")

FIELD_MANAGER: Final = "kvplane-planner"
TICK_S: Final = 10.0

Scrape = Callable[[str], Awaitable[str]]  # router endpoint -> its /metrics text
Planner = Callable[[Observation, Targets, Budget, PlannerSetup], Awaitable[Plan]]


class PlannerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.replicas = Gauge(
            "kvplane_planner_recommended_replicas",
            "Replicas the P:D planner recommends, by role",
            ("namespace", "pool", "role"),
            registry=self.registry,
        )
        self.meets = Gauge(
            "kvplane_planner_meets_targets",
            "1 if the recommended split meets the pool's TTFT and ITL targets in simulation",
            ("namespace", "pool"),
            registry=self.registry,
        )
        self.ttft = Gauge(
            "kvplane_planner_predicted_ttft_p90_seconds",
            "Simulated TTFT p90 of the recommended split",
            ("namespace", "pool"),
            registry=self.registry,
        )


async def scrape_router(endpoint: str) -> str:
    async with httpx.AsyncClient(timeout=10.0) as client:
        resp = await client.get(f"{endpoint.rstrip('/')}/metrics")
        resp.raise_for_status()
        return resp.text


_POOL: ProcessPoolExecutor | None = None


async def simulate(obs: Observation, t: Targets, b: Budget, setup: PlannerSetup) -> Plan:
    """``recommend`` in a worker process (the simulation holds the GIL)."""
    global _POOL
    if _POOL is None:
        _POOL = ProcessPoolExecutor(max_workers=1)
    return await asyncio.get_running_loop().run_in_executor(_POOL, recommend, obs, t, b, setup)


def setup_for(spec: InferencePoolSpec) -> PlannerSetup:
    """The simulated fleet: the planner's engine profile, NVLink inside a node, the
    default P/D links between nodes (the router's own defaults), NIXL handoffs."""
    assert spec.planner is not None
    pd = PDSpec.model_validate({"connector": "nixl"})
    return PlannerSetup(pd, spec.planner.profile, spec.planner.gpus_per_node)


Objects = Callable[[str], list[Json]]  # kind -> the objects of that kind (a cache)


@dataclass
class PlannerHook:
    kube: Kube  # writes: the InferencePool's status, the engine pools' replicas
    objects: Objects  # reads: the operator's informer cache (no request at rest)
    active: Callable[[], bool] = lambda: True  # kopf peering: only the active replica
    scrape: Scrape = scrape_router
    plan: Planner = simulate
    metrics: PlannerMetrics = field(default_factory=PlannerMetrics)
    clock: Callable[[], float] = time.time
    _samples: dict[tuple[str, str], Sample] = field(default_factory=dict)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            if not self.active():
                continue
            for item in self.objects("InferencePool"):
                try:
                    await self.visit(item)
                except Exception:  # the next interval retries
                    log.exception("planner: %s failed", item["metadata"].get("name"))

    async def visit(self, item: Json) -> Plan | None:
        """One pool: scrape if its interval has passed, plan if there was traffic."""
        meta = item["metadata"]
        key = (meta["namespace"], meta["name"])
        spec = InferencePoolSpec.model_validate(item["spec"])
        endpoint = (item.get("status") or {}).get("routerEndpoint")
        if spec.planner is None or spec.slo is None or not endpoint:
            self._samples.pop(key, None)
            return None
        prev = self._samples.get(key)
        now = self.clock()
        if prev is not None and now - prev["time"] < spec.planner.interval_seconds:
            return None
        try:
            cur = sample(await self.scrape(endpoint), now)
        except httpx.HTTPError as exc:
            log.warning("planner: %s/%s: router metrics unreachable: %s", *key, exc)
            return None
        self._samples[key] = cur
        obs = observe(prev, cur) if prev is not None else None
        if obs is None:
            return None
        targets = Targets(spec.slo.ttft_ms, spec.slo.itl_ms)
        budget = Budget(spec.planner.min_replicas, spec.planner.max_replicas)
        plan = await self.plan(obs, targets, budget, setup_for(spec))
        applied = False
        if spec.planner.mode is PlannerMode.APPLY:
            applied = await self.apply(key[0], key[1], plan)
        await self.publish(key[0], key[1], plan, applied)
        return plan

    async def publish(self, namespace: str, name: str, plan: Plan, applied: bool) -> None:
        status = PlanStatus(
            prefill_replicas=plan.prefill,
            decode_replicas=plan.decode,
            meets_targets=plan.meets_targets,
            predicted_ttft_p90_ms=round(plan.ttft_p90_ms, 1),
            predicted_itl_p99_ms=round(plan.itl_p99_ms, 2),
            observed=plan.observed.describe(),
            applied=applied,
            planned_at=datetime.fromtimestamp(self.clock(), UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        )
        body = status.model_dump(by_alias=True, exclude_none=True)
        await self.kube.patch_status("InferencePool", namespace, name, {"plan": body})
        m = self.metrics
        m.replicas.labels(namespace, name, "prefill").set(plan.prefill)
        m.replicas.labels(namespace, name, "decode").set(plan.decode)
        m.meets.labels(namespace, name).set(int(plan.meets_targets))
        m.ttft.labels(namespace, name).set(plan.ttft_p90_ms / 1000)
        log.info(
            "planner: %s/%s: P:D %s (%s) for %s",
            namespace,
            name,
            plan.ratio,
            "meets targets" if plan.meets_targets else "best found, targets missed",
            plan.observed.describe(),
        )

    async def apply(self, namespace: str, name: str, plan: Plan) -> bool:
        """Set the replicas of the pool's one PrefillPool and one DecodePool; False (and
        nothing changed) when the pool has not exactly one of each with fixed replicas."""
        pools = {}
        for kind in ("PrefillPool", "DecodePool"):
            mine = [
                p
                for p in self.objects(kind)
                if p["metadata"].get("namespace") == namespace
                and (p.get("spec", {}).get("poolRef") or {}).get("name") == name
            ]
            if len(mine) != 1 or mine[0]["spec"].get("autoscaling"):
                log.warning(
                    "planner: %s/%s: apply needs one %s with fixed replicas; recommending only",
                    namespace,
                    name,
                    kind,
                )
                return False
            pools[kind] = mine[0]["metadata"]["name"]
        for kind, replicas in (("PrefillPool", plan.prefill), ("DecodePool", plan.decode)):
            patch = {
                "apiVersion": API_VERSION,
                "kind": kind,
                "metadata": {"name": pools[kind], "namespace": namespace},
                "spec": {"replicas": replicas},
            }
            await self.kube.apply(patch, FIELD_MANAGER)
        return True


def start(kube: Kube, controller: Controller) -> asyncio.Task[None]:
    """The operator's hook: the planner loop over the controller's cache, writing only
    while this replica is active (cancel the task to stop)."""
    hook = PlannerHook(kube, controller.cache.objects, controller.active)
    serve_metrics(hook.metrics)
    return asyncio.create_task(hook.run(), name="kvplane-planner")


def serve_metrics(metrics: PlannerMetrics) -> None:
    """``kvplane_planner_*`` on ``$KVPLANE_METRICS_PORT`` (unset: not served)."""
    port = os.environ.get("KVPLANE_METRICS_PORT")
    if port:
        start_http_server(int(port), registry=metrics.registry)
