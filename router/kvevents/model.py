"""Engine KV events, normalised across vLLM (map-tagged and legacy array forms)
and SGLang. Hashes are unsigned 64-bit ints whatever the wire form was."""

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str | None = None
    lora_name: str | None = None
    group_idx: int = 0
    locality: str | None = None
    extra_keys: list[object] | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int = 0
    locality: str | None = None
    # engine events merged into this one: vLLM sends one per evicted block, and
    # consecutive ones of the same medium and group are decoded as one
    events: int = 1


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    dp_rank: int | None = None
