"""Benchmark workloads as traces of prompts built from deterministic token segments.

A request names the *segments* its prompt is made of instead of carrying tokens:

    prompt = BOS + concat(segment(s) for s in segments)[: input_length - 1]

Every segment is a deterministic function of (seed, segment id), so equal ids give
equal token blocks in any order and any process, and a trace of 145 M prompt tokens
(Mooncake) stays a few megabytes until a prompt is actually needed. Prefix reuse is
expressed by sharing leading segment ids, exactly as Mooncake's prefix ``hash_ids``.

Sources of the shapes:

- ``mooncake``: the conversation trace of the Mooncake FAST'25 release
  (https://github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/conversation_trace.jsonl``,
  Apache-2.0; a copy ships in ``data/``): 512-token prefix hash ids.
- ``generated_shared_prefix``: SGLang ``bench_serving --dataset-name
  generated-shared-prefix`` defaults (64 groups x 16, system 2048, question 128, output 256).
- ``multi_round_qa``: production-stack ``benchmarks/multi-round-qa`` (shared system
  prompt, per-user history, rounds spaced ``users/qps`` apart).
- ``long_doc_qa``: LMCache ``benchmarks/long_doc_qa`` (warm-up round, then repeats).
- ``no_reuse``: a control with nothing shared but BOS.
"""

from __future__ import annotations

import json
import lzma
import math
import os
import random
import re
from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import reduce
from pathlib import Path
from typing import IO, Any, Final

import xxhash

MOONCAKE_FILE = "mooncake_conversation_trace.jsonl.xz"
MOONCAKE_ENV = "KVPLANE_MOONCAKE_TRACE"
MOONCAKE_BLOCK = 512
MOONCAKE_BATCH_MS = 3000.0  # the trace's timestamps come in batches about 3 s apart


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float  # offset from run start, seconds of simulated time
    session: str  # conversation/group id (for multi-turn and analysis)
    input_length: int  # prompt tokens, BOS included
    output_tokens: int
    segments: tuple[int, ...]  # ids of the deterministic token segments of the prompt
    segment_tokens: int = MOONCAKE_BLOCK  # tokens per segment (the workload's)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    description: str
    requests: list[TraceRequest]
    segment_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def duration_s(self) -> float:
        """Span of the arrivals (0 for fewer than two requests)."""
        if len(self.requests) < 2:
            return 0.0
        return self.requests[-1].arrival_s - self.requests[0].arrival_s

    @property
    def offered_rps(self) -> float:
        span = self.duration_s
        return (len(self.requests) - 1) / span if span > 0 else 0.0


# --------------------------------------------------------------------------- tokens


def _segment_seed(seed: int, segment: int) -> int:
    return xxhash.xxh3_64_intdigest(f"kvplane-segment:{seed}:{segment}".encode())


class SegmentTokens:
    """Deterministic token ids of segments drawn from a vocabulary, memoised per segment.

    The memo is an LRU of at most ``cache_segments`` segments: a Mooncake replay
    touches ~180k distinct segments, far too many to keep, but consecutive requests
    share most of theirs.
    """

    def __init__(
        self, vocab: Sequence[int], bos: int, seed: int = 0, cache_segments: int = 8192
    ) -> None:
        if not 2 <= len(vocab) <= 1 << 16:
            raise ValueError("a segment vocabulary needs 2 to 65536 tokens")
        self.vocab = tuple(vocab)
        n = len(self.vocab)
        self._table = [self.vocab[i % n] for i in range(1 << 16)]
        self.bos = bos
        self.seed = seed
        self._cache: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
        self._cap = max(1, cache_segments)

    def segment(self, segment: int, length: int) -> list[int]:
        key = (segment, length)
        cache = self._cache
        toks = cache.get(key)
        if toks is not None:
            cache.move_to_end(key)
            return toks
        # 16 random bits per token index a 65536-entry table of the vocabulary: a C loop,
        # where Random.choices topped a Mooncake replay's profile.
        picks = array("H", random.Random(_segment_seed(self.seed, segment)).randbytes(2 * length))
        toks = list(map(self._table.__getitem__, picks))
        cache[key] = toks
        if len(cache) > self._cap:
            cache.popitem(last=False)
        return toks

    def token_ids(self, req: TraceRequest) -> list[int]:
        """BOS + the segments' tokens, cut at ``input_length``."""
        need = req.input_length - 1
        out = [self.bos]
        size = req.segment_tokens
        for seg in req.segments:
            if need <= 0:
                break
            toks = self.segment(seg, size)
            out.extend(toks if need >= size else toks[:need])
            need -= size
        if need > 0:
            raise ValueError(
                f"request of {req.input_length} tokens names only {len(req.segments)} "
                f"segments of {size}"
            )
        return out


class SyntheticTokens(SegmentTokens):
    """Token ids for a simulator, which only compares them: no tokenizer, no words.

    A segment is a unique head token (``HEAD_BASE + id``) followed by a slice of one
    seeded random table at an offset derived from the id: the head alone makes
    different segments differ, and a slice costs a copy instead of a draw.
    """

    HEAD_BASE: Final = 1_000_000
    TABLE: Final = 1 << 16

    def __init__(self, seed: int = 0) -> None:
        super().__init__(range(1000, 31000), bos=0, seed=seed, cache_segments=1)
        rng = random.Random(_segment_seed(seed, -1))
        self._pool = rng.choices(self.vocab, k=2 * self.TABLE)

    def segment(self, segment: int, length: int) -> list[int]:
        if length - 1 > self.TABLE:
            return super().segment(segment, length)
        off = _segment_seed(self.seed, segment) % self.TABLE
        return [self.HEAD_BASE + segment, *self._pool[off : off + length - 1]]


def synthetic_tokens(seed: int = 0) -> SegmentTokens:
    """Token ids without a tokenizer (the discrete-event simulator only needs ids)."""
    return SyntheticTokens(seed)


_WORD = re.compile(r" [A-Za-z]+")
_SPACE_MARKS = ("Ġ", "▁")
VOCAB_WORDS = 4096


class PromptBuilder:
    """Turns trace requests into exact token ids and a text that tokenizes to them.

    The vocabulary is words that are one token each *with* their leading space:
    a byte-level BPE pre-tokenizes on spaces, so a text of such words joined by
    nothing but their own spaces encodes to exactly one token per word. Each chosen
    word is checked alone, and the whole set on long random sequences.
    """

    def __init__(
        self,
        tokenizer_dir: Path,
        seed: int = 0,
        *,
        words: int = VOCAB_WORDS,
        cache_segments: int = 8192,
    ) -> None:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        bos = tok.bos_token_id
        if bos is None:
            raise ValueError(f"tokenizer in {tokenizer_dir} has no BOS token")
        self.tokenizer = tok
        self.bos: int = int(bos)
        # Does the tokenizer prepend BOS itself? If not (DeepSeek: add_bos_token false),
        # the text carries the BOS token's literal, which encodes to the special token.
        adds_bos = tok.encode(" a", add_special_tokens=True)[:1] == [self.bos]
        self._prefix = "" if adds_bos else str(tok.bos_token)
        self.words = self._pick_words(tok, seed, words)
        self.vocab_ids = tuple(sorted(self.words))
        self.tokens = SegmentTokens(self.vocab_ids, self.bos, seed, cache_segments)

    @staticmethod
    def _pick_words(tok: Any, seed: int, n: int) -> dict[int, str]:
        special = set(tok.all_special_ids)
        candidates: list[tuple[int, str]] = []
        # Byte-level BPE spells a leading space "Ġ", SentencePiece "▁"; the encode check
        # below drops any piece whose text is not really " word".
        for piece, i in tok.get_vocab().items():
            if i not in special and piece[:1] in _SPACE_MARKS:
                text = " " + piece[1:]
                if _WORD.fullmatch(text):
                    candidates.append((i, text))
        candidates.sort()
        encoded = tok([w for _, w in candidates], add_special_tokens=False)["input_ids"]
        single = [(i, w) for (i, w), ids in zip(candidates, encoded, strict=True) if ids == [i]]
        if len(single) < 2000:
            raise ValueError(f"tokenizer has only {len(single)} single-token ' word' tokens")
        rng = random.Random(seed)
        chosen = dict(rng.sample(single, min(n, len(single))))
        ids = sorted(chosen)
        for trial in range(4):  # the set as a whole: long random sequences, one token each
            seq = random.Random(seed * 31 + trial).choices(ids, k=20_000)
            got = tok.encode("".join(chosen[i] for i in seq), add_special_tokens=False)
            if got != seq:
                raise ValueError("chosen words do not tokenize one token per word")
        return chosen

    def token_ids(self, req: TraceRequest) -> list[int]:
        return self.tokens.token_ids(req)

    def text(self, req: TraceRequest) -> str:
        """Text whose ``encode(..., add_special_tokens=True)`` is ``token_ids(req)``."""
        words = self.words
        ids = self.token_ids(req)
        return self._prefix + "".join([words[t] for t in ids[1:]])


# --------------------------------------------------------------------------- Mooncake


def default_mooncake_path() -> Path:
    """``$KVPLANE_MOONCAKE_TRACE``, else the copy shipped in this package (xz)."""
    env = os.environ.get(MOONCAKE_ENV)
    return Path(env) if env else Path(__file__).with_name("data") / MOONCAKE_FILE


def _open_text(path: Path) -> IO[str]:
    """A trace file, xz-compressed (``.xz``) or plain."""
    if path.suffix == ".xz":
        return lzma.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _spread(stamps_ms: Sequence[float]) -> list[float]:
    """Spread each batch of equal timestamps evenly over the gap to the next batch."""
    out: list[float] = []
    i, n = 0, len(stamps_ms)
    while i < n:
        j = i
        while j < n and stamps_ms[j] == stamps_ms[i]:
            j += 1
        gap = stamps_ms[j] - stamps_ms[i] if j < n else MOONCAKE_BATCH_MS
        gap = min(gap, MOONCAKE_BATCH_MS)
        k = j - i
        out.extend(stamps_ms[i] + gap * m / k for m in range(k))
        i = j
    return out


def mooncake(
    path: Path | None = None,
    *,
    limit: int | None = None,
    start: int = 0,
    rate_scale: float = 1.0,
    spread_batches: bool = True,
) -> Workload:
    """The Mooncake conversation trace: hash ids become 512-token segments.

    Arrivals are ``timestamp / 1000 / rate_scale`` from the first selected request.
    The trace comes in ~3 s batches; ``spread_batches`` spaces each batch evenly over
    its gap to the next one (at most 3 s), which a smooth replay needs. The session
    of a request is its first non-universal hash id (block 0 is shared by all).
    """
    if rate_scale <= 0:
        raise ValueError("rate_scale must be positive")
    src = path if path is not None else default_mooncake_path()
    rows: list[dict[str, Any]] = []
    with _open_text(Path(src)) as fh:
        for lineno, line in enumerate(fh):
            if lineno < start:
                continue
            if limit is not None and len(rows) >= limit:
                break
            if line.strip():
                rows.append(json.loads(line))
    # spread on the whole selection, so a batch cut by `limit` keeps its own spacing
    stamps = [float(r["timestamp"]) for r in rows]
    if spread_batches:
        stamps = _spread(stamps)
    t0 = stamps[0] if stamps else 0.0
    reqs = []
    for r, ts in zip(rows, stamps, strict=True):
        ids = tuple(int(h) for h in r["hash_ids"])
        n_in = int(r["input_length"])
        if math.ceil(n_in / MOONCAKE_BLOCK) > len(ids):
            raise ValueError(f"{src}: input_length {n_in} needs more than {len(ids)} hash ids")
        reqs.append(
            TraceRequest(
                arrival_s=(ts - t0) / 1000.0 / rate_scale,
                session=f"h{ids[1] if len(ids) > 1 else ids[0]}",
                input_length=n_in,  # BOS is the first of them
                output_tokens=max(1, int(r["output_length"])),
                segments=ids,
                segment_tokens=MOONCAKE_BLOCK,
            )
        )
    reqs.sort(key=lambda q: q.arrival_s)
    scale = "" if rate_scale == 1.0 else f", rate x{rate_scale:g}"
    return Workload(
        name="mooncake",
        description=f"Mooncake conversation trace ({len(reqs)} requests from line {start}"
        f"{scale}{', batches spread' if spread_batches else ''})",
        requests=reqs,
        segment_tokens=MOONCAKE_BLOCK,
    )


# --------------------------------------------------------------------------- synthetic


class _Ids:
    """Allocates fresh segment ids."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        out = tuple(range(self.next, self.next + n))
        self.next += n
        return out


def _unit(*lengths: int) -> int:
    """Segment size that divides every component length (their gcd)."""
    positive = [n for n in lengths if n > 0]
    if not positive:
        raise ValueError("every component length is zero")
    return reduce(math.gcd, positive)


def _poisson(rng: random.Random, n: int, rate: float) -> list[float]:
    if rate <= 0:
        raise ValueError("rate must be positive")
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _request(
    arrival: float, session: str, segments: Sequence[int], unit: int, output: int
) -> TraceRequest:
    return TraceRequest(arrival, session, 1 + len(segments) * unit, output, tuple(segments), unit)


def generated_shared_prefix(
    groups: int = 64,
    per_group: int = 16,
    system_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    rate: float = 16.0,
    seed: int = 0,
) -> Workload:
    """SGLang's generated-shared-prefix: ``groups`` system prompts, each followed by
    ``per_group`` distinct questions, in shuffled order with Poisson arrivals."""
    unit = _unit(system_len, question_len)
    ids = _Ids()
    systems = [ids.take(system_len // unit) for _ in range(groups)]
    items = [(g, i) for g in range(groups) for i in range(per_group)]
    rng = random.Random(seed)
    rng.shuffle(items)
    arrivals = _poisson(rng, len(items), rate)
    reqs = [
        _request(t, f"g{g}", systems[g] + ids.take(question_len // unit), unit, output_len)
        for t, (g, _) in zip(arrivals, items, strict=True)
    ]
    return Workload(
        name="gsp",
        description=f"generated shared prefix: {groups} groups x {per_group}, system "
        f"{system_len}, question {question_len}, output {output_len}, {rate:g} req/s",
        requests=reqs,
        segment_tokens=unit,
    )


def multi_round_qa(
    users: int = 32,
    rounds: int = 5,
    system_len: int = 1000,
    history_len: int = 2000,
    answer_len: int = 100,
    qps: float = 2.0,
    seed: int = 0,
    *,
    question_len: int = 20,
) -> Workload:
    """production-stack multi-round QA: turn k of a user is the shared system prompt,
    the user's history, and every earlier question and answer, then a new question.

    User u asks round k at ``(u + k * users) / qps``: users start 1/qps apart and each
    comes back every ``users/qps`` s. Open loop (the original also waits for the
    previous answer). The earlier answers in the prompt are fixed segments, not what
    an engine generated, so they hit only where an earlier *prompt* held them.
    """
    if qps <= 0:
        raise ValueError("qps must be positive")
    unit = _unit(system_len, history_len, question_len, answer_len)
    ids = _Ids()
    system = ids.take(system_len // unit)
    reqs = []
    for u in range(users):
        convo = system + ids.take(history_len // unit)
        for k in range(rounds):
            convo += ids.take(question_len // unit)
            reqs.append(_request((u + k * users) / qps, f"u{u}", convo, unit, answer_len))
            convo += ids.take(answer_len // unit)
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload(
        name="multi-round-qa",
        description=f"multi-round QA: {users} users x {rounds} rounds, system {system_len}, "
        f"history {history_len}, answer {answer_len}, {qps:g} req/s",
        requests=reqs,
        segment_tokens=unit,
    )


def long_doc_qa(
    documents: int = 8,
    document_len: int = 20000,
    output_len: int = 100,
    repeat_count: int = 2,
    repeat_mode: str = "random",
    rate: float = 1.0,
    seed: int = 0,
    *,
    question_len: int = 100,
) -> Workload:
    """LMCache long-doc QA: a warm-up round sends each document once, then
    ``repeat_count`` more of each in ``repeat_mode`` order (random: shuffled; tile:
    0..n-1 repeated; interleave: each document's repeats back to back); every
    request is a document plus its own question. Poisson arrivals at ``rate``."""
    unit = _unit(document_len, question_len)
    ids = _Ids()
    docs = [ids.take(document_len // unit) for _ in range(documents)]
    if repeat_mode == "random":
        order = [d for _ in range(repeat_count) for d in range(documents)]
        random.Random(seed + 1).shuffle(order)
    elif repeat_mode == "tile":
        order = [d for _ in range(repeat_count) for d in range(documents)]
    elif repeat_mode == "interleave":
        order = [d for d in range(documents) for _ in range(repeat_count)]
    else:
        raise ValueError(f"repeat_mode must be random, tile or interleave, not {repeat_mode!r}")
    sequence = list(range(documents)) + order
    arrivals = _poisson(random.Random(seed), len(sequence), rate)
    reqs = [
        _request(t, f"d{d}", docs[d] + ids.take(question_len // unit), unit, output_len)
        for t, d in zip(arrivals, sequence, strict=True)
    ]
    return Workload(
        name="long-doc-qa",
        description=f"long-document QA: {documents} documents of {document_len}, "
        f"{repeat_count} repeats ({repeat_mode}), output {output_len}, {rate:g} req/s",
        requests=reqs,
        segment_tokens=unit,
    )


def no_reuse(
    n: int = 1000,
    input_len: int = 2048,
    output_len: int = 256,
    rate: float = 8.0,
    seed: int = 0,
) -> Workload:
    """Control: every prompt is fresh (only BOS is shared, never a full block)."""
    if input_len < 2:
        raise ValueError("input_len must be at least 2 (BOS + one token)")
    unit = min(MOONCAKE_BLOCK, input_len - 1)
    per = math.ceil((input_len - 1) / unit)
    ids = _Ids()
    arrivals = _poisson(random.Random(seed), n, rate)
    reqs = [
        TraceRequest(t, f"r{i}", input_len, output_len, ids.take(per), unit)
        for i, t in enumerate(arrivals)
    ]
    return Workload(
        name="no-reuse",
        description=f"no reuse: {n} fresh prompts of {input_len}, output {output_len}, "
        f"{rate:g} req/s",
        requests=reqs,
        segment_tokens=unit,
    )


# --------------------------------------------------------------------------- helpers


def scale_rate(workload: Workload, factor: float) -> Workload:
    """The same requests arriving ``factor`` times faster."""
    if factor <= 0:
        raise ValueError("factor must be positive")
    reqs = [replace(r, arrival_s=r.arrival_s / factor) for r in workload.requests]
    return replace(workload, requests=reqs, description=f"{workload.description}, x{factor:g}")


def head(workload: Workload, n: int) -> Workload:
    """The first ``n`` requests by arrival."""
    reqs = sorted(workload.requests, key=lambda r: r.arrival_s)[:n]
    return replace(workload, requests=reqs, description=f"{workload.description}, first {n}")


WORKLOAD_NAMES: Final = ("mooncake", "gsp", "multi-round-qa", "long-doc-qa", "no-reuse")


def build_workload(
    name: str,
    *,
    trace: Path | None,
    limit: int | None,
    start: int,
    rate_scale: float,
    seed: int = 0,
    shape: Mapping[str, Any] | None = None,
) -> Workload:
    """A workload by name; ``seed`` draws the generated shared-prefix order and arrivals
    (the other builders are fixed); ``shape`` passes keyword arguments to a synthetic
    workload's builder (its size: e.g. ``documents``, ``users``, ``rounds``)."""
    if name == "mooncake":
        if shape:
            raise ValueError("the Mooncake trace has no shape parameters")
        return mooncake(trace, limit=limit, start=start, rate_scale=rate_scale)
    kw = dict(shape or {})
    builders: dict[str, Callable[[], Workload]] = {
        "gsp": lambda: generated_shared_prefix(seed=seed, **kw),
        "multi-round-qa": lambda: multi_round_qa(**kw),
        "long-doc-qa": lambda: long_doc_qa(**kw),
        "no-reuse": lambda: no_reuse(**kw),
    }
    if name not in builders:
        raise ValueError(f"unknown workload {name!r} (known: {', '.join(WORKLOAD_NAMES)})")
    wl = builders[name]()
    if limit is not None:
        wl = replace(wl, requests=wl.requests[start : start + limit])
    return scale_rate(wl, rate_scale) if rate_scale != 1.0 else wl
