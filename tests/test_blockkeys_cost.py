"""Pure parts of routing: block keys, the cost formula, the policies."""

from __future__ import annotations

from dataclasses import replace

import pytest
from kvplane.router.blockkeys import block_keys, chain_keys, generation_root
from kvplane.router.config import (
    Backend,
    CostParams,
    LinkClass,
    LinkCost,
    PeerPullSpec,
    SharedStoreSpec,
    TierCost,
)
from kvplane.router.cost import CostModel, PeerOffer, PodLoad, peer_offers
from kvplane.router.engine_stats import EngineStats
from kvplane.router.generation import generation_tag
from kvplane.router.load import Attempt
from kvplane.router.policies.cost import CostReason as Reason
from kvplane.router.policies.cost import choose_by_cost, over_cap
from kvplane.router.policies.sticky import sticky_order
from kvplane.router.pool import BackendState
from kvplane.router.shared import SharedStores
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.tiers import Tier

ROOT = generation_root("gen-a")


def test_equal_prefixes_give_equal_keys_and_partial_blocks_none() -> None:
    a = block_keys(list(range(100)), 16, ROOT)
    b = block_keys([*range(64), 999, *range(65, 90)], 16, ROOT)
    assert len(a) == 6 and len(b) == 5
    assert a[:4] == b[:4] and a[4] != b[4]


def test_generations_never_share_keys() -> None:
    toks = list(range(64))
    assert not set(block_keys(toks, 16, ROOT)) & set(block_keys(toks, 16, generation_root("b")))
    assert generation_tag("m", "r1", "t", 16) != generation_tag("m", "r2", "t", 16)
    assert generation_tag("m", "r", "t", 16) != generation_tag("m", "r", "t", 32)
    assert generation_tag("m", "r", "t", 16, pool="a/x") != generation_tag(
        "m", "r", "t", 16, pool="b/x"
    )


def test_chaining_from_a_parent_continues_the_chain() -> None:
    toks = list(range(96))
    keys = block_keys(toks, 16, ROOT)
    assert chain_keys(toks[32:], 16, keys[1]) == keys[2:]
    assert chain_keys(toks, 16, keys[1], start_block=2) == keys[2:]


P = CostParams(
    prefill_tokens_per_s=10000.0,
    running_step_ms_per_request=0.0,
    prefill_attention_ms_per_mpair=0.0,
)  # linear prefill: the attention term has its own tests below
M = CostModel(P, 10, 1000)  # block size 10, 1000 bytes per token


def match(h: int = 0, d: int = 0, n: int = 0, r: int = 0) -> dict[Tier, int]:
    return {
        Tier.HBM: h,
        Tier.DRAM: max(h, d),
        Tier.NVME: max(h, d, n),
        Tier.REMOTE: max(h, d, n, r),
    }


def test_recompute_time_of_missing_tokens() -> None:
    t = M.predict("p", 1000, match(), PodLoad())
    assert t.recompute_ms == pytest.approx(100.0) and t.cached_tokens == 0
    t = M.predict("p", 1000, match(h=50), PodLoad())
    assert t.cached_tokens == 500 and t.recompute_ms == pytest.approx(50.0)


def test_whole_prompt_resident_still_computes_the_last_token() -> None:
    t = M.predict("p", 100, match(h=10), PodLoad())
    assert t.cached_tokens == 99 and t.recompute_ms == pytest.approx(0.1)


def test_transfer_when_cheaper_recompute_when_not() -> None:
    fast = P.model_copy(update={"tiers": {Tier.DRAM: TierCost(bandwidth_gbps=100.0)}})
    t = CostModel(fast, 10, 128 * 1024).predict("p", 1000, match(d=100), PodLoad())
    assert t.loaded_from == {Tier.DRAM: 999} and t.transfer_ms < 2.0
    slow = P.model_copy(update={"tiers": {Tier.DRAM: TierCost(bandwidth_gbps=0.01)}})
    t = CostModel(slow, 10, 128 * 1024).predict("p", 1000, match(d=100), PodLoad())
    assert t.loaded_from == {} and t.transfer_ms == 0 and t.recompute_ms == pytest.approx(100.0)


def test_an_unconfigured_tier_is_never_loaded() -> None:
    none = P.model_copy(update={"tiers": {}})
    t = CostModel(none, 10, 1000).predict("p", 1000, match(r=100), PodLoad())
    assert t.cached_tokens == 0


def test_queue_counts_pending_tokens_and_unseen_waiting() -> None:
    # the scrape saw 3 waiting while the router had 1 pending: 2 came from elsewhere
    load = PodLoad(
        pending_prefill_tokens=2000,
        pending_requests=1,
        engine_waiting=3,
        scraped_pending_requests=1,
    )
    t = M.predict("p", 10, match(), replace(load, mean_request_tokens=500))
    assert t.queue_ms == pytest.approx((2000 + 2 * 500) / 10000 * 1000)
    hot = M.predict("p", 10, match(), PodLoad(kv_usage=0.95, mean_request_tokens=500))
    assert hot.queue_ms == pytest.approx(P.kv_pressure_penalty_ms)


def test_a_stale_scrape_of_the_routers_own_requests_adds_no_queue() -> None:
    """The scrape saw the router's 3 requests waiting; they have started since (nothing
    pending now). Compared with pending now, they would be 3 phantom prompts."""
    load = PodLoad(engine_waiting=3, scraped_pending_requests=3)
    assert M.predict("p", 10, match(), replace(load, mean_request_tokens=500)).queue_ms == 0.0
    state = BackendState(Backend(name="p", url="http://p"))
    sent = [Attempt(state, 10, 0.0, 10) for _ in range(3)]
    for attempt in sent:
        attempt.begin()
    state.observe(EngineStats(waiting=3.0))
    for attempt in sent:
        attempt.first()
    assert state.pending_requests == 0
    assert state.load(1024.0, now=0.0).scraped_pending_requests == 3


def test_a_stale_scrape_of_the_routers_finished_requests_counts_them_no_more() -> None:
    """The scrape saw the router's 2 requests running; one has ended since: the pod
    runs at most one (a request the scrape never saw still counts by the router's own)."""

    state = BackendState(Backend(name="p", url="http://p"))
    attempts = [Attempt(state, 10, 0.0, 10) for _ in range(2)]
    for a in attempts:
        a.begin()
        a.first()
    state.observe(EngineStats(running=2.0))
    attempts[0].end()
    assert state.load(1024.0, now=0.0).engine_running == 1.0
    attempts[1].end()
    assert state.load(1024.0, now=0.0).engine_running == 0.0
    state.observe(EngineStats(running=1.0))  # someone else's request: counted again
    assert state.load(1024.0, now=0.0).engine_running == 1.0


def test_cost_prefers_the_cached_pod_until_its_queue_costs_more() -> None:
    loads = {"a": PodLoad(), "b": PodLoad()}
    d = choose_by_cost(M, 2000, {"a": match(h=150), "b": match()}, loads)
    assert d.pod == "a" and d.reason == Reason.CACHE and d.ranked == ["a", "b"]
    busy = {
        "a": PodLoad(pending_prefill_tokens=50_000, pending_requests=3, inflight=3),
        "b": PodLoad(),
    }
    d = choose_by_cost(M, 2000, {"a": match(h=150), "b": match()}, busy)
    assert d.pod == "b" and d.reason == Reason.LOAD_OVER_CACHE


def test_recompute_weight_keeps_a_prefix_on_its_pod_through_a_moderate_queue() -> None:
    # P's rate is 10k tok/s: b must compute all 2000 tokens (200 ms) but starts at once; a
    # holds 1500 of them (50 ms left) behind a 300 ms queue. Plain TTFT picks b; weighting
    # recompute (it also delays everyone queued behind it on b) keeps the prompt with its
    # prefix.
    loads = {"a": PodLoad(pending_prefill_tokens=3000, pending_requests=1, inflight=1)}
    loads["b"] = PodLoad()
    plain = P.model_copy(update={"recompute_weight": 1.0})
    d = choose_by_cost(CostModel(plain, 10, 1000), 2000, {"a": match(h=150), "b": match()}, loads)
    assert d.pod == "b" and d.terms["b"].ttft_ms < d.terms["a"].ttft_ms
    weighted = P.model_copy(update={"recompute_weight": 4.0})
    d = choose_by_cost(
        CostModel(weighted, 10, 1000), 2000, {"a": match(h=150), "b": match()}, loads
    )
    assert d.pod == "a" and d.reason == Reason.CACHE
    # the predicted TTFT itself is unchanged: the weight only ranks
    assert d.terms["b"].recompute_ms == pytest.approx(200.0)


def test_near_ties_go_to_the_pod_sent_the_least_work_lately() -> None:
    # nobody holds the prompt and the queues are (almost) equal: a placement that only
    # looked at the queue would pick "a" every time; recent work says "b" is the emptier
    loads = {
        "a": PodLoad(recent_prefill_tokens=50_000),
        "b": PodLoad(pending_prefill_tokens=10, pending_requests=1, inflight=1),
        "c": PodLoad(recent_prefill_tokens=20_000),
    }
    d = choose_by_cost(M, 2000, {}, loads)
    assert d.pod == "b" and set(d.ranked) == {"a", "b", "c"}
    # outside the band the cost decides: a pod holding the prefix is not traded for balance
    d = choose_by_cost(M, 2000, {"a": match(h=150)}, loads)
    assert d.pod == "a" and d.reason == Reason.CACHE


def test_load_cap_stops_a_shared_first_block_from_herding() -> None:
    loads = {"a": PodLoad(inflight=20), "b": PodLoad(inflight=1), "c": PodLoad(inflight=0)}
    assert over_cap(loads, P) == {"a"}
    d = choose_by_cost(
        CostModel(P, 10, 1), 200, {"a": match(h=19), "b": match(), "c": match()}, loads
    )
    assert d.pod != "a" and d.reason == Reason.LOAD_CAP and d.ranked[-1] == "a"


def test_sticky_order_is_stable_and_minimally_disrupted() -> None:
    pods = [f"p{i}" for i in range(5)]
    firsts = {a: sticky_order(a, pods)[0] for a in range(200)}
    assert len(set(firsts.values())) == 5
    fewer = [p for p in pods if p != "p2"]
    for a, first in firsts.items():
        if first != "p2":
            assert sticky_order(a, fewer)[0] == first


def test_a_shared_store_loads_at_its_link_for_its_readers_only() -> None:
    """The remote tier of a store's reader costs the store's link; a pod outside the store
    keeps the default remote tier."""
    store = SharedStoreSpec(name="s", pods=["a"], link=TierCost(bandwidth_gbps=100.0))
    slow = P.model_copy(update={"tiers": {Tier.REMOTE: TierCost(bandwidth_gbps=0.01)}})
    model = CostModel(slow, 10, 128 * 1024, SharedStores.of([store]))
    t = model.predict("a", 1000, match(r=100), PodLoad())
    assert t.loaded_from == {Tier.REMOTE: 999} and t.store == "s"
    assert t.loaded_ms[Tier.REMOTE] == pytest.approx(999 * 128 * 1024 / 100e9 * 1000)
    t = model.predict("b", 1000, match(r=100), PodLoad())
    assert t.loaded_from == {} and t.store is None  # 0.01 GB/s: recompute is faster
    far = store.model_copy(
        update={"pods": ["a", "c"], "pod_links": {"c": TierCost(bandwidth_gbps=10.0)}}
    )
    remote = CostModel(slow, 10, 128 * 1024, SharedStores.of([far])).predict(
        "c", 1000, match(r=100), PodLoad()
    )
    assert remote.loaded_ms[Tier.REMOTE] == pytest.approx(999 * 128 * 1024 / 10e9 * 1000)
    d = choose_by_cost(
        model, 1000, {"a": match(r=100), "b": match(r=100)}, {"a": PodLoad(), "b": PodLoad()}
    )
    assert d.pod == "a" and d.reason == Reason.SHARED


def test_a_peer_pull_is_costed_against_loading_and_recompute() -> None:
    """Pulling a's prefix into b beats recomputing it; a local tier that is faster
    still wins; without peer_pull configured nothing is pulled."""
    link = LinkCost(bandwidth_gbps=40.0, latency_ms=0.2)
    model = replace(M, peer_pull=PeerPullSpec(link=link))
    t = model.predict("b", 1000, match(h=10), PodLoad(), peers=[PeerOffer("a", 100)])
    assert t.peer == "a" and t.peer_tokens == 899 and t.cached_tokens == 999
    assert t.peer_ms == pytest.approx(0.2 + 899 * M.kv_bytes_per_token / 40e9 * 1000)
    assert t.transfer_ms == t.peer_ms and t.recompute_ms == pytest.approx(0.1)
    fast = replace(
        model, params=P.model_copy(update={"tiers": {Tier.DRAM: TierCost(bandwidth_gbps=1000.0)}})
    )
    t = fast.predict("b", 1000, match(d=100), PodLoad(), peers=[PeerOffer("a", 100)])
    assert t.peer is None and t.loaded_from == {Tier.DRAM: 999}
    assert M.predict("b", 1000, match(), PodLoad(), peers=[PeerOffer("a", 100)]).peer is None
    # the policy offers each pod the best other pod's HBM-or-DRAM prefix
    busy = PodLoad(pending_prefill_tokens=100_000, pending_requests=5, inflight=5)
    d = choose_by_cost(model, 2000, {"a": match(h=150), "b": match()}, {"a": busy, "b": PodLoad()})
    assert d.pod == "b" and d.reason == Reason.PEER and d.terms["b"].peer == "a"
    assert peer_offers({"a": match(d=5), "b": match(h=3), "c": match()}, ["a", "b", "c"]) == {
        "a": [PeerOffer("b", 3)],
        "b": [PeerOffer("a", 5)],
        "c": [PeerOffer("a", 5)],
    }


NODE = LinkCost(bandwidth_gbps=400.0, latency_ms=0.05)
NIC = LinkCost(bandwidth_gbps=5.0, latency_ms=0.5)
FAR = LinkCost(bandwidth_gbps=1.0, latency_ms=2.0)


def test_a_peer_pull_goes_over_its_pairs_link_class() -> None:
    """`peer_pull.link` is every class's link until `links` names the class; a pull is
    costed at the link of the pair's class."""
    one = PeerPullSpec(link=NIC)
    assert {one.link_for(c) for c in LinkClass} == {NIC}
    per = PeerPullSpec(link=NIC, links={LinkClass.SAME_NODE: NODE, LinkClass.CROSS_ZONE: FAR})
    assert per.link_for(LinkClass.SAME_NODE) == NODE and per.link_for(LinkClass.SAME_ZONE) == NIC
    model = replace(M, peer_pull=per)
    for cls, link in ((LinkClass.SAME_NODE, NODE), (LinkClass.CROSS_ZONE, FAR)):
        t = model.predict("b", 1000, match(), PodLoad(), peers=[PeerOffer("a", 100, cls)])
        assert t.peer == "a" and t.peer_link is cls and t.peer_tokens == 999
        assert t.peer_ms == pytest.approx(
            link.latency_ms + 999 * 1000 / (link.bandwidth_gbps * 1e6)
        )
    # a link slower than prefill: recomputing wins
    crawl = replace(model, peer_pull=PeerPullSpec(link=LinkCost(bandwidth_gbps=0.001)))
    assert crawl.predict("b", 1000, match(), PodLoad(), peers=[PeerOffer("a", 100)]).peer is None


def test_peer_offers_give_the_longest_holder_of_each_link_class() -> None:
    """Per puller, one offer per class of link from it: the longest holder of that class,
    itself excluded (ties by name); a holder on the puller's node is same_node, one in
    another labelled zone cross_zone, the rest same_zone."""
    labels = {
        "a": {"node": "n1", "zone": "z1"},
        "b": {"node": "n1", "zone": "z1"},
        "c": {"node": "n2", "zone": "z1"},
        "d": {"node": "n3", "zone": "z2"},
        "e": {"node": "n2", "zone": "z1"},
    }
    matches = {"a": match(h=90), "b": match(d=95), "c": match(h=100), "d": match(h=120)}
    offers = peer_offers(matches, list(labels), labels)
    same = LinkClass.SAME_NODE
    assert sorted(offers["a"], key=lambda o: o.link) == [
        PeerOffer("d", 120, LinkClass.CROSS_ZONE),
        PeerOffer("b", 95, same),
        PeerOffer("c", 100, LinkClass.SAME_ZONE),
    ]
    assert PeerOffer("b", 95, same) in offers["a"] and PeerOffer("a", 90, same) in offers["b"]
    # c's own node holds nothing but c: no same_node offer for c, c's for e
    assert {o.link for o in offers["c"]} == {LinkClass.SAME_ZONE, LinkClass.CROSS_ZONE}
    assert PeerOffer("c", 100, same) in offers["e"]
    # d is alone in z2: every other holder is across zones, the longest is c
    assert offers["d"] == [PeerOffer("c", 100, LinkClass.CROSS_ZONE)]
    # no labels: one zone, different nodes
    assert peer_offers(matches, ["a", "c"]) == {
        "a": [PeerOffer("c", 100, LinkClass.SAME_ZONE)],
        "c": [PeerOffer("a", 90, LinkClass.SAME_ZONE)],
    }
    # given the links, an offer no longer than one over a link as fast is left out
    per = PeerPullSpec(link=NIC, links={LinkClass.SAME_NODE: NODE, LinkClass.CROSS_ZONE: NIC})
    pruned = peer_offers(matches, list(labels), labels, per)
    assert pruned["a"] == [PeerOffer("d", 120, LinkClass.CROSS_ZONE), PeerOffer("b", 95, same)]
    assert pruned["e"] == [PeerOffer("d", 120, LinkClass.CROSS_ZONE), PeerOffer("c", 100, same)]
    # one link for every class: the longest other holder, its class named
    assert peer_offers(matches, list(labels), labels, PeerPullSpec(link=NIC)) == {
        "a": [PeerOffer("d", 120, LinkClass.CROSS_ZONE)],
        "b": [PeerOffer("d", 120, LinkClass.CROSS_ZONE)],
        "c": [PeerOffer("d", 120, LinkClass.CROSS_ZONE)],
        "d": [PeerOffer("c", 100, LinkClass.CROSS_ZONE)],
        "e": [PeerOffer("d", 120, LinkClass.CROSS_ZONE)],
    }


def test_a_same_node_holder_with_fewer_blocks_beats_a_longer_one_across_the_nic() -> None:
    """The policy costs each class's holder at its pair's link and keeps the cheapest pull
    plus recompute: b pulls 950 tokens from a on its node, not 1000 from c across the
    NIC (26 ms for 128 KiB a token against 5 ms of recomputing the 50 more); with one
    link for every pair it pulls the longest prefix, c's."""
    labels = {"a": {"node": "n1"}, "b": {"node": "n1"}, "c": {"node": "n2"}}
    per = PeerPullSpec(link=NIC, links={LinkClass.SAME_NODE: NODE})
    big = replace(M, kv_bytes_per_token=128 * 1024)
    busy = PodLoad(pending_prefill_tokens=100_000, pending_requests=5, inflight=5)
    loads = {"a": busy, "b": PodLoad(), "c": busy}
    matches = {"a": match(h=95), "b": match(), "c": match(h=100)}
    d = choose_by_cost(replace(big, peer_pull=per), 1001, matches, loads, labels=labels)
    t = d.terms["b"]
    assert d.pod == "b" and d.reason == Reason.PEER
    assert (t.peer, t.peer_link, t.peer_tokens) == ("a", LinkClass.SAME_NODE, 950)
    assert t.recompute_ms == pytest.approx(51 / P.prefill_tokens_per_s * 1000)
    d = choose_by_cost(replace(big, peer_pull=PeerPullSpec(link=NIC)), 1001, matches, loads)
    t = d.terms["b"]
    assert (d.pod, t.peer, t.peer_link, t.peer_tokens) == ("b", "c", LinkClass.SAME_ZONE, 1000)


def test_the_tier_metrics_count_a_peer_pull_as_its_own_source() -> None:
    model = replace(M, peer_pull=PeerPullSpec(link=LinkCost(bandwidth_gbps=40.0, latency_ms=0.2)))
    terms = model.predict("b", 1000, match(h=10), PodLoad(), peers=[PeerOffer("a", 100)])
    metrics = RouterMetrics("p", "m")
    metrics.chose(terms, None)

    def value(name: str, tier: str) -> float | None:
        labels = {"pool": "p", "model": "m", "tier": tier}
        return metrics.registry.get_sample_value(name, labels)

    assert value("kvplane_router_tier_hit_tokens_total", "peer") == 899
    assert value("kvplane_router_tier_hit_tokens_total", "hbm") == 100
    assert value("kvplane_router_tier_loads_total", "peer") == 1
    assert value("kvplane_router_tier_load_seconds_sum", "peer") == pytest.approx(
        terms.peer_ms / 1000
    )


QUAD = P.model_copy(update={"prefill_attention_ms_per_mpair": 2.0})  # 2 ms per 1e6 pairs


def test_prefill_attention_grows_with_context() -> None:
    """n new tokens after c cached cost n / rate plus n x (c + n/2) attention pairs."""
    m = CostModel(QUAD, 10, 1000)
    cold = m.predict("p", 10_000, match(), PodLoad())
    assert cold.recompute_ms == pytest.approx(1000.0 + 10_000 * 5_000 * 2.0 / 1e6)
    warm = m.predict("p", 10_000, match(h=500), PodLoad())  # 5000 resident
    assert warm.recompute_ms == pytest.approx(500.0 + 5_000 * (5_000 + 2_500) * 2.0 / 1e6)
    # the same tokens after a longer context cost more: attention reads the context
    assert warm.recompute_ms > m.predict("p", 5_000, match(), PodLoad()).recompute_ms


MQ = CostModel(P.model_copy(update={"queue_progress": True}), 10, 1000)


class _Clock:
    """A clock the test sets: the pool's load accounting reads it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_pod_half_through_its_pending_prefill_predicts_half_the_wait() -> None:
    """With queue_progress, the pod runs its pending prefills in order: the queue is what
    was sent less the time it has been on the oldest one, at most that one's work until
    its first token comes (P: 10,000 tokens/s, so 2,000 tokens are 200 ms)."""
    from kvplane.router.pool import Pool

    clock = _Clock()
    pool = Pool(clock=clock)
    pool.set_backends([Backend(name="p", url="http://p")])
    state = pool.states["p"]

    def queue() -> float:
        return MQ.predict("p", 10, match(), pool.loads(["p"])["p"]).queue_ms

    a, b, c = (Attempt(state, n, clock.now, n) for n in (2000, 1000, 500))
    a.begin()
    clock.now = 0.1
    assert queue() == pytest.approx(100.0)  # half of a's 200 ms done
    off = M.predict("p", 10, match(), pool.loads(["p"])["p"]).queue_ms
    assert off == pytest.approx(200.0)  # off (the default): all of it queued
    b.begin()  # sent behind a: the pod is still on a
    assert queue() == pytest.approx(100.0 + 100.0)
    clock.now = 0.25
    assert queue() == pytest.approx(100.0)  # a predicted done, but not b before a is
    c.begin()
    clock.now = 0.3
    b.first()  # out of order: the pod is still on a
    assert queue() == pytest.approx(50.0)
    a.first()  # the pod moves on to c now
    assert queue() == pytest.approx(50.0)
    clock.now = 0.32
    assert queue() == pytest.approx(30.0)
    clock.now = 1.0
    assert queue() == 0.0  # predicted done, its first token still to come
    c.end()
    a.end()
    b.end()
    clock.now = 2.0
    assert queue() == 0.0 and state.prefill_busy_s(clock.now) == 0.0
    Attempt(state, 2000, clock.now, 2000).begin()  # an idle pod starts on it when sent
    assert queue() == pytest.approx(200.0)
    # the pure formula: the time on the head comes off, never more than the head's work
    busy = PodLoad(
        pending_prefill_tokens=3000,
        pending_requests=2,
        head_prefill=(2000, 0.0),
        prefill_busy_s=0.05,
    )
    assert MQ.predict("p", 10, match(), busy).queue_ms == pytest.approx(250.0)
    done = replace(busy, prefill_busy_s=5.0)
    assert MQ.predict("p", 10, match(), done).queue_ms == pytest.approx(100.0)


def test_a_scrape_still_counts_the_waiting_it_reports_beyond_the_routers_own() -> None:
    """With queue_progress, requests the engine reported waiting beyond the router's
    pending at the scrape are queued in full at the mean prompt (the router never saw
    them start); the next scrape that no longer reports them takes them off."""
    from kvplane.router.pool import Pool

    clock = _Clock()
    pool = Pool(clock=clock)
    pool.set_backends([Backend(name="p", url="http://p")])
    state = pool.states["p"]
    pool.mean_request_tokens = 500.0  # 50 ms each

    def queue() -> float:
        return MQ.predict("p", 10, match(), pool.loads(["p"])["p"]).queue_ms

    Attempt(state, 2000, clock.now, 2000).begin()
    state.observe(EngineStats(waiting=3.0))  # the router's one and two from elsewhere
    clock.now = 0.1
    assert queue() == pytest.approx(100.0 + 2 * 50.0)
    clock.now = 0.15
    state.observe(EngineStats(waiting=1.0))  # only the router's own now
    assert queue() == pytest.approx(50.0)


def test_one_long_pending_prompt_queues_longer_than_short_ones_of_its_size() -> None:
    from kvplane.router.cost import pending_prefill_ms
    from kvplane.router.load import Attempt, LoadCounters

    long, short = LoadCounters(), LoadCounters()
    Attempt(long, 40_000, 0.0, 40_000).begin()
    attempts = [Attempt(short, 4_000, 0.0, 4_000) for _ in range(10)]
    for a in attempts:
        a.begin()
    assert long.pending_tokens == short.pending_tokens == 40_000
    as_load = [
        PodLoad(pending_prefill_tokens=c.pending_tokens, pending_prefill_pairs=c.pending_pairs)
        for c in (long, short)
    ]
    long_ms, short_ms = (pending_prefill_ms(ld, QUAD) for ld in as_load)
    assert long_ms == pytest.approx(4000.0 + 40_000 * 20_000 * 2.0 / 1e6)
    assert short_ms == pytest.approx(4000.0 + 10 * 4_000 * 2_000 * 2.0 / 1e6)
    assert long_ms > short_ms
    # a cached prefix makes the pending prefill's attention longer, not its tokens more
    warm = LoadCounters()
    Attempt(warm, 1_000, 0.0, 9_000).begin()
    assert warm.pending_pairs == pytest.approx(1_000 * (8_000 + 500))
    for a in attempts:
        a.first()
    assert short.pending_pairs == 0.0 and short.pending_tokens == 0


def test_tail_guard_keeps_a_request_from_waiting_behind_a_long_queue_for_its_prefix() -> None:
    """The weighted score values reuse above a request's own TTFT; the guard, when set,
    bounds that trade while an idle pod could start the prompt at once."""
    loads = {
        "a": PodLoad(pending_prefill_tokens=80_000, pending_requests=1, inflight=1),
        "b": PodLoad(),
    }
    keys = {"a": match(h=1990), "b": match()}
    guarded = CostModel(P.model_copy(update={"tail_guard": 2.0}), 10, 1000)
    d = choose_by_cost(guarded, 20_000, keys, loads)  # a's queue is 8 s, b recomputes 2 s
    assert d.terms["a"].ttft_ms > 2.0 * d.terms["b"].ttft_ms + 2000.0
    assert d.pod == "b" and d.reason == Reason.TAIL_GUARD and d.ranked == ["b", "a"]
    # off by default: the weight (6 x 2 s of recompute) keeps it with its prefix
    assert choose_by_cost(M, 20_000, keys, loads).pod == "a"
    # a busy fastest pod leaves the weight to decide: recompute there delays its queue
    loads["b"] = PodLoad(pending_prefill_tokens=1_000, pending_requests=1, inflight=1)
    assert choose_by_cost(guarded, 20_000, keys, loads).pod == "a"
    # within the slack the weight decides too: a short queue is worth a prefix
    near = {"a": PodLoad(pending_prefill_tokens=4_000, pending_requests=1, inflight=1)}
    near["b"] = PodLoad()
    assert choose_by_cost(guarded, 2_000, {"a": match(h=190), "b": match()}, near).pod == "a"


def test_a_new_prefix_spreads_instead_of_following_a_short_common_head() -> None:
    """A prompt of which no pod holds new_prefix_share goes to the pod sent the least
    prefill lately among those about as fast: a shared system prompt cached on one pod
    does not pull every new conversation there (its follow-ups then find it spread)."""
    loads = {
        "hot": PodLoad(recent_prefill_tokens=500_000.0),
        "cold": PodLoad(recent_prefill_tokens=1_000.0),
    }
    keys = {"hot": match(h=10), "cold": match()}  # 100 of 1000 tokens: a 10 % head
    # off: the weight keeps it with the head (6 x 10 ms of recompute saved)
    off = CostModel(P.model_copy(update={"new_prefix_share": 0.0}), 10, 1000)
    assert choose_by_cost(off, 1000, keys, loads).pod == "hot"
    spread = CostModel(P.model_copy(update={"new_prefix_share": 0.25}), 10, 1000)
    d = choose_by_cost(spread, 1000, keys, loads)
    assert d.pod == "cold" and d.ranked == ["cold", "hot"]
    # a prompt that is mostly cached somewhere is not new: it stays with its prefix
    assert choose_by_cost(spread, 1000, {"hot": match(h=60), "cold": match()}, loads).pod == "hot"
    # nor does a new prefix go to a pod much slower than the fastest
    busy = {**loads, "cold": PodLoad(pending_prefill_tokens=20_000, pending_requests=1)}
    assert choose_by_cost(spread, 1000, keys, busy).pod == "hot"
