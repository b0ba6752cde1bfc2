"""How much of a shared store's reuse any eviction policy could keep: replays of the
store's own access stream under LRU, segmented LRU and Belady's offline optimum.

A discrete-event run with a traced store (``SharedStore(trace=True)``) records every
write (the blocks engines store) and every load attempt (the blocks an engine looks up,
in chain order); :func:`replay` runs that stream through a store of the same capacity
under another policy and counts the blocks loads found. ``opt`` evicts the block whose
next load is farthest away (Belady), and may decline to store a block that is needed
later than everything it holds: no policy that sees the same stream keeps more blocks
for loads at once. Two limits, both stated beside the figures: the stream is the one
the traced run produced (a different policy would change what the router and the
engines do next), and loads stop at the first missing block while Belady counts
blocks one by one, so its figure is a ceiling for the policies, not a schedule.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Final

from kvplane.sim.kvcache import STORE_POLICIES, BlockMeta, Link, SharedStore, StoreAccess

REPLAY_POLICIES: Final = (*STORE_POLICIES, "opt")
_META: Final = BlockMeta(ext=0, parent=None, tokens=())
NEVER: Final = 1 << 62


def replay(trace: Sequence[StoreAccess], capacity: int, policy: str) -> int:
    """Blocks the loads of ``trace`` find in a store of ``capacity`` blocks run by
    ``policy`` (``lru`` and ``slru`` run :class:`SharedStore` itself)."""
    if policy == "opt":
        return _belady(trace, capacity)
    store = SharedStore(capacity, 1, Link(1.0, 0.0), policy)
    found = 0
    for write, blocks in trace:
        if write:
            store.write("", [(h, _META) for h in blocks])
        else:
            found += store.match(list(blocks), 0, len(blocks))
    store.take_events()
    return found


def _next_loads(trace: Sequence[StoreAccess]) -> list[list[int]]:
    """For every block of every access, the index of the next load that looks it up
    (``NEVER`` if none)."""
    upcoming: dict[bytes, int] = {}
    out: list[list[int]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        write, blocks = trace[i]
        out[i] = [upcoming.get(h, NEVER) for h in blocks]
        if not write:
            for h in blocks:
                upcoming[h] = i
    return out


def _belady(trace: Sequence[StoreAccess], capacity: int) -> int:
    """Belady's eviction (with bypass) over the stream, loads counted up to the first
    block not held."""
    nxt = _next_loads(trace)
    held: dict[bytes, int] = {}  # block -> its next load
    heap: list[tuple[int, bytes]] = []  # (-next load, block), stale entries skipped
    found = 0

    def admit(h: bytes, when: int) -> None:
        if h in held:
            held[h] = when
            heapq.heappush(heap, (-when, h))
            return
        if when == NEVER:
            return  # never loaded again: holding it helps nothing
        while len(held) >= capacity:
            far, victim = heap[0]
            if held.get(victim) != -far:
                heapq.heappop(heap)  # stale
                continue
            if -far <= when:
                return  # everything held is needed sooner: bypass
            heapq.heappop(heap)
            del held[victim]
        held[h] = when
        heapq.heappush(heap, (-when, h))

    for i, (write, blocks) in enumerate(trace):
        if write:
            for h, when in zip(blocks, nxt[i], strict=True):
                admit(h, when)
            continue
        run = 0
        while run < len(blocks) and blocks[run] in held:
            run += 1
        found += run
        for h, when in zip(blocks[:run], nxt[i][:run], strict=True):
            admit(h, when)
    return found
