"""The routing pipeline: request -> tokens -> block keys -> index lookup -> cost -> choice.

Everything but the index lookup is CPU work on local data; the lookup is one
round trip through ``GuardedIndex``, so that a slow or dead index degrades routing to
sticky hashing instead of failing or stalling requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvplane.router import tracing
from kvplane.router.blockkeys import adapter_root, block_keys, chain_keys, generation_root
from kvplane.router.config import BackendRole, RouterConfig, TokenForwarding
from kvplane.router.cost import CostModel
from kvplane.router.errors import APIError
from kvplane.router.index.base import PrefixMatches, ResidencyIndex, deepest_held, lookup_or_none
from kvplane.router.policies import Decision, Policy, RoutingInput, make_policy, route
from kvplane.router.policies.sticky import index_down
from kvplane.router.pool import Pool
from kvplane.router.request import ParsedRequest
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.templates import UNTRUSTED_TEMPLATE, RequestTemplates, request_template
from kvplane.router.tokens import CachedPrefix, ChatFormatError, PromptTokenizer, prompt_source

# A new tail longer than this after a cached prefix (a fraction of a millisecond of
# encoding, on the request's path otherwise) is encoded
# after forwarding when the caller allows it, if it is at most this share of the
# prompt: text this router never saw may still be resident (another router replica
# sent it), so the prefix decided on must be most of the prompt.
DEFER_TAIL_CHARS = 1024
DEFER_MAX_TAIL_SHARE = 0.25
# A prompt longer than this whose cached prefix is not most of it is first encoded only
# a piece beyond that prefix; when no pod holds the blocks up to where that encode
# ends, its rest cannot extend any pod's match (block keys chain) and is encoded after
# forwarding, like a short tail. A long prompt's encode is then off the request's path.
# Any piece length is exact (a piece that ends inside what some pod holds only means the
# whole prompt is encoded first); a shorter one costs less on the path. Past a cached
# prefix the piece reaches PROBE_BLOCKS blocks beyond it (the first block no pod holds
# decides); with none, PROBE_CHARS, past a head many prompts share (a system prompt)
# that this router has not seen.
PROBE_PROMPT_CHARS = 8_192
PROBE_CHARS = 4_096
PROBE_BLOCKS = 2
# Such a tail is deferred only while its estimated ids (the encoded part's characters per
# id) times this stay within the context; a prompt nearer the limit is counted exactly.
# An estimate that is still short leaves the refusal to the engine (the same 400).
DEFER_ESTIMATE_MARGIN = 1.25

log = logging.getLogger("kvplane.router")


Whole = tuple[Sequence[int], list[int]]  # a prompt's token ids and block keys


class PromptTooLong(Exception):
    """The prompt fills the model's context: ``tokens`` ids (or at least that many)."""

    def __init__(self, tokens: int, exact: bool = True) -> None:
        super().__init__(tokens)
        self.tokens, self.exact = tokens, exact


@dataclass(slots=True)
class Prompt:
    """A prompt as the router sees it: token ids and their block keys.

    A *partial* prompt (``complete`` set) has only its exactly known prefix (from the
    reuse cache) in ``tokens`` and ``keys`` and an estimate in ``n_tokens``; its tail
    is encoded by ``complete``, which ``when_whole`` starts the first time it is
    asked (the router asks once the answer is on its way, so that the encode does
    not compete with the request's own path for the CPU)."""

    tokens: Sequence[int]  # a list, or an array of a partial prompt's prefix
    keys: list[int]
    n_tokens: int
    complete: Callable[[], Awaitable[Whole]] | None = None
    _rest: asyncio.Future[Whole] | None = None
    adapter: str | None = None  # the request's LoRA adapter: keys chain from its root
    # the probe's index answer for exactly ``keys`` (a partial prompt): its decision
    # takes it instead of asking again, once (a retry asks afresh)
    probed: PrefixMatches | None = None

    @property
    def partial(self) -> bool:
        return self.complete is not None

    def whole(self) -> Whole | None:
        """(tokens, keys) of the whole prompt; None while its tail is not encoded."""
        if self.complete is None:
            return self.tokens, self.keys
        rest = self._rest
        if rest is not None and rest.done() and not rest.cancelled() and not rest.exception():
            return rest.result()
        return None

    def rest(self) -> asyncio.Future[Whole]:
        """The whole partial prompt, encoding its tail now if nobody asked before."""
        if self.complete is None:
            raise ValueError("a whole prompt has no rest to encode")
        if self._rest is None:
            self._rest = asyncio.ensure_future(self.complete())
        return self._rest

    def when_whole(self, fn: Callable[[Sequence[int], list[int]], None]) -> None:
        """Call ``fn(tokens, keys)`` of the whole prompt: now, or once its tail is encoded."""
        if self.complete is None:
            fn(self.tokens, self.keys)
            return

        def done(f: asyncio.Future[Whole]) -> None:
            if f.cancelled() or f.exception() is not None:
                log.warning("tail tokenization failed: %r", f.cancelled() or f.exception())
                return
            fn(*f.result())

        self.rest().add_done_callback(done)


@dataclass(frozen=True, slots=True)
class Routed:
    prompt: Prompt
    decision: Decision
    matches: PrefixMatches | None

    @property
    def tokens(self) -> Sequence[int]:
        return self.prompt.tokens

    @property
    def keys(self) -> list[int]:
        return self.prompt.keys


class RoutingPipeline:
    def __init__(
        self,
        config: RouterConfig,
        tokenizer: PromptTokenizer,
        index: ResidencyIndex,
        pool: Pool,
        metrics: RouterMetrics,
        generation: str,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.index = index  # guarded: lookups that cannot be answered raise IndexUnavailable
        self.pool = pool
        self.metrics = metrics
        self.root = generation_root(generation)
        # a LoRA adapter's requests key their blocks in the adapter's own namespace
        self.roots = {a: adapter_root(self.root, a) for a in config.model.lora_adapters}
        # Backends that take the router's ids (forward_tokens) are sent them when the
        # prompt is whole before it goes: a short tail is then encoded on the request's
        # path, which spares the backend encoding the whole prompt. A long prompt no pod
        # holds is still sent as text: Dynamo's frontend encodes it faster than the
        # router, which also records it in the reuse cache.
        self.defer_short_tails = config.forward_tokens is TokenForwarding.OFF
        self.cost = CostModel.of(config)
        self.policy = make_policy(config.policy, self.cost, config.policy_options)
        self.by_load = make_policy("least_loaded", self.cost)  # requests with no prompt
        self._tokenize_seconds = metrics.tokenize.labels(**metrics.labels)  # labels() costs µs
        # id(ids of a cached prompt) -> (opening special ids, chain root) -> block keys; an
        # entry goes when the token cache lets go of those ids (weakref.finalize)
        self._source_keys: dict[int, dict[tuple[int, int], list[int]]] = {}
        model = config.model
        self.templates = (
            RequestTemplates(model.tokenizer, model.request_template_timeout_s)
            if model.trust_request_chat_template
            else None
        )

    def close(self) -> None:
        if self.templates is not None:
            self.templates.close()

    async def _source(self, req: ParsedRequest) -> tuple[str | list[int], bool]:
        """The text to encode (a chat rendered through its template) or given token ids.
        The served template renders off the event loop unless the body is small; a
        request's own template only where trusted, in a worker process, time-bounded."""
        if req.messages is None:
            return prompt_source(req.prompt), req.add_special_tokens
        assert req.messages is not None and req.chat is not None
        if request_template(req.chat) is None:
            tok = self.tokenizer
            text = await tok.call(req.size, tok.render_chat, req.messages, req.chat)
        elif self.templates is None:
            raise APIError(400, UNTRUSTED_TEMPLATE, param="chat_template")
        else:
            text = await self.templates.render(req.messages, req.chat)
        return text, req.chat.add_special_tokens

    def adapter(self, model: str) -> str | None:
        """The LoRA adapter a request's ``model`` names; None for the base model."""
        return model if model in self.roots else None

    def _prefix_keys(self, prefix: CachedPrefix, root: int) -> list[int]:
        """Block keys of a cached prefix, sliced from those of the whole cached prompt it
        was cut from (computed once per cached prompt: later prompts repeat it). They
        live as long as the token cache keeps that prompt, and no longer."""
        per_source = self._source_keys.get(id(prefix.source))
        if per_source is None:
            per_source = self._source_keys[id(prefix.source)] = {}
            weakref.finalize(prefix.source, self._source_keys.pop, id(prefix.source), None)
        keys = per_source.get((prefix.opening, root))
        if keys is None:
            whole = [*prefix.ids[: prefix.opening], *prefix.source.tolist()]
            keys = per_source[prefix.opening, root] = block_keys(
                whole, self.config.model.block_size, root
            )
        return keys[: len(prefix.ids) // self.config.model.block_size]

    def _keys(self, tokens: list[int], root: int) -> Prompt:
        keys = block_keys(tokens, self.config.model.block_size, root)
        return Prompt(tokens, keys, len(tokens))

    def _new_and_keys(self, text: str, special: bool, root: int) -> tuple[list[int], list[int]]:
        tokens = self.tokenizer.encode_new(text, special)
        return tokens, block_keys(tokens, self.config.model.block_size, root)

    def _complete_and_keys(
        self, prefix: CachedPrefix, prefix_keys: list[int], root: int
    ) -> tuple[list[int], list[int]]:
        """The whole prompt's ids and keys, chaining on from the prefix's keys."""
        tokens = self.tokenizer.complete(prefix)
        block = self.config.model.block_size
        parent = prefix_keys[-1] if prefix_keys else root
        return tokens, prefix_keys + chain_keys(tokens, block, parent, len(prefix_keys))

    async def _encode(self, text: str, special: bool, defer_tail: bool, root: int) -> Prompt:
        """Encoding runs on the event loop or in the tokenizer's threads by the size of
        what needs encoding (``PromptTokenizer.call``). With ``defer_tail``, a long new
        tail after a cached prefix that covers most of the prompt is encoded once the
        answer is out: the decision needs only the prefix (text this router has sent
        before is in its cache, whole prompts included, so new text is resident nowhere
        it knows of), and the context check only an upper bound on the tail's ids."""
        tok = self.tokenizer
        at_least = tok.min_ids(len(text))
        if at_least >= self.config.model.max_model_len:  # refused before any encoding
            raise PromptTooLong(at_least, exact=False)
        prefix = tok.cached_prefix(text, special)
        probed: PrefixMatches | None = None  # the index's answer for the prefix's keys
        if defer_tail and self._worth_probing(text, special, prefix):
            prefix, probed = await self._probe(text, special, prefix, root)
        if prefix is None:
            tokens, keys = await tok.call(len(text), self._new_and_keys, text, special, root)
            return Prompt(tokens, keys, len(tokens))
        limit = self.config.model.max_model_len
        keys = self._prefix_keys(prefix, root)
        # no pod holds the probed blocks to their end (an index that cannot answer
        # counts as one where some pod might)
        unheld = probed is not None and deepest_held(probed) < len(keys)
        tail = len(prefix.tail)
        if unheld:
            estimate = len(prefix.ids) + prefix.tail_estimate * DEFER_ESTIMATE_MARGIN
            defer = estimate < limit
        else:
            fits = len(prefix.ids) + prefix.max_tail_ids < limit
            short = DEFER_TAIL_CHARS < tail <= DEFER_MAX_TAIL_SHARE * len(text)
            defer = defer_tail and self.defer_short_tails and fits and short
        if defer:

            def complete() -> Awaitable[tuple[list[int], list[int]]]:
                return tok.run(self._complete_and_keys, prefix, keys, root)

            n_tokens = len(prefix.ids) + prefix.tail_estimate
            return Prompt(prefix.ids, keys, n_tokens, complete, probed=probed)
        tokens, keys = await tok.call(tail, self._complete_and_keys, prefix, keys, root)
        return Prompt(tokens, keys, len(tokens))

    def _worth_probing(self, text: str, special: bool, prefix: CachedPrefix | None) -> bool:
        """A long prompt whose cached prefix (if any) leaves more than a short tail, with
        a tokenizer whose cache can give the probed piece's exact ids."""
        if len(text) <= PROBE_PROMPT_CHARS or not self.tokenizer.can_reuse(special):
            return False
        return prefix is None or len(prefix.tail) > DEFER_MAX_TAIL_SHARE * len(text)

    async def _probe(
        self, text: str, special: bool, prefix: CachedPrefix | None, root: int
    ) -> tuple[CachedPrefix | None, PrefixMatches | None]:
        """Encode a piece of ``text`` beyond its cached prefix (``PROBE_BLOCKS`` blocks
        past it, or ``PROBE_CHARS`` from the start without one; the piece joins the
        reuse cache, which then gives the exact ids of ``text`` up to a segment boundary
        in it) and ask the index which pods hold those blocks. Returns the longer prefix
        and the index's answer for its keys; None for the answer when it gave no longer
        prefix or the index cannot answer."""
        tok = self.tokenizer
        start, reach = 0, PROBE_CHARS
        if prefix is not None:
            block = self.config.model.block_size
            start, reach = prefix.cut, min(reach, tok.reach(prefix, PROBE_BLOCKS * block))
        piece = text[: start + reach]
        await tok.call(reach, tok.encode, piece, special)
        longer = tok.cached_prefix(text, special)
        if longer is None or (prefix is not None and longer.cut <= prefix.cut):
            return prefix, None
        keys = self._prefix_keys(longer, root)
        if not keys:
            return longer, None
        return longer, await lookup_or_none(self.index, keys, self.pool.healthy())

    async def prompt(self, req: ParsedRequest, defer_tail: bool = False) -> Prompt:
        """The request's tokens and block keys; a prompt the model cannot take is a 400."""
        start = time.perf_counter()
        param = {"chat": "messages", "responses": "input"}.get(req.kind, "prompt")
        limit = self.config.model.max_model_len
        adapter = self.adapter(req.model)
        root = self.roots[adapter] if adapter is not None else self.root
        try:
            source, special = await self._source(req)
            if isinstance(source, list):
                if len(source) >= limit:  # before hashing it into block keys
                    raise PromptTooLong(len(source))
                prompt = self._keys(source, root)
            else:
                prompt = await self._encode(source, special, defer_tail, root)
            prompt.adapter = adapter
            # As vLLM: a prompt that leaves no room for one output token is a 400; a
            # larger max_tokens is cut by the engine to what the context leaves, not
            # refused. (A deferred tail is only taken when even its longest encoding fits.)
            if prompt.n_tokens >= limit:
                raise PromptTooLong(prompt.n_tokens)
        except ChatFormatError as exc:
            raise APIError(400, str(exc), param=param) from exc
        except PromptTooLong as exc:
            at = "" if exc.exact else "at least "
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your request "
                f"has {at}{exc.tokens} input tokens. Please reduce the length of the input.",
                param=param,
            ) from None
        self._tokenize_seconds.observe(time.perf_counter() - start)
        tracing.record("kvplane.tokenize", start)
        return prompt

    async def tokens_and_keys(self, req: ParsedRequest) -> tuple[list[int], list[int]]:
        """The whole prompt's tokens and block keys."""
        prompt = await self.prompt(req)
        tokens = prompt.tokens  # a list: only a partial prompt holds an array
        return tokens if isinstance(tokens, list) else list(tokens), prompt.keys

    async def route(
        self, req: ParsedRequest, exclude: frozenset[str] = frozenset(), defer_tail: bool = False
    ) -> Routed:
        return await self.decide(await self.prompt(req, defer_tail), exclude)

    async def route_by_load(self, req: ParsedRequest, only: str | None = None) -> Routed:
        """A request with no prompt a pod could hold cached (embeddings, scores,
        tokenization, tool-call turns): the least loaded pod, or ``only``. Its size is
        estimated from the body (a token is about four bytes of JSON text); tokenizing
        puts none on the engine's model."""
        computes = req.kind not in ("tokenize", "detokenize")
        prompt = Prompt([], [], req.size // 4 if computes else 0)
        return await self.decide(prompt, policy=self.by_load, only=only)

    async def decide(
        self,
        prompt: Prompt,
        exclude: frozenset[str] = frozenset(),
        policy: Policy | None = None,
        only: str | None = None,
    ) -> Routed:
        """``only``: the one pod the request may go to (it holds state no other has)."""
        states = self.pool.states
        pods = [
            p
            for p in self.pool.healthy()
            if p not in exclude
            and states[p].backend.role is not BackendRole.PREFILL
            and (only is None or p == only)
        ]
        if only is not None and not pods:
            raise APIError(
                503, f"backend {only}, which holds the state this request needs, is unavailable"
            )
        if not pods:
            raise APIError(
                503,
                "no healthy backend for model "
                f"'{self.config.model.name}' ({len(self.pool.states)} configured, none healthy)",
            )
        loads = self.pool.loads(pods)
        labels = None
        if self.cost.peer_pull is not None:  # peer pulls cost each pair's link
            labels = {p: states[p].backend.labels for p in pods}
        inp = RoutingInput(
            prompt.n_tokens,
            prompt.tokens,
            prompt.keys,
            loads,
            adapter=prompt.adapter,
            labels=labels,
        )
        with tracing.span("kvplane.choose"):
            known, prompt.probed = prompt.probed, None  # once: a retry asks afresh
            decision, matches = await route(
                policy or self.policy, self.index, inp, self._index_down, known
            )
            if tracing.on():
                tracing.set_attributes(
                    pod=decision.pod, reason=decision.reason, prompt_tokens=prompt.n_tokens
                )
        terms = decision.terms.get(decision.pod)
        self.pool.note_routed(decision.pod, prompt.n_tokens - (terms.cached_tokens if terms else 0))
        return Routed(prompt, decision, matches)

    def _index_down(self, inp: RoutingInput) -> Decision:
        return index_down(self.cost, inp)
