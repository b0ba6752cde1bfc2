"""Prompts of known token counts: fresh ones, and sessions whose prompts share most of
their text (the ``shared`` regime)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_SUBJECTS = (
    "the engineer", "our team", "the operator", "a new scheduler", "the cluster", "each replica",
    "the storage layer", "a careful reviewer", "the city council", "the old library",
    "my neighbour", "the research group", "a small startup", "the customer", "the night shift",
    "every student", "the museum", "a delivery driver", "the orchestra", "the hospital",
    "the farmer", "the pilot", "the translator", "a junior analyst", "the committee",
    "the river authority", "the kitchen staff",
)  # fmt: skip
_VERBS = (
    "reviewed", "rebuilt", "measured", "described", "questioned", "documented", "replaced",
    "compared", "explained", "scheduled", "cleaned", "painted", "tested", "moved", "ignored",
    "summarised", "translated", "repaired", "announced", "postponed", "approved", "rejected",
    "simplified", "monitored", "recorded", "estimated", "shipped", "planned", "borrowed",
)  # fmt: skip
_OBJECTS = (
    "the quarterly report", "a broken pipeline", "the winter schedule", "three old bridges",
    "the latency budget", "a long list of complaints", "the garden fence", "the new contract",
    "several hundred invoices", "the migration plan", "a forgotten backup", "the evening menu",
    "the traffic lights", "an unusual error message", "the training data", "the spare parts",
    "the annual budget", "a handwritten letter", "the concert programme", "the safety manual",
    "the cache hit rate", "a noisy neighbour", "the load balancer", "the harvest forecast",
)  # fmt: skip
_ADVERBS = (
    "quietly", "quickly", "carefully", "reluctantly", "twice", "again", "at last", "in secret",
    "without much fuss", "before lunch", "after a long debate", "with some help", "on Tuesday",
    "during the storm", "for the first time", "under pressure", "in good spirits",
    "late at night",
)  # fmt: skip
_CLAUSES = (
    "because the deadline moved", "although nobody asked", "while the rain kept falling",
    "so that the numbers would add up", "since the old method failed", "as the manual suggested",
    "even though it was expensive", "until the alarm stopped", "whenever the queue grew",
    "after the power came back", "before the auditors arrived", "once the fog had lifted",
)  # fmt: skip
_OPENERS = (
    "Meanwhile,", "In the end,", "According to the notes,", "Surprisingly,", "As a result,",
    "Later that week,", "In March,", "By contrast,", "For example,", "Honestly,", "Then",
    "On the other hand,", "In practice,", "To be fair,", "At first,",
)  # fmt: skip
_NAMES = (
    "Amara", "Bruno", "Chen", "Dagny", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kofi",
    "Lena", "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Sven", "Tomas", "Uma",
)  # fmt: skip


def _sentence(rng: random.Random) -> str:
    """One natural-ish sentence: realistic word and punctuation statistics for a BPE."""
    if rng.random() < 0.15:
        name, n = rng.choice(_NAMES), rng.randint(2, 9000)
        return f'{name} said, "We {rng.choice(_VERBS)} {n} of them {rng.choice(_ADVERBS)}."'
    parts: list[str] = []
    if rng.random() < 0.4:
        parts.append(rng.choice(_OPENERS))
    subject = rng.choice(_SUBJECTS)
    parts.append(subject if parts else subject[0].upper() + subject[1:])
    parts += [rng.choice(_VERBS), rng.choice(_OBJECTS)]
    if rng.random() < 0.6:
        parts.append(rng.choice(_ADVERBS))
    if rng.random() < 0.4:
        parts.append(rng.choice(_CLAUSES))
    return " ".join(parts) + ("." if rng.random() < 0.9 else "?")


def load_counter(tokenizer_dir: str | Path) -> Any:
    """The Rust `tokenizers.Tokenizer`: cheap to import, fast batch encode, for counting."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False).ids)


@dataclass(frozen=True)
class Session:
    """A shared-regime session: its root prompt and the prefix every later prompt repeats."""

    root: str
    prefix: str
    prefix_tokens: int


class PromptFactory:
    """Deterministic prompts of a target token length, built from a seeded sentence pool.

    A prompt is a concatenation of pool sentences whose token counts are known, so
    building one costs microseconds (the max-rate phase needs thousands); every
    piece starts at a space or a paragraph break, where the pre-tokenizer splits
    anyway, and a scale measured once at start-up corrects the small boundary drift.

    * fresh: a unique first line, so no prefix of the prompt was ever seen.
    * shared: a session root is sent first; each later prompt is the root's first
      ~95% plus a new ~5% tail (multi-turn chat, RAG over one document).
    """

    def __init__(self, tokenizer: Any, seed: int = 0, pool_size: int = 6000) -> None:
        rng = random.Random(seed)
        self._rng = random.Random(seed + 1)
        pool = [" " + _sentence(rng) for _ in range(pool_size)]
        for i in range(0, pool_size, 7):
            pool[i] = "\n\n" + pool[i][1:]  # a paragraph break now and then
        encoded = tokenizer.encode_batch(pool, add_special_tokens=False)
        self.pool = pool
        self.lengths = [len(e.ids) for e in encoded]
        self._uid = 0
        self._scale = 1.0
        probe = [self.fresh(4096) for _ in range(4)]
        actual = sum(count_tokens(tokenizer, p) for p in probe)
        self._scale = actual / (4 * 4096) if actual else 1.0

    def _next_uid(self) -> str:
        self._uid += 1
        return f"{self._uid:06d}-{self._rng.getrandbits(32):08x}"

    def _fill(self, parts: list[str], total: int, target: int) -> int:
        """Appends random pool sentences until ``target`` (in pool-count units) is reached."""
        pool, lengths, rng = self.pool, self.lengths, self._rng
        n = len(pool)
        while total < target:
            i = rng.randrange(n)
            if total + lengths[i] > target and target - total < lengths[i] // 2:
                break  # stop nearest the target instead of always overshooting
            parts.append(pool[i])
            total += lengths[i]
        return total

    def fresh(self, tokens: int) -> str:
        """A prompt no router has seen any prefix of (its first line is unique)."""
        parts = [f"Request {self._next_uid()}: read the notes below and answer briefly."]
        self._fill(parts, 18, round(tokens / self._scale))
        return "".join(parts)

    def session(self, tokens: int, shared_fraction: float = 0.95) -> Session:
        """A session root of ``tokens`` tokens whose first ``shared_fraction`` later repeats."""
        parts = [f"Document {self._next_uid()}: background material for this conversation."]
        cut_at = round(tokens * shared_fraction / self._scale)
        total = self._fill(parts, 16, cut_at)
        prefix = "".join(parts)
        self._fill(parts, total, round(tokens / self._scale))
        return Session(root="".join(parts), prefix=prefix, prefix_tokens=round(total * self._scale))

    def shared(self, session: Session, tokens: int) -> str:
        """The session's prefix and a new tail: it differs from every earlier prompt at the end."""
        parts = [f"\n\nQuestion {self._next_uid()}:"]
        self._fill(parts, 4, max(8, round((tokens - session.prefix_tokens) / self._scale)))
        return session.prefix + "".join(parts)
