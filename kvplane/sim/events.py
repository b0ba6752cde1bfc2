"""KV-cache events as the simulated engine emits them: plain data, no wire format.

They mirror vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` (hashes as
the 64-bit ints vLLM publishes by default); the publisher encodes them as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# a store outside the pod (vLLM: medium STORAGE, locality REMOTE): the fleet's shared store
MEDIUM_STORAGE = "STORAGE"
LOCALITY_REMOTE = "REMOTE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one request became cached; ``token_ids`` holds
    ``len(block_hashes) * block_size`` tokens, ``parent_block_hash`` is the hash of the
    block before the first one (None at the start of a prompt)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_id: int | None = None  # the adapter of an adapter request's blocks
    lora_name: str | None = None
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from a tier (vLLM sends one hash per event)."""

    block_hashes: list[int]
    medium: str = MEDIUM_GPU
    locality: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Prefix-cache reset: every GPU block forgotten (offload tiers keep theirs)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
