"""Baseline: each request to the next pod in name order."""

from __future__ import annotations

import itertools
from typing import ClassVar

from kvplane.router.policies.base import BasePolicy, Decision, PolicyContext, RoutingInput
from kvplane.router.policies.registry import register


@register
class RoundRobin(BasePolicy):
    name: ClassVar[str] = "round_robin"

    def __init__(self, ctx: PolicyContext) -> None:
        super().__init__(ctx)
        self._counter = itertools.count()

    def choose(self, inp: RoutingInput) -> Decision:
        pods = sorted(inp.loads)
        start = next(self._counter) % len(pods)
        return Decision(pods[start], self.name, [*pods[start:], *pods[:start]], {})
