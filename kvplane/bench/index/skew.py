"""Hot-prefix skew: how evenly a workload's lookups and writes spread over shards, for
three ways of placing blocks on Redis Cluster slots.

- ``block``: every block in a bucket of its own (placed by its key);
- ``chunk``: a bucket per chunk of ``CHUNK`` blocks, placed by the chunk's first key
  (kvplane's layout);
- ``root``: a bucket per prompt chain, placed by its first key.

A lookup reads each of its buckets once (one command per bucket, on the bucket's
shard); a block is written once, when first seen. Shards own equal slot ranges and a
bucket's slot is its hash tag's, as in the layout. Reported per shard count: the
busiest shard's share of lookup commands and of written blocks against an even share
(1.0 = even), the shards a lookup touches, and the largest bucket's share of all
blocks (a bucket lives on one shard, however hot). ``gsp-chat`` puts a 24-token chat
header before every GSP prompt: a first block every prompt shares, which ends the
shared prefix inside a chunk.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Final

import numpy as np

from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.index.base import CHUNK
from kvplane.router.index.redis_layout import TAG_SLOTS, bucket_id, tag_index
from kvplane.workload.traces import build_workload, synthetic_tokens

SCHEMES: Final = ("block", "chunk", "root")
BLOCK_SIZE: Final = 16
CHAT_HEADER: Final = list(range(500, 524))  # 24 tokens: one shared block and a half
SLOTS: Final = 16384


@dataclass(frozen=True, slots=True)
class Skew:
    workload: str
    scheme: str
    shards: int
    requests: int
    lookup_max_over_mean: float
    write_max_over_mean: float
    shards_per_lookup: float
    commands_per_lookup: float
    largest_bucket_share: float

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _prompts(workload: str, limit: int) -> list[list[int]]:
    name = "gsp" if workload == "gsp-chat" else workload
    wl = build_workload(name, trace=None, limit=limit, start=0, rate_scale=1.0)
    tokens = synthetic_tokens(0)
    root = generation_root("skew")
    out = []
    for req in wl.requests:
        ids = tokens.token_ids(req)
        if workload == "gsp-chat":
            ids = CHAT_HEADER + ids
        out.append(block_keys(ids, BLOCK_SIZE, root))
    return out


def _buckets(keys: Sequence[int], scheme: str) -> list[tuple[int, int]]:
    """(bucket, blocks in it) of one prompt, in order."""
    if not keys:
        return []
    if scheme == "block":
        return [(k, 1) for k in keys]
    if scheme == "root":
        return [(keys[0], len(keys))]
    return [(keys[i], min(CHUNK, len(keys) - i)) for i in range(0, len(keys), CHUNK)]


def _shard_of(buckets: Sequence[int], shards: int) -> np.ndarray[Any, np.dtype[np.intp]]:
    ids = np.array([bucket_id(b) for b in buckets], dtype=np.uint32)
    slots = TAG_SLOTS[tag_index(ids)].astype(np.intp)
    return slots * shards // SLOTS


def analyse(workload: str, limit: int, shard_counts: Sequence[int]) -> list[Skew]:
    prompts = _prompts(workload, limit)
    out: list[Skew] = []
    for scheme in SCHEMES:
        per_prompt = [_buckets(p, scheme) for p in prompts]
        every = sorted({b for buckets in per_prompt for b, _ in buckets})
        index = {b: i for i, b in enumerate(every)}
        members: dict[int, set[int]] = {}  # bucket -> distinct blocks in it
        for keys, buckets in zip(prompts, per_prompt, strict=True):
            at = 0
            for bucket, n in buckets:
                members.setdefault(bucket, set()).update(keys[at : at + n])
                at += n
        blocks = sum(len(m) for m in members.values())
        largest = max(len(m) for m in members.values()) / blocks
        for shards in shard_counts:
            shard = _shard_of(every, shards)
            reads: Counter[int] = Counter()
            touched = 0
            for buckets in per_prompt:
                hit = [int(shard[index[b]]) for b, _ in buckets]
                reads.update(hit)
                touched += len(set(hit))
            writes: Counter[int] = Counter()
            for bucket, m in members.items():
                writes[int(shard[index[bucket]])] += len(m)
            commands = sum(reads.values())
            out.append(
                Skew(
                    workload,
                    scheme,
                    shards,
                    len(prompts),
                    max(reads.values()) / (commands / shards),
                    max(writes.values()) / (blocks / shards),
                    touched / len(prompts),
                    commands / len(prompts),
                    largest,
                )
            )
    return out
