"""Shared heads: a cached part that other prompts continued differently makes a prompt
a new prefix (``cost.shared_head_share``), its own conversation's history does not."""

from __future__ import annotations

from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.config import CostParams
from kvplane.router.cost import CostModel, PodLoad
from kvplane.router.index.base import deepest_held
from kvplane.router.policies.base import Policy, RoutingInput
from kvplane.router.policies.branches import BranchPoints, after_shared_head
from kvplane.router.policies.registry import make_policy
from kvplane.router.tiers import Tier

ROOT = generation_root("gen-a")
BLOCK = 10
P = CostParams(
    prefill_tokens_per_s=10000.0,
    running_step_ms_per_request=0.0,
    prefill_attention_ms_per_mpair=0.0,
)


def test_a_head_is_shared_once_two_prompts_continue_it_differently() -> None:
    b = BranchPoints()
    assert not b.shared(1, 10)  # first seen
    assert not b.shared(1, 10)  # the same continuation (a retry, the same prompt again)
    assert b.shared(1, 11)  # another continuation
    assert b.shared(1, 10)  # and it stays shared
    assert not b.shared(2, 20)


def test_branch_points_are_bounded_least_recently_seen_first() -> None:
    b = BranchPoints(max_heads=2)
    b.shared(1, 10)
    b.shared(2, 20)
    b.shared(1, 10)  # 1 is now the most recent
    b.shared(3, 30)  # evicts 2
    assert len(b) == 2
    assert not b.shared(2, 21)  # forgotten: seen afresh
    assert b.shared(3, 31)


def test_only_a_prompt_that_goes_on_past_what_pods_hold_is_noted() -> None:
    b = BranchPoints()
    keys = [5, 6, 7]
    assert deepest_held(None) == 0 and deepest_held({"a": {Tier.HBM: 1, Tier.DRAM: 2}}) == 2
    assert not after_shared_head(b, keys, 0)  # nothing held: no head
    assert not after_shared_head(b, keys, 3)  # all held: no continuation
    assert len(b) == 0
    assert not after_shared_head(b, keys, 2)
    assert after_shared_head(b, [5, 6, 8], 2)


def _route(
    policy: Policy, tokens: list[int], held: dict[str, int], loads: dict[str, PodLoad]
) -> str:
    keys = block_keys(tokens, BLOCK, ROOT)
    matches = {p: {t: n for t in Tier} for p, n in held.items()}
    inp = RoutingInput(len(tokens), tokens, keys, loads, matches=matches)
    return policy.choose(inp).pod


def test_conversations_under_a_shared_system_prompt_spread() -> None:
    """A third of each first turn is a system prompt cached on one pod: the first
    conversation follows it there, the next (another continuation of the same head)
    is a new prefix and goes where less prefill went lately."""
    system = list(range(1000, 1100))  # 10 blocks
    loads = {
        "hot": PodLoad(recent_prefill_tokens=50_000.0),
        "cold": PodLoad(recent_prefill_tokens=1_000.0),
    }
    held = {"hot": 10, "cold": 0}
    user1 = system + list(range(2000, 2200))  # 300 tokens, a third cached
    user2 = system + list(range(3000, 3200))
    policy = make_policy("cost", CostModel(P, BLOCK, 1000))
    assert _route(policy, user1, held, loads) == "hot"  # the head is nobody else's yet
    assert _route(policy, user2, held, loads) == "cold"
    # the first conversation's next turn holds most of its prompt on hot: it stays
    turn2 = user1 + list(range(4000, 4100))
    assert _route(policy, turn2, {"hot": 30, "cold": 0}, loads) == "hot"
    # off, the weighted recompute keeps every conversation with the head
    off_params = P.model_copy(update={"shared_head_share": 0.0})
    off = make_policy("cost", CostModel(off_params, BLOCK, 1000))
    assert _route(off, user1, held, loads) == "hot"
    assert _route(off, user2, held, loads) == "hot"


def test_a_conversations_own_history_is_not_a_shared_head() -> None:
    """A turn continuing the conversation whose history one pod holds (under half of the
    prompt) stays there: only this conversation ever continued that history."""
    history = list(range(5000, 5200))  # 20 blocks
    loads = {
        "hot": PodLoad(recent_prefill_tokens=50_000.0),
        "cold": PodLoad(recent_prefill_tokens=1_000.0),
    }
    policy = make_policy("cost", CostModel(P, BLOCK, 1000))
    turn = history + list(range(6000, 6300))  # 200 of 500 tokens held: 40 %
    assert _route(policy, turn, {"hot": 20, "cold": 0}, loads) == "hot"
