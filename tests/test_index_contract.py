"""One contract for every ResidencyIndex backend: the in-memory one and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from kvplane.router.index.base import ResidencyIndex
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.index.redis import RedisIndex
from kvplane.router.tiers import Tier
from support.redis_server import RedisServer

H, D, N, R = Tier.HBM, Tier.DRAM, Tier.NVME, Tier.REMOTE
KEYS = [101, 102, 103, 104, 105]


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[ResidencyIndex]:
    if request.param == "memory":
        idx: ResidencyIndex = MemoryIndex()
    else:
        server: RedisServer = request.getfixturevalue("redis_server")
        idx = RedisIndex(server.url, generation=f"t{id(request)}")
    yield idx
    await idx.close()


def _m(h: int, d: int, n: int, r: int) -> dict[Tier, int]:
    return {H: h, D: d, N: n, R: r}


async def test_unknown_keys_and_pods_match_nothing(index: ResidencyIndex) -> None:
    assert await index.lookup(KEYS, ["a", "b"]) == {"a": _m(0, 0, 0, 0), "b": _m(0, 0, 0, 0)}
    assert await index.lookup([], ["a"]) == {"a": _m(0, 0, 0, 0)}
    assert await index.lookup(KEYS, []) == {}


async def test_longest_prefix_per_tier_is_cumulative(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "i1")
    await index.store("a", "i1", KEYS[:2], H)
    await index.store("a", "i1", KEYS[2:4], D)
    await index.store("a", "i1", KEYS[4:], R)
    got = await index.lookup(KEYS, ["a"])
    assert got["a"] == _m(2, 4, 4, 5)


async def test_gap_ends_the_prefix(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "i1")
    await index.store("a", "i1", [KEYS[0], KEYS[2], KEYS[3]], H)
    assert (await index.lookup(KEYS, ["a"]))["a"] == _m(1, 1, 1, 1)


async def test_pods_are_independent(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.begin_incarnation("b", "1")
    await index.store("a", "1", KEYS[:3], H)
    await index.store("b", "1", KEYS[:1], H)
    got = await index.lookup(KEYS, ["a", "b", "c"])
    assert got["a"][H] == 3 and got["b"][H] == 1 and got["c"][H] == 0


async def test_remove_and_clear(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", KEYS, H)
    await index.store("a", "1", KEYS, D)
    await index.remove("a", "1", [KEYS[1]], H)
    got = (await index.lookup(KEYS, ["a"]))["a"]
    assert got[H] == 1 and got[D] == 5
    await index.clear("a", "1", H)
    got = (await index.lookup(KEYS, ["a"]))["a"]
    assert got == _m(0, 5, 5, 5), "AllBlocksCleared clears HBM only"


async def test_new_incarnation_hides_old_entries(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "old")
    await index.store("a", "old", KEYS, H)
    await index.begin_incarnation("a", "new")
    assert (await index.lookup(KEYS, ["a"]))["a"][R] == 0
    await index.store("a", "old", KEYS, H)  # a late write of the dead incarnation
    assert (await index.lookup(KEYS, ["a"]))["a"][R] == 0
    await index.store("a", "new", KEYS[:2], H)
    assert (await index.lookup(KEYS, ["a"]))["a"][H] == 2
    assert (await index.incarnations())["a"] == "new"


async def test_drop_pod(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", KEYS, H)
    await index.drop_pod("a")
    assert (await index.lookup(KEYS, ["a"]))["a"][R] == 0
    assert "a" not in await index.incarnations()


async def test_tentative_marks_expire_and_events_confirm(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.mark_tentative("a", KEYS[:3], ttl_s=0.3)
    await index.mark_tentative("b", KEYS[:2], ttl_s=0.3)  # pod without a stream yet
    got = await index.lookup(KEYS, ["a", "b"])
    assert got["a"][H] == 3 and got["b"][H] == 2
    await index.store("a", "1", KEYS[:1], H)  # the engine confirms one block
    await asyncio.sleep(0.5)
    got = await index.lookup(KEYS, ["a", "b"])
    assert got["a"][H] == 1 and got["b"][H] == 0


async def test_tentative_never_downgrades_a_confirmed_block(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", KEYS[:2], H)
    await index.mark_tentative("a", KEYS[:2], ttl_s=0.2)
    await asyncio.sleep(0.35)
    assert (await index.lookup(KEYS, ["a"]))["a"][H] == 2


async def test_long_prompt_lookup(index: ResidencyIndex) -> None:
    keys = list(range(1, 2049))
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", keys[:1500], H)
    await index.store("a", "1", keys[1500:1800], N)
    got = await index.lookup(keys, ["a", "b"])
    assert got["a"] == _m(1500, 1500, 1800, 1800)
    assert got["b"] == _m(0, 0, 0, 0)
