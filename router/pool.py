"""Live state of the backends: health, scraped engine load, router-tracked load.

The router's own in-flight accounting (``load.py``) is exact and instant; the scraped
figures lag by a scrape interval but see traffic from other router replicas.
The cost model reads both (see ``cost.queue_ms``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvplane.router.backoff import Backoff
from kvplane.router.config import Backend
from kvplane.router.cost import PodLoad
from kvplane.router.engine_stats import EngineStats, parse_metrics
from kvplane.router.errors import describe
from kvplane.router.forwarder import BackendUnavailable, Cause, Forwarder, ResponseBroken
from kvplane.router.headers import backend_lines
from kvplane.router.load import LoadCounters

log = logging.getLogger("kvplane.router.pool")

SLOW_SCRAPES_UNHEALTHY = 3


@dataclass
class BackendState(LoadCounters):
    """A backend's health, its scraped engine figures and the router's own accounting
    of the load sent there (``LoadCounters``)."""

    backend: Backend
    healthy: bool = True
    stats: EngineStats = field(default_factory=EngineStats)
    unhealthy_since: float | None = None
    slow_scrapes: int = 0  # consecutive scrapes that timed out
    # Demoted: out of rotation until then although /health answers (it stalled, answered
    # 5xx or dropped requests other pods served); the scraper does not bring it back.
    demoted_until: float = 0.0
    demotions: Backoff | None = None  # while demotions repeat without a good answer
    scraped_at: float = 0.0  # monotonic time of the last scrape that read /metrics
    progressed_at: float = 0.0  # ... of the last one whose progress figure had moved
    # its own headers (Backend.headers) as wire lines, encoded once for the request path
    header_lines: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.use(self.backend)

    def use(self, backend: Backend) -> None:
        """Serve ``backend`` (a reloaded config may change its url or headers)."""
        self.backend = backend
        self.header_lines = backend_lines(backend)

    def routable(self, now: float) -> bool:
        return self.healthy and self.demoted_until <= now

    def answered(self) -> None:
        """The pod answered a request (below 500): its next demotion starts short."""
        if self.demotions is not None and self.demoted_until <= time.monotonic():
            self.demotions = None

    def observe(self, stats: EngineStats, now: float | None = None) -> None:
        """A fresh scrape: remember what the router had pending at that instant, which
        is what the engine's waiting count can be compared with until the next one,
        and whether the engine has computed anything since the last one."""
        now = self.clock() if now is None else now
        if stats.progress is not None and stats.progress != self.stats.progress:
            self.progressed_at = now
        self.stats = stats
        self.scraped_at = now
        self.scraped_pending_requests = self.pending_requests
        self.scraped_finished = self.finished

    def running_now(self) -> float:
        """The engine's running requests as last scraped, less the router's own that
        have ended since: a scrape is up to an interval old, and a request it counted
        may be long done."""
        return max(0.0, self.stats.running - (self.finished - self.scraped_finished))

    def still_for(self, since: float) -> float:
        """Seconds the engine has computed nothing since ``since`` (monotonic), as far as
        scrapes after it show; 0 when the engine has no progress figure."""
        if self.stats.progress is None:
            return 0.0
        return self.scraped_at - max(since, self.progressed_at)

    def load(self, mean_request_tokens: float, now: float | None = None) -> PodLoad:
        now = self.clock() if now is None else now
        return PodLoad(
            recent_prefill_tokens=self.recent(now),
            pending_prefill_tokens=self.pending_tokens,
            pending_prefill_pairs=self.pending_pairs,
            pending_requests=self.pending_requests,
            head_prefill=self.head(),
            prefill_busy_s=self.prefill_busy_s(now),
            inflight=self.inflight,
            inflight_tokens=self.inflight_tokens,
            engine_waiting=self.stats.waiting,
            scraped_pending_requests=self.scraped_pending_requests,
            engine_running=self.running_now(),
            kv_usage=self.stats.kv_usage,
            kv_capacity_tokens=self.stats.kv_capacity_tokens,
            mean_request_tokens=mean_request_tokens,
            lora=self.stats.lora,
        )


class Pool:
    """Backends by name. Mutated only on the event loop."""

    def __init__(
        self,
        demote_first_s: float = 2.0,
        demote_max_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.states: dict[str, BackendState] = {}
        self.clock = clock  # the backends' load accounting's (virtual time in the simulator)
        self.mean_request_tokens = 1024.0
        self._demote_s = (demote_first_s, demote_max_s)
        self.on_demote: Callable[[str], None] | None = None  # the demotions metric

    def set_backends(self, backends: Sequence[Backend]) -> tuple[list[str], list[str]]:
        """Replace the backend set; returns (added, removed) names."""
        new = {b.name: b for b in backends}
        removed = [n for n in self.states if n not in new]
        added = [n for n in new if n not in self.states]
        for n in removed:
            del self.states[n]
        for n, b in new.items():
            if n in self.states:
                self.states[n].use(b)
            else:
                self.states[n] = BackendState(b, clock=self.clock)
        return added, removed

    def loads(self, names: Sequence[str], now: float | None = None) -> dict[str, PodLoad]:
        """What the cost model reads of each named pod, now."""
        states, mean = self.states, self.mean_request_tokens
        return {n: states[n].load(mean, now) for n in names}

    def healthy(self) -> list[str]:
        """Pods to route to: healthy and not demoted (all healthy ones if every one is
        demoted: a pod on probation beats refusing every request)."""
        now = time.monotonic()
        up = [n for n, s in self.states.items() if s.healthy]
        routable = [n for n in up if self.states[n].demoted_until <= now]
        return routable or up

    def demote(self, name: str, why: str) -> None:
        """Out of rotation for a back-off that doubles while it keeps failing."""
        state = self.states.get(name)
        if state is None:
            return
        if state.demotions is None:
            state.demotions = Backoff(*self._demote_s)
        delay = state.demotions.next()
        state.demoted_until = time.monotonic() + delay
        if self.on_demote is not None:
            self.on_demote(name)
        log.warning("backend %s out of rotation for %.1f s: %s", name, delay, why)

    def mark_unhealthy(self, name: str, why: str) -> None:
        state = self.states.get(name)
        if state is not None and state.healthy:
            log.warning("backend %s marked unhealthy: %s", name, why)
            state.healthy = False
            state.unhealthy_since = time.monotonic()

    def note_routed(self, name: str, uncached_tokens: int, now: float | None = None) -> None:
        """Remember the prefill work a decision sent to ``name`` (for balancing)."""
        state = self.states.get(name)
        if state is not None:
            state.add_recent(uncached_tokens, self.clock() if now is None else now)

    def observe_prompt(self, tokens: int) -> None:
        self.mean_request_tokens += 0.05 * (tokens - self.mean_request_tokens)


def _timed_out(exc: BaseException) -> bool:
    """A scrape that failed only by being slow (the backend is busy, not gone)."""
    if isinstance(exc, BackendUnavailable):
        return exc.cause is Cause.TIMEOUT
    if isinstance(exc, ResponseBroken):
        return exc.timed_out
    return isinstance(exc, TimeoutError)


class Scraper:
    """Polls every backend's /health and /metrics on an interval, with the proxy's kind
    of HTTP client (``Forwarder.get``: a poll costs a fraction of httpx's CPU, and polls
    count at two per pod per interval) but its own connections: a request the proxy
    sends on a pooled connection that the backend then closes unanswered is sent again
    on a fresh one (a stale keep-alive), so polls on the proxy's connections would have
    a pod that drops requests take each of them twice."""

    def __init__(self, pool: Pool, interval_s: float, connect_timeout_s: float) -> None:
        self._pool = pool
        self._interval = interval_s
        self._timeout = max(2.0, 2 * interval_s)  # a scrape of one backend, at most
        # every wait for a poll's answer bounded by that; one connection per backend (its
        # two polls go one after the other)
        self._forwarder = Forwarder(connect_timeout_s, self._timeout, max_idle_per_backend=1)
        self._task: asyncio.Task[None] | None = None

    async def scrape_once(self) -> None:
        names = list(self._pool.states)
        await asyncio.gather(*(self._scrape(n) for n in names))

    async def _scrape(self, name: str) -> None:
        state = self._pool.states.get(name)
        if state is None:
            return
        url = state.backend.url
        # A busy engine answers /metrics late; only a refused connection, a non-200
        # /health or SLOW_SCRAPES_UNHEALTHY slow scrapes in a row take it out of rotation.
        timeout = self._timeout
        slow = False
        why = ""
        metrics: tuple[int, bytes] | None = None
        try:
            async with asyncio.timeout(timeout):
                status, _ = await self._get(url, b"/health", state.header_lines)
                ok = status == 200
                why = f"/health answered {status}"
                if ok:
                    metrics = await self._get(url, b"/metrics", state.header_lines)
        except (TimeoutError, BackendUnavailable, ResponseBroken, ValueError) as exc:
            if _timed_out(exc):
                ok, slow = True, True
            else:
                ok, why = False, f"/health failed: {describe(exc)}"
        if slow:
            state.slow_scrapes += 1
            ok = state.slow_scrapes < SLOW_SCRAPES_UNHEALTHY and state.healthy
            why = f"{state.slow_scrapes} scrapes in a row took over {timeout:g} s"
        else:
            state.slow_scrapes = 0
        if ok and metrics is not None and metrics[0] == 200:
            state.observe(parse_metrics(metrics[1].decode("utf-8", "replace")))
        if ok and not state.healthy:
            log.info("backend %s healthy again", name)
            state.healthy, state.unhealthy_since = True, None
        elif not ok:
            self._pool.mark_unhealthy(name, why)

    async def _get(self, url: str, path: bytes, header_lines: bytes) -> tuple[int, bytes]:
        """Status and body of ``GET url+path``."""
        resp = await self._forwarder.get(url, path, header_lines)
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self.scrape_once()
            except Exception:  # never let the loop die on one bad scrape
                log.exception("scrape failed")

    def start(self) -> None:
        """Scrape every interval from now on; the caller has just run ``scrape_once``."""
        self._task = asyncio.create_task(self._run(), name="kvplane-scraper")

    def retain(self, urls: Iterable[str]) -> None:
        """Drops the connections of backends not in ``urls``."""
        self._forwarder.retain(urls)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._forwarder.close()
