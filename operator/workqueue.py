"""Per-key work with coalescing, delays and per-key back-off (client-go's workqueue).

One run per key at a time; triggers during a run make exactly one more run. A run
returns ``None`` (done until triggered again), a delay (run again then, e.g. when a
settle window ends), or :data:`RETRY` (a failure: run again after the key's own
doubling back-off). A failing key never delays another, and ``limit`` bounds how
many keys run at once. While a key is backing off, only an urgent trigger (its
spec changed) runs it early; repairs and periodic passes wait for the back-off.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from kvplane.router.backoff import Backoff

log = logging.getLogger("kvplane.operator")

K = TypeVar("K", bound=Hashable)


class _Retry:
    def __repr__(self) -> str:
        return "RETRY"


RETRY: Final = _Retry()
Result = float | _Retry | None
MAX_RUNS: Final = 100  # per trigger burst: a key rewritten faster than this is broken


@dataclass
class _State:
    backoff: Backoff
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    due: float = 0.0
    dirty: bool = False
    urgent: bool = False  # an urgent trigger arrived during the run
    failing: bool = False


@dataclass
class WorkQueue(Generic[K]):
    work: Callable[[K], Awaitable[Result]]
    limit: int = 8
    backoff_s: tuple[float, float] = (1.0, 300.0)
    _keys: dict[K, _State] = field(default_factory=dict)
    _slots: asyncio.Semaphore | None = None

    def add(self, key: K, *, delay: float = 0.0, urgent: bool = False) -> None:
        state = self._keys.get(key)
        if state is None:
            state = self._keys[key] = _State(Backoff(*self.backoff_s))
        if state.task is not None:
            state.dirty = True
            state.urgent = state.urgent or urgent
            return
        loop = asyncio.get_running_loop()
        when = loop.time() + max(0.0, delay)
        if state.timer is not None:
            if state.failing and not urgent:
                return  # backing off: repairs wait for the back-off
            if state.due <= when:
                return  # an earlier run is already scheduled
            state.timer.cancel()
            state.timer = None
        if when <= loop.time():
            self._start(key)
        else:
            state.due = when
            state.timer = loop.call_at(when, self._start, key)

    def forget(self, key: K) -> None:
        """The key is gone: drop its timers (a running run finishes on its own)."""
        state = self._keys.get(key)
        if state is not None and state.task is None:
            if state.timer is not None:
                state.timer.cancel()
            del self._keys[key]

    def failing(self, key: K) -> bool:
        state = self._keys.get(key)
        return state is not None and state.failing

    def _start(self, key: K) -> None:
        state = self._keys[key]
        state.timer = None
        state.task = asyncio.create_task(self._run(key, state), name=f"reconcile-{key}")

    async def _run(self, key: K, state: _State) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limit)
        again: float | None = None
        try:
            for _ in range(MAX_RUNS):
                state.dirty = False
                async with self._slots:
                    try:
                        result = await self.work(key)
                    except Exception:
                        log.exception("reconcile of %s failed", key)
                        result = RETRY
                if isinstance(result, _Retry):
                    state.failing = True
                    again = state.backoff.next()
                    return
                state.failing = False
                state.backoff.reset()
                again = result
                if not state.dirty:
                    return
            log.error("%s changed %d times in a row; waiting for the next change", key, MAX_RUNS)
        finally:
            state.task = None
            urgent, state.urgent = state.urgent, False
            if state.failing and urgent:
                again = 0.0  # the spec changed while it failed: try the new one now
            if again is not None:
                loop = asyncio.get_running_loop()
                state.due = loop.time() + again
                state.timer = loop.call_at(state.due, self._start, key)
            elif state.dirty:
                self._start(key)

    async def drain(self) -> None:
        """Until no run is in progress (scheduled retries and delays may remain)."""
        while running := [s.task for s in self._keys.values() if s.task is not None]:
            await asyncio.gather(*running, return_exceptions=True)
            await asyncio.sleep(0)

    async def stop(self) -> None:
        tasks = []
        for state in self._keys.values():
            if state.timer is not None:
                state.timer.cancel()
            if state.task is not None:
                state.task.cancel()
                tasks.append(state.task)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._keys.clear()
