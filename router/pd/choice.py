"""The joint (prefill pod, decode pod) choice, and when to skip the prefill pool.

Every pair is costed (``pd.cost``) next to every decode pod prefilling the request
itself. The decode pod may do so only when it lacks few of the prompt's tokens
(``aggregate_max_uncached_tokens``: short prompts, or prompts mostly resident
there); then the cheaper option wins. The result names the pods, a reason label
shared by headers and metrics, and the rankings that retries walk.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from kvplane.router.cost import CostTerms, PodLoad, pending_prefill_ms
from kvplane.router.pd.cost import (
    DecodeSide,
    Link,
    OptionCost,
    PDCostModel,
    aggregated_cost,
    exposure_ms,
    pair_cost,
    running_requests,
)
from kvplane.router.pd.topology import link_class, link_cost
from kvplane.router.policies.cost import over_cap
from kvplane.router.tiers import Tier


class PDReason:
    DISAGGREGATED = "disaggregated"
    SHORT_PROMPT = "aggregated_short_prompt"  # the decode pod lacks few tokens: all of them
    RESIDENT_ON_DECODE = "aggregated_resident_on_decode"  # ... because it holds most
    RESIDENT_ON_PREFILL = "aggregated_resident_on_prefill"  # a prefill pod holds most: alone
    PREFILL_FAILED = "aggregated_prefill_failed"  # every prefill attempt failed
    NO_PREFILL = "aggregated_no_prefill"  # no healthy prefill pod
    NO_KV_PARAMS = "aggregated_no_kv_params"  # the prefill pod returned nothing to hand off
    MULTI_SEQUENCE = "aggregated_multi_sequence"  # n > 1 or a batch: a handoff has one consumer


@dataclass(frozen=True, slots=True)
class PDCandidates:
    """The pods one P/D choice weighs, with what is known of each."""

    prefill: Mapping[str, PodLoad]
    decode: Mapping[str, PodLoad]  # must not be empty; a pod in both is never paired with itself
    labels: Mapping[str, Mapping[str, str]]  # node and zone labels: the pairs' links
    alone: Collection[str] = ()  # prefill pods that may serve a request they hold alone


@dataclass(frozen=True, slots=True)
class PDDecision:
    reason: str
    chosen: OptionCost
    decode_ranked: list[str]  # decode pods for retries, best first (chosen first)
    prefill_ranked: list[str]  # prefill pods for the chosen decode pod, best first
    aggregated: dict[str, OptionCost]  # each pod serving alone: decode pods (the fallback),
    # and prefill pods allowed to (``prefill_serves_resident``)
    options: list[OptionCost] = field(default_factory=list)  # every eligible option, best first

    @property
    def decode(self) -> str:
        return self.chosen.decode

    @property
    def prefill(self) -> str | None:
        return self.chosen.prefill

    @property
    def disaggregated(self) -> bool:
        return self.chosen.disaggregated


def _resident_tokens(match: Mapping[Tier, int], block_size: int, prompt_tokens: int) -> int:
    return min(match.get(Tier.HBM, 0) * block_size, max(0, prompt_tokens - 1))


def _exposures(model: PDCostModel, cands: PDCandidates) -> dict[str, float]:
    """Unweighted exposure per decode pod (zeros when the weight is 0)."""
    decode_loads = cands.decode
    if model.pd.exposure_weight <= 0.0:
        return dict.fromkeys(decode_loads, 0.0)
    pods = {**cands.prefill, **decode_loads}
    total = sum(ld.recent_prefill_tokens for ld in pods.values())
    inflight = float(sum(ld.inflight for ld in pods.values()))
    return {
        d: exposure_ms(
            ld.recent_prefill_tokens / total if total > 0 else 1.0 / len(pods),
            inflight,
            ld.mean_request_tokens,
            model.params,
        )
        for d, ld in decode_loads.items()
    }


def _handoff_or_local(
    options: list[OptionCost], key: Callable[[OptionCost], tuple[bool, float, int, str, str]]
) -> OptionCost:
    """With ``balance_decides_handoff`` off (the default): the best pair against the
    best decode pod prefilling alone (each the first of its kind in ``options``, sorted
    by the full score), compared without balance. Balance spreads decodes over the pods
    a request could decode on, but it is no reason to hand off: a handoff buys a less
    loaded decode pod with certain TTFT (a second leg, a transfer, a decode step):
    counted in, shared-prefix cache hits resident on a busier decode pod get handed off
    (bench/HISTORY.md, P/D points 9-10)."""
    handoff = next((o for o in options if o.prefill is not None), None)
    local = next((o for o in options if o.prefill is None), None)
    if handoff is None or local is None:
        return options[0]

    def without_balance(o: OptionCost) -> tuple[bool, float]:
        over, score = key(o)[:2]
        return (over, score - o.balance_ms)

    return handoff if without_balance(handoff) < without_balance(local) else local


def _alone_on_prefill(
    model: PDCostModel,
    prompt_tokens: int,
    prefill_terms: Mapping[str, CostTerms],
    alone_loads: Mapping[str, PodLoad],
) -> list[OptionCost]:
    """Prefill pods serving a request alone, as a decode pod would: one they hold most
    of and lack no more of than a decode pod may prefill itself, while the pod and most
    of its pool have no prefill in flight. A prefill pod holds every prefix it computed,
    so a shared prefix's follow-ups can use the idle prefill pool's GPUs instead of
    queueing on the one decode pod its first request went to. A busy pool keeps them: a
    decode there would sit through long prefills and slow them (bench/HISTORY.md, P/D
    point 11)."""
    pd = model.pd
    if not pd.prefill_serves_resident or not alone_loads:
        return []
    busy = sum(1 for load in alone_loads.values() if load.pending_requests > 0)
    if busy > pd.prefill_pool_busy_max * len(alone_loads):
        return []
    out = []
    for p, load in alone_loads.items():
        terms = prefill_terms[p]
        if load.pending_requests > 0:
            continue
        uncached = prompt_tokens - terms.cached_tokens
        if uncached <= pd.aggregate_max_uncached_tokens and terms.cached_tokens > uncached:
            out.append(aggregated_cost(model, terms, load))
    return out


def _first(pod: str, ranked: list[str]) -> list[str]:
    """``ranked`` with the chosen pod first (a prefill pod serving alone is not in it)."""
    return [pod, *(p for p in ranked if p != pod)]


def choose_pd(
    model: PDCostModel,
    prompt_tokens: int,
    matches: Mapping[str, Mapping[Tier, int]],
    cands: PDCandidates,
    *,
    can_aggregate: bool = True,
    multi_sequence: bool = False,
    adapter: str | None = None,
) -> PDDecision:
    """Cheapest option by score; ``can_aggregate`` False (SGLang decode servers take
    only handed-off requests) leaves pairs only. ``cands.alone``: prefill pods (not
    decode pods) that may serve a request they hold nearly all of alone
    (``prefill_serves_resident``), never a handoff's decode leg. ``adapter``: the
    request's LoRA adapter, whose loading the pod that computes the prefill pays."""
    prefill_loads, decode_loads = cands.prefill, cands.decode
    if not decode_loads:
        raise ValueError("no decode candidates")
    params, pd = model.params, model.pd

    def terms(pod: str, load: PodLoad) -> CostTerms:
        return model.cost.predict(pod, prompt_tokens, matches.get(pod, {}), load, adapter)

    exposure = _exposures(model, cands)
    aggregated = {
        d: aggregated_cost(model, terms(d, load), load, exposure[d])
        for d, load in decode_loads.items()
    }
    capped = over_cap(decode_loads, params) | over_cap(prefill_loads, params)
    alone_loads = {
        p: prefill_loads[p] for p in cands.alone if p in prefill_loads and p not in decode_loads
    }
    serving = {**alone_loads, **decode_loads}  # pods an option may decode on

    def key(o: OptionCost) -> tuple[bool, float, int, str, str]:
        over = o.decode in capped or (o.prefill is not None and o.prefill in capped)
        return (over, o.score_ms, serving[o.decode].inflight, o.decode, o.prefill or "")

    def agg_ranked() -> list[str]:
        return [o.decode for o in sorted(aggregated.values(), key=key)]

    if can_aggregate and (multi_sequence or not prefill_loads):
        ranked = agg_ranked()
        reason = PDReason.MULTI_SEQUENCE if multi_sequence else PDReason.NO_PREFILL
        best = aggregated[ranked[0]]
        return PDDecision(
            reason, best, ranked, [], aggregated, sorted(aggregated.values(), key=key)
        )

    prefill_terms = {p: terms(p, load) for p, load in prefill_loads.items()}
    pending = {d: pending_prefill_ms(load, params) for d, load in decode_loads.items()}
    block_size = model.cost.block_size
    pairs: dict[tuple[str, str], OptionCost] = {}
    for d, d_load in decode_loads.items():
        side = DecodeSide(
            d,
            d_load,
            _resident_tokens(matches.get(d, {}), block_size, prompt_tokens),
            exposure[d],
            pending[d],
        )
        for p, p_terms in prefill_terms.items():
            if p == d:
                continue
            cls = link_class(cands.labels.get(p, {}), cands.labels.get(d, {}))
            link = Link(cls, link_cost(cls, pd))
            running = running_requests(prefill_loads[p])
            pairs[(p, d)] = pair_cost(model, prompt_tokens, p_terms, side, link, running)
    options = list(pairs.values())
    served_alone = aggregated
    if can_aggregate:
        options += [
            o
            for o in aggregated.values()
            if prompt_tokens - o.prefill_terms.cached_tokens <= pd.aggregate_max_uncached_tokens
        ]
        on_prefill = _alone_on_prefill(model, prompt_tokens, prefill_terms, alone_loads)
        options += on_prefill
        served_alone = {**aggregated, **{o.decode: o for o in on_prefill}}
    if not options:  # only a pod that is both, paired with itself
        if not can_aggregate:
            raise ValueError("no prefill pod can serve these decode pods")
        ranked = agg_ranked()
        best = aggregated[ranked[0]]
        return PDDecision(PDReason.NO_PREFILL, best, ranked, [], aggregated, [best])
    options.sort(key=key)
    best = options[0] if pd.balance_decides_handoff else _handoff_or_local(options, key)
    if best is not options[0]:
        options.remove(best)
        options.insert(0, best)
    if best.prefill is None:
        reason = (
            PDReason.RESIDENT_ON_PREFILL
            if best.decode not in decode_loads
            else PDReason.SHORT_PROMPT
            if prompt_tokens <= pd.aggregate_max_uncached_tokens
            else PDReason.RESIDENT_ON_DECODE
        )
        ranked = _first(best.decode, agg_ranked())
        return PDDecision(reason, best, ranked, [], served_alone, options)

    p = best.prefill

    def decode_key(d: str) -> tuple[bool, tuple[bool, float, int, str, str]]:
        pair = pairs.get((p, d))
        return (pair is None, key(pair if pair is not None else aggregated[d]))

    decode_ranked = _first(best.decode, sorted(decode_loads, key=decode_key))
    prefill_ranked = [
        o.prefill
        for o in sorted((o for (_, d), o in pairs.items() if d == best.decode), key=key)
        if o.prefill is not None
    ]
    return PDDecision(
        PDReason.DISAGGREGATED, best, decode_ranked, prefill_ranked, served_alone, options
    )
