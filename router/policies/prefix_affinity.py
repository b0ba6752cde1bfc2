"""Baseline: prefix affinity until saturated (llm-d's prefix-cache affinity with a
saturation cut-off, as in its ``prefix-cache-affinity`` filter and load-aware
scoring).

The request goes to the pod that holds the longest resident prefix of the prompt
(leading blocks in HBM, from the index) as long as that pod's queued prefill stays
under ``saturation_tokens``; past it, or when no pod holds a block, to the least
loaded pod. Unlike ``cost`` it weighs neither how much of the prompt a pod lacks nor
what the others' queues would cost, only a fixed threshold.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

from kvplane.router.cost import PodLoad
from kvplane.router.policies.base import BasePolicy, Decision, Options, PolicyContext, RoutingInput
from kvplane.router.policies.least_loaded import least_loaded_order
from kvplane.router.policies.registry import register
from kvplane.router.tiers import Tier
from pydantic import Field


class AffinityOptions(Options):
    saturation_tokens: Annotated[int, Field(ge=0)] = Field(
        default=16384,
        description="the pod holding the longest prefix keeps the request while its queued "
        "prefill (router-sent tokens awaiting a first token, plus waiting requests it did "
        "not send at the fleet's mean prompt) is under this many tokens",
    )


class AffinityReason:
    AFFINITY = "prefix_affinity"  # the pod holding the longest prefix, not saturated
    SATURATED = "prefix_affinity_saturated"  # it was saturated: least loaded instead
    NO_PREFIX = "prefix_affinity_no_prefix"  # no pod holds a block: least loaded


def queued_tokens(load: PodLoad) -> float:
    unseen = max(0.0, load.engine_waiting - load.scraped_pending_requests)
    return load.pending_prefill_tokens + unseen * load.mean_request_tokens


@register
class PrefixAffinity(BasePolicy):
    name: ClassVar[str] = "prefix_affinity"
    uses_index: ClassVar[bool] = True
    options: ClassVar[type[Options]] = AffinityOptions

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        assert isinstance(ctx.options, AffinityOptions)
        self._limit = ctx.options.saturation_tokens

    def choose(self, inp: RoutingInput) -> Decision:
        matches = inp.matches or {}
        loads = inp.loads
        ranked = least_loaded_order(loads)
        held = {p: matches.get(p, {}).get(Tier.HBM, 0) for p in ranked}
        # longest prefix first; among equals, the least loaded (ranked is stable)
        holder = max(ranked, key=lambda p: held[p])
        if held[holder] == 0:
            return Decision(ranked[0], AffinityReason.NO_PREFIX, ranked, {})
        if queued_tokens(loads[holder]) >= self._limit:
            return Decision(ranked[0], AffinityReason.SATURATED, ranked, {})
        ranked.remove(holder)
        return Decision(holder, AffinityReason.AFFINITY, [holder, *ranked], {})
