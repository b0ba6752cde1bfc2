"""A read-only cache of the objects the operator reconciles, kept by list and watch.

controller-runtime's informer reduced to what the operator reads: per kind (with a
server-side label selector for the objects it owns) and namespace, one list, then a
watch resumed from its last resourceVersion and bookmarks; a list again only when
that version expired (410) or the connection failed, and then the difference with
the cache is reported as changes. Reconciles read from here, so a pool at rest costs
no request. Why not kopf's own watches: kopf filters labels in the client (it would
stream every ConfigMap, Service and RoleBinding of the cluster), and it stops them
while its replica is paused, when a standby's cache should stay warm for takeover.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvplane.router.backoff import Backoff
from kvplane.router.kube import API_VERSIONS, Kube, api_error_status, not_served

from kvplane.types import Json

log = logging.getLogger("kvplane.operator.informer")


@dataclass(frozen=True)
class Watched:
    kind: str
    label_selector: str | None = None
    cluster_scoped: bool = False


# kind, the object before (None: added), after (None: deleted)
OnChange = Callable[[str, Json | None, Json | None], None]


def controller_uid(obj: Json) -> str | None:
    for ref in obj["metadata"].get("ownerReferences") or []:
        if ref.get("controller"):
            return str(ref["uid"])
    return None


class Informer:
    """``namespaces``: None for the whole cluster."""

    def __init__(
        self,
        client: Kube,
        kinds: Sequence[Watched],
        namespaces: Sequence[str] | None,
        on_change: OnChange,
        *,
        watch_timeout_s: float = 300.0,
    ) -> None:
        self._client = client
        self._kinds = list(kinds)
        self._namespaces: list[str | None] = list(namespaces) if namespaces else [None]
        self._on_change = on_change
        self._watch_timeout_s = watch_timeout_s
        # kind -> namespace -> name -> object
        self._store: dict[str, dict[str, dict[str, Json]]] = {k.kind: {} for k in kinds}
        self._owned: dict[str, dict[tuple[str, str, str], Json]] = {}  # owner uid -> objects
        self._tasks: list[asyncio.Task[None]] = []
        self._pending = 0
        self.synced = asyncio.Event()
        self.relists = 0  # lists after the first one of each stream

    # --- reads ---------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> Json | None:
        """The cached object (None when absent, or of a kind not watched)."""
        return self._store.get(kind, {}).get(namespace, {}).get(name)

    def objects(self, kind: str, namespace: str | None = None) -> list[Json]:
        by_ns = self._store.get(kind, {})
        if namespace is not None:
            return list(by_ns.get(namespace, {}).values())
        return [o for objs in by_ns.values() for o in objs.values()]

    def owned(self, uid: str) -> list[tuple[str, Json]]:
        """(kind, object) of every cached object whose controller is ``uid``."""
        return [(kind, obj) for (kind, _, _), obj in self._owned.get(uid, {}).items()]

    def namespaces(self, kind: str) -> Iterator[str]:
        yield from list(self._store.get(kind, {}))

    # --- lifecycle -----------------------------------------------------------------

    def start(self) -> None:
        streams = [
            (w, None if w.cluster_scoped else ns)
            for w in self._kinds
            for ns in (self._namespaces if not w.cluster_scoped else [None])
        ]
        self._pending = len(streams)
        for watched, ns in streams:
            self._tasks.append(
                asyncio.create_task(self._run(watched, ns), name=f"informer-{watched.kind}-{ns}")
            )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    # --- streams -------------------------------------------------------------------

    async def _run(self, watched: Watched, namespace: str | None) -> None:
        backoff = Backoff(0.5, 30.0)
        first = True
        while True:
            try:
                items, version = await self._client.list_versioned(
                    watched.kind, namespace, watched.label_selector
                )
                if not first:
                    self.relists += 1
                self._replace(watched.kind, namespace, items)
                if first:
                    first = False
                    self._pending -= 1
                    if self._pending == 0:
                        self.synced.set()
                while True:  # one watch per server timeout, resumed from the last version
                    async for kind, obj in self._client.watch(
                        watched.kind,
                        namespace,
                        version,
                        label_selector=watched.label_selector,
                        timeout_s=self._watch_timeout_s,
                    ):
                        version = obj["metadata"].get("resourceVersion", version)
                        if kind == "DELETED":
                            self._remove(watched.kind, obj)
                        elif kind in ("ADDED", "MODIFIED"):
                            self._put(watched.kind, obj)
                    backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if api_error_status(exc) == 410:  # the version expired: list again now
                    continue
                if first and not_served(exc):  # no such CRD (yet): an empty kind, synced
                    first = False
                    self._pending -= 1
                    if self._pending == 0:
                        self.synced.set()
                    await self._until_served(watched.kind)
                    continue
                delay = backoff.next()
                log.warning(
                    "watch of %s in %s failed (%s); listing again in %.1fs",
                    watched.kind,
                    namespace or "all namespaces",
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)

    async def _until_served(self, kind: str) -> None:
        """Returns once ``kind``'s CRD is established, learnt from a watch of the
        CRDs: an absent optional kind (GIE's InferencePool) costs no request at rest."""
        name = kind.partition(".")[0]
        group = API_VERSIONS[kind].rpartition("/")[0]
        backoff = Backoff(0.5, 30.0)
        while True:
            try:
                crds, version = await self._client.list_versioned("CustomResourceDefinition")
                if any(_defines(crd, group, name) for crd in crds):
                    return
                while True:
                    async for event, crd in self._client.watch(
                        "CustomResourceDefinition", None, version, timeout_s=self._watch_timeout_s
                    ):
                        version = crd["metadata"].get("resourceVersion", version)
                        if event in ("ADDED", "MODIFIED") and _defines(crd, group, name):
                            return
                    backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = 0.0 if api_error_status(exc) == 410 else backoff.next()
                log.warning("watch of CRDs for %s failed (%s); again in %.1fs", kind, exc, delay)
                await asyncio.sleep(delay)

    # --- the cache -----------------------------------------------------------------

    def _put(self, kind: str, obj: Json) -> None:
        meta = obj["metadata"]
        meta.pop("managedFields", None)  # never read; most of an object's size
        ns = meta.get("namespace", "")
        old = self._store[kind].setdefault(ns, {}).get(meta["name"])
        if old is not None and old["metadata"].get("resourceVersion") == meta.get(
            "resourceVersion"
        ):
            return
        self._store[kind][ns][meta["name"]] = obj
        self._index(kind, old, obj)
        self._notify(kind, old, obj)

    def _remove(self, kind: str, obj: Json) -> None:
        meta = obj["metadata"]
        ns = meta.get("namespace", "")
        old = self._store[kind].get(ns, {}).pop(meta["name"], None)
        if old is not None:
            self._index(kind, old, None)
            self._notify(kind, old, None)

    def _replace(self, kind: str, namespace: str | None, items: list[Json]) -> None:
        """A fresh list: what is gone was deleted while we were not watching."""
        seen = {(i["metadata"].get("namespace", ""), i["metadata"]["name"]) for i in items}
        for ns, objs in list(self._store[kind].items()):
            if namespace is not None and ns != namespace:
                continue
            for name, obj in list(objs.items()):
                if (ns, name) not in seen:
                    self._remove(kind, obj)
        for item in items:
            self._put(kind, item)

    def _index(self, kind: str, old: Json | None, new: Json | None) -> None:
        for obj, add in ((old, False), (new, True)):
            if obj is None:
                continue
            uid = controller_uid(obj)
            if uid is None:
                continue
            key = (kind, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])
            if add:
                self._owned.setdefault(uid, {})[key] = obj
            else:
                owned = self._owned.get(uid, {})
                owned.pop(key, None)
                if not owned:
                    self._owned.pop(uid, None)

    def _notify(self, kind: str, old: Json | None, new: Json | None) -> None:
        try:
            self._on_change(kind, old, new)
        except Exception:  # a bug in a handler must not stop the cache
            log.exception("handling a change of %s failed", kind)


def _defines(crd: Json, group: str, kind: str) -> bool:
    """Whether ``crd`` serves ``kind`` of ``group`` (established)."""
    spec = crd.get("spec") or {}
    if spec.get("group") != group or (spec.get("names") or {}).get("kind") != kind:
        return False
    conditions = (crd.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)
