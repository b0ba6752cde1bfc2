"""The Redis index's keys and encodings, and the pure half of a lookup.

Keys of one pool (generation tag ``g``; ``{...}`` is the Redis Cluster hash tag):

- ``kvp:g:{aaaaaaaa}``     a chunk bucket: HASH 8-byte block key -> holders. ``aaaaaaaa``
  is the top 32 bits of the chunk's anchor (``index.base.CHUNK``), so a prompt's
  blocks sit in one bucket per chunk and the buckets spread over the cluster's slots.
  Holders are 2-byte entries ``slot << N_TIERS | tier bits``, one per pod holding
  the block: a sparse bitset of pods, 2 bytes per (block, pod).
- ``kvp:g:{aaaaaaaa}t<w>`` the chunk's tentative marks made in window ``w`` (``now //
  window``): HASH block key -> 8-byte entries ``slot (2) | expiry ms (6)``. A window
  key expires by itself two windows after it was made, so marks never outlive it.
- ``kvp:{g}:pods``         HASH pod -> ``slot␟incarnation`` (one slot, one node)
- ``kvp:{g}:slots``        HASH slot -> pod, or ``~<ms>`` for a slot dead since then
- ``kvp:{g}:own:<pod>``    the indexer owning the pod's stream (a lease)
- ``kvp:{g}:indexers``     ZSET indexer id -> lease expiry ms
- ``kvp:{g}:gc``           the indexer running garbage collection (a lease)

A slot is one incarnation of one pod: a new incarnation takes a new slot, so entries
of the old one stop counting at once, and the slot is freed only after garbage
collection has swept every bucket (``redis_gc``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from kvplane.router.tiers import TIER_BIT, TIER_ORDER, Tier

N_TIERS: Final = len(TIER_ORDER)
SLOT_MUL: Final = 1 << N_TIERS  # entry = slot * SLOT_MUL + tier bits
MAX_SLOTS: Final = 1 << (16 - N_TIERS)
FIELD: Final = SLOT_MUL - 1  # every tier bit
HBM_BIT: Final = TIER_BIT[Tier.HBM]
EXPIRY_BITS: Final = 48
SEP: Final = "\x1f"
TENTATIVE_POD_INC: Final = "-"  # incarnation of a pod the router marked before any stream


def cumulative_field(mask: int) -> int:
    """Tier bits -> bits t set for every tier t at or slower than the fastest held."""
    if not mask:
        return 0
    fastest = (mask & -mask).bit_length() - 1
    return FIELD & ~((1 << fastest) - 1)


CUMULATIVE: Final = np.array([cumulative_field(m) for m in range(SLOT_MUL)], dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class Names:
    """Every key name of one generation."""

    generation: str

    def bucket(self, anchor: int) -> bytes:
        return b"kvp:%s:{%08x}" % (self.generation.encode(), anchor >> 32)

    @property
    def bucket_pattern(self) -> bytes:
        """SCAN pattern of the chunk buckets (not their tentative windows)."""
        return b"kvp:%s:{*}" % self.generation.encode()

    @property
    def patterns(self) -> tuple[bytes, bytes]:
        """SCAN patterns of every key of the generation."""
        g = self.generation.encode()
        return b"kvp:%s:*" % g, b"kvp:{%s}:*" % g

    def _meta(self, name: str) -> bytes:
        return f"kvp:{{{self.generation}}}:{name}".encode()

    @property
    def pods(self) -> bytes:
        return self._meta("pods")

    @property
    def slots(self) -> bytes:
        return self._meta("slots")

    @property
    def indexers(self) -> bytes:
        return self._meta("indexers")

    @property
    def gc(self) -> bytes:
        return self._meta("gc")

    def lease(self, pod: str) -> bytes:
        return self._meta(f"own:{pod}")


def window_suffix(window: int) -> bytes:
    return b"t%d" % window


def parse_pod(value: bytes | None) -> tuple[int, str] | None:
    """``slot␟incarnation`` -> (slot, incarnation)."""
    if value is None:
        return None
    slot, _, inc = value.decode().partition(SEP)
    return int(slot), inc


def tentative_entry(slot: int, expiry_ms: int) -> tuple[bytes, bytes]:
    """(slot as 2 bytes, expiry as 6 bytes): the parts of an 8-byte tentative entry."""
    return slot.to_bytes(2, "big"), expiry_ms.to_bytes(EXPIRY_BITS // 8, "big")


@dataclass(slots=True)
class Found:
    """What a lookup read, flattened over nodes: each non-empty value with the
    position of its block in the prompt."""

    positions: list[int]
    values: list[bytes]
    mark_positions: list[int]
    marks: list[bytes]

    def add(self, positions: Sequence[int], values: Sequence[bytes | None]) -> None:
        for pos, value in zip(positions, values, strict=True):
            if value:
                self.positions.append(pos)
                self.values.append(value)

    def add_marks(self, positions: Sequence[int], values: Sequence[bytes | None]) -> None:
        if not values:  # no window key on that node
            return
        for pos, value in zip(positions, values, strict=True):
            if value:
                self.mark_positions.append(pos)
                self.marks.append(value)


def prefixes(n: int, slots: Sequence[int | None], found: Found, now_ms: int) -> list[list[int]]:
    """Per candidate (by slot; None: unknown pod), its leading blocks per tier, from the
    holders of a prompt's ``n`` blocks."""
    zero = [0] * N_TIERS
    col_of = {s: c for c, s in enumerate(slots) if s is not None}
    if not col_of or not (found.values or found.marks):
        return [zero] * len(slots)
    colmap = np.full(MAX_SLOTS, -1, dtype=np.int32)
    colmap[list(col_of)] = list(col_of.values())
    cells = np.zeros((n + 1, len(slots)), dtype=np.uint8)  # row n: all zero, a sentinel
    if found.values:
        entries = np.frombuffer(b"".join(found.values), dtype=">u2")
        counts = [len(v) >> 1 for v in found.values]
        rows = np.repeat(np.asarray(found.positions, dtype=np.intp), counts)
        cols = colmap[entries >> N_TIERS]
        keep = cols >= 0
        cells[rows[keep], cols[keep]] = CUMULATIVE[entries[keep] & FIELD]
    if found.marks:
        marks = np.frombuffer(b"".join(found.marks), dtype=">u8")
        counts = [len(v) >> 3 for v in found.marks]
        rows = np.repeat(np.asarray(found.mark_positions, dtype=np.intp), counts)
        cols = colmap[marks >> EXPIRY_BITS]
        keep = (cols >= 0) & ((marks & ((1 << EXPIRY_BITS) - 1)) > now_ms)
        cells[rows[keep], cols[keep]] = FIELD  # held in HBM: counts in every tier
    active = np.flatnonzero(cells.any(axis=0))
    out = [zero] * len(slots)
    if active.size:
        sub: npt.NDArray[np.uint8] = cells[:, active]
        runs = [np.argmin((sub & (1 << t)) != 0, axis=0) for t in range(N_TIERS)]
        for j, col in enumerate(active.tolist()):
            out[col] = [int(r[j]) for r in runs]
    return out
