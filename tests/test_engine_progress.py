"""What the router reads of an engine's progress (router/engine_stats.py, pool.py): vLLM's
per-step token counters move while it computes; a page without them (SGLang counts
tokens only when a request finishes) gives no progress figure, and then no stall is
ever concluded from it. The hang itself is caused for real in test_router_vllm.py."""

from __future__ import annotations

from kvplane.router.config import Backend
from kvplane.router.engine_stats import parse_metrics
from kvplane.router.pool import BackendState

VLLM = (
    'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {p}\n'
    'vllm:generation_tokens_total{{engine="0",model_name="m"}} {g}\n'
    'vllm:generation_tokens_total{{engine="1",model_name="m"}} 1.0\n'
)
SGLANG = 'sglang:prompt_tokens_total{model_name="m"} 9.0\nsglang:num_running_reqs 1.0\n'


def state() -> BackendState:
    return BackendState(Backend(name="a", url="http://127.0.0.1:1"))


def test_progress_is_vllms_token_counters_summed_over_ranks() -> None:
    assert parse_metrics(VLLM.format(p=10, g=5)).progress == 16.0
    assert parse_metrics(SGLANG).progress is None
    assert parse_metrics("").progress is None


def test_still_for_counts_only_scrapes_after_the_request_and_since_the_last_move() -> None:
    s = state()
    s.observe(parse_metrics(VLLM.format(p=10, g=5)), now=100.0)
    assert s.still_for(since=101.0) < 0  # no scrape since the request left: no evidence
    s.observe(parse_metrics(VLLM.format(p=10, g=5)), now=102.0)
    assert s.still_for(since=101.0) == 1.0
    s.observe(parse_metrics(VLLM.format(p=10, g=9)), now=103.0)  # it computes
    assert s.still_for(since=101.0) == 0.0
    s.observe(parse_metrics(VLLM.format(p=10, g=9)), now=107.5)
    assert s.still_for(since=101.0) == 4.5
    s.observe(parse_metrics(VLLM.format(p=0, g=0)), now=108.0)  # a restart resets them
    assert s.still_for(since=101.0) == 0.0


def test_an_engine_without_progress_counters_is_never_judged_still() -> None:
    s = state()
    for t in (100.0, 200.0, 300.0):
        s.observe(parse_metrics(SGLANG), now=t)
    assert s.still_for(since=0.0) == 0.0
