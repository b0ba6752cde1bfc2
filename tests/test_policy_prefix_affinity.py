"""The prefix-affinity-until-saturated baseline: the pod holding the longest prefix
keeps the request until its queued prefill passes the threshold."""

from __future__ import annotations

from kvplane.router.config import CostParams
from kvplane.router.cost import CostModel, PodLoad
from kvplane.router.policies import RoutingInput, make_policy
from kvplane.router.tiers import Tier

MODEL = CostModel(CostParams(), 16, 1000)


def choose(loads: dict[str, PodLoad], held: dict[str, int], limit: int = 1000) -> tuple[str, str]:
    policy = make_policy("prefix_affinity", MODEL, {"saturation_tokens": limit})
    matches = {p: {Tier.HBM: n} for p, n in held.items()}
    d = policy.choose(RoutingInput(500, list(range(500)), list(range(31)), loads, matches))
    assert sorted(d.ranked) == sorted(loads) and d.ranked[0] == d.pod
    return d.pod, d.reason


def test_the_longest_prefix_wins_even_against_an_idle_pod() -> None:
    loads = {"a": PodLoad(), "b": PodLoad(pending_prefill_tokens=900, inflight=3)}
    assert choose(loads, {"a": 2, "b": 10}) == ("b", "prefix_affinity")


def test_a_saturated_holder_gives_way_to_the_least_loaded() -> None:
    loads = {
        "a": PodLoad(inflight=2),
        "b": PodLoad(pending_prefill_tokens=1000, inflight=3),
        "c": PodLoad(inflight=1),
    }
    assert choose(loads, {"b": 10}) == ("c", "prefix_affinity_saturated")
    # requests waiting that the router did not send count at the fleet's mean prompt
    unseen = PodLoad(engine_waiting=2, mean_request_tokens=600)
    assert choose({"a": PodLoad(), "b": unseen}, {"b": 10})[1] == "prefix_affinity_saturated"


def test_without_any_resident_prefix_it_is_least_loaded() -> None:
    loads = {"a": PodLoad(inflight=4), "b": PodLoad(inflight=1)}
    assert choose(loads, {}) == ("b", "prefix_affinity_no_prefix")


def test_equal_prefixes_go_to_the_less_loaded_holder() -> None:
    loads = {"a": PodLoad(inflight=5), "b": PodLoad(inflight=1), "c": PodLoad()}
    assert choose(loads, {"a": 4, "b": 4}) == ("b", "prefix_affinity")
