"""Exact reuse of token ids across prompts that share a text prefix.

Byte-level BPE never merges across pre-tokenizer segments, so the ids of a text
prefix that ends on a segment boundary are the ids of the whole text up to that
boundary. A prompt that repeats a long prefix of an earlier one (multi-turn
chat, RAG over the same documents) therefore only needs its new tail encoded.

The cache keys a prompt by chained xxh3 hashes of its text in fixed-size
character chunks. For each chunk end ``L`` it stores a *cut*: a segment
boundary ``b`` well before ``L`` together with the number of ids before it. The
cut is only valid when the segmentation up to ``b`` cannot depend on text past
``L``: the segment that starts at ``b`` must end, with one character of regex
lookahead and room for the longest added (special) token, before ``L``. A new
prompt that agrees with the cached one on ``[0, L)`` then has the same ids up to
``b`` and the same boundary at ``b``.

Only tokenizers where this argument holds use the cache: no normalizer, a
pre-tokenizer made of regex splits and ByteLevel, and no Metaspace (which would
prepend a marker to a tail encoded on its own). ``tests/test_token_reuse.py``
checks exactness against full encoding over adversarial prompts.
"""

from __future__ import annotations

import json
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import xxhash

CHUNK_CHARS = 512


class _Spans(Protocol):
    """Where tokens and pre-tokenizer segments ("words") sit in the text."""

    def char_to_token(self, pos: int) -> int | None: ...

    def token_to_word(self, token: int) -> int | None: ...

    def word_to_tokens(self, word: int) -> tuple[int, int] | None: ...

    def word_to_chars(self, word: int) -> tuple[int, int] | None: ...


class _Encoding(_Spans, Protocol):
    @property
    def ids(self) -> list[int]: ...

    @property
    def word_ids(self) -> list[int | None]: ...

    def token_to_chars(self, token: int) -> tuple[int, int] | None: ...


class SortedSpans:
    """An encoding's spans by binary search. ``tokenizers``' own ``char_to_token`` and
    ``word_to_tokens`` scan the tokens from the first on every call, which made
    recording a long prompt's cuts quadratic in its length; ``token_to_chars`` is a
    direct lookup. The searches rely on what a byte-level BPE pipeline (the only kind
    ``reuse_is_exact`` admits) guarantees: tokens come in text order, so their
    character offsets never go backwards; word ids are checked."""

    def __init__(self, encoding: _Encoding, words: list[int]) -> None:
        self._encoding = encoding
        self._words = words
        self._ends = _Ends(encoding, len(words))

    @classmethod
    def of(cls, encoding: _Encoding) -> _Spans:
        """The searches where word ids are in order, else the encoding's own lookups."""
        words = encoding.word_ids
        if None in words or words != sorted(words):  # type: ignore[type-var]
            return encoding
        return cls(encoding, words)  # type: ignore[arg-type]  # None ruled out

    def _chars(self, token: int) -> tuple[int, int]:
        chars = self._encoding.token_to_chars(token)
        assert chars is not None  # every token of a single sequence has offsets
        return chars

    def char_to_token(self, pos: int) -> int | None:
        # the first token that ends after pos, if it starts at or before it
        i = bisect_right(self._ends, pos)
        return i if i < len(self._words) and self._chars(i)[0] <= pos else None

    def token_to_word(self, token: int) -> int | None:
        return self._words[token] if 0 <= token < len(self._words) else None

    def word_to_tokens(self, word: int) -> tuple[int, int] | None:
        first, end = bisect_left(self._words, word), bisect_right(self._words, word)
        return (first, end) if first < end else None

    def word_to_chars(self, word: int) -> tuple[int, int] | None:
        span = self.word_to_tokens(word)
        return None if span is None else (self._chars(span[0])[0], self._chars(span[1] - 1)[1])


class _Ends(Sequence[int]):
    """Each token's end offset, looked up when a search asks for it."""

    def __init__(self, encoding: _Encoding, n: int) -> None:
        self._encoding, self._n = encoding, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> int:  # type: ignore[override]  # no slices
        chars = self._encoding.token_to_chars(i)
        assert chars is not None
        return chars[1]


def reuse_is_exact(backend_json: str) -> bool:
    """Whether the tokenizer's pipeline satisfies the segment-independence argument."""
    spec: dict[str, Any] = json.loads(backend_json)
    norm = spec.get("normalizer")
    if norm is not None and not (norm.get("type") == "Sequence" and not norm.get("normalizers")):
        return False
    if (spec.get("model") or {}).get("type") != "BPE":
        return False
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = {p.get("type") for p in parts}
    if "ByteLevel" not in kinds or not kinds <= {"Split", "ByteLevel", "Digits", "Punctuation"}:
        return False
    for p in parts:
        if p.get("type") == "ByteLevel" and p.get("add_prefix_space"):
            return False
        if p.get("type") == "Split" and p.get("behavior") not in ("Isolated", "Removed"):
            return False
    return True


@dataclass(slots=True)
class _Entry:
    ids: array[int]  # ids of the whole cached prompt; cuts share it
    n_ids: int  # ids before the cut
    cut: int  # character offset of the cut


def chunk_hashes(text: str, chunk: int = CHUNK_CHARS) -> list[int]:
    """Chained hash of ``text[:k*chunk]`` for every full chunk ``k >= 1``."""
    h = xxhash.xxh3_64()
    out: list[int] = []
    for start in range(0, len(text) - chunk + 1, chunk):
        h.update(text[start : start + chunk].encode("utf-8", "surrogatepass"))
        out.append(h.intdigest())
    return out


class PrefixTokenCache:
    """LRU of cuts into recently encoded prompts, bounded by cached token count.

    Thread-safe: the router looks up on the event loop and fills from its
    tokenizer threads."""

    def __init__(self, max_tokens: int, max_added_token_chars: int, chunk: int = CHUNK_CHARS):
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._prompts: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()
        self._max_tokens = max_tokens
        self._tokens = 0
        self.margin = max_added_token_chars + 2  # characters a cut keeps from a chunk's end
        self._chunk = chunk
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every cached prompt."""
        with self._lock:
            self._entries.clear()
            self._prompts.clear()
            self._tokens = 0

    def find(self, hashes: list[int]) -> _Entry | None:
        """The cut of the longest cached chunk-prefix of a prompt, if any."""
        with self._lock:
            return self._find(hashes)

    def _find(self, hashes: list[int]) -> _Entry | None:
        for h in reversed(hashes):
            entry = self._entries.get(h)
            if entry is not None:
                self._entries.move_to_end(h)
                self.hits += 1
                return entry
        self.misses += 1
        return None

    def add(
        self,
        hashes: list[int],
        encoding: _Encoding,
        ids: array[int],
        text_len: int,
        base: tuple[int, int] = (0, 0),
    ) -> None:
        """Record cuts for every chunk of a freshly encoded prompt. ``encoding`` may cover
        only the text from an earlier cut on: ``base`` is that cut (ids before it, its
        character offset), and ``ids`` the whole prompt's."""
        with self._lock:
            self._add(hashes, encoding, ids, text_len, base)

    def _add(
        self,
        hashes: list[int],
        encoding: _Encoding,
        ids: array[int],
        text_len: int,
        base: tuple[int, int],
    ) -> None:
        if not hashes or hashes[-1] in self._entries:
            return
        base_ids, base_chars = base
        keys: list[int] = []
        spans = SortedSpans.of(encoding)
        for k, h in enumerate(hashes, start=1):
            if h in self._entries:
                continue
            limit = k * self._chunk - self.margin - base_chars
            cut = _cut_before(spans, limit, text_len - base_chars)
            if cut is None:
                continue
            n_ids, offset = cut
            self._entries[h] = _Entry(ids, base_ids + n_ids, base_chars + offset)
            keys.append(h)
        if not keys:
            return
        self._prompts[keys[-1]] = (len(ids), keys)
        self._tokens += len(ids)
        while self._tokens > self._max_tokens and self._prompts:
            _, (n, old_keys) = self._prompts.popitem(last=False)
            self._tokens -= n
            for old in old_keys:
                self._entries.pop(old, None)


def _cut_before(encoding: _Spans, limit: int, text_len: int) -> tuple[int, int] | None:
    """(ids before, char offset) of a segment boundary whose next segment ends before
    ``limit``; None when no such boundary is near (e.g. one huge segment)."""
    if limit <= 0 or limit > text_len:
        return None
    pos = limit
    for _ in range(8):
        token = encoding.char_to_token(pos)
        if token is None:  # a character that produced no token of its own
            pos -= 1
            if pos <= 0:
                return None
            continue
        word = encoding.token_to_word(token)
        if word is None:
            return None
        span = encoding.word_to_tokens(word)
        chars = encoding.word_to_chars(word)
        if span is None or chars is None:
            return None
        start_char, end_char = chars
        if end_char < limit:
            return span[0], start_char
        pos = start_char - 1
        if pos <= 0:
            return None
    return None
