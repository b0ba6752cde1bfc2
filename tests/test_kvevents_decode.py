"""Decoding every wire form of engine KV events into the normalised model.

The publisher side is re-declared here as msgspec Structs shaped like vLLM
0.33's (engine-interfaces.md §1.4) so the bytes are what msgspec really emits.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.kvevents.decode import (
    DecodeError,
    decode_batch,
    decode_message,
    decode_seq,
    is_end_seq,
    normalise_hash,
    parse_live,
    parse_replay,
)
from kvplane.router.kvevents.ingest import Ingestor
from kvplane.router.kvevents.model import AllBlocksCleared, BlockRemoved, BlockStored
from kvplane.router.tiers import Tier

from kvplane.sim.publisher import AllBlocksCleared as MapCleared
from kvplane.sim.publisher import BlockRemoved as MapRemoved
from kvplane.sim.publisher import BlockStored as MapStored
from kvplane.sim.publisher import EventBatch as Batch
from kvplane.sim.publisher import KVCacheEvent

Hash = bytes | int


# vLLM 0.33: events are maps tagged with "type"; the simulator's publisher declares
# them exactly as vLLM does (and tests/test_sim_conformance.py holds it to real vLLM).
class MapFuture(KVCacheEvent, tag="SomethingNew"):
    detail: int = 1


# Legacy (vLLM 0.9 .. 2026-06): positional arrays. Each release sends the
# fields it declares, so older ones are shorter (a release with `medium` but
# before `lora_name`, and one with every field up to kv_cache_spec_*).
class _ArrEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class ArrStored(_ArrEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class ArrStoredLate(_ArrEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class ArrRemoved(_ArrEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None = None


class ArrRemovedLate(_ArrEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None


class ArrStored09(_ArrEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None


class ArrCleared(_ArrEvent, tag="AllBlocksCleared"):
    pass


class Batch09(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]


# SGLang 0.5: tagged maps, medium omitted when None, signed int64 hashes, cache_salt.
class SgStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None
    lora_name: str | None = None


class SgRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


def _enc(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


DIGEST_A = bytes(range(32))
DIGEST_B = bytes(range(100, 132))


def test_map_form_with_int_hashes() -> None:
    payload = _enc(
        Batch(
            1.5,
            [
                MapStored([123, 456], None, [1, 2, 3, 4], 2, None, "GPU", None, group_idx=0),
                MapRemoved([123], "GPU", group_idx=0),
                MapCleared(),
            ],
            0,
        )
    )
    batch = decode_batch(payload)
    assert batch.ts == 1.5 and batch.dp_rank == 0
    assert batch.events == [
        BlockStored([123, 456], None, [1, 2, 3, 4], 2, medium="GPU"),
        BlockRemoved([123], medium="GPU"),
        AllBlocksCleared(),
    ]


def test_map_form_with_bytes_hashes_keeps_last_8_bytes_big_endian() -> None:
    payload = _enc(Batch(2.0, [MapStored([DIGEST_B], DIGEST_A, [7] * 16, 16, None, "CPU", None)]))
    (ev,) = decode_batch(payload).events
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [int.from_bytes(DIGEST_B[-8:], "big")]
    assert ev.parent_block_hash == int.from_bytes(DIGEST_A[-8:], "big")
    # the same value vLLM's int mode would have sent
    assert ev.parent_block_hash == int.from_bytes(DIGEST_A, "big") & (2**64 - 1)


def test_map_form_offload_fields() -> None:
    stored = MapStored(
        [5], 4, [1, 2], 2, None, "STORAGE", None, group_idx=1, locality="REMOTE", ownership="x"
    )
    (ev,) = decode_batch(_enc(Batch(0.0, [stored]))).events
    assert isinstance(ev, BlockStored)
    assert (ev.medium, ev.locality, ev.group_idx) == ("STORAGE", "REMOTE", 1)


def test_extra_keys_and_lora() -> None:
    with_mm = MapStored([1], None, [1, 2], 2, None, "GPU", None, extra_keys=[("mm", 0)])
    no_extra = MapStored([2], None, [1, 2], 2, None, "GPU", None, extra_keys=[None])
    lora_id_only = MapStored([3], None, [1, 2], 2, 7, "GPU", None)
    events = decode_batch(_enc(Batch(0.0, [with_mm, no_extra, lora_id_only]))).events
    assert isinstance(events[0], BlockStored) and events[0].extra_keys == [["mm", 0]]
    assert isinstance(events[1], BlockStored) and events[1].extra_keys is None
    assert isinstance(events[2], BlockStored) and events[2].lora_name is not None


def test_legacy_array_form_of_a_later_release() -> None:
    late = ArrStoredLate([1, 2], 0, [1, 2, 3, 4], 2, None, "GPU", None, None, 3, "sliding", 8)
    raw = msgspec.msgpack.decode(_enc(late))
    assert len(raw) == 12 and raw[9] == 3
    payload = _enc(Batch(1.0, [late, ArrRemovedLate([2], "CPU", 3)], 2))
    batch = decode_batch(payload)
    assert batch.dp_rank == 2
    assert batch.events == [
        BlockStored([1, 2], 0, [1, 2, 3, 4], 2, medium="GPU", group_idx=3),
        BlockRemoved([2], medium="CPU", group_idx=3),
    ]


def test_legacy_array_form_with_trailing_fields_missing() -> None:
    raw_stored = ArrStored([DIGEST_A, 99], None, [1, 2, 3, 4], 2, None, "GPU")
    assert msgspec.msgpack.decode(_enc(raw_stored)) == [
        "BlockStored",
        [DIGEST_A, 99],
        None,
        [1, 2, 3, 4],
        2,
        None,
        "GPU",
    ]
    payload = _enc(
        Batch(3.0, [raw_stored, ArrRemoved([99], "GPU"), ArrCleared(), ["Unknown", 1]], None)
    )
    batch = decode_batch(payload)
    assert batch.dp_rank is None
    first = int.from_bytes(DIGEST_A[-8:], "big")
    assert batch.events == [
        BlockStored([first, 99], None, [1, 2, 3, 4], 2, medium="GPU"),
        BlockRemoved([99], medium="GPU"),
        AllBlocksCleared(),
    ]


def test_vllm_09_two_element_batch() -> None:
    payload = _enc(Batch09(4.0, [ArrStored09([10], 9, [5, 6], 2, None), ArrRemoved([10])]))
    assert len(msgspec.msgpack.decode(payload)) == 2
    batch = decode_batch(payload)
    assert batch.dp_rank is None
    assert batch.events == [BlockStored([10], 9, [5, 6], 2), BlockRemoved([10])]


def test_sglang_form_signed_hashes_and_media() -> None:
    neg = -(2**63) + 5
    payload = _enc(
        Batch(
            5.0,
            [
                SgStored([neg], None, list(range(64)), 64, None),  # medium omitted
                SgStored([-2], neg, list(range(64)), 64, None, medium="CPU_PINNED"),
                SgStored([-3], None, list(range(64)), 64, None, cache_salt="tenant"),
                SgRemoved([-2], medium="DISK"),
                SgRemoved([-4], medium="EXTERNAL"),
            ],
            1,
        )
    )
    assert "medium" not in msgspec.msgpack.decode(payload)[1][0]
    ev = decode_batch(payload).events
    assert ev[0] == BlockStored([neg & (2**64 - 1)], None, list(range(64)), 64)
    assert isinstance(ev[1], BlockStored)
    assert ev[1].block_hashes == [2**64 - 2] and ev[1].parent_block_hash == neg + 2**64
    assert ev[1].medium == "CPU_PINNED"
    assert isinstance(ev[2], BlockStored) and ev[2].extra_keys == ["tenant"]
    assert ev[3] == BlockRemoved([2**64 - 2], medium="DISK")
    assert ev[4] == BlockRemoved([2**64 - 4], medium="EXTERNAL")


def test_unknown_event_types_are_skipped() -> None:
    payload = _enc(Batch(1.0, [MapFuture(), MapCleared(), {"type": "Other", "x": [1]}]))
    assert decode_batch(payload).events == [AllBlocksCleared()]


def test_seq_frames() -> None:
    assert decode_seq((7).to_bytes(8, "big")) == (7, b"")
    pid = bytes(range(16))
    assert decode_seq((2**40).to_bytes(8, "big") + pid) == (2**40, pid)
    assert is_end_seq((-1).to_bytes(8, "big", signed=True))
    assert not is_end_seq((5).to_bytes(8, "big"))
    with pytest.raises(DecodeError):
        decode_seq(b"\x00\x01")


def test_live_message_with_24_byte_seq() -> None:
    payload = _enc(Batch(1.0, [MapCleared()]))
    env, batch = decode_message([b"kv@pod@m", (3).to_bytes(8, "big") + b"P" * 16, payload])
    assert (env.topic, env.seq, env.publisher) == (b"kv@pod@m", 3, b"P" * 16)
    assert batch.events == [AllBlocksCleared()]
    with pytest.raises(DecodeError):
        parse_live([b"", payload])


def test_replay_reply_shapes() -> None:
    seq8, end = (9).to_bytes(8, "big"), (-1).to_bytes(8, "big", signed=True)
    new = parse_replay([b"", b"topic", seq8, b"pl"])
    assert new is not None and (new.topic, new.seq, new.payload) == (b"topic", 9, b"pl")
    old = parse_replay([b"", seq8, b"pl"])
    assert old is not None and (old.seq, old.payload) == (9, b"pl")
    bare = parse_replay([seq8, b"pl"])
    assert bare is not None and bare.seq == 9
    assert parse_replay([b"", b"", end, b""]) is None
    assert parse_replay([b"", end, b""]) is None
    with pytest.raises(DecodeError):
        parse_replay([b"x"])


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # never-used msgpack byte
        _enc({"ts": 1.0}),
        _enc([1.0]),
        _enc(["soon", []]),
        _enc([1.0, {"not": "a list"}]),
        _enc([1.0, [{"no_type": 1}]]),
        _enc([1.0, [42]]),
        _enc(
            [1.0, [{"type": "BlockStored", "block_hashes": "x", "token_ids": [], "block_size": 2}]]
        ),
        _enc([1.0, [{"type": "BlockStored", "block_hashes": [1.5], "block_size": 2}]]),
        _enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "block_size": 0}]]),
        _enc(
            [
                1.0,
                [{"type": "BlockStored", "block_hashes": [1], "block_size": 2, "token_ids": [-1]}],
            ]
        ),
        _enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": 3}]]),
        _enc([1.0, [], "rank"]),
    ],
)
def test_malformed_payloads_raise_decode_error(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        decode_batch(payload)


def test_typed_and_untyped_decoding_agree() -> None:
    """The typed fast path decodes what the untyped decoder does; runs of removals alike
    come out as one event that counts them."""
    from kvplane.router.kvevents.decode import _decode_untyped

    events: list[Any] = [
        MapStored([5, -7], None, list(range(8)), 4, None, "GPU", None, [None, None], 0),
        MapStored([DIGEST_A], 5, [1, 2, 3, 4], 4, 3, None, None),  # lora_id: namespaced
        SgStored([-3], None, list(range(64)), 64, None, cache_salt="tenant"),
        MapRemoved([5], "GPU", 0),
        MapRemoved([-7], "GPU", 0),
        MapRemoved([DIGEST_B], "GPU", 0),
        MapRemoved([9], "CPU", 0),
        MapCleared(),
        MapRemoved([11], None, 0),
    ]
    payload = _enc(Batch(2.5, events, 1))
    typed, untyped = decode_batch(payload), _decode_untyped(payload)
    assert (typed.ts, typed.dp_rank) == (untyped.ts, untyped.dp_rank)
    assert typed.events[:3] == untyped.events[:3]
    merged = typed.events[3]
    assert isinstance(merged, BlockRemoved) and merged.events == 3
    assert merged.block_hashes == [h for e in untyped.events[3:6] for h in e.block_hashes]  # type: ignore[union-attr]
    assert typed.events[4:] == untyped.events[6:]


def test_normalise_hash_rejects_other_types() -> None:
    assert normalise_hash(-1) == 2**64 - 1
    assert normalise_hash(b"\x01\x02") == 0x0102
    for bad in (True, 1.0, "ab", None, b""):
        with pytest.raises(DecodeError):
            normalise_hash(bad)


# --- real frames captured from vLLM (another engineer records them) -------------------

DATA = Path(__file__).parent / "data"
CAPTURES = sorted(DATA.glob("vllm-0.32-kv-events*"))


def _frame(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return bytes.fromhex(value)
        except ValueError:
            return base64.b64decode(value, validate=True)
    raise TypeError(f"frame of type {type(value).__name__}")


def _capture(path: Path) -> list[dict[str, Any]]:
    """The golden capture: JSON lines of kind ``meta``, ``action`` (the request and
    its prompt token ids from /tokenize) and ``batch`` (``frames_b64``: the message
    the engine published after it); see tests/test_vllm_engines.py."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _frames(line: dict[str, Any]) -> list[bytes]:
    return [base64.b64decode(f) for f in line["frames_b64"]]


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_real_vllm_frames_decode(path: Path) -> None:
    lines = _capture(path)
    batches = [ln for ln in lines if ln["kind"] == "batch"]
    assert batches, f"{path} holds no batches"
    seqs: list[int] = []
    stored = 0
    for line in batches:
        env, batch = decode_message(_frames(line))
        assert env.seq == int(line["seq"]) and env.topic == line["topic"].encode()
        seqs.append(env.seq)
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored += 1
                assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
                assert all(0 <= h < 2**64 for h in ev.block_hashes)
                assert ev.medium == "GPU"
    assert seqs == sorted(seqs), "a capture from one publisher has increasing seqs"
    assert stored > 0, "a capture of real traffic stores blocks"


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
async def test_real_vllm_events_map_to_the_routers_own_keys(path: Path) -> None:
    """Ingesting what vLLM really published yields, for each request, exactly the keys
    the router computes from the prompt's token ids (engine hashes never compared)."""
    lines = _capture(path)
    block = 32
    index = MemoryIndex()
    ingestor = Ingestor(index, generation="golden", block_size=block)
    await index.begin_incarnation("e", "1")
    root = generation_root("golden")
    checked = 0
    for line in lines:
        if line["kind"] == "batch":
            _, batch = decode_message(_frames(line))
            await ingestor.apply("e", "1", batch)
        elif line["kind"] == "action" and "prompt_token_ids" in line:
            pending = line
            continue
        else:
            continue
        action = pending
        keys = block_keys(action["prompt_token_ids"], block, root)
        if not keys:
            continue
        got = (await index.lookup(keys, ["e"]))["e"][Tier.HBM]
        assert got == len(keys), action["name"]
        checked += 1
    assert checked >= 2
