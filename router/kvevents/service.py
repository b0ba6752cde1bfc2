"""The indexer: one KV-event subscriber per backend, all feeding one index.

Each backend gets its own task, so a slow or dead engine never delays the
others; within a task, updates are applied strictly in stream order. Backends
come and go at runtime (discovery calls ``set_backends`` / ``add_backend`` /
``remove_backend``); a removed backend's entries are dropped from the index.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

import zmq
import zmq.asyncio
from kvplane.router.backoff import Backoff
from kvplane.router.config import Backend, UnreportedTierSpec
from kvplane.router.index.base import NotOwner, ResidencyIndex
from kvplane.router.kvevents.ingest import DEFAULT_MAX_BLOCKS_PER_POD, Ingestor, IngestStats
from kvplane.router.kvevents.subscriber import (
    DEFAULT_REPLAY_TIMEOUT_S,
    EngineSubscriber,
    IncarnationChanged,
    StreamLost,
    StreamStats,
    Update,
    new_incarnation_id,
)

log = logging.getLogger(__name__)

RESTART_MIN_S: Final = 0.5
RESTART_MAX_S: Final = 30.0


def resolve_endpoint(endpoint: str, backend_url: str) -> str:
    """A bind-style endpoint (``tcp://*:5557``, as engines report it) dialled at
    the backend's host; anything else unchanged."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme != "tcp":
        return endpoint
    host, colon, port = rest.rpartition(":")
    if not colon or host not in ("*", "0.0.0.0", "[::]", "::"):
        return endpoint
    target = urlsplit(backend_url).hostname
    if not target:
        return endpoint
    if ":" in target:
        target = f"[{target}]"
    return f"tcp://{target}:{port}"


def _endpoints(backend: Backend) -> tuple[str | None, str | None, str]:
    """What a subscriber is built from: a change in any of it means a new one."""
    pub = None if backend.kv_events is None else resolve_endpoint(backend.kv_events, backend.url)
    replay = None if backend.replay is None else resolve_endpoint(backend.replay, backend.url)
    return pub, replay, backend.topic


@dataclass(slots=True)
class _Worker:
    backend: Backend
    subscriber: EngineSubscriber
    task: asyncio.Task[None]


class Indexer:
    """Keeps ``index`` in step with the KV events of every backend."""

    def __init__(
        self,
        index: ResidencyIndex,
        *,
        generation: str,
        block_size: int,
        backends: Iterable[Backend] = (),
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        max_blocks_per_pod: int = DEFAULT_MAX_BLOCKS_PER_POD,
        new_incarnation: Callable[[], str] = new_incarnation_id,
        unreported: UnreportedTierSpec | None = None,
    ) -> None:
        self.index = index
        self.ingestor = Ingestor(
            index,
            generation=generation,
            block_size=block_size,
            max_blocks_per_pod=max_blocks_per_pod,
            unreported=unreported,
        )
        self._initial = list(backends)
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self._new_incarnation = new_incarnation
        self._workers: dict[str, _Worker] = {}
        self._lock = asyncio.Lock()
        self._closed = False
        # per pod: how far behind its engine the last applied batch was (s): back-pressure
        self.lag_s: dict[str, float] = {}

    @property
    def ingest_stats(self) -> IngestStats:
        return self.ingestor.stats

    def stream_stats(self) -> Mapping[str, StreamStats]:
        """Per backend (pod) stream counters."""
        return {name: w.subscriber.stats for name, w in self._workers.items()}

    def incarnation(self, pod: str) -> str | None:
        worker = self._workers.get(pod)
        return None if worker is None else worker.subscriber.incarnation

    @property
    def backends(self) -> list[Backend]:
        return [w.backend for w in self._workers.values()]

    async def start(self) -> None:
        """Subscribe to the backends given at construction."""
        self._closed = False
        await self.set_backends(self._initial)

    async def stop(self) -> None:
        """Stop every subscriber; index entries are left as they are."""
        self._closed = True
        async with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        await asyncio.gather(*(_cancel(w.task) for w in workers))

    async def add_backend(self, backend: Backend) -> None:
        """Start (or, if its endpoints changed, restart) a backend's subscriber."""
        async with self._lock:
            await self._add(backend)

    async def remove_backend(self, name: str) -> None:
        """Stop a backend's subscriber and drop its entries from the index."""
        async with self._lock:
            await self._remove(name)

    async def set_backends(self, backends: Iterable[Backend]) -> None:
        """Reconcile with the full current list (what discovery sees)."""
        wanted = {b.name: b for b in backends}
        async with self._lock:
            for name in [n for n in self._workers if n not in wanted]:
                await self._remove(name)
            for backend in wanted.values():
                await self._add(backend)

    async def _add(self, backend: Backend) -> None:
        if self._closed:
            raise RuntimeError("Indexer is stopped")
        current = self._workers.get(backend.name)
        if current is not None:
            if _endpoints(current.backend) == _endpoints(backend):
                current.backend = backend  # labels/url-only changes keep the stream
                return
            await self._remove(backend.name)
        pub, replay, topic = _endpoints(backend)
        if pub is None:
            log.info("backend %s publishes no kv events: not indexed", backend.name)
            return
        sub = EngineSubscriber(
            backend.name,
            pub,
            replay_endpoint=replay,
            topic=topic,
            context=self._ctx,
            replay_timeout_s=self._replay_timeout_s,
            new_incarnation=self._new_incarnation,
        )
        task = asyncio.create_task(self._run(sub), name=f"kvevents:{backend.name}")
        self._workers[backend.name] = _Worker(backend, sub, task)

    async def _remove(self, name: str) -> None:
        worker = self._workers.pop(name, None)
        if worker is not None:
            await _cancel(worker.task)
        self.ingestor.forget(name)
        self.lag_s.pop(name, None)
        try:
            await self.index.drop_pod(name)
        except NotOwner:  # another indexer took the pod over: its incarnation stands
            log.info("kv events %s: stream handed over", name)

    async def _run(self, sub: EngineSubscriber) -> None:
        """Feed one stream into the index; restart it (new incarnation) on failure."""
        backoff = Backoff(RESTART_MIN_S, RESTART_MAX_S)
        while not self._closed:
            try:
                async with contextlib.aclosing(sub.updates()) as updates:
                    async for update in updates:
                        await self._handle(sub, update)
                        backoff.reset()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.ETERM:
                    log.info("kv events %s: zmq context terminated; stream stops", sub.pod)
                    return
                delay = backoff.next()
                log.exception("kv events %s: stream failed; restarting in %.1fs", sub.pod, delay)
                await asyncio.sleep(delay)

    async def _handle(self, sub: EngineSubscriber, update: Update) -> None:
        if isinstance(update, StreamLost):
            self.ingestor.forget(update.pod)
            await self.index.drop_pod(update.pod)
            return
        if update.incarnation != sub.incarnation:
            return  # produced before a resync: superseded
        if isinstance(update, IncarnationChanged):
            self.ingestor.forget(update.pod)
            await self.index.begin_incarnation(update.pod, update.incarnation)
            return
        try:
            await self.ingestor.apply(update.pod, update.incarnation, update.batch)
            if update.batch.ts:
                self.lag_s[update.pod] = max(0.0, time.time() - update.batch.ts)
        except Exception:
            # the mapping ran ahead of the index: rebuild this pod from scratch
            log.exception("kv events %s: index write failed; resyncing", update.pod)
            await self._handle(sub, sub.resync())


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
