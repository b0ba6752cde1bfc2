"""The routing pipeline: request -> tokens -> block keys -> index lookup -> cost -> choice.

Everything but the index lookup is CPU work on local data; the lookup is one
round trip, guarded so that a slow or dead index degrades routing to sticky
hashing instead of failing or stalling requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.choice import (
    Decision,
    Reason,
    RoundRobin,
    choose_baseline,
    choose_by_cost,
    sticky_anchor,
    sticky_order,
)
from kvplane.router.config import BackendRole, Policy, RouterConfig
from kvplane.router.errors import APIError
from kvplane.router.index.base import PrefixMatches, ResidencyIndex
from kvplane.router.pool import Pool
from kvplane.router.request import ParsedRequest
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.tokens import ChatFormatError, PromptTokenizer, prompt_source

# Encoding at most this many characters (about 1000 tokens, ~1 ms) is done on the
# event loop: less than a thread hop costs on a busy machine.
INLINE_TAIL_CHARS = 4096

log = logging.getLogger("kvplane.router")


class IndexGuard:
    """Timeout plus circuit breaker around index lookups.

    After a failure the index is skipped for a back-off that doubles up to 5 s,
    so an unreachable Redis costs one timeout per back-off, not one per request.
    """

    def __init__(self, index: ResidencyIndex, timeout_s: float, metrics: RouterMetrics) -> None:
        self.index = index
        self._timeout = timeout_s
        self._metrics = metrics
        self._open_until = 0.0
        self._backoff = 0.25

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._open_until

    async def lookup(self, keys: list[int], pods: list[str]) -> PrefixMatches | None:
        if not self.available:
            return None
        start = time.perf_counter()
        try:
            result = await asyncio.wait_for(self.index.lookup(keys, pods), self._timeout)
        except Exception as exc:  # timeout, connection refused, script error
            self._metrics.index_errors.labels(**self._metrics.labels).inc()
            self._open_until = time.monotonic() + self._backoff
            log.warning("index lookup failed (%s); sticky routing for %.2fs", exc, self._backoff)
            self._backoff = min(self._backoff * 2, 5.0)
            return None
        self._metrics.index_lookup.labels(**self._metrics.labels).observe(
            time.perf_counter() - start
        )
        self._backoff = 0.25
        return result


@dataclass(frozen=True, slots=True)
class Routed:
    tokens: list[int]
    keys: list[int]
    decision: Decision
    matches: PrefixMatches | None


class RoutingPipeline:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PromptTokenizer,
        guard: IndexGuard,
        pool: Pool,
        metrics: RouterMetrics,
        generation: str,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.guard = guard
        self.pool = pool
        self.metrics = metrics
        self.root = generation_root(generation)
        self._rr = RoundRobin()

    def _source(self, req: ParsedRequest) -> tuple[str | list[int], bool]:
        """The text to encode (a chat rendered through its template) or given token ids."""
        if req.kind == "chat":
            assert req.messages is not None and req.chat is not None
            return self.tokenizer.render_chat(req.messages, req.chat), req.chat.add_special_tokens
        return prompt_source(req.prompt), req.add_special_tokens

    def _encode_and_key(self, text: str, special: bool) -> tuple[list[int], list[int]]:
        tokens = self.tokenizer.encode(text, special)
        return tokens, block_keys(tokens, self.config.model.block_size, self.root)

    async def tokens_and_keys(self, req: ParsedRequest) -> tuple[list[int], list[int]]:
        """Tokens and block keys. Encoding runs in the tokenizer's threads unless a
        cached prefix leaves only a short tail (then the hop would cost more than
        the work, and the loop is held for well under a millisecond)."""
        start = time.perf_counter()
        try:
            source, special = self._source(req)
            if isinstance(source, list):
                tokens = source
                keys = block_keys(tokens, self.config.model.block_size, self.root)
            else:
                quick = self.tokenizer.encode_reusing(source, special, INLINE_TAIL_CHARS)
                if quick is not None:
                    tokens = quick
                    keys = block_keys(tokens, self.config.model.block_size, self.root)
                else:
                    tokens, keys = await self.tokenizer.run(self._encode_and_key, source, special)
        except ChatFormatError as exc:
            param = "messages" if req.kind == "chat" else "prompt"
            raise APIError(400, str(exc), param=param) from exc
        self.metrics.tokenize.labels(**self.metrics.labels).observe(time.perf_counter() - start)
        # As vLLM: a prompt that leaves no room for one output token is a 400; a larger
        # max_tokens is cut by the engine to what the context leaves, not refused.
        limit = self.config.model.max_model_len
        if len(tokens) >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {len(tokens)} input tokens. Please reduce the length of the input.",
                param="messages" if req.kind == "chat" else "prompt",
            )
        return tokens, keys

    async def route(self, req: ParsedRequest, exclude: frozenset[str] = frozenset()) -> Routed:
        tokens, keys = await self.tokens_and_keys(req)
        return await self.decide(tokens, keys, exclude)

    async def decide(
        self, tokens: list[int], keys: list[int], exclude: frozenset[str] = frozenset()
    ) -> Routed:
        states = self.pool.states
        pods = [
            p
            for p in self.pool.healthy()
            if p not in exclude and states[p].backend.role is not BackendRole.PREFILL
        ]
        if not pods:
            raise APIError(
                503,
                "no healthy backend for model "
                f"'{self.config.model.name}' ({len(self.pool.states)} configured, none healthy)",
            )
        loads = {p: self.pool.states[p].load() for p in pods}
        cost = self.config.cost
        policy = self.config.policy
        matches: PrefixMatches | None = None
        if policy is not Policy.COST:
            anchor = sticky_anchor(keys, tokens, cost.sticky_tokens, self.config.model.block_size)
            decision = choose_baseline(policy, pods, loads, anchor, self._rr)
        else:
            matches = await self.guard.lookup(keys, pods)
            if matches is None:
                block = self.config.model.block_size
                ranked = sticky_order(sticky_anchor(keys, tokens, cost.sticky_tokens, block), pods)
                decision = Decision(ranked[0], Reason.INDEX_DOWN, ranked, {})
            else:
                decision = choose_by_cost(
                    len(tokens),
                    matches,
                    loads,
                    cost,
                    self.config.model.block_size,
                    self.config.model.kv_bytes_per_token,
                    self.pool.mean_request_tokens,
                )
        terms = decision.terms.get(decision.pod)
        self.pool.note_routed(decision.pod, len(tokens) - (terms.cached_tokens if terms else 0))
        return Routed(tokens, keys, decision, matches)
