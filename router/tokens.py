"""Request -> token ids, exactly as the engine computes them.

vLLM encodes a completion prompt with the HF fast tokenizer
(``add_special_tokens=True`` by default) and a chat request by rendering the
chat template to text (``add_generation_prompt=True``) and encoding that with
``add_special_tokens=False``. Residency keys are only as good as this match,
so ``tests/test_tokenize_vs_vllm.py`` compares with a real engine's
``/tokenize``.

Encoding is CPU-bound: off the event loop it runs through ``encode_batch``, which
releases the GIL (``encode`` does not).
"""

from __future__ import annotations

import asyncio
import math
from array import array
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from kvplane.router.token_reuse import CHUNK_CHARS, PrefixTokenCache, chunk_hashes, reuse_is_exact
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerBase

T = TypeVar("T")
# Encoding at most this many characters (about 1000 tokens) is done on the event loop,
# which costs less than a thread hop; longer texts go to the tokenizer's threads.
INLINE_CHARS: Final = 4096


class ChatFormatError(ValueError):
    """The messages cannot be rendered (bad roles or content parts)."""


@dataclass(frozen=True, slots=True)
class ChatOptions:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    tools: list[Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)


def _text_of(content: Any) -> str:
    """vLLM's "string" content format: text parts joined with newlines."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ChatFormatError(f"unsupported message content part: {kind!r}")
        return "\n".join(texts)
    raise ChatFormatError("message content must be a string or a list of parts")


def normalise_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ChatFormatError("'messages' must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ChatFormatError(f"messages[{i}] must be an object with a string 'role'")
        norm = dict(msg)
        norm["content"] = _text_of(msg.get("content"))
        out.append(norm)
    return out


MAX_TOKEN_ID: Final = 2**32 - 1  # ids are hashed as uint32 (blockkeys.py)


def _token_ids(ids: list[Any]) -> list[int]:
    if not ids or not all(type(t) is int for t in ids):
        raise ChatFormatError("'prompt' must be a string, a list of strings or token ids")
    low, high = min(ids), max(ids)
    # vLLM's words; ids past the tokenizer's vocabulary but below 2**32 are left to the
    # engine, which knows the model's (possibly larger) vocabulary
    if low < 0:
        raise ChatFormatError(f"Token id {low} is out of vocabulary")
    if high > MAX_TOKEN_ID:
        raise ChatFormatError(f"Token id {high} is out of vocabulary")
    return ids


def prompt_source(prompt: Any) -> str | list[int]:
    """A completion ``prompt`` as text or token ids; a batch is routed by its first item."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return first
        if isinstance(first, list):
            return _token_ids(first)
        return _token_ids(prompt)
    raise ChatFormatError("'prompt' must be a string, a list of strings or token ids")


def render_chat(
    hf: PreTrainedTokenizerBase, messages: Sequence[Any], opts: ChatOptions, default: str | None
) -> str:
    """The prompt text of a chat as vLLM renders it; ``default``: the served template
    (None: the tokenizer's). A template in ``chat_template_kwargs`` wins, as in vLLM."""
    msgs = normalise_messages(messages)
    kwargs: dict[str, Any] = dict(opts.chat_template_kwargs)
    template = kwargs.pop("chat_template", None) or opts.chat_template or default
    try:
        rendered = hf.apply_chat_template(
            msgs,
            tools=opts.tools,
            documents=opts.documents,
            chat_template=template,
            add_generation_prompt=opts.add_generation_prompt,
            continue_final_message=opts.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except ChatFormatError:
        raise
    except Exception as exc:  # jinja errors, raise_exception() in templates, bad kwargs
        raise ChatFormatError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(rendered, str):
        raise ChatFormatError("chat template did not render to text")
    return rendered


@dataclass(frozen=True, slots=True)
class CachedPrefix:
    """A prompt whose leading ids the reuse cache knows exactly; its tail is not encoded yet.

    A router can decide on these ids (the tail, new text, cannot be resident anywhere
    this cache would not know of) and encode the tail after forwarding."""

    ids: array[int]  # opening special ids + the cached prefix's ids (an array: no boxing)
    tail: str  # the text after them
    source: array[int]  # ids of the whole cached prompt the prefix was cut from
    opening: int  # how many of ``ids`` are opening special ids
    cut: int  # character offset of the tail
    hashes: list[int]  # the text's chunk hashes, to cache the completed prompt under
    closing: list[int]  # special ids the post-processor appends
    max_tail_ids: int  # no encoding of the tail (with closing ids) has more ids
    tail_estimate: int  # ids the tail most likely has (the cached prompt's chars per id)


class PromptTokenizer:
    """The engine's tokenizer and chat template, with exact prefix reuse."""

    def __init__(
        self,
        path: str | Path,
        chat_template: str | None = None,
        reuse_max_tokens: int = 4_000_000,
        threads: int = 2,
        max_prompt_ids: int | None = None,
    ) -> None:
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(path))
        self._rust: Tokenizer = self.hf.backend_tokenizer
        self._chat_template = chat_template
        # prompts with this many ids or more are refused: never cached
        self.max_prompt_ids = max_prompt_ids
        added = [t.content for t in self._rust.get_added_tokens_decoder().values()]
        max_added = max((len(t) for t in added), default=0)
        exact = reuse_is_exact(self._rust.to_str())
        self.reuse_enabled = reuse_max_tokens > 0 and exact
        # Where text is not normalised before byte-level BPE, one id covers at most the
        # longest vocabulary entry's characters (one per byte) or the longest added token,
        # so a text of N characters has at least N / that many ids (0: no such bound).
        longest = max((len(t) for t in self._rust.get_vocab(with_added_tokens=False)), default=0)
        self.max_chars_per_id = max(longest, max_added) if exact else 0
        self._cache = PrefixTokenCache(reuse_max_tokens, max_added)
        self._specials = self._special_affixes()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenize")

    def _special_affixes(self) -> tuple[list[int], list[int]] | None:
        """Ids the post-processor adds around a text (BOS etc.), if separable."""
        bare = self._rust.encode("a", add_special_tokens=False).ids
        full = self._rust.encode("a", add_special_tokens=True).ids
        for i in range(len(full) - len(bare) + 1):
            if full[i : i + len(bare)] == bare:
                return full[:i], full[i + len(bare) :]
        return None

    @property
    def reuse_stats(self) -> tuple[int, int]:
        return self._cache.hits, self._cache.misses

    def min_ids(self, chars: int) -> int:
        """A lower bound on the ids of any text of ``chars`` characters (0 if unknown)."""
        return -(-chars // self.max_chars_per_id) if self.max_chars_per_id else 0

    def reach(self, prefix: CachedPrefix, ids: int) -> int:
        """Characters past ``prefix`` to encode so that this cache then knows about
        ``ids`` more ids of the text exactly: its exact ids end at a segment boundary
        before the last whole chunk of what was encoded, and the prefix's own characters
        per id estimate the rest."""
        per_id = prefix.cut / max(1, len(prefix.ids) - prefix.opening)
        return 2 * CHUNK_CHARS + self._cache.margin + math.ceil(ids * per_id)

    def can_reuse(self, add_special_tokens: bool) -> bool:
        """Whether prompts encoded so are cached and their prefixes reused."""
        return self.reuse_enabled and not (add_special_tokens and self._specials is None)

    def _cacheable(self, n_ids: int) -> bool:
        return self.max_prompt_ids is None or n_ids < self.max_prompt_ids

    # -- encoding ---------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; equal to a full encode, cheaper on a shared prefix."""
        prefix = self.cached_prefix(text, add_special_tokens)
        if prefix is not None:
            return self.complete(prefix)
        return self.encode_new(text, add_special_tokens)

    def cached_prefix(self, text: str, add_special_tokens: bool) -> CachedPrefix | None:
        """The exactly known leading ids of ``text`` from the reuse cache (None: no reusable
        prefix, or reuse is off). Nothing is encoded: the tail is left to ``complete``."""
        if not self.can_reuse(add_special_tokens):
            return None
        hashes = chunk_hashes(text)
        entry = self._cache.find(hashes) if hashes else None
        if entry is None:
            return None
        head, closing = self._specials if add_special_tokens and self._specials else ([], [])
        tail = text[entry.cut :]
        per_id = entry.cut / max(1, entry.n_ids)  # the cached prompt's characters per id
        return CachedPrefix(
            ids=array("I", head) + entry.ids[: entry.n_ids],
            tail=tail,
            source=entry.ids,
            opening=len(head),
            cut=entry.cut,
            hashes=hashes,
            closing=list(closing),
            # A byte-level BPE id covers at least one byte of text.
            max_tail_ids=len(tail.encode("utf-8", "surrogatepass")) + len(closing),
            tail_estimate=math.ceil(len(tail) / per_id) + len(closing) if per_id else len(tail),
        )

    def complete(self, prefix: CachedPrefix) -> list[int]:
        """All ids of a prompt found by ``cached_prefix``: only its tail is encoded, with
        the GIL released (``encode_batch``), so that off the loop it blocks nobody. The
        whole prompt then joins the cache: the next turn of a conversation reuses it all,
        not just the part this one reused."""
        enc = self._rust.encode_batch([prefix.tail], add_special_tokens=False)[0]
        tail = enc.ids
        body = prefix.ids[prefix.opening :]
        if self._cacheable(len(prefix.ids) + len(tail) + len(prefix.closing)):
            self._cache.add(
                prefix.hashes,
                enc,
                body + array("I", tail),
                prefix.cut + len(prefix.tail),
                (len(body), prefix.cut),
            )
        return [*prefix.ids.tolist(), *tail, *prefix.closing]

    def encode_new(self, text: str, add_special_tokens: bool) -> list[int]:
        """A full encode (GIL released) that feeds the reuse cache for later prompts."""
        if not self.can_reuse(add_special_tokens):
            enc = self._rust.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            return list(enc.ids)
        enc = self._rust.encode_batch([text], add_special_tokens=False)[0]
        ids = enc.ids
        head, closing = self._specials if add_special_tokens and self._specials else ([], [])
        hashes = chunk_hashes(text) if self._cacheable(len(head) + len(ids) + len(closing)) else []
        if hashes:
            self._cache.add(hashes, enc, array("I", ids), len(text))
        if head or closing:
            return [*head, *ids, *closing]
        return list(ids)

    async def call(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)``, an encode of ``chars`` characters: on the event loop when at
        most ``INLINE_CHARS`` (less than a thread hop costs on a busy machine, where the
        thread then waits for the GIL), else in the tokenizer's threads."""
        if chars <= INLINE_CHARS:
            return fn(*args)
        return await self.run(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the tokenizer's threads, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def encode_async(self, text: str, add_special_tokens: bool) -> list[int]:
        """``encode``, on or off the event loop by the size of what needs encoding."""
        prefix = self.cached_prefix(text, add_special_tokens)
        if prefix is not None:
            return await self.call(len(prefix.tail), self.complete, prefix)
        return await self.call(len(text), self.encode_new, text, add_special_tokens)

    def render_chat(self, messages: Sequence[Any], opts: ChatOptions) -> str:
        return render_chat(self.hf, messages, opts, self._chat_template)

    def encode_chat(self, messages: Sequence[Any], opts: ChatOptions) -> list[int]:
        return self.encode(self.render_chat(messages, opts), opts.add_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def tokenizer_fingerprint(path: str | Path) -> str:
    """What identifies a tokenizer for the generation tag: its vocab and template files."""
    import hashlib

    h = hashlib.sha256()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        p = Path(path) / name
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()[:12]
