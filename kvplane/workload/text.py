"""Deterministic prompt workloads shared by the demo and the benchmarks."""

from __future__ import annotations

import random
from dataclasses import dataclass

_WORDS = [
    "cache",
    "block",
    "token",
    "prefix",
    "router",
    "engine",
    "decode",
    "prefill",
    "tier",
    "memory",
    "bandwidth",
    "latency",
    "cluster",
    "pod",
    "queue",
    "transfer",
    "recompute",
    "index",
    "event",
    "stream",
    "model",
    "request",
    "reply",
    "vector",
    "kernel",
    "layer",
    "attention",
    "head",
    "value",
    "key",
    "page",
    "chunk",
    "batch",
    "schedule",
    "node",
    "zone",
    "link",
    "store",
    "the",
    "a",
    "of",
    "and",
    "to",
    "in",
    "is",
    "for",
    "on",
    "with",
    "as",
    "by",
    "at",
    "from",
    "that",
    "this",
    "it",
    "be",
    "are",
    "was",
    "were",
    "has",
    "have",
]


def text_of_words(rng: random.Random, n_words: int) -> str:
    """Plain English-ish text; about 1.3 tokens per word with BPE tokenizers."""
    words = [rng.choice(_WORDS) for _ in range(n_words)]
    out = []
    for i, w in enumerate(words):
        out.append(w)
        if i % 17 == 16:
            out.append(".\n" if i % 51 == 50 else ",")
    return " ".join(out)


@dataclass(frozen=True, slots=True)
class SharedPrefixRequest:
    group: int
    index: int
    prompt: str


def shared_prefix_workload(
    groups: int, per_group: int, prefix_words: int, question_words: int, seed: int
) -> list[SharedPrefixRequest]:
    """``groups`` long system prompts, each followed by ``per_group`` distinct questions
    (SGLang's generated-shared-prefix shape), in a shuffled order so that every group's
    requests arrive spread over the run, as they do in production (a fixed interleave
    would let round-robin land a group on one pod by accident)."""
    rng = random.Random(seed)
    prefixes = [f"[doc {seed}-{g}] " + text_of_words(rng, prefix_words) for g in range(groups)]
    out = []
    for i in range(per_group):
        for g in range(groups):
            question = text_of_words(rng, question_words)
            out.append(SharedPrefixRequest(g, i, f"{prefixes[g]}\n\nQuestion {i}: {question}"))
    rng.shuffle(out)
    return out
