"""The Redis index's keys and encodings, and the pure half of a lookup.

Keys of one pool (generation tag ``g``; ``{...}`` is the Redis Cluster hash tag):

- ``kvp:g:{TT}SS``         a chunk bucket: HASH 8-byte block key -> holders. ``TTSS`` are
  4 raw bytes, the *bucket id*: the top 32 bits of the chunk's anchor
  (``index.base.CHUNK``) with the top bit of each byte set, so that no byte is a
  brace; ``TT`` is the Redis Cluster hash tag (16,384 tags). A prompt's blocks sit in
  one bucket per chunk, and the buckets spread over the cluster's slots. Scripts
  build the names from the ids (the client sends 4 bytes, not a name, per block).
  Holders are 2-byte entries ``slot << N_TIERS | tier bits``, one per pod holding
  the block: a sparse bitset of pods, 2 bytes per (block, pod).
- ``kvp:g:{TT}SSt<w>``     the chunk's tentative marks made in window ``w`` (``now //
  window``): HASH block key -> 8-byte entries ``slot (2) | expiry ms (6)``. A window
  key expires by itself two windows after it was made, so marks never outlive it.
- ``kvp:{g}:pods``         HASH pod -> ``slot␟incarnation`` (one slot, one node), and
  ``kvp:{g}:podsv`` its version, bumped on every change: a lookup reads the table only
  when its version moved
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
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt
from kvplane.router.index.base import CHUNK
from kvplane.router.tiers import TIER_BIT, TIER_ORDER, Tier
from redis.crc import key_slot

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

    @property
    def prefix(self) -> bytes:
        """What the scripts put before ``{TT}SS``."""
        return b"kvp:%s:" % self.generation.encode()

    def bucket(self, anchor: int) -> bytes:
        """The bucket of a chunk (as the scripts name it)."""
        tt_ss = bucket_id(anchor).to_bytes(4, "big")
        return self.prefix + b"{" + tt_ss[:2] + b"}" + tt_ss[2:]

    @property
    def bucket_pattern(self) -> bytes:
        """SCAN pattern of the chunk buckets (not their tentative windows)."""
        return self.prefix + b"{*}??"

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
    def pods_version(self) -> bytes:
        return self._meta("podsv")

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


ID_BITS: Final = 0x80808080  # set in every bucket id: no byte of it is a brace


def bucket_id(anchor: int) -> int:
    return (anchor >> 32) | ID_BITS


def bucket_ids(anchors: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint32]:
    return ((anchors >> np.uint64(32)) | np.uint64(ID_BITS)).astype(np.uint32)


def _tag_slots() -> npt.NDArray[np.uint16]:
    """Cluster slot of every hash tag, by ``tag_index``."""
    out = np.zeros(1 << 14, dtype=np.uint16)
    for i in range(1 << 14):
        out[i] = key_slot(b"{" + bytes([0x80 | i >> 7, 0x80 | i & 0x7F]) + b"}")
    return out


TAG_SLOTS: Final = _tag_slots()


def tag_index(ids: npt.NDArray[np.uint32]) -> npt.NDArray[np.intp]:
    """Bucket ids -> index of their hash tag in ``TAG_SLOTS``."""
    return (((ids >> 24) & 0x7F) << 7 | ((ids >> 16) & 0x7F)).astype(np.intp)


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
    """What a lookup read, by chunk of the prompt: per block the value of its field
    (None where none) in the chunk bucket and in each tentative window it has."""

    chunks: int
    held: list[Sequence[bytes | None]] = field(default_factory=list)
    marks: list[tuple[int, Sequence[bytes | None]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.held = [()] * self.chunks

    def add(
        self, chunk: int, held: Sequence[bytes | None], *windows: Sequence[bytes | None] | int
    ) -> None:
        """One chunk's answer: its blocks' holders, each window's marks (0: no window)."""
        self.held[chunk] = held
        for marks in windows:
            if not isinstance(marks, int):
                self.marks.append((chunk, marks))


def prefixes(
    n: int,
    slots: Sequence[int | None],
    found: Found,
    now_ms: int,
    unions: Sequence[tuple[int, int]] = (),
) -> list[list[int] | None]:
    """Per candidate (by slot; None: unknown pod), its leading blocks per tier (None:
    none at all), from the holders of a prompt's ``n`` blocks. ``unions``: (reader,
    holder) columns; the reader also holds, block by block, what the holder holds."""
    col_of = {s: c for c, s in enumerate(slots) if s is not None}
    out: list[list[int] | None] = [None] * len(slots)
    if not col_of:
        return out
    colmap = np.full(MAX_SLOTS, -1, dtype=np.int32)
    colmap[list(col_of)] = list(col_of.values())
    cells = np.zeros((n + 1, len(slots)), dtype=np.uint8)  # row n: all zero, a sentinel
    flat = [v for chunk in found.held for v in chunk]
    blob = b"".join(v for v in flat if v)
    if blob:
        sizes = np.fromiter((len(v) >> 1 if v else 0 for v in flat), np.intp, len(flat))
        entries = np.frombuffer(blob, dtype=">u2")
        rows = np.repeat(np.arange(len(flat)), sizes)
        cols = colmap[entries >> N_TIERS]
        keep = cols >= 0
        cells[rows[keep], cols[keep]] = CUMULATIVE[entries[keep] & FIELD]
    if found.marks:
        values = [v for _, chunk_values in found.marks for v in chunk_values]
        marked = b"".join(v for v in values if v)
        if marked:
            firsts = [chunk * CHUNK for chunk, _ in found.marks]
            counts = [len(chunk_values) for _, chunk_values in found.marks]
            blocks = np.arange(len(values)) - np.repeat(np.cumsum([0, *counts[:-1]]), counts)
            blocks += np.repeat(firsts, counts)
            sizes = np.fromiter((len(v) >> 3 if v else 0 for v in values), np.intp, len(values))
            marks = np.frombuffer(marked, dtype=">u8")
            rows = np.repeat(blocks, sizes)
            cols = colmap[marks >> EXPIRY_BITS]
            keep = (cols >= 0) & ((marks & ((1 << EXPIRY_BITS) - 1)) > now_ms)
            cells[rows[keep], cols[keep]] = FIELD  # held in HBM: counts in every tier
    for reader, holder in unions:
        # the union of two cumulative fields is the cumulative field of the union
        cells[:, reader] |= cells[:, holder]
    active = np.flatnonzero(cells[0])  # a prefix starts at the first block
    if active.size:
        sub: npt.NDArray[np.uint8] = cells[:, active]
        runs = np.stack([np.argmin((sub & (1 << t)) != 0, axis=0) for t in range(N_TIERS)], 1)
        for col, run in zip(active.tolist(), runs.tolist(), strict=True):
            out[col] = run
    return out
