"""kvplane's policy: the lowest predicted time to first token, recompute weighted.

Every candidate is costed (``CostModel.predict``: queue + transfer of what sits in a
slower tier + recompute of what is missing); the score weighs recompute by
``recompute_weight`` because every recomputed token also delays the requests queued
behind it; with ``tail_guard`` set, a pod predicted much slower than an idle one is not
chosen for its reuse. Pods over the load cap go last; near-ties (within ``balance_band``) go to
the pod sent the least prefill work lately, exact ties to fewer in flight.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvplane.router.config import CostParams
from kvplane.router.cost import (
    CostModel,
    CostTerms,
    PeerOffer,
    PodLoad,
    peer_offers,
    pending_prefill_ms,
)
from kvplane.router.index.base import PrefixMatches, deepest_held
from kvplane.router.policies.base import BasePolicy, Decision, PolicyContext, RoutingInput
from kvplane.router.policies.branches import BranchPoints, after_shared_head
from kvplane.router.policies.registry import register


class CostReason:
    CACHE = "cache_hit"  # the cheapest pod holds part of the prompt
    LOAD = "load_balance"  # no usable residency anywhere: cheapest queue wins
    LOAD_OVER_CACHE = "load_over_cache"  # a pod held more, but its queue cost more
    LOAD_CAP = "load_cap"  # the best-cached pod was over the load cap
    TAIL_GUARD = "tail_guard"  # the best-cached pod's predicted TTFT was too far behind
    PEER = "peer_pull"  # the chosen pod pulls the prefix from another pod's HBM or DRAM
    SHARED = "shared_store"  # the chosen pod loads part of the prompt from a shared store


def over_cap(loads: Mapping[str, PodLoad], params: CostParams) -> set[str]:
    """Pods whose in-flight count exceeds ``load_cap`` x the mean (+ slack)."""
    if len(loads) < 2:
        return set()
    mean = sum(ld.inflight for ld in loads.values()) / len(loads)
    limit = params.load_cap * mean + params.load_cap_slack
    return {pod for pod, ld in loads.items() if ld.inflight > limit}


def too_slow(
    terms: Mapping[str, CostTerms],
    pods: list[str],
    loads: Mapping[str, PodLoad],
    params: CostParams,
) -> set[str]:
    """Pods predicted slower than ``tail_guard`` x the fastest of ``pods`` (and by more
    than the slack) while that fastest pod has no prefill queued: the weighted score may
    not pick them for their reuse. A busy fastest pod leaves the weight to decide."""
    if params.tail_guard is None or not pods:
        return set()
    quickest = min(pods, key=lambda p: terms[p].ttft_ms)
    if pending_prefill_ms(loads[quickest], params) > 0.0:
        return set()
    fastest = terms[quickest].ttft_ms
    limit = max(fastest * params.tail_guard, fastest + params.tail_guard_slack_ms)
    return {p for p in pods if terms[p].ttft_ms > limit}


def choose_by_cost(
    model: CostModel,
    prompt_tokens: int,
    matches: PrefixMatches,
    loads: Mapping[str, PodLoad],
    adapter: str | None = None,
    labels: Mapping[str, Mapping[str, str]] | None = None,
    shared_head: bool = False,
) -> Decision:
    """Lowest score (predicted TTFT with recompute weighted) among pods under the load
    cap; near-ties go to the pod sent the least prefill work lately, exact ties to fewer
    in flight. ``labels``: the pods' node and zone labels, which place them for peer
    pulls; ``shared_head``: what pods hold of the prompt ends where other prompts went
    on differently (``BranchPoints``)."""
    params = model.params
    pods = list(loads)
    offers: dict[str, list[PeerOffer]] = {}
    if model.peer_pull is not None:
        offers = peer_offers(matches, pods, labels, model.peer_pull)
    terms = {
        p: model.predict(
            p, prompt_tokens, matches.get(p, {}), loads[p], adapter, peers=offers.get(p, ())
        )
        for p in pods
    }
    capped = over_cap(loads, params)
    eligible = [p for p in pods if p not in capped] or pods
    slow = too_slow(terms, eligible, loads, params)
    eligible = [p for p in eligible if p not in slow]
    w = params.recompute_weight
    score = {p: t.ttft_ms + (w - 1.0) * t.recompute_ms for p, t in terms.items()}

    def rank_key(p: str) -> tuple[float, int, str]:
        return (score[p], loads[p].inflight, p)

    ranked = sorted(eligible, key=rank_key) + sorted(set(pods) - set(eligible), key=rank_key)
    top_share = max(t.cached_tokens for t in terms.values()) / max(1, prompt_tokens)
    new_share = params.shared_head_share if shared_head else 0.0
    if top_share < max(params.new_prefix_share, new_share):
        # A new prefix: what it can reuse anywhere is a small head (or a head other
        # prompts share, no longer than its own part), and where its own KV goes decides
        # where its follow-ups find it; spread it by recent prefill work among the pods
        # that are about as fast, as for near-ties below.
        fastest = min(terms[p].ttft_ms for p in eligible)
        # a pod that holds the head saves at most that share of the prompt's prefill
        reach = fastest / (1.0 - top_share) * (1 + params.balance_band)
        band = [p for p in eligible if terms[p].ttft_ms <= reach]
    else:
        # Near-ties go to the pod sent the least prefill work lately: queues that look
        # equal now say little about the requests that will follow this prompt's prefix.
        limit = score[ranked[0]] * (1 + params.balance_band)
        band = [p for p in eligible if score[p] <= limit]
    if len(band) > 1:
        pick = min(band, key=lambda p: (loads[p].recent_prefill_tokens, rank_key(p)))
        ranked.remove(pick)
        ranked.insert(0, pick)
    best = ranked[0]
    most_cached = max(pods, key=lambda p: (terms[p].cached_tokens, -terms[p].ttft_ms))
    top_cached = terms[most_cached].cached_tokens
    if terms[best].peer is not None:
        reason = CostReason.PEER
    elif terms[best].store is not None:
        reason = CostReason.SHARED
    elif terms[best].cached_tokens >= top_cached and top_cached > 0:
        reason = CostReason.CACHE
    elif top_cached == 0:
        reason = CostReason.LOAD
    elif most_cached in capped:
        reason = CostReason.LOAD_CAP
    elif most_cached in slow and score[most_cached] < score[best]:
        reason = CostReason.TAIL_GUARD
    else:
        reason = CostReason.LOAD_OVER_CACHE
    return Decision(best, reason, ranked, terms)


@register
class CostPolicy(BasePolicy):
    name: ClassVar[str] = "cost"
    uses_index: ClassVar[bool] = True

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self.branches = BranchPoints()

    def choose(self, inp: RoutingInput) -> Decision:
        shared = False
        if self.cost.params.shared_head_share > 0:
            held = deepest_held(inp.matches)
            shared = after_shared_head(self.branches, inp.keys, held)
        return choose_by_cost(
            self.cost,
            inp.prompt_tokens,
            inp.matches or {},
            inp.loads,
            inp.adapter,
            inp.labels,
            shared_head=shared,
        )
