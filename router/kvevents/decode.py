"""Pure decoding of engine KV-event messages into the normalised model.

One untyped msgpack decoder covers every wire form we meet, because the typed
structs differ between releases: vLLM 0.33 map-tagged events, the legacy
positional arrays (trailing fields omitted, 2-element outer batch in 0.9), and
SGLang's tagged maps. Hashes are normalised to unsigned 64-bit ints so that int
and 32-byte-digest publishers (and SGLang's signed int64) compare equal.

The tagged maps (vLLM 0.33, SGLang) are first decoded with typed structs, which
msgspec checks in C (token ids in uint32 among them); anything they refuse goes the
untyped way, which accepts or rejects exactly as before. Checking each token id in
Python cost about 6x the typed decode (bench/RESULTS.md, index).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Final

import msgspec
from kvplane.router.kvevents.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
)

U64_MASK: Final = (1 << 64) - 1
SEQ_BYTES: Final = 8
END_SEQ: Final = -1

# Legacy array positions after the tag (vLLM 0.33 declared field order; older
# releases send a prefix of it).
STORED_FIELDS: Final = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
)
REMOVED_FIELDS: Final = ("block_hashes", "medium", "group_idx", "locality", "ownership")

_decoder: Final = msgspec.msgpack.Decoder()

_U32 = Annotated[int, msgspec.Meta(ge=0, le=0xFFFFFFFF)]
_Hash = int | bytes


class _TypedStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[_Hash]
    parent_block_hash: _Hash | None
    token_ids: list[_U32] | None
    block_size: Annotated[int, msgspec.Meta(gt=0)]
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    locality: str | None = None
    cache_salt: Any = None


class _TypedRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[_Hash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None


class _TypedCleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class _TypedBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_TypedStored | _TypedRemoved | _TypedCleared]
    data_parallel_rank: int | None = None


_typed_decoder: Final = msgspec.msgpack.Decoder(_TypedBatch)


class DecodeError(ValueError):
    """A message or payload that no known wire form explains."""


@dataclass(frozen=True, slots=True)
class Envelope:
    """One message's frames, before the payload is decoded."""

    topic: bytes
    seq: int
    publisher: bytes  # b"" unless the seq frame carries a publisher id (24 bytes)
    payload: bytes


def normalise_hash(value: object) -> int:
    """Engine block hash -> uint64: ints are masked (SGLang sends signed int64),
    digests keep their last 8 bytes big-endian (vLLM's int conversion)."""
    if type(value) is int:
        return value & U64_MASK
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise DecodeError("empty bytes block hash")
        return int.from_bytes(raw[-8:], "big")
    raise DecodeError(f"block hash of type {type(value).__name__}")


def decode_seq(frame: bytes) -> tuple[int, bytes]:
    """Frame 1 -> (seq, publisher id). 8 bytes in vLLM 0.33 / SGLang; main's
    snapshot mode appends a 16-byte publisher id (24 bytes)."""
    if len(frame) < SEQ_BYTES:
        raise DecodeError(f"seq frame of {len(frame)} bytes, need at least {SEQ_BYTES}")
    return int.from_bytes(frame[:SEQ_BYTES], "big"), bytes(frame[SEQ_BYTES:])


def is_end_seq(frame: bytes) -> bool:
    """The replay stream's terminator: seq -1 as signed 64-bit."""
    head = frame[:SEQ_BYTES]
    return len(head) == SEQ_BYTES and int.from_bytes(head, "big", signed=True) == END_SEQ


def parse_live(frames: Sequence[bytes]) -> Envelope:
    """A PUB message: ``[topic, seq, payload]``."""
    if len(frames) != 3:
        raise DecodeError(f"live message has {len(frames)} frames, expected 3")
    seq, publisher = decode_seq(frames[1])
    return Envelope(bytes(frames[0]), seq, publisher, bytes(frames[2]))


def parse_replay(frames: Sequence[bytes]) -> Envelope | None:
    """A replay reply as a DEALER sees it; None marks the end of the stream.

    Accepts ``[b"", topic, seq, payload]`` (0.33, SGLang) and the older
    ``[b"", seq, payload]``, with or without the empty delimiter frame.
    """
    n = len(frames)
    if n == 4 and frames[0] == b"":
        topic, seq_frame, payload = frames[1], frames[2], frames[3]
    elif n == 3:
        # [topic, seq, payload] and the old [b"", seq, payload] coincide here
        topic, seq_frame, payload = frames[0], frames[1], frames[2]
    elif n == 2:
        topic, seq_frame, payload = b"", frames[0], frames[1]
    else:
        raise DecodeError(f"replay reply has {n} frames")
    if is_end_seq(seq_frame):
        return None
    seq, publisher = decode_seq(seq_frame)
    return Envelope(bytes(topic), seq, publisher, bytes(payload))


def decode_batch(payload: bytes) -> EventBatch:
    """Frame 2 -> EventBatch; unknown event types are dropped."""
    try:
        typed = _typed_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return _decode_untyped(payload)
    out: list[KVEvent] = []
    events = typed.events
    i, n = 0, len(events)
    while i < n:
        e = events[i]
        i += 1
        if type(e) is _TypedRemoved:
            # a run of removals alike (vLLM: one event per evicted block) is one event
            raw, merged = list(e.block_hashes), 1
            while i < n and _same_removal(events[i], e):
                raw += events[i].block_hashes  # type: ignore[union-attr]
                merged += 1
                i += 1
            out.append(BlockRemoved(_hashes(raw), e.medium, e.group_idx or 0, e.locality, merged))
        elif type(e) is _TypedStored:
            out.append(_typed_stored(e))
        else:
            out.append(AllBlocksCleared())
    return EventBatch(ts=typed.ts, events=out, dp_rank=typed.data_parallel_rank)


def _same_removal(e: object, first: _TypedRemoved) -> bool:
    return (
        type(e) is _TypedRemoved
        and e.medium == first.medium
        and (e.group_idx or 0) == (first.group_idx or 0)
        and e.locality == first.locality
    )


def _hashes(values: list[int | bytes]) -> list[int]:
    """``_hash_list`` for values msgspec has typed already."""
    if all(type(h) is int for h in values):
        return [h & U64_MASK for h in values]  # type: ignore[operator]
    return [normalise_hash(h) for h in values]


def _typed_stored(e: _TypedStored) -> BlockStored:
    hashes = _hashes(e.block_hashes)
    lora_name = e.lora_name
    if lora_name is None and e.lora_id is not None:
        lora_name = f"lora_id:{e.lora_id}"
    parent = e.parent_block_hash
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else normalise_hash(parent),
        token_ids=[] if e.token_ids is None else e.token_ids,
        block_size=e.block_size,
        medium=e.medium,
        lora_name=lora_name,
        group_idx=e.group_idx or 0,
        locality=e.locality,
        extra_keys=_extra_keys(e.extra_keys, e.cache_salt, len(hashes)),
    )


def _decode_untyped(payload: bytes) -> EventBatch:
    try:
        raw: Any = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"invalid msgpack: {exc}") from exc
    if not isinstance(raw, list) or len(raw) < 2:
        raise DecodeError("batch is not an array of [ts, events, dp_rank?]")
    ts, events = raw[0], raw[1]
    if type(ts) not in (float, int):
        raise DecodeError(f"batch ts of type {type(ts).__name__}")
    if not isinstance(events, list):
        raise DecodeError("batch events is not an array")
    dp_rank = _opt_int(raw[2] if len(raw) > 2 else None, "data_parallel_rank")
    out: list[KVEvent] = []
    for item in events:
        event = decode_event(item)
        if event is not None:
            out.append(event)
    return EventBatch(ts=float(ts), events=out, dp_rank=dp_rank)


def decode_message(frames: Sequence[bytes]) -> tuple[Envelope, EventBatch]:
    """A whole live message: envelope plus decoded batch."""
    env = parse_live(frames)
    return env, decode_batch(env.payload)


def decode_event(raw: object) -> KVEvent | None:
    """One event in either form; None for an event type we do not know."""
    tag, fields = _tagged_fields(raw)
    builder = _BUILDERS.get(tag)
    return None if builder is None else builder(fields)


def _tagged_fields(raw: object) -> tuple[str, dict[str, Any]]:
    if isinstance(raw, dict):
        tag = raw.get("type")
        if not isinstance(tag, str):
            raise DecodeError("map event without a string 'type'")
        return tag, raw
    if isinstance(raw, list) and raw:
        tag = raw[0]
        if not isinstance(tag, str):
            raise DecodeError("array event without a string tag")
        names = STORED_FIELDS if tag == "BlockStored" else REMOVED_FIELDS
        return tag, dict(zip(names, raw[1:], strict=False))
    raise DecodeError(f"event of type {type(raw).__name__}")


def _stored(f: dict[str, Any]) -> BlockStored:
    hashes = _hash_list(f.get("block_hashes"))
    parent = f.get("parent_block_hash")
    block_size = f.get("block_size")
    if type(block_size) is not int or block_size <= 0:
        raise DecodeError(f"BlockStored.block_size {block_size!r}")
    lora_name = _opt_str(f.get("lora_name"), "lora_name")
    lora_id = _opt_int(f.get("lora_id"), "lora_id")
    if lora_name is None and lora_id is not None:
        # deprecated field: still a LoRA namespace, never the base model's
        lora_name = f"lora_id:{lora_id}"
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None if parent is None else normalise_hash(parent),
        token_ids=_token_list(f.get("token_ids")),
        block_size=block_size,
        medium=_opt_str(f.get("medium"), "medium"),
        lora_name=lora_name,
        group_idx=_opt_int(f.get("group_idx"), "group_idx") or 0,
        locality=_opt_str(f.get("locality"), "locality"),
        extra_keys=_extra_keys(f.get("extra_keys"), f.get("cache_salt"), len(hashes)),
    )


def _removed(f: dict[str, Any]) -> BlockRemoved:
    return BlockRemoved(
        block_hashes=_hash_list(f.get("block_hashes")),
        medium=_opt_str(f.get("medium"), "medium"),
        group_idx=_opt_int(f.get("group_idx"), "group_idx") or 0,
        locality=_opt_str(f.get("locality"), "locality"),
    )


def _cleared(_: dict[str, Any]) -> AllBlocksCleared:
    return AllBlocksCleared()


_BUILDERS: Final[dict[str, Callable[[dict[str, Any]], KVEvent]]] = {
    "BlockStored": _stored,
    "BlockRemoved": _removed,
    "AllBlocksCleared": _cleared,
}


def _hash_list(value: object) -> list[int]:
    if not isinstance(value, list):
        raise DecodeError("block_hashes is not an array")
    return [normalise_hash(h) for h in value]


def _token_list(value: object) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(type(t) is int for t in value):
        raise DecodeError("token_ids is not an array of ints")
    if value and (min(value) < 0 or max(value) > 0xFFFFFFFF):
        raise DecodeError("token id outside uint32")
    return value


def _extra_keys(value: object, cache_salt: object, n_blocks: int) -> list[object] | None:
    """vLLM's per-block extra keys, or SGLang's cache_salt spread over the blocks;
    None when nothing would change the KV (all entries empty)."""
    if cache_salt is not None:
        return [cache_salt] * n_blocks
    if value is None:
        return None
    if not isinstance(value, list):
        raise DecodeError("extra_keys is not an array")
    return list(value) if any(v is not None and v != [] for v in value) else None


def _opt_int(value: object, name: str) -> int | None:
    if value is None or type(value) is int:
        return value
    raise DecodeError(f"{name} of type {type(value).__name__}")


def _opt_str(value: object, name: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise DecodeError(f"{name} of type {type(value).__name__}")
