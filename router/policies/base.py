"""What every routing policy shares: its input, its output, and the protocol.

A policy ranks the candidate pods of one request. It sees the prompt (its length,
tokens and block keys), each candidate's load, and (when it ``uses_index``) the
residency index's answer; it returns a ``Decision`` naming the pod, the reason and the
ranking that retries walk, so that response headers, the explain endpoint and the
metrics all tell the same story. Policies are pure over that input but for two bounded
pieces of state (a round-robin counter, and the cost policy's ``BranchPoints``: which
cached heads other prompts continued differently); the live router and the
discrete-event simulator call them through ``route`` alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar, Protocol

from kvplane.router.cost import CostModel, CostTerms, PodLoad
from kvplane.router.index.base import PrefixMatches, ResidencyIndex, lookup_or_none
from pydantic import BaseModel, ConfigDict


class Reason:
    """Reasons shared by several policies (each policy module adds its own)."""

    INDEX_DOWN = "index_unavailable"  # sticky fallback while the index is unreachable


@dataclass(frozen=True, slots=True)
class Decision:
    pod: str
    reason: str
    ranked: list[str]  # every candidate, best first: retries walk this list
    terms: dict[str, CostTerms]  # empty for policies that do not cost


@dataclass(frozen=True, slots=True)
class RoutingInput:
    """One request as a policy sees it."""

    prompt_tokens: int  # an estimate while a deferred tail is not encoded
    tokens: Sequence[int]  # the known token ids (a partial prompt's prefix)
    keys: Sequence[int]  # block keys of ``tokens``
    loads: Mapping[str, PodLoad]  # the candidates, in the pool's order
    matches: PrefixMatches | None = None  # the index's answer, for policies that use it
    adapter: str | None = None  # the request's LoRA adapter (None: the base model)
    # the candidates' node and zone labels (peer pulls cost each pair's link); None: unknown
    labels: Mapping[str, Mapping[str, str]] | None = None

    @property
    def pods(self) -> list[str]:
        return list(self.loads)


class Options(BaseModel):
    """A policy's own settings (``policy_options`` in the router config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy is built from: the cost model and its own options."""

    cost: CostModel
    options: Options


class Policy(Protocol):
    name: ClassVar[str]
    uses_index: ClassVar[bool]  # asks the index before choosing

    def choose(self, inp: RoutingInput) -> Decision: ...


class BasePolicy:
    """What most policies share: no index, no options of their own, the build context
    kept (``self.cost``, ``self.options``)."""

    name: ClassVar[str]
    uses_index: ClassVar[bool] = False
    options: ClassVar[type[Options]] = Options

    def __init__(self, ctx: PolicyContext) -> None:
        self.cost = ctx.cost
        self.opts = ctx.options


Fallback = Callable[[RoutingInput], Decision]


async def route(
    policy: Policy,
    index: ResidencyIndex,
    inp: RoutingInput,
    index_down: Fallback,
    known: PrefixMatches | None = None,
) -> tuple[Decision, PrefixMatches | None]:
    """The decision for one request: the index's answer first if the policy uses it
    (while the index cannot answer, ``index_down`` decides). ``known``: the index's
    answer for exactly ``inp.keys``, asked a moment before (the pipeline's probe)."""
    if not policy.uses_index:
        return policy.choose(inp), None
    if known is not None:
        matches: PrefixMatches | None = {p: known[p] for p in inp.pods if p in known}
    else:
        matches = await lookup_or_none(index, inp.keys, inp.pods)
    if matches is None:
        return index_down(inp), None
    return policy.choose(replace(inp, matches=matches)), matches
