"""Engine events -> router keys in the residency index.

The emulated engine hashes blocks with SHA-256 and its own seed, on purpose
unlike the router's xxh3 chain: ingestion must still land on the keys that
``block_keys`` gives for the same tokens.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Sequence

import pytest
from kvplane.router.blockkeys import adapter_root, block_keys, generation_root
from kvplane.router.config import UnreportedTierSpec
from kvplane.router.index.base import Blocks, chunk_anchors, cumulative
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.kvevents.ingest import IndexOp, Ingestor, write
from kvplane.router.kvevents.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)
from kvplane.router.tiers import TIER_ORDER, Tier
from pydantic import ValidationError

GEN = "gen-test"
BS = 4
H, D, N, R = Tier.HBM, Tier.DRAM, Tier.NVME, Tier.REMOTE


def engine_hashes(
    tokens: Sequence[int], block_size: int = BS, seed: bytes = b"engine"
) -> list[int]:
    """A different chain hash than the router's (sha256, own seed, last 8 bytes)."""
    out: list[int] = []
    parent = hashlib.sha256(seed).digest()
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + repr(list(block)).encode()).digest()
        out.append(int.from_bytes(parent[-8:], "big"))
    return out


TOKENS = list(range(1000, 1024))  # 6 blocks
EH = engine_hashes(TOKENS)
KEYS = block_keys(TOKENS, BS, generation_root(GEN))


def stored(first: int, last: int, medium: str | None = "GPU", **kw: object) -> BlockStored:
    """BlockStored for blocks first..last-1 of TOKENS, chained like the engine does."""
    parent = None if first == 0 else EH[first - 1]
    return BlockStored(
        EH[first:last],
        parent,
        TOKENS[first * BS : last * BS],
        BS,
        medium=medium,
        **kw,  # type: ignore[arg-type]
    )


def batch(*events: KVEvent) -> EventBatch:
    return EventBatch(ts=0.0, events=list(events))


async def prefix(index: MemoryIndex, keys: Sequence[int] = KEYS) -> dict[Tier, int]:
    return (await index.lookup(keys, ["p"]))["p"]


def counts(h: int, d: int, n: int, r: int) -> dict[Tier, int]:
    return dict(zip(TIER_ORDER, (h, d, n, r), strict=True))


@pytest.fixture
async def index() -> MemoryIndex:
    idx = MemoryIndex()
    await idx.begin_incarnation("p", "i1")
    return idx


@pytest.fixture
def ingestor(index: MemoryIndex) -> Ingestor:
    return Ingestor(index, generation=GEN, block_size=BS)


async def test_foreign_engine_hashes_map_to_router_keys(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    assert set(EH).isdisjoint(KEYS)
    await ingestor.apply("p", "i1", batch(stored(0, 6)))
    assert await prefix(index) == counts(6, 6, 6, 6)
    chains = ingestor.chains("p", "i1")
    assert [chains.keys[h] for h in EH] == KEYS


async def test_parent_chaining_across_events_and_batches(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    await ingestor.apply("p", "i1", batch(stored(0, 2), stored(2, 3)))
    await ingestor.apply("p", "i1", batch(stored(3, 6)))
    assert await prefix(index) == counts(6, 6, 6, 6)
    # a prompt sharing only the first two blocks, then diverging
    other = TOKENS[: 2 * BS] + [7] * BS
    other_eh = engine_hashes(other)
    ev = BlockStored(other_eh[2:], EH[1], other[2 * BS :], BS, medium="GPU")
    await ingestor.apply("p", "i1", batch(ev))
    other_keys = block_keys(other, BS, generation_root(GEN))
    assert other_keys[:2] == KEYS[:2]
    assert await prefix(index, other_keys) == counts(3, 3, 3, 3)


async def test_unknown_parent_is_skipped_and_counted(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    await ingestor.apply("p", "i1", batch(stored(2, 4)))
    assert ingestor.stats.unmapped == 1
    assert len(index) == 0


async def test_removal_forgets_the_mapping(index: MemoryIndex, ingestor: Ingestor) -> None:
    await ingestor.apply("p", "i1", batch(stored(0, 6)))
    await ingestor.apply(
        "p", "i1", batch(BlockRemoved([EH[5]], "GPU"), BlockRemoved([EH[3]], "GPU"))
    )
    assert await prefix(index) == counts(3, 3, 3, 3)
    assert ingestor.mapped_blocks("p") == 4
    # a removal we cannot map (never stored, or another tier) is only counted
    await ingestor.apply(
        "p", "i1", batch(BlockRemoved([12345], "GPU"), BlockRemoved([EH[0]], "CPU"))
    )
    assert ingestor.stats.removed_unknown == 2
    assert await prefix(index) == counts(3, 3, 3, 3)


async def test_offload_announced_after_the_eviction_is_still_mapped(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    """vLLM sends a step's GPU events before its offload connector's: blocks evicted and
    offloaded in one step reach the CPU tier after the removals that emptied them."""
    await ingestor.apply("p", "i1", batch(stored(0, 6)))
    evicted = [BlockRemoved([h], "GPU") for h in reversed(EH)]  # tail first
    self_describing = stored(3, 6, medium="CPU")  # its parent EH[2] left the GPU above
    placeholder = BlockStored(EH[:3], None, [], 0, medium="CPU")  # hashes only
    await ingestor.apply("p", "i1", batch(*evicted, self_describing, placeholder))
    assert ingestor.stats.unmapped == 0
    assert await prefix(index) == counts(0, 6, 6, 6)
    assert ingestor.mapped_blocks("p") == 6


async def test_dropped_mappings_are_kept_in_a_bounded_lru(index: MemoryIndex) -> None:
    ingestor = Ingestor(index, generation=GEN, block_size=BS, recent_per_pod=2)
    await ingestor.apply("p", "i1", batch(stored(0, 6)))
    await ingestor.apply("p", "i1", batch(*(BlockRemoved([h], "GPU") for h in EH)))
    assert ingestor.mapped_blocks("p") == 0
    await ingestor.apply("p", "i1", batch(stored(5, 6, medium="CPU")))  # parent EH[4]: kept
    await ingestor.apply("p", "i1", batch(stored(3, 4, medium="CPU")))  # parent EH[2]: gone
    assert ingestor.stats.unmapped == 1
    assert await prefix(index) == counts(0, 0, 0, 0)  # block 5 alone is no prefix
    assert ingestor.mapped_blocks("p") == 1


async def test_clear_drops_hbm_only(index: MemoryIndex, ingestor: Ingestor) -> None:
    await ingestor.apply("p", "i1", batch(stored(0, 6), stored(0, 3, medium="CPU")))
    await ingestor.apply("p", "i1", batch(AllBlocksCleared()))
    assert await prefix(index) == counts(0, 3, 3, 3)
    assert ingestor.mapped_blocks("p") == 3  # the HBM-only blocks are forgotten
    # the DRAM copies still anchor new chains
    await ingestor.apply("p", "i1", batch(stored(3, 6)))
    assert await prefix(index) == counts(0, 6, 6, 6)  # cumulative: HBM or DRAM
    await ingestor.apply("p", "i1", batch(stored(0, 3)))
    assert await prefix(index) == counts(6, 6, 6, 6)


async def test_tiers_from_medium_and_locality(index: MemoryIndex, ingestor: Ingestor) -> None:
    await ingestor.apply(
        "p",
        "i1",
        batch(
            stored(0, 1),
            stored(1, 2, medium="CPU_PINNED"),
            stored(2, 3, medium="STORAGE"),
            stored(3, 4, medium="STORAGE", locality="REMOTE"),
            stored(4, 5, medium=None),
        ),
    )
    assert await prefix(index) == counts(1, 2, 3, 5)


async def test_placeholder_offload_events_use_known_hashes(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    await ingestor.apply("p", "i1", batch(stored(0, 4)))
    cpu = BlockStored([*EH[:4], 999], None, [], BS, medium="CPU")
    await ingestor.apply("p", "i1", batch(cpu))
    assert ingestor.stats.unmapped == 1  # 999 was never announced with tokens
    assert await prefix(index) == counts(4, 4, 4, 4)
    await ingestor.apply("p", "i1", batch(*(BlockRemoved([h], "GPU") for h in EH[:4])))
    assert await prefix(index) == counts(0, 4, 4, 4)
    assert ingestor.mapped_blocks("p") == 4  # still held in DRAM
    await ingestor.apply("p", "i1", batch(BlockRemoved(EH[:4], "CPU")))
    assert await prefix(index) == counts(0, 0, 0, 0)
    assert ingestor.mapped_blocks("p") == 0


async def test_filters_count_what_they_skip(index: MemoryIndex, ingestor: Ingestor) -> None:
    wrong_size = BlockStored([1, 2], None, TOKENS[:16], 8, medium="GPU")
    lora = stored(0, 2, lora_name="adapter", extra_keys=[["adapter", "salt"], ["adapter"]])
    salted = stored(0, 2, extra_keys=["salt", "salt"])
    other_group = stored(0, 2, group_idx=1)
    short = BlockStored(EH[:2], None, TOKENS[:5], BS)
    await ingestor.apply("p", "i1", batch(wrong_size, lora, salted, other_group, short))
    s = ingestor.stats
    assert (s.block_size_mismatch, s.namespaced, s.other_group, s.malformed) == (1, 2, 1, 1)
    assert s.stored == 5
    assert len(index) == 0


async def test_adapter_blocks_key_in_the_adapters_namespace(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    """vLLM hashes an adapter request's blocks with the adapter folded in (different
    engine hashes, the adapter's name as every block's extra key): they are indexed
    under the adapter's root, never credited to the base model or another adapter."""
    lora_eh = engine_hashes(TOKENS, seed=b"engine+ada")
    name: list[object] = [["ada"]] * 2
    first = BlockStored(lora_eh[:2], None, TOKENS[: 2 * BS], BS, "GPU", "ada", extra_keys=name)
    rest = BlockStored(lora_eh[2:4], lora_eh[1], TOKENS[2 * BS : 4 * BS], BS, "GPU", "ada",
                       extra_keys=name)  # fmt: skip
    await ingestor.apply("p", "i1", batch(first, rest))
    root = generation_root(GEN)
    ada_keys = block_keys(TOKENS, BS, adapter_root(root, "ada"))
    other_keys = block_keys(TOKENS, BS, adapter_root(root, "other"))
    assert set(ada_keys).isdisjoint(KEYS) and set(ada_keys).isdisjoint(other_keys)
    assert await prefix(index, ada_keys) == counts(4, 4, 4, 4)
    assert await prefix(index) == counts(0, 0, 0, 0)  # the base model's keys: nothing
    assert await prefix(index, other_keys) == counts(0, 0, 0, 0)
    await ingestor.apply("p", "i1", batch(stored(0, 6)))  # the base model's own blocks
    assert await prefix(index) == counts(6, 6, 6, 6)
    assert await prefix(index, ada_keys) == counts(4, 4, 4, 4)
    await ingestor.apply("p", "i1", batch(BlockRemoved(lora_eh[3:4], "GPU")))
    assert await prefix(index, ada_keys) == counts(3, 3, 3, 3)
    assert await prefix(index) == counts(6, 6, 6, 6)
    assert ingestor.stats.namespaced == 0


async def test_new_incarnation_starts_an_empty_mapping(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    await ingestor.apply("p", "i1", batch(stored(0, 3)))
    await index.begin_incarnation("p", "i2")
    await ingestor.apply("p", "i2", batch(stored(3, 6)))  # parent belongs to i1
    assert ingestor.stats.unmapped == 1
    await ingestor.apply("p", "i2", batch(stored(0, 6)))
    assert await prefix(index) == counts(6, 6, 6, 6)
    ingestor.forget("p")
    assert ingestor.mapped_blocks("p") == 0


async def test_mapping_cap(index: MemoryIndex, caplog: pytest.LogCaptureFixture) -> None:
    ingestor = Ingestor(index, generation=GEN, block_size=BS, max_blocks_per_pod=4)
    with caplog.at_level(logging.WARNING):
        await ingestor.apply("p", "i1", batch(stored(0, 3), stored(3, 6)))
    assert ingestor.mapped_blocks("p") == 4
    assert ingestor.stats.mapping_full == 2
    assert await prefix(index) == counts(4, 4, 4, 4)
    assert sum("cap" in r.message for r in caplog.records) == 1
    await ingestor.apply("p", "i1", batch(BlockRemoved([EH[3]], "GPU"), stored(3, 5)))
    assert await prefix(index) == counts(4, 4, 4, 4)  # room again for one block
    assert ingestor.mapped_blocks("p") == 4


def test_writes_are_coalesced_in_order() -> None:
    ingestor = Ingestor(MemoryIndex(), generation=GEN, block_size=BS)
    per_page = [stored(i, i + 1) for i in range(6)]  # SGLang: one event per page
    ops = ingestor.plan(
        "p",
        "i1",
        batch(
            *per_page,
            BlockRemoved([EH[5]], "GPU"),
            BlockRemoved([EH[4]], "GPU"),
            AllBlocksCleared(),
            AllBlocksCleared(),
        ),
    )
    assert ops == [
        IndexOp("store", H, KEYS, [KEYS[0]] * 6),
        IndexOp("remove", H, [KEYS[5], KEYS[4]], [KEYS[0]] * 2),
        IndexOp("clear", H, []),
        IndexOp("clear", H, []),
    ]


def test_blocks_carry_the_anchor_of_their_chunk() -> None:
    """Every written block names the first block of its CHUNK, counted from the chain's
    start, whichever events stored, evicted and offloaded it."""
    tokens = list(range(5000, 5000 + 40 * BS))  # 40 blocks: chunks 0-15, 16-31, 32-39
    eh, keys = engine_hashes(tokens), block_keys(tokens, BS, generation_root(GEN))
    want = chunk_anchors(keys)
    ingestor = Ingestor(MemoryIndex(), generation=GEN, block_size=BS)

    def run(first: int, last: int, medium: str | None = "GPU") -> BlockStored:
        parent = None if first == 0 else eh[first - 1]
        return BlockStored(eh[first:last], parent, tokens[first * BS : last * BS], BS, medium)

    ops = ingestor.plan("p", "i1", batch(run(0, 10), run(10, 17), run(17, 40)))
    assert ops == [IndexOp("store", H, keys, want)]
    ops = ingestor.plan("p", "i1", batch(BlockRemoved(eh[30:34], "GPU")))
    assert ops == [IndexOp("remove", H, keys[30:34], want[30:34])]
    # an offload placeholder names blocks by hash alone, even ones just evicted
    placeholder = BlockStored(eh[30:34], None, [], 0, medium="CPU")
    ops = ingestor.plan("p", "i1", batch(placeholder))
    assert ops == [IndexOp("store", D, keys[30:34], want[30:34])]
    assert chunk_anchors(keys)[:16] == [keys[0]] * 16 and want[16] == keys[16]


async def test_rehash_with_other_tokens_withdraws_the_old_key(
    index: MemoryIndex, ingestor: Ingestor
) -> None:
    await ingestor.apply("p", "i1", batch(stored(0, 1)))
    collision = BlockStored([EH[0]], None, [5] * BS, BS, medium="GPU")
    await ingestor.apply("p", "i1", batch(collision))
    assert ingestor.stats.remapped == 1
    assert await prefix(index) == counts(0, 0, 0, 0)
    assert await prefix(index, block_keys([5] * BS, BS, generation_root(GEN))) == counts(1, 1, 1, 1)


def unreported(blocks: int, index: MemoryIndex) -> Ingestor:
    spec = UnreportedTierSpec(tier=Tier.DRAM, blocks=blocks)
    return Ingestor(index, generation=GEN, block_size=BS, unreported=spec)


async def test_an_unreported_tier_keeps_what_leaves_hbm_within_its_capacity(
    index: MemoryIndex,
) -> None:
    """Engines that publish nothing for their host tier (Dynamo's mocker): a block that
    leaves HBM is indexed in DRAM while it is among the pod's most recently stored, and
    leaves DRAM when newer blocks push it out."""
    ingestor = unreported(8, index)
    await ingestor.apply("p", "i1", batch(stored(0, 6)))
    assert await prefix(index) == counts(6, 6, 6, 6)
    # one event for the step's evictions, as the decoder merges vLLM's one per block
    ops = ingestor.plan("p", "i1", batch(BlockRemoved(EH, "GPU")))
    assert ops == [
        IndexOp("remove", H, KEYS, [KEYS[0]] * 6),
        IndexOp("store", D, KEYS, [KEYS[0]] * 6),
    ]
    for op in ops:
        await write(index, "p", "i1", op)
    assert await prefix(index) == counts(0, 6, 6, 6)
    assert ingestor.mapped_blocks("p") == 6  # still mapped: later events chain on them
    # the oldest of them go once four newer blocks are stored (capacity 8)
    other = [7] * (4 * BS)
    await ingestor.apply("p", "i1", batch(BlockStored(engine_hashes(other), None, other, BS)))
    assert await prefix(index) == counts(0, 0, 0, 0)
    assert await prefix(index, KEYS[2:]) == counts(0, 4, 4, 4)
    assert ingestor.mapped_blocks("p") == 4 + 4
    assert (ingestor.stats.unreported_kept, ingestor.stats.unreported_dropped) == (6, 2)
    # a block back in HBM (loaded from the tier) is in both, and the newest again
    await ingestor.apply("p", "i1", batch(stored(2, 3)))
    await ingestor.apply("p", "i1", batch(BlockStored(engine_hashes([8] * BS), None, [8] * BS, BS)))
    assert await prefix(index, KEYS[2:]) == counts(1, 1, 1, 1)  # block 3 pushed out


async def test_blocks_only_in_hbm_leave_the_unreported_tier_unindexed(index: MemoryIndex) -> None:
    ingestor = unreported(4, index)
    ops = ingestor.plan("p", "i1", batch(stored(0, 6)))  # 0 and 1 were never in DRAM
    assert ops == [IndexOp("store", H, KEYS, [KEYS[0]] * 6)]
    for op in ops:
        await write(index, "p", "i1", op)
    await ingestor.apply("p", "i1", batch(*(BlockRemoved([h], "GPU") for h in EH)))
    assert await prefix(index) == counts(0, 0, 0, 0)
    assert await prefix(index, KEYS[2:]) == counts(0, 4, 4, 4)
    assert ingestor.mapped_blocks("p") == 4


async def test_an_unreported_tier_outlives_a_prefix_cache_reset(index: MemoryIndex) -> None:
    ingestor = unreported(8, index)
    await ingestor.apply("p", "i1", batch(stored(0, 6)))
    await ingestor.apply("p", "i1", batch(AllBlocksCleared()))
    assert await prefix(index) == counts(0, 6, 6, 6)


async def test_reported_stores_without_removals_are_bounded(index: MemoryIndex) -> None:
    """An engine that reports what a tier stores but not what it drops (LMCache's
    in-process connector): the tier's capacity bounds what the index keeps of it."""
    ingestor = unreported(4, index)
    await ingestor.apply("p", "i1", batch(stored(0, 6, medium="CPU")))
    assert await prefix(index) == counts(0, 0, 0, 0)
    assert await prefix(index, KEYS[2:]) == counts(0, 4, 4, 4)
    assert ingestor.mapped_blocks("p") == 4


def test_the_unreported_tier_is_below_hbm() -> None:
    with pytest.raises(ValidationError, match="below hbm"):
        UnreportedTierSpec(tier=Tier.HBM, blocks=8)


async def test_memory_index_agrees_with_reference_semantics() -> None:
    """Random writes (incl. tentative marks and their expiry) vs ``cumulative()``."""
    now = [0.0]
    rnd = random.Random(7)
    idx = MemoryIndex(clock=lambda: now[0])
    pods = ["a", "b", "c"]
    keys = list(range(30))

    def at(sel: list[int]) -> Blocks:  # key k sits at position k of ``keys``
        anchors = chunk_anchors(keys)
        return Blocks(sel, [anchors[k] for k in sel])

    held: dict[str, dict[int, set[Tier]]] = {p: {} for p in pods}
    marks: dict[str, dict[int, float]] = {p: {} for p in pods}
    for p in pods:
        await idx.begin_incarnation(p, "1")
    for step in range(3000):
        now[0] += 0.01
        p, tier = rnd.choice(pods), rnd.choice(TIER_ORDER)
        sel = rnd.sample(keys, rnd.randint(1, 6))
        op = rnd.random()
        if op < 0.5:
            await idx.store(p, "1", at(sel), tier)
            for k in sel:
                held[p].setdefault(k, set()).add(tier)
        elif op < 0.85:
            await idx.remove(p, "1", at(sel), tier)
            for k in sel:
                held[p].get(k, set()).discard(tier)
        elif op < 0.95:
            ttl = rnd.choice([0.05, 0.3])
            await idx.mark_tentative(p, at(sel), ttl)
            for k in sel:
                marks[p][k] = max(marks[p].get(k, 0.0), now[0] + ttl)
        elif op < 0.98:
            await idx.clear(p, "1", tier)
            for s in held[p].values():
                s.discard(tier)
        else:
            await idx.begin_incarnation(p, f"x{step}")
            await idx.store(p, "1", at(sel), tier)  # stale: ignored
            await idx.drop_pod(p)
            await idx.begin_incarnation(p, "1")
            held[p], marks[p] = {}, {}
        if tier is Tier.HBM and op < 0.85:
            for k in sel:  # an HBM event settles the router's mark
                marks[p].pop(k, None)
        query = keys[: rnd.randint(0, len(keys))]
        got = await idx.lookup(query, [*pods, "unknown"])
        for q in pods:
            blocks = [
                held[q].get(k, set()) | ({Tier.HBM} if marks[q].get(k, 0.0) > now[0] else set())
                for k in query
            ]
            assert got[q] == cumulative(blocks, TIER_ORDER), (step, q)
        assert got["unknown"] == counts(0, 0, 0, 0)
