"""Baseline: the pod with the fewest requests in flight plus waiting (as scraped)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from kvplane.router.cost import PodLoad
from kvplane.router.policies.base import BasePolicy, Decision, RoutingInput
from kvplane.router.policies.registry import register


def least_loaded_order(loads: Mapping[str, PodLoad]) -> list[str]:
    return sorted(loads, key=lambda p: (loads[p].inflight + loads[p].engine_waiting, p))


@register
class LeastLoaded(BasePolicy):
    name: ClassVar[str] = "least_loaded"

    def choose(self, inp: RoutingInput) -> Decision:
        ranked = least_loaded_order(inp.loads)
        return Decision(ranked[0], self.name, ranked, {})
