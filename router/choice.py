"""Cost terms -> one pod, and the baseline policies it is compared with.

Pure functions over plain data: a ``Decision`` names the pod, the reason and
the ranked candidates, so the response headers, the explain endpoint and the
metrics all tell the same story.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash
from kvplane.router.config import CostParams, Policy
from kvplane.router.cost import CostTerms, PodLoad, predict
from kvplane.router.tiers import Tier


class Reason:
    CACHE = "cache_hit"  # the cheapest pod holds part of the prompt
    LOAD = "load_balance"  # no usable residency anywhere: cheapest queue wins
    LOAD_OVER_CACHE = "load_over_cache"  # a pod held more, but its queue cost more
    LOAD_CAP = "load_cap"  # the best-cached pod was over the load cap
    INDEX_DOWN = "index_unavailable"  # sticky fallback while the index is unreachable
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    STICKY = "sticky"


@dataclass(frozen=True, slots=True)
class Decision:
    pod: str
    reason: str
    ranked: list[str]  # every candidate, best first: retries walk this list
    terms: dict[str, CostTerms]  # empty for policies that do not cost


def over_cap(loads: Mapping[str, PodLoad], params: CostParams) -> set[str]:
    """Pods whose in-flight count exceeds ``load_cap`` x the mean (+ slack)."""
    if len(loads) < 2:
        return set()
    mean = sum(ld.inflight for ld in loads.values()) / len(loads)
    limit = params.load_cap * mean + params.load_cap_slack
    return {pod for pod, ld in loads.items() if ld.inflight > limit}


def choose_by_cost(
    prompt_tokens: int,
    matches: Mapping[str, dict[Tier, int]],
    loads: Mapping[str, PodLoad],
    params: CostParams,
    block_size: int,
    kv_bytes_per_token: int,
    mean_request_tokens: float,
) -> Decision:
    """Lowest score (predicted TTFT with recompute weighted) among pods under the load
    cap; near-ties go to the pod sent the least prefill work lately, exact ties to fewer
    in flight."""
    pods = list(loads)
    terms = {
        p: predict(
            p,
            prompt_tokens,
            matches.get(p, {}),
            loads[p],
            params,
            block_size,
            kv_bytes_per_token,
            mean_request_tokens,
        )
        for p in pods
    }
    capped = over_cap(loads, params)
    eligible = [p for p in pods if p not in capped] or pods
    w = params.recompute_weight
    score = {p: t.ttft_ms + (w - 1.0) * t.recompute_ms for p, t in terms.items()}

    def rank_key(p: str) -> tuple[float, int, str]:
        return (score[p], loads[p].inflight, p)

    ranked = sorted(eligible, key=rank_key) + sorted(set(pods) - set(eligible), key=rank_key)
    # Near-ties go to the pod sent the least prefill work lately: queues that look equal now
    # say little about the requests that will follow this prompt's prefix.
    limit = score[ranked[0]] * (1 + params.balance_band)
    band = [p for p in eligible if score[p] <= limit]
    if len(band) > 1:
        pick = min(band, key=lambda p: (loads[p].recent_prefill_tokens, rank_key(p)))
        ranked.remove(pick)
        ranked.insert(0, pick)
    best = ranked[0]
    most_cached = max(pods, key=lambda p: (terms[p].cached_tokens, -terms[p].ttft_ms))
    top_cached = terms[most_cached].cached_tokens
    if terms[best].cached_tokens >= top_cached and top_cached > 0:
        reason = Reason.CACHE
    elif top_cached == 0:
        reason = Reason.LOAD
    elif most_cached in capped:
        reason = Reason.LOAD_CAP
    else:
        reason = Reason.LOAD_OVER_CACHE
    return Decision(best, reason, ranked, terms)


def sticky_order(anchor: int, pods: Sequence[str]) -> list[str]:
    """Rendezvous hashing: every replica ranks pods alike for the same anchor, and
    removing a pod only moves the prompts that were on it."""
    return sorted(pods, key=lambda p: xxhash.xxh3_64_intdigest(p.encode(), anchor), reverse=True)


def sticky_anchor(
    keys: Sequence[int], tokens: Sequence[int], sticky_tokens: int, block_size: int
) -> int:
    """The key of the prompt's first ``sticky_tokens`` tokens (whole blocks; or of its tokens
    if shorter). Counted in tokens, not blocks: a system prompt shared by every request
    spans several small blocks, and an anchor inside it would send everything to one pod."""
    if keys:
        return keys[min(max(1, sticky_tokens // block_size), len(keys)) - 1]
    return xxhash.xxh3_64_intdigest(repr(list(tokens[:64])).encode())


def least_loaded_order(loads: Mapping[str, PodLoad]) -> list[str]:
    return sorted(loads, key=lambda p: (loads[p].inflight + loads[p].engine_waiting, p))


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def order(self, pods: Sequence[str]) -> list[str]:
        if not pods:
            return []
        start = next(self._counter) % len(pods)
        return [*pods[start:], *pods[:start]]


def choose_baseline(
    policy: Policy,
    pods: Sequence[str],
    loads: Mapping[str, PodLoad],
    anchor: int,
    rr: RoundRobin,
) -> Decision:
    if policy is Policy.ROUND_ROBIN:
        ranked, reason = rr.order(sorted(pods)), Reason.ROUND_ROBIN
    elif policy is Policy.LEAST_LOADED:
        ranked, reason = least_loaded_order({p: loads[p] for p in pods}), Reason.LEAST_LOADED
    else:
        ranked, reason = sticky_order(anchor, pods), Reason.STICKY
    return Decision(ranked[0], reason, ranked, {})
