"""Room in a pod's KV cache (router/engine_stats.py, router/cost.py ``kv_pressure_ms``).

A prompt whose new tokens do not fit in the KV its pod has free cannot finish its prefill
until running requests end (vLLM preempts the newest request, most often that prompt,
until blocks free up), so the cost model charges that wait. The capacity comes from the
engine's own page: a recorded vLLM page here; the live vLLM and simulator pages are
checked in test_router_vllm.py and test_sim_server.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvplane.router.config import CostParams
from kvplane.router.cost import CostModel, PodLoad, kv_pressure_ms, surviving_hbm_tokens
from kvplane.router.engine_stats import parse_metrics
from kvplane.router.policies.cost import choose_by_cost
from kvplane.router.tiers import Tier

DATA = Path(__file__).parent / "data"
P = CostParams(prefill_tokens_per_s=10_000.0, prefill_attention_ms_per_mpair=0.0)
M = CostModel(P, 16, 1000)


def test_capacity_from_a_recorded_vllm_page() -> None:
    # vLLM 0.32: num_gpu_blocks="64", block_size="32" among labels whose names end in
    # block_size (hash_block_size, user_specified_block_size, ...)
    stats = parse_metrics((DATA / "vllm-0.32-metrics.txt").read_text())
    assert stats.kv_capacity_tokens == 63 * 32


def test_capacity_sums_data_parallel_ranks_and_skips_an_unsized_cache() -> None:
    page = (
        'vllm:cache_config_info{hash_block_size="None",block_size="16",engine="0",'
        'num_gpu_blocks="101"} 1.0\n'
        'vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="101"} 1.0\n'
    )
    assert parse_metrics(page).kv_capacity_tokens == 2 * 100 * 16
    unsized = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n'
    assert parse_metrics(unsized).kv_capacity_tokens == 0.0


def test_capacity_from_sglang() -> None:
    page = "sglang:max_total_num_tokens 500000.0\nsglang:token_usage 0.25\n"
    stats = parse_metrics(page)
    assert stats.kv_capacity_tokens == 500_000 and stats.kv_usage == 0.25


def test_a_prompt_that_does_not_fit_waits_for_running_requests() -> None:
    load = PodLoad(kv_usage=0.5, kv_capacity_tokens=100_000, pending_prefill_tokens=10_000)
    assert kv_pressure_ms(load, 40_000, P) == 0.0  # fits: full after it, not before
    assert kv_pressure_ms(load, 40_001, P) == P.kv_overflow_penalty_ms  # does not fit
    hot = PodLoad(kv_usage=0.95, kv_capacity_tokens=100_000)
    assert kv_pressure_ms(hot, 1_000, P) == P.kv_pressure_penalty_ms  # preemptions ahead
    # a pod that does not say how much it holds is judged by its usage alone
    blind = PodLoad(kv_usage=0.5)
    assert kv_pressure_ms(blind, 10**6, P) == 0.0
    assert kv_pressure_ms(PodLoad(kv_usage=0.95), 1, P) == P.kv_pressure_penalty_ms


def test_a_long_prompt_goes_where_it_fits_and_a_resident_one_stays() -> None:
    # "full" holds long contexts still decoding; "room" has prefill queued but KV free
    loads = {
        "full": PodLoad(kv_usage=0.8, kv_capacity_tokens=400_000, engine_running=3),
        "room": PodLoad(
            kv_usage=0.1,
            kv_capacity_tokens=400_000,
            pending_prefill_tokens=5_000,
            pending_requests=1,
            inflight=1,
        ),
    }
    head = {Tier.HBM: 32}  # every pod holds the trace's common 512-token head
    d = choose_by_cost(M, 110_000, {"full": head, "room": head}, loads)
    assert d.pod == "room"
    assert d.terms["full"].queue_ms >= P.kv_overflow_penalty_ms
    # the same length whose prefix "full" holds needs only its last blocks there
    resident = {"full": {Tier.HBM: 110_000 // 16 - 8}, "room": head}
    d = choose_by_cost(M, 110_000, resident, loads)
    assert d.pod == "full"
    assert d.terms["full"].queue_ms == pytest.approx(3 * P.running_step_ms_per_request)


def test_pending_prefill_takes_the_least_recently_used_free_blocks_first() -> None:
    """A free cached prefix survives a pod's pending prefill only as far as the free
    blocks older than it cover that prefill; the part no free block could hold is held
    by a running request and stays."""
    room = PodLoad(kv_usage=0.75, kv_capacity_tokens=400_000, pending_prefill_tokens=93_895)
    # 100,000 free, the prefix the newest 68,608 of them: the pending prefill takes the
    # 31,392 older ones, then 62,503 of the prefix, from its end
    assert surviving_hbm_tokens(room, 68_608) == 68_608 - 62_503
    idle = PodLoad(kv_usage=0.25, kv_capacity_tokens=400_000, pending_prefill_tokens=93_895)
    assert surviving_hbm_tokens(idle, 68_608) == 68_608  # 300,000 free: older ones suffice
    # 80,000 free and a 109,872-token prefix: 29,872 of it is held by a running request
    held = PodLoad(kv_usage=0.8, kv_capacity_tokens=400_000)
    assert surviving_hbm_tokens(held, 109_872) == 109_872  # nothing pending: all stays
    behind = PodLoad(kv_usage=0.8, kv_capacity_tokens=400_000, pending_prefill_tokens=10_000)
    assert surviving_hbm_tokens(behind, 109_872) == 99_872
    flood = PodLoad(kv_usage=0.8, kv_capacity_tokens=400_000, pending_prefill_tokens=10**6)
    assert surviving_hbm_tokens(flood, 109_872) == 29_872
    assert surviving_hbm_tokens(PodLoad(pending_prefill_tokens=10**6), 5_000) == 5_000  # unsized


def test_a_prefix_the_pending_prefill_will_evict_is_costed_as_recomputed() -> None:
    """The tail request of the HBM-only Mooncake replay: its 68,608-token prefix sat on a
    pod behind 93,895 pending tokens, which evicted it before the prompt ran."""
    prompt, prefix_blocks = 69_491, 68_608 // 16
    busy = PodLoad(
        kv_usage=0.75,
        kv_capacity_tokens=400_000,
        pending_prefill_tokens=93_895,
        pending_requests=2,
        inflight=2,
    )
    terms = M.predict("e5", prompt, {Tier.HBM: prefix_blocks}, busy)
    assert terms.cached_tokens == (68_608 - 62_503) // 16 * 16
    blind = CostModel(P.model_copy(update={"pending_evicts_cached": False}), 16, 131_072)
    assert blind.predict("e5", prompt, {Tier.HBM: prefix_blocks}, busy).cached_tokens == 68_608
    # with a DRAM tier below, what HBM loses is loaded back from DRAM
    tiered = M.predict("e5", prompt, {Tier.HBM: prefix_blocks, Tier.DRAM: prefix_blocks}, busy)
    assert tiered.cached_tokens == 68_608 and tiered.loaded_from[Tier.DRAM] > 60_000
