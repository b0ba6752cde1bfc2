"""What the index benchmark feeds the index: a fleet's residency, and engine event streams.

Residency: every pod holds ``SYSTEM_PROMPTS`` shared system prompts of ``SYSTEM_BLOCKS``
blocks each (a fleet-wide prefix every pod caches) and its own conversations, each a
system prompt continued by ``TAIL_BLOCKS`` blocks that only this pod holds (what a
cache-aware router makes of a fleet). A lookup is one of those conversations, 128
keys, asked of every pod. Keys are random 64-bit ints drawn from a seed per
conversation, so the benchmark regenerates the few it looks up instead of keeping
millions.

Event streams: what a vLLM engine publishes under prefill-heavy load, encoded as vLLM
does (``kvplane.sim.publisher``): each step one ``BlockStored`` of a new prompt's
blocks (chained to a system prompt held since the start), and once the cache is full
one ``BlockRemoved`` per evicted block, as vLLM's block pool sends them.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from kvplane.router.index.base import CHUNK, Blocks
from kvplane.sim import events as ev
from kvplane.sim.publisher import encode_batch

SYSTEM_PROMPTS: Final = 8
SYSTEM_BLOCKS: Final = 32
TAIL_BLOCKS: Final = 96
PROMPT_BLOCKS: Final = SYSTEM_BLOCKS + TAIL_BLOCKS  # 128: an 8K-token prompt at block 64

U64 = npt.NDArray[np.uint64]


def _keys(seed: int, n: int) -> U64:
    return np.random.default_rng(seed).integers(0, 1 << 64, size=n, dtype=np.uint64)


def anchors_of(prompt: U64) -> U64:
    """The chunk anchor of every block of a prompt (keys from its first block)."""
    starts = np.arange(len(prompt)) // CHUNK * CHUNK
    return prompt[starts]


@dataclass(frozen=True, slots=True)
class Residency:
    """``pods`` pods holding about ``entries`` (block, pod) entries between them."""

    pods: int
    entries: int
    seed: int = 0

    @property
    def conversations_per_pod(self) -> int:
        own = self.entries // self.pods - SYSTEM_PROMPTS * SYSTEM_BLOCKS
        return max(1, own // TAIL_BLOCKS)

    @property
    def total_entries(self) -> int:
        return self.pods * (
            SYSTEM_PROMPTS * SYSTEM_BLOCKS + self.conversations_per_pod * TAIL_BLOCKS
        )

    def system(self, i: int) -> U64:
        return _keys(self.seed * 1_000_003 + i, SYSTEM_BLOCKS)

    def prompt(self, pod: int, conversation: int) -> U64:
        """The whole prompt of one conversation: its system prompt, then its tail."""
        n = self.conversations_per_pod
        tail = _keys((self.seed + 1) * 7_919_999 + pod * n + conversation + 1_000, TAIL_BLOCKS)
        return np.concatenate([self.system(conversation % SYSTEM_PROMPTS), tail])

    def pod_name(self, pod: int) -> str:
        return f"pod-{pod:04d}"

    def writes(self, pod: int, per_write: int = 64) -> Iterator[Blocks]:
        """What ``pod`` holds, as writes of about ``per_write`` prompts each."""
        system = np.concatenate([self.system(i) for i in range(SYSTEM_PROMPTS)])
        anchors = np.concatenate([anchors_of(self.system(i)) for i in range(SYSTEM_PROMPTS)])
        yield Blocks(system.tolist(), anchors.tolist())
        n = self.conversations_per_pod
        for start in range(0, n, per_write):
            tails, tail_anchors = [], []
            for c in range(start, min(n, start + per_write)):
                prompt = self.prompt(pod, c)
                tails.append(prompt[SYSTEM_BLOCKS:])
                tail_anchors.append(anchors_of(prompt)[SYSTEM_BLOCKS:])
            yield Blocks(np.concatenate(tails).tolist(), np.concatenate(tail_anchors).tolist())

    def queries(self, count: int, pods: int, seed: int = 1) -> list[tuple[str, list[int]]]:
        """``count`` lookups: (the pod holding it, its keys), drawn among the first
        ``pods`` pods."""
        rnd = random.Random(seed)
        out = []
        for _ in range(count):
            pod = rnd.randrange(pods)
            conv = rnd.randrange(self.conversations_per_pod)
            out.append((self.pod_name(pod), self.prompt(pod, conv).tolist()))
        return out


# ------------------------------------------------------------------------ event streams


@dataclass(frozen=True, slots=True)
class StreamShape:
    block_size: int = 16
    blocks_per_step: int = 32  # a step's new prompt: 512 tokens at block size 16
    capacity_blocks: int = 4096  # the engine's HBM blocks
    steps: int = 300


def event_stream(seed: int, shape: StreamShape) -> tuple[list[bytes], int]:
    """One engine's batches, encoded, and the block events in them."""
    rng = np.random.default_rng(seed)
    bs, per = shape.block_size, shape.blocks_per_step
    hashes = rng.integers(0, 1 << 63, size=4 + shape.steps * per, dtype=np.int64).tolist()
    tokens = rng.integers(0, 32_000, size=(4 + shape.steps * per) * bs).tolist()
    system = hashes[:4]
    batches = [
        encode_batch([ev.BlockStored(system, None, tokens[: 4 * bs], bs)], time.time(), None)
    ]
    count = len(system)
    held: deque[int] = deque()
    for step in range(shape.steps):
        first = 4 + step * per
        new = hashes[first : first + per]
        events: list[ev.KVEvent] = [
            ev.BlockStored(new, system[-1], tokens[first * bs : (first + per) * bs], bs)
        ]
        held.extend(new)
        while len(held) > shape.capacity_blocks:
            events.append(ev.BlockRemoved([held.popleft()]))
        count += per + len(events) - 1
        batches.append(encode_batch(events, time.time(), None))
    return batches, count
