"""The residency index: which pods hold which block keys in which tier.

Writers (the indexer, fed by engine KV events) tag every entry with the pod's
*incarnation*: one engine process lifetime, as seen by its event stream. A new
incarnation makes every older entry of that pod invisible at once, so residency
of a dead or restarted engine is never used even before garbage collection.

Readers (the router) ask one question per request: for each candidate pod, how
many leading blocks of this prompt does it hold, per tier. Counts are
cumulative over tiers: ``prefix[Tier.DRAM]`` is the longest prefix held in HBM
*or* DRAM, so it never decreases along ``TIER_ORDER``.

Writes name their blocks as ``Blocks``: each key with its chunk *anchor*, the key
of the first block of its chunk (``CHUNK`` consecutive blocks counted from the
chain's first block). A backend may keep a chunk's blocks together, so that a
lookup reads a prompt chunk by chunk (the Redis layout does); the memory index
uses the keys alone. Lookups take a prompt's keys from its first block, whose
anchors follow from the positions.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from kvplane.router.tiers import Tier

# Blocks per chunk of a chain: the unit the Redis layout stores and reads together.
CHUNK: Final = 16

# pod -> tier -> number of leading blocks resident in that tier or a faster one
PrefixMatches = dict[str, dict[Tier, int]]


@dataclass(frozen=True, slots=True)
class Blocks:
    """Block keys, and for each the key of the first block of its chunk."""

    keys: Sequence[int]
    anchors: Sequence[int]

    @classmethod
    def of_prompt(cls, keys: Sequence[int], start: int = 0) -> "Blocks":
        """``keys[start:]`` of a prompt whose ``keys`` begin at its first block."""
        return cls(keys[start:], [keys[i - i % CHUNK] for i in range(start, len(keys))])


def chunk_anchors(keys: Sequence[int]) -> list[int]:
    """The anchor of every block of a prompt whose ``keys`` begin at its first block."""
    return [keys[i - i % CHUNK] for i in range(len(keys))]


class NotOwner(Exception):
    """A write of a pod's incarnation refused: another indexer holds its stream now."""


class IndexUnavailable(Exception):
    """A lookup the index could not answer in time (``GuardedIndex``): route without it."""


def deepest_held(matches: PrefixMatches | None) -> int:
    """The most leading blocks of the prompt any pod holds, in any tier."""
    if not matches:
        return 0
    return max((n for tiers in matches.values() for n in tiers.values()), default=0)


async def lookup_or_none(
    index: "ResidencyIndex", keys: Sequence[int], pods: Sequence[str]
) -> PrefixMatches | None:
    """The index's answer, or None while it is unavailable."""
    try:
        return await index.lookup(keys, pods)
    except IndexUnavailable:
        return None


class ResidencyIndex(Protocol):
    # Lookups run in this process and never wait on I/O: no timeout guard needed
    # (wrapping one in asyncio.wait_for costs a task and a loop turn per request).
    in_process: bool

    async def begin_incarnation(self, pod: str, incarnation: str) -> None:
        """A new event stream for ``pod``: everything older stops counting. Raises
        ``NotOwner`` when the pod's stream is leased to another indexer."""

    async def drop_pod(self, pod: str) -> None:
        """``pod`` is gone: none of its entries count any more (``NotOwner`` as above)."""

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        """Blocks confirmed resident (BlockStored). Ignored for a stale incarnation."""

    async def remove(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        """Blocks evicted from one tier (BlockRemoved). An HBM removal also ends
        the blocks' tentative marks on that pod, as an HBM store does."""

    async def clear(self, pod: str, incarnation: str, tier: Tier) -> None:
        """Every block of one tier gone (AllBlocksCleared clears HBM only)."""

    async def mark_tentative(self, pod: str, blocks: Blocks, ttl_s: float) -> None:
        """The router just sent these blocks to ``pod``: count them in HBM for
        ``ttl_s`` seconds unless an event confirms them first."""

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        """Longest resident prefix of ``keys`` (a prompt's, from its first block)
        per pod and tier, in one round trip."""

    async def incarnations(self) -> Mapping[str, str]:
        """Current incarnation of every pod the index knows."""

    async def ping(self) -> None:
        """Raise if the index is unreachable."""

    async def close(self) -> None: ...


def cumulative(present_by_block: Sequence[set[Tier]], tiers: Sequence[Tier]) -> dict[Tier, int]:
    """Reference semantics of one pod's match: leading blocks held per tier or faster.

    Backends must agree with this (the contract tests compare against it).
    """
    out: dict[Tier, int] = {}
    allowed: set[Tier] = set()
    for tier in tiers:
        allowed.add(tier)
        n = 0
        for held in present_by_block:
            if not held & allowed:
                break
            n += 1
        out[tier] = n
    return out
