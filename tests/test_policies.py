"""The policy seam: the registry, the one ``route`` function the router and the
simulator share, and the config's validation of a policy and its options."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kvplane.router.config import CostParams, RouterConfig
from kvplane.router.cost import CostModel, PodLoad
from kvplane.router.index.base import Blocks, IndexUnavailable, PrefixMatches
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.policies import (
    Decision,
    Reason,
    RoutingInput,
    labelled,
    make_policy,
    options_model,
    policy_names,
    route,
)
from kvplane.router.policies.sticky import index_down
from kvplane.router.tiers import Tier
from pydantic import ValidationError

MODEL = CostModel(CostParams(), 16, 1000)
LOADS = {"a": PodLoad(), "b": PodLoad(), "c": PodLoad()}


def test_every_policy_module_is_registered_cost_first() -> None:
    names = policy_names()
    assert names[0] == "cost"
    assert {"round_robin", "least_loaded", "sticky", "prefix_affinity"} <= set(names)
    assert labelled()["kvplane"] == "cost"
    assert labelled()["kvplane-prefix_affinity"] == "prefix_affinity"


@pytest.mark.parametrize("name", policy_names())
def test_each_policy_ranks_every_candidate(name: str) -> None:
    policy = make_policy(name, MODEL)
    assert policy.name == name
    inp = RoutingInput(100, list(range(100)), [1, 2, 3, 4, 5, 6], LOADS, {})
    d = policy.choose(inp)
    assert sorted(d.ranked) == ["a", "b", "c"] and d.pod == d.ranked[0]


def test_unknown_policy_and_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'fastest'.*cost"):
        make_policy("fastest", MODEL)
    base = {"model": {"name": "m", "tokenizer": "/t"}}
    with pytest.raises(ValidationError, match="unknown policy"):
        RouterConfig.model_validate({**base, "policy": "fastest"})
    with pytest.raises(ValidationError, match="saturation_tokens"):
        RouterConfig.model_validate(
            {**base, "policy": "prefix_affinity", "policy_options": {"saturation_tokens": -1}}
        )
    with pytest.raises(ValidationError, match="extra"):
        RouterConfig.model_validate({**base, "policy": "cost", "policy_options": {"x": 1}})
    ok = RouterConfig.model_validate(
        {**base, "policy": "prefix_affinity", "policy_options": {"saturation_tokens": 10}}
    )
    assert options_model(ok.policy).model_validate(ok.policy_options)


class _DownIndex(MemoryIndex):
    """An index whose lookups the guard gave up on (a real stall: test_router_api)."""

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        raise IndexUnavailable("test")


async def test_route_asks_the_index_only_for_policies_that_use_it() -> None:
    index = MemoryIndex()
    await index.begin_incarnation("b", "i1")
    await index.store("b", "i1", Blocks.of_prompt([1, 2, 3]), Tier.HBM)
    inp = RoutingInput(3 * 16 + 1, list(range(49)), [1, 2, 3], LOADS)

    def fallback(i: RoutingInput) -> Decision:
        return index_down(MODEL, i)

    d, matches = await route(make_policy("cost", MODEL), index, inp, fallback)
    assert d.pod == "b" and matches is not None and matches["b"][Tier.HBM] == 3
    d, matches = await route(make_policy("round_robin", MODEL), index, inp, fallback)
    assert matches is None and d.reason == "round_robin"
    # an index that cannot answer: sticky hashing, the same pod for the same prefix
    down = _DownIndex()
    d1, m1 = await route(make_policy("cost", MODEL), down, inp, fallback)
    d2, _ = await route(make_policy("cost", MODEL), down, inp, fallback)
    assert m1 is None and d1.reason == Reason.INDEX_DOWN and d1.pod == d2.pod
