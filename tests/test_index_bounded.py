"""The Redis index stays bounded: what leaves the engines leaves Redis.

Reproduces what a 10-minute soak found in the earlier layout (per-pod GC sets that
gained every stored block and lost none on removal; expired tentative marks that
were never deleted), checks that dead incarnations are collected and their slots
reused, and runs a bounded soak: once the working set is warm, the key count, Redis
memory and the client's own tables stay flat. Real redis-servers throughout; waits
are on conditions, each with a generous bound for a loaded machine.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import redis
from kvplane.router.index.base import Blocks
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.redis_gc import collect, dead_slots
from kvplane.router.index.redis_layout import SLOT_MUL
from kvplane.router.index.redis_nodes import MAX_CONNECTIONS
from kvplane.router.tiers import Tier

from kvplane.local import redis as local_redis

H, D = Tier.HBM, Tier.DRAM
GEN = "bounded"


@pytest.fixture
def server() -> Iterator[local_redis.LocalRedis]:
    """A Redis of its own: key counts and memory are this test's alone."""
    with local_redis.running() as local:
        yield local


@pytest.fixture
async def index(server: local_redis.LocalRedis) -> AsyncIterator[RedisIndex]:
    idx = RedisIndex(server.url, GEN, window_s=0.2)
    yield idx
    await idx.close()


def prompt(rnd: random.Random, blocks: int = 40) -> list[int]:
    return [rnd.getrandbits(64) for _ in range(blocks)]


def keys_of(server: local_redis.LocalRedis) -> list[bytes]:
    with redis.Redis(port=server.port) as r:
        return list(r.scan_iter(count=1000))


def tentative_keys(server: local_redis.LocalRedis) -> list[bytes]:
    """Tentative window keys: a bucket's name (ending in two bytes >= 0x80) + ``t<w>``."""
    return [k for k in keys_of(server) if k.startswith(b"kvp:bounded:{") and k[-1:].isdigit()]


def holders(server: local_redis.LocalRedis) -> set[int]:
    """Every slot with an entry in any bucket."""
    out: set[int] = set()
    with redis.Redis(port=server.port) as r:
        for key in r.scan_iter(match=b"kvp:bounded:{*}??", count=1000):
            for value in r.hvals(key):
                entries = [value[i : i + 2] for i in range(0, len(value), 2)]
                out |= {int.from_bytes(e, "big") // SLOT_MUL for e in entries}
    return out


async def wait_for(check: Callable[[], object], what: str, bound_s: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while not check():
        if loop.time() > deadline:
            raise AssertionError(f"not within {bound_s}s: {what}")
        await asyncio.sleep(0.1)


async def test_removal_takes_blocks_out_of_redis(
    index: RedisIndex, server: local_redis.LocalRedis
) -> None:
    """The old layout kept every stored block in a per-pod set that removals never
    shrank. Here a block removed from every tier leaves no trace."""
    rnd = random.Random(1)
    await index.begin_incarnation("a", "1")
    baseline = len(keys_of(server))
    prompts = [prompt(rnd) for _ in range(50)]
    for p in prompts:
        await index.store("a", "1", Blocks.of_prompt(p), H)
        await index.store("a", "1", Blocks.of_prompt(p), D)
    assert len(keys_of(server)) > baseline + 50
    for p in prompts:
        await index.remove("a", "1", Blocks.of_prompt(p), H)
        await index.remove("a", "1", Blocks.of_prompt(p), D)
    assert len(keys_of(server)) == baseline, "empty buckets must go"
    assert (await index.lookup(prompts[0], ["a"]))["a"][Tier.REMOTE] == 0


async def test_a_fleet_of_concurrent_callers_waits_for_bounded_connections(
    server: local_redis.LocalRedis,
) -> None:
    """An indexer starting 300 pods' streams at once, and as many lookups in flight: each
    waits for one of the process' connections to the node (redis-py's plain pool
    refused its 101st caller with ``Too many connections``), and the server sees no more
    clients than the bound. The wait for a connection is bounded by the index's timeout
    (0.5 s by default, a router's budget); here it is long, since the 300th caller on a
    busy machine can wait longer than that for its turn and the test is about the bound
    on connections, not about latency."""
    index = RedisIndex(server.url, GEN, window_s=0.2, timeout_s=60.0)
    try:
        await _many_callers(index, server)
    finally:
        await index.close()


async def _many_callers(index: RedisIndex, server: local_redis.LocalRedis) -> None:
    rnd = random.Random(4)
    pods = [f"p{i}" for i in range(300)]
    await asyncio.gather(*(index.begin_incarnation(p, "1") for p in pods))
    shared = prompt(rnd)
    await asyncio.gather(*(index.store(p, "1", Blocks.of_prompt(shared), H) for p in pods))
    answers = await asyncio.gather(*(index.lookup(shared, pods) for _ in range(300)))
    assert all(a[p][H] == len(shared) for a in answers for p in pods)
    with redis.Redis(port=server.port) as r:
        clients = int(r.info("clients")["connected_clients"])
    assert clients <= MAX_CONNECTIONS + 1  # + this one


async def test_expired_tentative_marks_are_deleted(
    index: RedisIndex, server: local_redis.LocalRedis
) -> None:
    """The old layout left every expired mark in Redis (200 rejected requests: 3,533 ->
    11,144 keys, unchanged after the TTL). Marks now live in window keys that expire."""
    rnd = random.Random(2)
    await index.begin_incarnation("a", "1")
    baseline = len(keys_of(server))
    for i in range(200):  # 200 requests the engines never confirmed
        await index.mark_tentative(f"pod-{i % 4}", Blocks.of_prompt(prompt(rnd)), ttl_s=0.2)
    assert tentative_keys(server)
    await wait_for(lambda: not tentative_keys(server), "the tentative window keys expire")
    # what is left: the pods table, its version, the slots of the four marked pods
    assert len(keys_of(server)) == baseline


async def test_dead_incarnations_are_collected_and_their_slots_reused(
    index: RedisIndex, server: local_redis.LocalRedis
) -> None:
    rnd = random.Random(3)
    shared = prompt(rnd)
    for pod in ("a", "b"):
        await index.begin_incarnation(pod, "1")
        await index.store(pod, "1", Blocks.of_prompt(shared), H)
    await index.begin_incarnation("a", "2")  # a restarted: slot 0 dead, slot 2 new
    await index.store("a", "2", Blocks.of_prompt(shared[:10]), H)
    await index.drop_pod("b")  # b is gone: slot 1 dead
    assert holders(server) == {0, 1, 2}
    assert set(await dead_slots(index)) == {0, 1}
    got = await collect(index, grace_s=0)
    assert got.freed == 2
    assert holders(server) == {2}
    assert await dead_slots(index) == {}
    await index.begin_incarnation("c", "1")  # the lowest free slot again
    await index.store("c", "1", Blocks.of_prompt(shared[:3]), H)
    assert holders(server) == {0, 2}
    got_a = await index.lookup(shared, ["a", "b", "c"])
    assert [got_a[p][H] for p in ("a", "b", "c")] == [10, 0, 3]


async def test_soak_keys_memory_and_tables_stay_flat_once_warm(
    index: RedisIndex, server: local_redis.LocalRedis
) -> None:
    """A bounded soak of the index alone: 8 pods with 600-block caches, each round a new
    prompt per pod, evictions past the cache, a router's marks, now and then a pod
    restarting (one at the end of each window), and the collector. After warming up,
    every window ends with the same key count and Redis memory within a few percent,
    and with bounded client tables."""
    rnd = random.Random(4)
    pods = [f"pod-{i}" for i in range(8)]
    incarnation = dict.fromkeys(pods, 0)
    caches: dict[str, list[list[int]]] = {p: [] for p in pods}
    for pod in pods:
        await index.begin_incarnation(pod, "0")
    samples: list[tuple[int, int]] = []
    for window in range(8):
        for round_ in range(60):
            for pod in pods:
                new = prompt(rnd, 40)
                inc = str(incarnation[pod])
                await index.store(pod, inc, Blocks.of_prompt(new), H)
                caches[pod].append(new)
                if len(caches[pod]) > 15:  # 600 blocks
                    await index.remove(pod, inc, Blocks.of_prompt(caches[pod].pop(0)), H)
                await index.mark_tentative(rnd.choice(pods), Blocks.of_prompt(new), ttl_s=0.2)
                await index.lookup(new, pods)
            if round_ == 59:  # a pod restarts: its old slot dies, its cache is empty
                pod = pods[window % len(pods)]
                incarnation[pod] += 1
                caches[pod] = []
                await index.begin_incarnation(pod, str(incarnation[pod]))
                await collect(index, grace_s=0)
        await wait_for(lambda: not tentative_keys(server), "marks of this window expire")
        samples.append((len(keys_of(server)), server.used_memory()))
    warm = samples[2:]  # two windows to fill the caches
    keys, memory = [k for k, _ in warm], [m for _, m in warm]
    assert max(keys) <= min(keys) * 1.05, samples
    assert max(memory) <= min(memory) * 1.10, samples
    assert len(await dead_slots(index)) <= 1  # at most the last restart, not yet collected
    assert len(index._seen) <= len(pods) and len(index._pods_table) <= len(pods)
    assert len(index._writing) <= len(pods)
