"""Replays of a shared store's access stream: LRU and segmented LRU through the store
itself, Belady's optimum as the ceiling of any eviction policy."""

from __future__ import annotations

from kvplane.sim.kvcache import BlockMeta, Link, SharedStore, StoreAccess
from kvplane.sim.store_bound import replay

META = BlockMeta(ext=0, parent=None, tokens=())


def b(*names: str) -> tuple[bytes, ...]:
    return tuple(n.encode() for n in names)


def test_belady_keeps_what_is_needed_soonest_where_lru_keeps_the_most_recent() -> None:
    # capacity 2: A is loaded again at the end, B and C never; LRU lets A go for C
    trace: list[StoreAccess] = [
        (True, b("A")),
        (False, b("A")),
        (True, b("B")),
        (True, b("C")),
        (False, b("A")),
    ]
    assert replay(trace, 2, "lru") == 1
    assert replay(trace, 2, "opt") == 2  # B and C are never stored: A stays


def test_a_load_stops_at_the_first_block_not_held() -> None:
    trace: list[StoreAccess] = [(True, b("A", "B", "C")), (False, b("A", "X", "C"))]
    for policy in ("lru", "slru", "opt"):
        assert replay(trace, 8, policy) == 1, policy


def test_the_replay_of_a_traced_store_finds_what_the_store_found() -> None:
    live = SharedStore(3, 16, Link(25.0, 1.0), "lru", trace=True)
    chains = [b("s", "a1", "a2"), b("s", "b1"), b("s", "a1", "a2", "a3"), b("s", "b1", "b2")]
    for chain in chains:
        live.match(list(chain), 0, len(chain))
        live.write("e0", [(h, META) for h in chain])
    assert live.trace is not None
    assert replay(live.trace, 3, "lru") == live.found == 2  # s twice; a1 had gone for b1
    assert replay(live.trace, 3, "opt") >= live.found
