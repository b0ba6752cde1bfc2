"""Pure parts of P/D routing: link classes from labels, the pair cost, the joint choice."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import replace

import pytest
from kvplane.router.config import CostParams, LinkClass, LinkCost, PDSpec
from kvplane.router.cost import CostModel, PodLoad
from kvplane.router.pd.choice import PDCandidates, PDDecision, PDReason, choose_pd
from kvplane.router.pd.cost import (
    DecodeSide,
    Link,
    PDCostModel,
    aggregated_cost,
    decode_step_ms,
    exposure_ms,
    pair_cost,
)
from kvplane.router.pd.topology import link_class, link_cost, transfer_ms
from kvplane.router.tiers import Tier

BS = 16
KV = 100_000  # bytes per token: 1e9 bytes per 10k tokens keeps the arithmetic readable
P = CostParams(
    prefill_tokens_per_s=10_000.0,  # 0.1 ms per token
    running_step_ms_per_request=0.1,
    decode_step_ms=5.0,
    prefill_attention_ms_per_mpair=0.0,  # linear prefill keeps the arithmetic readable
)
PD = PDSpec(
    links={
        LinkClass.SAME_NODE: LinkCost(bandwidth_gbps=100.0, latency_ms=0.0),
        LinkClass.SAME_ZONE: LinkCost(bandwidth_gbps=10.0, latency_ms=1.0),
        LinkClass.CROSS_ZONE: LinkCost(bandwidth_gbps=1.0, latency_ms=10.0),
    },
    aggregate_max_uncached_tokens=256,
    decode_running_ms=1.0,
    decode_context_ms_per_ktok=0.0,
    decode_kv_weight_ms=10.0,
)
IDLE = PodLoad()


def model(params: CostParams = P, pd: PDSpec = PD) -> PDCostModel:
    return PDCostModel(CostModel(params, BS, KV), pd)


MODEL = model()
MEAN = 1000.0  # the fleet's mean prompt the loads carry


def cands(
    prefill: Mapping[str, PodLoad],
    decode: Mapping[str, PodLoad],
    labels: Mapping[str, Mapping[str, str]],
    alone: Collection[str] = (),
) -> PDCandidates:
    def mean(loads: Mapping[str, PodLoad]) -> dict[str, PodLoad]:
        return {p: replace(ld, mean_request_tokens=MEAN) for p, ld in loads.items()}

    return PDCandidates(mean(prefill), mean(decode), labels, alone)


def hbm(blocks: int) -> dict[Tier, int]:
    return {Tier.HBM: blocks}


def place(node: str, zone: str) -> dict[str, str]:
    return {"node": node, "zone": zone}


# --- topology -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("a", "b", "cls"),
    [
        (place("n1", "z1"), place("n1", "z1"), LinkClass.SAME_NODE),
        (place("n1", "z1"), place("n2", "z1"), LinkClass.SAME_ZONE),
        (place("n1", "z1"), place("n2", "z2"), LinkClass.CROSS_ZONE),
        # the well-known Kubernetes keys work as well as discovery's short ones
        (
            {"kubernetes.io/hostname": "n1"},
            {"kubernetes.io/hostname": "n1", "topology.kubernetes.io/zone": "z9"},
            LinkClass.SAME_NODE,
        ),
        ({"topology.kubernetes.io/zone": "a"}, {"zone": "b"}, LinkClass.CROSS_ZONE),
        # unknown placement: one zone, never a node-local link and never cross-zone
        ({}, {}, LinkClass.SAME_ZONE),
        ({"zone": "z1"}, {}, LinkClass.SAME_ZONE),
        ({"node": ""}, {"node": ""}, LinkClass.SAME_ZONE),
    ],
)
def test_link_class_from_labels(a: dict[str, str], b: dict[str, str], cls: LinkClass) -> None:
    assert link_class(a, b) is cls
    assert link_class(b, a) is cls


def test_missing_link_class_borrows_the_next_slower_one() -> None:
    partial = PDSpec(links={LinkClass.SAME_ZONE: LinkCost(bandwidth_gbps=7.0)})
    assert link_cost(LinkClass.SAME_NODE, partial).bandwidth_gbps == 7.0
    assert link_cost(LinkClass.SAME_ZONE, partial).bandwidth_gbps == 7.0
    # nothing slower configured: the slowest configured link
    assert link_cost(LinkClass.CROSS_ZONE, partial).bandwidth_gbps == 7.0


def test_transfer_is_latency_plus_bytes_over_bandwidth() -> None:
    link = LinkCost(bandwidth_gbps=10.0, latency_ms=1.0)
    assert transfer_ms(0, KV, link) == 0.0
    assert transfer_ms(10_000, KV, link) == pytest.approx(1.0 + 100.0)  # 1 GB at 10 GB/s


# --- cost -----------------------------------------------------------------------------


def test_pair_cost_adds_transfer_of_what_decode_lacks_and_one_decode_step() -> None:
    pre = MODEL.cost.predict("p", 2000, hbm(0), IDLE)
    link = PD.links[LinkClass.SAME_ZONE]
    busy = PodLoad(engine_running=10, kv_usage=0.5)
    full = pair_cost(MODEL, 2000, pre, DecodeSide("d", busy, 0), Link(LinkClass.SAME_ZONE, link))
    assert full.transfer_tokens == 2000 and full.transfer_bytes == 2000 * KV
    assert full.transfer_ms == pytest.approx(1.0 + 20.0)
    assert full.decode_ms == pytest.approx(5.0 + 10 * 0.1)
    assert full.ttft_ms == pytest.approx(pre.ttft_ms + 21.0 + 6.0)
    assert full.balance_ms == pytest.approx(10 * 1.0 + 0.5 * 10.0)
    backlog = (P.recompute_weight - 1) * pre.recompute_ms
    assert full.score_ms == pytest.approx(full.ttft_ms + 15.0 + backlog)
    # the decode pod already holds 1600 tokens: only 400 move
    part = pair_cost(MODEL, 2000, pre, DecodeSide("d", busy, 1600), Link(LinkClass.SAME_ZONE, link))
    assert part.transfer_tokens == 400 and part.transfer_ms < full.transfer_ms


def test_kv_pressure_on_the_decode_pod_delays_its_first_step() -> None:
    assert decode_step_ms(PodLoad(kv_usage=0.95), P) == pytest.approx(5.0 + 200.0)


def test_aggregated_option_pays_for_stalling_running_decodes() -> None:
    terms = MODEL.cost.predict("d", 1000, hbm(0), PodLoad(engine_running=4))
    agg = aggregated_cost(MODEL, terms, PodLoad(engine_running=4))
    assert agg.prefill is None and agg.transfer_ms == 0 and agg.link is None
    assert agg.ttft_ms == pytest.approx(terms.ttft_ms)
    # 1000 tokens = 100 ms of prefill; the 5.4 ms step the four decodes take anyway leaves
    # 5.0 ms of compute idle (their rows use 0.4), the rest stalls each of them
    assert agg.interference_ms == pytest.approx((100.0 - 5.0) * 4)
    # recompute also delays what queues behind it, weighted as the aggregated policy does
    assert agg.backlog_ms == pytest.approx((P.recompute_weight - 1) * terms.recompute_ms)


def test_a_prefill_that_fits_in_a_decode_step_stalls_nobody() -> None:
    """Decode steps are memory-bound: a short prefill rides in the step the running
    requests take anyway (stall-free batching), so it costs them nothing; a longer one
    stalls them by what does not fit."""
    busy = PodLoad(engine_running=10)  # a step of 5 + 10 x 0.1 = 6 ms, 1 ms of it compute
    short = MODEL.cost.predict("d", 50, hbm(0), busy)  # 5 ms of prefill
    assert aggregated_cost(MODEL, short, busy).interference_ms == 0.0
    longer = MODEL.cost.predict("d", 200, hbm(0), busy)  # 20 ms
    assert aggregated_cost(MODEL, longer, busy).interference_ms == pytest.approx(15.0 * 10)


def test_a_mostly_resident_prompt_skips_the_prefill_pool_despite_busy_decodes() -> None:
    """Both pods hold all but a 32-token tail of the prompt. The idle prefill pod
    could compute the tail and hand it over at once, but the decode pod, with 10
    requests running, prefills it inside its decode step (3.2 ms of prefill in the
    5 ms its 6 ms step leaves idle): quicker, without the transfer and the extra step.
    Charged as a full stall (32 ms), the handoff would have won."""
    busy = PodLoad(engine_running=10)
    matches = {"p0": hbm(98), "d0": hbm(98)}
    d = choose_pd(MODEL, 1600, matches, cands({"p0": IDLE}, {"d0": busy}, {}))
    assert not d.disaggregated and d.reason == PDReason.RESIDENT_ON_DECODE
    alone = next(o for o in d.options if o.prefill is None)
    assert alone.interference_ms == 0.0


# --- choice ---------------------------------------------------------------------------


def test_short_prompt_is_prefilled_on_the_decode_pod() -> None:
    d = choose_pd(MODEL, 100, {}, cands({"p0": IDLE}, {"d0": IDLE}, {}))
    assert not d.disaggregated and d.reason == PDReason.SHORT_PROMPT
    assert d.decode == "d0" and d.prefill is None and d.prefill_ranked == []


def test_long_uncached_prompt_is_disaggregated() -> None:
    d = choose_pd(MODEL, 4000, {}, cands({"p0": IDLE}, {"d0": IDLE}, {}))
    assert d.disaggregated and d.reason == PDReason.DISAGGREGATED
    assert (d.prefill, d.decode) == ("p0", "d0") and d.prefill_ranked == ["p0"]


def test_a_lora_request_pays_its_adapter_where_the_prefill_runs() -> None:
    """The pod computing the prefill loads the request's adapter unless it runs it: of
    two idle prefill pods, the one with the adapter running is chosen, and the other's
    option carries the adapter's load."""
    from kvplane.router.engine_stats import LoraState

    warm = replace(IDLE, lora=LoraState(running=frozenset({"sql"}), max_loras=2))
    cold = replace(IDLE, lora=LoraState(max_loras=2))
    c = cands({"p0": cold, "p1": warm}, {"d0": IDLE}, {})
    d = choose_pd(MODEL, 4000, {}, c, adapter="sql")
    assert d.disaggregated and d.prefill == "p1"
    by_prefill = {o.prefill: o for o in d.options if o.prefill is not None}
    assert by_prefill["p1"].prefill_terms.adapter_ms == 0.0
    assert by_prefill["p0"].prefill_terms.adapter_ms == P.adapter_load_ms > 0
    base = choose_pd(MODEL, 4000, {}, c)  # the base model loads nothing anywhere
    assert all(o.prefill_terms.adapter_ms == 0.0 for o in base.options)


def test_prompt_mostly_resident_on_a_decode_pod_skips_the_prefill_pool() -> None:
    # 4000 tokens, d1 holds 3840 of them (240 blocks): it lacks 160 <= 256
    d = choose_pd(MODEL, 4000, {"d1": hbm(240)}, cands({"p0": IDLE}, {"d0": IDLE, "d1": IDLE}, {}))
    assert not d.disaggregated and d.reason == PDReason.RESIDENT_ON_DECODE
    assert d.decode == "d1" and d.decode_ranked[0] == "d1"


def test_busy_decode_pod_prefers_a_pair_even_for_a_short_prompt() -> None:
    # the only decode pod runs 200 requests: prefilling there stalls all of them
    busy = PodLoad(engine_running=200)
    d = choose_pd(MODEL, 250, {}, cands({"p0": IDLE}, {"d0": busy}, {}))
    assert d.disaggregated and d.reason == PDReason.DISAGGREGATED


def test_pair_is_chosen_jointly_by_link_and_residency() -> None:
    labels = {
        "p0": place("n1", "z1"),
        "p1": place("n2", "z2"),
        "d0": place("n1", "z1"),
        "d1": place("n3", "z2"),
    }
    # p1 holds the prompt; p0 must recompute 4000 tokens (400 ms)
    d = choose_pd(
        MODEL,
        4000,
        {"p1": hbm(250)},
        cands({"p0": IDLE, "p1": IDLE}, {"d0": IDLE, "d1": IDLE}, labels),
    )
    assert (d.prefill, d.decode) == ("p1", "d1")  # same zone beats crossing to d0
    assert d.chosen.link is LinkClass.SAME_ZONE
    # the retry order for decode keeps the same prefill pod: d0 next
    assert d.decode_ranked == ["d1", "d0"]
    assert d.prefill_ranked == ["p1", "p0"]
    # with no residency anywhere, the same-node pair wins
    d2 = choose_pd(
        MODEL, 4000, {}, cands({"p0": IDLE, "p1": IDLE}, {"d0": IDLE, "d1": IDLE}, labels)
    )
    assert (d2.prefill, d2.decode) == ("p0", "d0")
    assert d2.chosen.link is LinkClass.SAME_NODE


def test_decode_choice_balances_running_requests_and_kv_usage() -> None:
    d = choose_pd(
        MODEL,
        4000,
        {},
        cands(
            {"p0": IDLE},
            {"d0": PodLoad(engine_running=30, kv_usage=0.7), "d1": PodLoad(engine_running=5)},
            {},
        ),
    )
    assert d.decode == "d1" and d.decode_ranked == ["d1", "d0"]


def test_prefill_queue_moves_the_pair_to_an_idle_prefill_pod() -> None:
    queued = PodLoad(pending_prefill_tokens=50_000, pending_requests=5, inflight=5)
    d = choose_pd(MODEL, 4000, {}, cands({"p0": queued, "p1": IDLE}, {"d0": IDLE}, {}))
    assert d.prefill == "p1" and d.prefill_ranked == ["p1", "p0"]


def test_no_prefill_pod_or_several_sequences_stay_aggregated() -> None:
    d = choose_pd(MODEL, 4000, {}, cands({}, {"d0": IDLE}, {}))
    assert d.reason == PDReason.NO_PREFILL and not d.disaggregated
    m = choose_pd(MODEL, 4000, {}, cands({"p0": IDLE}, {"d0": IDLE}, {}), multi_sequence=True)
    assert m.reason == PDReason.MULTI_SEQUENCE and not m.disaggregated


def test_without_aggregation_every_request_is_a_pair() -> None:
    """SGLang decode servers take only handed-off requests."""
    d = choose_pd(MODEL, 10, {}, cands({"p0": IDLE}, {"d0": IDLE}, {}), can_aggregate=False)
    assert d.disaggregated and d.reason == PDReason.DISAGGREGATED
    m = choose_pd(
        MODEL,
        10,
        {},
        cands({"p0": IDLE}, {"d0": IDLE}, {}),
        can_aggregate=False,
        multi_sequence=True,
    )
    assert m.disaggregated


def test_aggregation_can_be_switched_off_by_config() -> None:
    never = PD.model_copy(update={"aggregate_max_uncached_tokens": 0})
    d = choose_pd(model(P, never), 20, {}, cands({"p0": IDLE}, {"d0": IDLE}, {}))
    assert d.disaggregated


def test_overloaded_pods_rank_last() -> None:
    heavy = PodLoad(inflight=40)
    d = choose_pd(
        MODEL,
        4000,
        {"p0": hbm(250)},
        cands({"p0": heavy, "p1": IDLE, "p2": IDLE}, {"d0": IDLE}, {}),
    )
    assert d.prefill != "p0" and d.prefill_ranked[-1] == "p0"


def test_no_decode_candidate_is_an_error() -> None:
    with pytest.raises(ValueError):
        choose_pd(MODEL, 10, {}, cands({"p0": IDLE}, {}, {}))


def test_flexible_pods_are_candidates_for_either_leg_and_stall_what_they_run() -> None:
    """On a fleet of ``both`` pods (NIXL) every pod may take either leg. A prefill
    stalls what decodes on the pod that runs it, paired or not, so the new prompt is
    prefilled where fewest requests decode; a handoff would only add the transfer."""
    open_gate = PD.model_copy(update={"aggregate_max_uncached_tokens": 1 << 30})
    loads = {"a": PodLoad(engine_running=20), "b": PodLoad(engine_running=1), "c": IDLE}
    d = choose_pd(model(P, open_gate), 4000, {}, cands(loads, loads, {}))
    assert not d.disaggregated and d.decode == "c"
    pairs = {(o.prefill, o.decode): o for o in d.options if o.prefill is not None}
    assert set(pairs) == {(p, q) for p in loads for q in loads if p != q}
    b_to_c = pairs[("b", "c")]
    assert b_to_c.interference_ms == pytest.approx(b_to_c.prefill_terms.recompute_ms - 5.0)
    assert pairs[("c", "a")].interference_ms == 0.0


def test_exposure_keeps_decodes_off_the_pods_that_prefill() -> None:
    """With ``exposure_weight``, a request expects to be stalled by the prefills later
    routed to its decode pod (that pod's share of recent prefill work, times the work
    arriving during its life): a pod that has done all the prefilling lately prefills
    again, and hands the decode to one that has not."""
    flex = PD.model_copy(update={"aggregate_max_uncached_tokens": 1 << 30})
    loads = {
        "p": PodLoad(recent_prefill_tokens=90_000, inflight=1),
        "d": PodLoad(recent_prefill_tokens=10_000, inflight=6, engine_running=6),
    }
    off = choose_pd(model(P, flex), 4000, {}, cands(loads, loads, {}))
    assert not off.disaggregated and off.decode == "p"  # fewest decoding: prefill there
    on = flex.model_copy(update={"exposure_weight": 1.0})
    d = choose_pd(model(P, on), 4000, {}, cands(loads, loads, {}))
    assert (d.prefill, d.decode) == ("p", "d")
    # share x in flight x mean prompt tokens at the prefill rate: 0.1 x 7 x 1000 / 10k/s
    assert d.chosen.exposure_ms == pytest.approx(exposure_ms(0.1, 7, 1000.0, P)) == 70.0
    assert d.aggregated["p"].exposure_ms == pytest.approx(630.0)


def test_balance_alone_never_hands_off_a_prompt_resident_on_a_decode_pod() -> None:
    """d1 holds the prompt and is busier than d0; p0 holds it too. The pair to idle d0
    scores lower only through balance, so d1 serves it (computing its last token)."""
    labels = {"p0": place("n1", "z1"), "d0": place("n1", "z1"), "d1": place("n2", "z1")}
    resident = {"p0": hbm(250), "d1": hbm(250)}

    def choose(d1: PodLoad, balance_decides_handoff: bool) -> PDDecision:
        pd = PD.model_copy(update={"balance_decides_handoff": balance_decides_handoff})
        loads = {"d0": IDLE, "d1": d1}
        return choose_pd(model(P, pd), 4000, resident, cands({"p0": IDLE}, loads, labels))

    busy = PodLoad(inflight=20, inflight_tokens=60_000)
    d = choose(busy, False)
    assert d.reason == PDReason.RESIDENT_ON_DECODE and d.decode == "d1"
    pair = next(o for o in d.options if o.prefill == "p0" and o.decode == "d0")
    assert pair.score_ms < d.chosen.score_ms  # balance counted, the pair would win
    assert pair.score_ms - pair.balance_ms > d.chosen.score_ms - d.chosen.balance_ms
    # with balance deciding too (the choice before 2026-11-24), the pair wins
    balanced = choose(busy, True)
    assert balanced.disaggregated and (balanced.prefill, balanced.decode) == ("p0", "d0")
    # a real queue on d1 (not balance) is a reason to hand off
    queued = PodLoad(inflight=20, pending_prefill_tokens=5000, pending_requests=3)
    d2 = choose(queued, False)
    assert d2.disaggregated and (d2.prefill, d2.decode) == ("p0", "d0")


def test_decode_balance_weighs_the_context_in_flight() -> None:
    """Same number of requests; d0's are long (a decode step reads all their KV)."""
    long_ctx = PodLoad(inflight=10, inflight_tokens=100_000)
    short_ctx = PodLoad(inflight=10, inflight_tokens=5_000)
    pd = PD.model_copy(update={"decode_context_ms_per_ktok": 0.15})
    d = choose_pd(
        model(P, pd), 4000, {}, cands({"p0": IDLE}, {"d0": long_ctx, "d1": short_ctx}, {})
    )
    assert d.decode == "d1"
    by_pod = {o.decode: o.balance_ms for o in d.options}
    assert by_pod["d0"] - by_pod["d1"] == pytest.approx(95 * 0.15)


def test_a_handoff_waits_behind_prefill_queued_on_its_decode_pod() -> None:
    queued = PodLoad(pending_prefill_tokens=1000, pending_requests=1, inflight=1)
    d = choose_pd(MODEL, 4000, {}, cands({"p0": IDLE}, {"d0": queued}, {}))
    assert d.chosen.decode_ms == pytest.approx(100.0 + decode_step_ms(queued, P))


# --- a prefill pod serving a request it holds, alone -----------------------------------

HELD = {"p0": hbm(240)}  # p0 holds 3840 of the 4000 tokens (it prefilled the prefix)


def alone_choice(prefill: dict[str, PodLoad], pd: PDSpec = PD) -> PDDecision:
    return choose_pd(
        model(P, pd), 4000, HELD, cands(prefill, {"d0": IDLE}, {}, alone=list(prefill))
    )


def test_an_idle_prefill_pod_serves_a_prompt_it_holds_alone() -> None:
    """d0 lacks the prompt (a handoff moves 4000 tokens); p0 lacks 160 of them and has
    nothing in flight: it serves the request itself, as a decode pod would."""
    d = alone_choice({"p0": IDLE, "p1": IDLE})
    assert d.reason == PDReason.RESIDENT_ON_PREFILL
    assert d.prefill is None and d.decode == "p0" and not d.disaggregated
    assert d.chosen.prefill_terms.cached_tokens == 3840
    # a failure falls back to the decode pods, which never include p0 otherwise
    assert d.decode_ranked == ["p0", "d0"]
    # switched off: the handoff from p0
    off = PD.model_copy(update={"prefill_serves_resident": False})
    d2 = alone_choice({"p0": IDLE, "p1": IDLE}, off)
    assert d2.disaggregated and (d2.prefill, d2.decode) == ("p0", "d0")


def test_a_prefill_pod_serves_alone_only_while_it_and_most_of_its_pool_are_idle() -> None:
    prefilling = PodLoad(pending_prefill_tokens=100, pending_requests=1, inflight=1)
    # p0 itself has prefill in flight
    assert alone_choice({"p0": prefilling, "p1": IDLE}).disaggregated
    # p0 is idle, but two of its pool's four pods prefill (over a quarter)
    pool = {"p0": IDLE, "p1": prefilling, "p2": prefilling, "p3": IDLE}
    assert alone_choice(pool).disaggregated
    # one of four is within it
    pool["p2"] = IDLE
    assert alone_choice(pool).reason == PDReason.RESIDENT_ON_PREFILL


def test_a_prefill_pod_never_serves_alone_what_it_does_not_hold() -> None:
    """A short prompt is within the decode pods' gate, but p0 holds none of it: a decode
    there would sit through the pod's next long prefills."""
    d = choose_pd(MODEL, 100, {}, cands({"p0": IDLE}, {"d0": IDLE}, {}, alone=["p0"]))
    assert d.reason == PDReason.SHORT_PROMPT and d.decode == "d0"
    assert all(o.decode == "d0" for o in d.options)
