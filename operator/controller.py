"""The operator's control loop: cache events become per-pool reconciles.

The informer watches the four kvplane kinds, the objects the operator owns (by the
managed-by label) and kopf's peering object. Each change triggers the reconcile of
the pool it belongs to: an engine pool's ``poolRef`` (before and after), a tier's
users, an owned object's controller reference. A namespace's tier and orphan
statuses are one more key. Each key runs on its own (``workqueue.py``): a failing
pool backs off alone and the others keep being repaired. The periodic pass and
every write happen only while this replica is the active one (``peering.py``), and
becoming active triggers a full pass.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Final

from kvplane.operator import peering
from kvplane.operator.informer import Informer, Watched, controller_uid
from kvplane.operator.reconcile import ENGINE_KINDS, PRUNABLE, Paused, Reconcile, Writer
from kvplane.operator.settings import MANAGED_BY, OperatorSettings
from kvplane.operator.workqueue import Result, WorkQueue
from kvplane.router.kube import Kube

from kvplane.types import Json

log = logging.getLogger("kvplane.operator")

OWNED_SELECTOR: Final = f"app.kubernetes.io/managed-by={MANAGED_BY}"
INPUT_KINDS: Final = ("InferencePool", "PrefillPool", "DecodePool", "KVCacheTier")

Key = tuple[str, str, str]  # ("pool", namespace, name) or ("namespace", namespace, "")


def _generation(obj: Json | None) -> int | None:
    return None if obj is None else int(obj["metadata"].get("generation", 0))


def _pool_ref(obj: Json | None) -> str | None:
    if obj is None:
        return None
    name = ((obj.get("spec") or {}).get("poolRef") or {}).get("name")
    return str(name) if name else None


def _tier_refs(obj: Json | None) -> set[str]:
    if obj is None:
        return set()
    return {str(r.get("name")) for r in (obj.get("spec") or {}).get("kvCacheTiers") or []}


class Controller:
    def __init__(self, client: Kube, settings: OperatorSettings, me: peering.Peering) -> None:
        self.settings = settings
        self.me = me
        kinds = [Watched(k) for k in INPUT_KINDS]
        kinds += [Watched(k, OWNED_SELECTOR) for k in PRUNABLE]
        if me.name is not None:
            kinds.append(Watched(me.kind, cluster_scoped=me.clusterwide))
        self.cache = Informer(client, kinds, settings.namespaces or None, self._changed)
        self.reconcile = Reconcile(self.cache, Writer(client, self.active), settings)
        self.queue: WorkQueue[Key] = WorkQueue(self._work, limit=settings.concurrency)
        self._input_changed: dict[tuple[str, str], float] = {}  # pool -> loop time
        self._was_active = False
        self._tasks: list[asyncio.Task[None]] = []

    def active(self) -> bool:
        peerings = self.cache.objects(self.me.kind) if self.me.name is not None else []
        return peering.active(self.me, peerings, dt.datetime.now(dt.UTC))

    async def start(self) -> None:
        self.cache.start()
        self._tasks.append(asyncio.create_task(self._periodic(), name="kvplane-resync"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.queue.stop()
        await self.cache.stop()

    # --- triggers ------------------------------------------------------------------

    def pass_all(self) -> None:
        """Queue every pool and namespace (each compares; writes only what differs)."""
        for ns in self.cache.namespaces("InferencePool"):
            for pool in self.cache.objects("InferencePool", ns):
                self.queue.add(("pool", ns, pool["metadata"]["name"]))
        for kind in INPUT_KINDS:
            for ns in self.cache.namespaces(kind):
                self.queue.add(("namespace", ns, ""))

    async def _periodic(self) -> None:
        await self.cache.synced.wait()
        while True:
            self._check_active()
            if self._was_active:
                self.pass_all()
            await asyncio.sleep(self.settings.resync_s)

    def _check_active(self) -> None:
        now_active = self.cache.synced.is_set() and self.active()
        if now_active and not self._was_active:
            log.info("this replica is active: checking every pool")
            self._was_active = True
            self.pass_all()
        elif not now_active and self._was_active:
            log.info("this replica is paused (kopf peering): no writes")
            self._was_active = False

    def _pool_input(self, namespace: str, name: str) -> None:
        self._input_changed[(namespace, name)] = asyncio.get_running_loop().time()
        self.queue.add(("pool", namespace, name), urgent=True)

    def _changed(self, kind: str, old: Json | None, new: Json | None) -> None:
        obj = new if new is not None else old
        assert obj is not None
        if kind == self.me.kind and self.me.name is not None:
            self._check_active()
            return
        ns = obj["metadata"].get("namespace", "")
        name = obj["metadata"]["name"]
        spec_changed = _generation(old) != _generation(new)
        if kind == "InferencePool":
            if new is None:
                self.queue.forget(("pool", ns, name))
                self.reconcile.forget(ns, name)
                self._input_changed.pop((ns, name), None)
            elif spec_changed:
                self._pool_input(ns, name)
            else:
                self.queue.add(("pool", ns, name))
            if spec_changed:
                self.queue.add(("namespace", ns, ""))
        elif kind in ENGINE_KINDS.values():
            for pool in {_pool_ref(old), _pool_ref(new)} - {None}:
                assert pool is not None
                if spec_changed:
                    self._pool_input(ns, pool)
                else:
                    self.queue.add(("pool", ns, pool))
            if spec_changed:
                self.queue.add(("namespace", ns, ""))
        elif kind == "KVCacheTier":
            if spec_changed:
                for user in self.cache.objects("InferencePool", ns):
                    if name in _tier_refs(user):
                        self._pool_input(ns, user["metadata"]["name"])
                self.queue.add(("namespace", ns, ""))
        else:  # an owned object: repair or report its pool
            uid = controller_uid(obj)
            for ref in obj["metadata"].get("ownerReferences") or []:
                if ref.get("uid") == uid and ref.get("kind") == "InferencePool":
                    self.queue.add(("pool", ns, ref["name"]))

    # --- work ----------------------------------------------------------------------

    async def _work(self, key: Key) -> Result:
        if not self.cache.synced.is_set() or not self.active():
            return None  # the active replica does it; becoming active passes over all
        what, ns, name = key
        try:
            if what == "namespace":
                return await self.reconcile.namespace(ns)
            changed = self._input_changed.get((ns, name), 0.0)
            settle_left = changed + self.settings.settle_s - asyncio.get_running_loop().time()
            return await self.reconcile.pool(ns, name, settle_left)
        except Paused:
            return None
