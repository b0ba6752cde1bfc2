"""One contract for every ResidencyIndex backend: the in-memory one, Redis, and a Redis
Cluster of three local shards (the same RedisIndex, its chunks spread over the nodes)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator

import pytest
from kvplane.router.config import SharedStoreSpec
from kvplane.router.index.base import CHUNK, Blocks, ResidencyIndex, chunk_anchors, cumulative
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.shared import SharedTierIndex
from kvplane.router.shared import SharedStores
from kvplane.router.tiers import TIER_ORDER, Tier
from support.redis_server import RedisServer

from kvplane.local import redis as local_redis

H, D, N, R = Tier.HBM, Tier.DRAM, Tier.NVME, Tier.REMOTE
KEYS = [101, 102, 103, 104, 105]


def at(keys: list[int], start: int = 0, stop: int | None = None) -> Blocks:
    """``keys[start:stop]`` of the prompt ``keys``."""
    return Blocks.of_prompt(keys[:stop], start)


@pytest.fixture(scope="module")
def redis_cluster() -> Iterator[local_redis.LocalRedis]:
    with local_redis.running(shards=3) as cluster:
        yield cluster


@pytest.fixture(params=["memory", "redis", "redis-cluster"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[ResidencyIndex]:
    if request.param == "memory":
        idx: ResidencyIndex = MemoryIndex()
    elif request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        idx = RedisIndex(server.url, generation=f"t{id(request):x}")
    else:
        cluster: local_redis.LocalRedis = request.getfixturevalue("redis_cluster")
        idx = RedisIndex(cluster.url, generation=f"t{id(request):x}")
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
    await index.store("a", "i1", at(KEYS, 0, 2), H)
    await index.store("a", "i1", at(KEYS, 2, 4), D)
    await index.store("a", "i1", at(KEYS, 4), R)
    got = await index.lookup(KEYS, ["a"])
    assert got["a"] == _m(2, 4, 4, 5)


async def test_gap_ends_the_prefix(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "i1")
    anchors = chunk_anchors(KEYS)
    await index.store("a", "i1", Blocks([KEYS[0], KEYS[2], KEYS[3]], anchors[:3]), H)
    assert (await index.lookup(KEYS, ["a"]))["a"] == _m(1, 1, 1, 1)


async def test_pods_are_independent(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.begin_incarnation("b", "1")
    await index.store("a", "1", at(KEYS, 0, 3), H)
    await index.store("b", "1", at(KEYS, 0, 1), H)
    got = await index.lookup(KEYS, ["a", "b", "c"])
    assert got["a"][H] == 3 and got["b"][H] == 1 and got["c"][H] == 0


async def test_remove_and_clear(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", at(KEYS), H)
    await index.store("a", "1", at(KEYS), D)
    await index.remove("a", "1", at(KEYS, 1, 2), H)
    got = (await index.lookup(KEYS, ["a"]))["a"]
    assert got[H] == 1 and got[D] == 5
    await index.clear("a", "1", H)
    got = (await index.lookup(KEYS, ["a"]))["a"]
    assert got == _m(0, 5, 5, 5), "AllBlocksCleared clears HBM only"


async def test_new_incarnation_hides_old_entries(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "old")
    await index.store("a", "old", at(KEYS), H)
    await index.begin_incarnation("a", "new")
    assert (await index.lookup(KEYS, ["a"]))["a"][R] == 0
    await index.store("a", "old", at(KEYS), H)  # a late write of the dead incarnation
    assert (await index.lookup(KEYS, ["a"]))["a"][R] == 0
    await index.store("a", "new", at(KEYS, 0, 2), H)
    assert (await index.lookup(KEYS, ["a"]))["a"][H] == 2
    assert (await index.incarnations())["a"] == "new"


async def test_drop_pod(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", at(KEYS), H)
    await index.drop_pod("a")
    assert (await index.lookup(KEYS, ["a"]))["a"][R] == 0
    assert "a" not in await index.incarnations()


async def test_tentative_marks_expire_and_events_confirm(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.mark_tentative("a", at(KEYS, 0, 3), ttl_s=0.3)
    await index.mark_tentative("b", at(KEYS, 0, 2), ttl_s=0.3)  # pod without a stream yet
    got = await index.lookup(KEYS, ["a", "b"])
    assert got["a"][H] == 3 and got["b"][H] == 2
    await index.store("a", "1", at(KEYS, 0, 1), H)  # the engine confirms one block
    await asyncio.sleep(0.5)
    got = await index.lookup(KEYS, ["a", "b"])
    assert got["a"][H] == 1 and got["b"][H] == 0


async def test_tentative_never_downgrades_a_confirmed_block(index: ResidencyIndex) -> None:
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", at(KEYS, 0, 2), H)
    await index.mark_tentative("a", at(KEYS, 0, 2), ttl_s=0.2)
    await asyncio.sleep(0.35)
    assert (await index.lookup(KEYS, ["a"]))["a"][H] == 2


async def test_an_hbm_eviction_ends_a_confirmed_mark(index: ResidencyIndex) -> None:
    """Marked, confirmed by an event, evicted: no longer held, mark or not."""
    await index.begin_incarnation("a", "1")
    await index.mark_tentative("a", at(KEYS, 0, 3), ttl_s=30)
    await index.store("a", "1", at(KEYS, 0, 3), H)
    await index.remove("a", "1", at(KEYS, 1, 3), H)
    assert (await index.lookup(KEYS, ["a"]))["a"][H] == 1


async def test_long_prompt_lookup(index: ResidencyIndex) -> None:
    keys = list(range(1, 2049))
    await index.begin_incarnation("a", "1")
    await index.store("a", "1", at(keys, 0, 1500), H)
    await index.store("a", "1", at(keys, 1500, 1800), N)
    got = await index.lookup(keys, ["a", "b"])
    assert got["a"] == _m(1500, 1500, 1800, 1800)
    assert got["b"] == _m(0, 0, 0, 0)


async def test_a_block_shared_by_many_pods(index: ResidencyIndex) -> None:
    """A system prompt every pod holds, each pod's own tail after it."""
    rnd = random.Random(3)
    keys = [rnd.getrandbits(64) for _ in range(3 * CHUNK + 5)]
    pods = [f"pod-{i}" for i in range(300)]
    for i, pod in enumerate(pods):
        await index.begin_incarnation(pod, "1")
        await index.store(pod, "1", at(keys, 0, CHUNK + 3 + i % 7), H)
    got = await index.lookup(keys, [*pods, "none"])
    assert [got[p][H] for p in pods] == [CHUNK + 3 + i % 7 for i in range(len(pods))]
    assert got["none"][R] == 0


async def test_random_writes_agree_with_reference_semantics(index: ResidencyIndex) -> None:
    """Random writes (incl. tentative marks and their expiry) vs ``cumulative()``,
    on a prompt of three chunks; time is the test's clock."""
    now = [1_000_000.0]
    if isinstance(index, MemoryIndex):
        idx: ResidencyIndex = MemoryIndex(clock=lambda: now[0])
    else:
        assert isinstance(index, RedisIndex)
        idx = RedisIndex(index.url, generation=index.names.generation, clock=lambda: now[0])
    rnd = random.Random(11)
    pods = ["a", "b", "c"]
    keys = [rnd.getrandbits(64) for _ in range(2 * CHUNK + 6)]
    anchors = chunk_anchors(keys)
    held: dict[str, dict[int, set[Tier]]] = {p: {} for p in pods}
    marks: dict[str, dict[int, float]] = {p: {} for p in pods}
    for p in pods:
        await idx.begin_incarnation(p, "1")
    try:
        for step in range(600):
            now[0] += 0.01
            p, tier = rnd.choice(pods), rnd.choice(TIER_ORDER)
            at_ = rnd.sample(range(len(keys)), rnd.randint(1, 8))
            sel = Blocks([keys[i] for i in at_], [anchors[i] for i in at_])
            op = rnd.random()
            if op < 0.5:
                await idx.store(p, "1", sel, tier)
                for k in sel.keys:
                    held[p].setdefault(k, set()).add(tier)
            elif op < 0.85:
                await idx.remove(p, "1", sel, tier)
                for k in sel.keys:
                    held[p].get(k, set()).discard(tier)
            elif op < 0.97:
                ttl = rnd.choice([0.055, 0.305])  # never a whole number of steps
                await idx.mark_tentative(p, sel, ttl)
                for k in sel.keys:
                    marks[p][k] = max(marks[p].get(k, 0.0), now[0] + ttl)
            elif op < 0.985:
                await idx.clear(p, "1", tier)
                for s in held[p].values():
                    s.discard(tier)
            else:
                await idx.begin_incarnation(p, f"x{step}")
                await idx.store(p, "1", sel, tier)  # stale: ignored
                await idx.drop_pod(p)
                await idx.begin_incarnation(p, "1")
                held[p], marks[p] = {}, {}
            if tier is Tier.HBM and op < 0.85:
                for k in sel.keys:  # an HBM event settles the router's mark
                    marks[p].pop(k, None)
            query = keys[: rnd.randint(0, len(keys))]
            got = await idx.lookup(query, [*pods, "unknown"])
            for q in pods:
                blocks = [
                    held[q].get(k, set()) | ({Tier.HBM} if marks[q].get(k, 0.0) > now[0] else set())
                    for k in query
                ]
                assert got[q] == cumulative(blocks, TIER_ORDER), (step, q)
            assert got["unknown"] == _m(0, 0, 0, 0)
    finally:
        if idx is not index:
            await idx.close()


def _shared(index: ResidencyIndex, *stores: SharedStoreSpec) -> SharedTierIndex:
    assert isinstance(index, MemoryIndex | RedisIndex)
    return SharedTierIndex(index, SharedStores.of(stores))


async def test_a_shared_store_block_is_every_readers(index: ResidencyIndex) -> None:
    """A remote-tier block a pod wrote to a shared store counts for every pod that reads
    the store, even one the index has never heard of, and for no other pod."""
    idx = _shared(index, SharedStoreSpec(name="s", pods=["a", "b", "c"]))
    await idx.begin_incarnation("a", "1")
    await idx.begin_incarnation("d", "1")
    await idx.store("a", "1", at(KEYS), R)
    await idx.store("d", "1", at(KEYS, 0, 2), R)  # d does not use the store: its own
    got = await idx.lookup(KEYS, ["a", "b", "c", "d"])
    assert got["a"] == got["b"] == got["c"] == _m(0, 0, 0, 5)
    assert got["d"] == _m(0, 0, 0, 2)
    everyone = _shared(index, SharedStoreSpec(name="s"))  # pods absent: the whole pool
    assert (await everyone.lookup(KEYS, ["z"]))["z"] == _m(0, 0, 0, 5)


async def test_shared_blocks_outlive_their_writer(index: ResidencyIndex) -> None:
    idx = _shared(index, SharedStoreSpec(name="s"))
    await idx.begin_incarnation("a", "1")
    await idx.store("a", "1", at(KEYS), R)
    await idx.store("a", "1", at(KEYS, 0, 2), H)
    await idx.drop_pod("a")  # the writer dies: its HBM goes, the store's blocks stay
    assert (await idx.lookup(KEYS, ["a", "b"])) == {"a": _m(0, 0, 0, 5), "b": _m(0, 0, 0, 5)}
    await idx.begin_incarnation("a", "2")  # and a restart does not hide them either
    assert (await idx.lookup(KEYS, ["a"]))["a"] == _m(0, 0, 0, 5)


async def test_a_store_eviction_leaves_every_reader(index: ResidencyIndex) -> None:
    """The store's BlockRemoved (remote medium), from any reader, ends the blocks."""
    idx = _shared(index, SharedStoreSpec(name="s"))
    await idx.begin_incarnation("a", "1")
    await idx.begin_incarnation("b", "1")
    await idx.store("a", "1", at(KEYS), R)
    await idx.remove("b", "1", at(KEYS, 3), R)
    assert (await idx.lookup(KEYS, ["a", "b"])) == {"a": _m(0, 0, 0, 3), "b": _m(0, 0, 0, 3)}


async def test_a_store_without_events_drops_its_least_recently_written_blocks(
    index: ResidencyIndex,
) -> None:
    """``capacity_blocks`` models a store that publishes no evictions: an LRU by write."""
    idx = _shared(index, SharedStoreSpec(name="s", capacity_blocks=3))
    await idx.begin_incarnation("a", "1")
    await idx.store("a", "1", at(KEYS, 0, 2), R)
    await idx.store("a", "1", at(KEYS, 0, 1), R)  # rewritten: now the most recent
    await idx.store("a", "1", at(KEYS, 2, 4), R)  # 4 blocks written: block 1 goes
    assert (await idx.lookup(KEYS, ["b"]))["b"] == _m(0, 0, 0, 1)
    await idx.remove("a", "1", at(KEYS, 0, 1), R)  # the store's own event, if it sends one
    await idx.store("a", "1", at(KEYS, 0, 2), R)  # 0, 1 back; 2 goes (3 is newer)
    got = await idx.lookup(KEYS, ["b"])
    assert got["b"] == _m(0, 0, 0, 2)


async def test_a_reader_run_joins_its_own_tiers_and_the_store_block_by_block(
    index: ResidencyIndex,
) -> None:
    idx = _shared(index, SharedStoreSpec(name="s"))
    await idx.begin_incarnation("a", "1")
    await idx.begin_incarnation("b", "1")
    anchors = chunk_anchors(KEYS)
    await idx.store("a", "1", at(KEYS, 0, 3), H)
    await idx.store(
        "b", "1", Blocks([KEYS[0], KEYS[1], KEYS[3], KEYS[4]], anchors[:2] + anchors[3:]), R
    )
    got = await idx.lookup(KEYS, ["a", "b"])
    assert got["a"] == _m(3, 3, 3, 5), "HBM for 0-2, the store for 3-4"
    assert got["b"] == _m(0, 0, 0, 2)


async def test_random_shared_writes_agree_with_reference_semantics(index: ResidencyIndex) -> None:
    """Random writes of readers and a non-reader vs ``cumulative()`` over each pod's own
    blocks joined with the store's, on a prompt of three chunks."""
    idx = _shared(index, SharedStoreSpec(name="s", pods=["a", "b"]))
    rnd = random.Random(5)
    pods = ["a", "b", "c"]
    keys = [rnd.getrandbits(64) for _ in range(2 * CHUNK + 6)]
    anchors = chunk_anchors(keys)
    held: dict[str, dict[int, set[Tier]]] = {p: {} for p in pods}
    store: set[int] = set()
    for p in pods:
        await idx.begin_incarnation(p, "1")
    for step in range(300):
        p, tier = rnd.choice(pods), rnd.choice(TIER_ORDER)
        at_ = rnd.sample(range(len(keys)), rnd.randint(1, 8))
        sel = Blocks([keys[i] for i in at_], [anchors[i] for i in at_])
        op = rnd.random()
        shared = tier is R and p != "c"
        if op < 0.55:
            await idx.store(p, "1", sel, tier)
            for k in sel.keys:
                store.add(k) if shared else held[p].setdefault(k, set()).add(tier)
        elif op < 0.95:
            await idx.remove(p, "1", sel, tier)
            for k in sel.keys:
                store.discard(k) if shared else held[p].get(k, set()).discard(tier)
        else:
            await idx.drop_pod(p)
            await idx.begin_incarnation(p, "1")
            held[p] = {}
        query = keys[: rnd.randint(0, len(keys))]
        got = await idx.lookup(query, pods)
        for q in pods:
            extra = {R} if q != "c" else set()
            blocks = [held[q].get(k, set()) | (extra if k in store else set()) for k in query]
            assert got[q] == cumulative(blocks, TIER_ORDER), (step, q)


@pytest.mark.parametrize("where", ["redis", "redis-cluster"])
async def test_router_replicas_see_one_index(where: str, request: pytest.FixtureRequest) -> None:
    """An indexer writes, two router replicas read: they get the same answers, each sees
    the other's marks, and a new incarnation hides the old one from both at once."""
    fixture = "redis_server" if where == "redis" else "redis_cluster"
    url = request.getfixturevalue(fixture).url
    gen = f"replicas{id(request):x}"
    indexer, one, two = (RedisIndex(url, gen) for _ in range(3))
    rnd = random.Random(5)
    keys = [rnd.getrandbits(64) for _ in range(3 * CHUNK)]
    try:
        await indexer.begin_incarnation("a", "1")
        await indexer.store("a", "1", at(keys, 0, 40), H)
        assert await one.lookup(keys, ["a", "b"]) == await two.lookup(keys, ["a", "b"])
        await one.mark_tentative("b", at(keys, 0, 20), ttl_s=30)
        assert (await two.lookup(keys, ["b"]))["b"][H] == 20
        await indexer.begin_incarnation("a", "2")
        for replica in (one, two):
            assert (await replica.lookup(keys, ["a"]))["a"][R] == 0
    finally:
        for idx in (indexer, one, two):
            await idx.close()
