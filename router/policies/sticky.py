"""Baseline, and the fallback while the index is down: rendezvous hashing of the
prompt's leading tokens, so that requests sharing a prefix land on the same pod
without any index (every router replica ranks pods alike)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import xxhash
from kvplane.router.cost import CostModel
from kvplane.router.policies.base import BasePolicy, Decision, Reason, RoutingInput
from kvplane.router.policies.registry import register


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


def sticky_ranking(model: CostModel, inp: RoutingInput) -> list[str]:
    block = model.block_size
    anchor = sticky_anchor(inp.keys, inp.tokens, model.params.sticky_tokens, block)
    return sticky_order(anchor, inp.pods)


def index_down(model: CostModel, inp: RoutingInput) -> Decision:
    """The decision of an index policy while the index cannot answer."""
    ranked = sticky_ranking(model, inp)
    return Decision(ranked[0], Reason.INDEX_DOWN, ranked, {})


@register
class Sticky(BasePolicy):
    name: ClassVar[str] = "sticky"

    def choose(self, inp: RoutingInput) -> Decision:
        ranked = sticky_ranking(self.cost, inp)
        return Decision(ranked[0], self.name, ranked, {})
