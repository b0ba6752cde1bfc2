"""The load a request puts on a pod, as the router accounts it.

The router's own accounting is exact and instant (the scraped engine figures lag by
a scrape interval): every send to a pod is an ``Attempt`` (its uncached prompt tokens
are pending prefill until the first byte; the request is in flight until the end),
and a P/D decode pod chosen for a handoff is held by a ``Booking`` from the choice
until its own decode leg's ``Attempt`` counts it. The live proxy, the P/D handoffs
and the discrete-event simulator all book load through these two, so that the cost
model reads the same figures everywhere.

A pod works through its pending prefills in the order they were sent, so the router
also keeps which one is at the head and when the pod began on it: its send if nothing
was pending there, else the first token of the one before it (``busy_since``, on the
counters' clock: the monotonic clock live, virtual time in the simulator). The cost
model takes the time since off the head's work, never more than all of it: until its
first token comes the head is not done (``cost.pending_prefill_ms``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvplane.router.cost import attention_pairs


@dataclass(kw_only=True)
class LoadCounters:
    """Router-tracked load of one pod."""

    pending_tokens: int = 0  # uncached prompt tokens sent, awaiting their first token
    pending_pairs: float = 0.0  # their prefill attention work (cost.attention_pairs)
    scraped_pending_requests: int = 0  # pending_requests when the last scrape was taken
    finished: int = 0  # requests sent here that have ended (Attempt.end)
    scraped_finished: int = 0  # finished when the last scrape was taken
    inflight: int = 0  # requests sent (or booked) and not finished
    inflight_tokens: int = 0  # prompt tokens of the requests in flight here
    recent_tokens: float = 0.0  # uncached prompt tokens routed here, decayed
    recent_at: float = 0.0
    half_life_s: float = 30.0  # "lately": a few prefix lifetimes on a busy pod
    # the pending prefills' (tokens, attention pairs) by send, oldest (the head) first
    pending_order: dict[int, tuple[int, float]] = field(default_factory=dict, repr=False)
    sends: int = 0  # Attempts begun here: the keys of pending_order
    busy_since: float = 0.0  # when the pod began on the head of its pending prefills
    clock: Callable[[], float] = field(default=time.monotonic, repr=False, compare=False)

    @property
    def pending_requests(self) -> int:
        """Requests sent here awaiting their first token."""
        return len(self.pending_order)

    def head(self) -> tuple[int, float]:
        """The oldest pending prefill's tokens and attention pairs ((0, 0.0): none)."""
        return next(iter(self.pending_order.values()), (0, 0.0))

    def prefill_busy_s(self, now: float) -> float:
        """Seconds the pod has been on the head of its pending prefills (0 with none)."""
        return max(0.0, now - self.busy_since) if self.pending_order else 0.0

    def recent(self, now: float) -> float:
        """Prefill work sent here lately (tokens, exponentially decayed to ``now``)."""
        if self.recent_tokens <= 0.0:
            return 0.0
        decay = 2.0 ** (-max(0.0, now - self.recent_at) / self.half_life_s)
        return float(self.recent_tokens * decay)

    def add_recent(self, tokens: int, now: float) -> None:
        self.recent_tokens = self.recent(now) + tokens
        self.recent_at = now

    def book(self, context_tokens: int) -> None:
        """A request is in flight here (sent, or booked for a decode leg to come)."""
        self.inflight += 1
        self.inflight_tokens += context_tokens

    def unbook(self, context_tokens: int) -> None:
        self.inflight -= 1
        self.inflight_tokens -= context_tokens


@dataclass
class Attempt:
    """One send to one pod, with the accounting to undo when it ends."""

    counters: LoadCounters
    uncached_tokens: int
    started: float
    context_tokens: int = 0  # the prompt: the KV the request holds there while in flight
    first_byte: bool = False
    done: bool = False
    send: int = 0  # its key in the counters' pending_order (from begin)

    @property
    def pairs(self) -> float:
        """The prefill's attention work: its uncached tokens after the cached rest."""
        return attention_pairs(
            self.uncached_tokens, max(0, self.context_tokens - self.uncached_tokens)
        )

    def begin(self) -> None:
        c = self.counters
        if not c.pending_order:  # nothing ahead of it: the pod starts on it now
            c.busy_since = c.clock()
        c.sends += 1
        self.send = c.sends
        c.pending_order[self.send] = (self.uncached_tokens, self.pairs)
        c.pending_tokens += self.uncached_tokens
        c.pending_pairs += self.pairs
        c.book(self.context_tokens)

    def first(self) -> None:
        if not self.first_byte:
            self.first_byte = True
            c = self.counters
            c.pending_tokens -= self.uncached_tokens
            was_head = next(iter(c.pending_order), None) == self.send
            c.pending_order.pop(self.send, None)
            if was_head:  # the pod moves on to the next one
                c.busy_since = c.clock()
            # float sums drift; nothing pending is exactly nothing
            c.pending_pairs = max(0.0, c.pending_pairs - self.pairs) if c.pending_requests else 0.0

    def end(self) -> None:
        if not self.done:
            self.first()
            self.done = True
            self.counters.unbook(self.context_tokens)
            self.counters.finished += 1


@dataclass(slots=True)
class Booking:
    """A P/D decode pod counted busy from the choice until a decode leg's own
    ``Attempt`` counts it, so that requests arriving while the prefill runs see it
    taken. Releasing twice is harmless."""

    counters: LoadCounters | None = None
    tokens: int = 0

    def hold(self, counters: LoadCounters | None, tokens: int) -> None:
        if counters is not None:
            counters.book(tokens)
            self.counters, self.tokens = counters, tokens

    def release(self) -> None:
        if self.counters is not None:
            self.counters.unbook(self.tokens)
            self.counters = None
