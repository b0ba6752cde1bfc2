"""KV-cache events on ZMQ in vLLM 0.33's wire format: a PUB socket plus a replay ROUTER.

Subscribers (kvplane's indexer, vllm-router's ``kv_aware``, llm-d) decode the bytes,
not our types, so the payload is encoded with msgspec structs declared exactly like
vLLM's (``vllm/distributed/kv_events.py``): an ``array_like`` batch
``[ts, events, data_parallel_rank]`` whose events are maps tagged ``"type"``, fields
without a default always present, fields with one omitted when equal to it. The
values a plain full-attention model sends are filled in as vLLM does (``group_idx``
0, ``kv_cache_spec_kind`` ``"full_attention"``, one ``None`` extra key per block).

Framing: ``[topic, seq (8 bytes big-endian, from 0), payload]``; replay answers
``[client, b"", topic, seq, payload]`` per buffered batch with ``seq >= start`` and
ends with ``[client, b"", b"", -1 (8 bytes), b""]``. Sending never blocks (PUB drops
at the high-water mark, as vLLM's does), so publishing from the event loop is safe.
Replay is answered by a thread of its own, as vLLM's publisher thread does: a replay
of thousands of batches then neither waits on nor delays the engines' event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Final

import msgspec
import zmq

from kvplane.sim import events as ev

log = logging.getLogger(__name__)

END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
FULL_ATTENTION: Final = "full_attention"

ExternalBlockHash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event maps (the tag is the class name under ``"type"``)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_encoder: Final = msgspec.msgpack.Encoder()


def to_wire(event: ev.KVEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """One simulator event as vLLM's block pool builds it for a plain model (a LoRA
    adapter's blocks carry its id and name)."""
    if isinstance(event, ev.BlockStored):
        return BlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            # vLLM publishes extra keys untagged: the adapter's bare name per block
            extra_keys=[None if event.lora_name is None else (event.lora_name,)]
            * len(event.block_hashes),
            group_idx=0,
            kv_cache_spec_kind=FULL_ATTENTION,
            locality=event.locality,
        )
    if isinstance(event, ev.BlockRemoved):
        return BlockRemoved(
            block_hashes=list(event.block_hashes),
            medium=event.medium,
            group_idx=0,
            locality=event.locality,
        )
    return AllBlocksCleared()


def encode_batch(events: Iterable[ev.KVEvent], ts: float, data_parallel_rank: int | None) -> bytes:
    """Frame 2 of a message: the msgpack ``KVEventBatch``."""
    batch = KVEventBatch(
        ts=ts, events=[to_wire(e) for e in events], data_parallel_rank=data_parallel_rank
    )
    return _encoder.encode(batch)


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints bind, the rest connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Binds; a TCP port 0 picks a free port. Returns the endpoint actually bound."""
    sock.bind(endpoint)
    bound = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        host = endpoint[len("tcp://") : endpoint.rfind(":")]
        return f"tcp://{host}:{bound.rsplit(':', 1)[1]}"
    return endpoint


class KVEventPublisher:
    """One engine's publisher: PUB for live batches, ROUTER for replay of the last
    ``buffer_steps`` batches. ``bind=None`` follows vLLM's bind-or-connect rule.

    Call :meth:`start` to serve replay (from a thread of its own) and :meth:`close`
    or :meth:`aclose` at the end.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        bind: bool | None = None,
    ) -> None:
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self._topic_bytes = topic.encode()
        self._seq = itertools.count()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._pub: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        if bind if bind is not None else is_bind_endpoint(endpoint):
            self.endpoint = _bind(self._pub, endpoint)
        else:
            self._pub.connect(endpoint)
            self.endpoint = endpoint
        self._replay: zmq.Socket[Any] | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self._replay = zmq.Context.instance().socket(zmq.ROUTER)
            self._replay.set_hwm(2 * (buffer_steps + 1))
            self.replay_endpoint = _bind(self._replay, replay_endpoint)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.published = 0
        self.replays_served = 0

    def config(self) -> dict[str, Any]:
        """vLLM's ``KVEventsConfig`` as ``/kv_event_sources`` reports it (per DP rank)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
            "max_queue_size": 100_000,
            "topic": self.topic,
        }

    def start(self) -> None:
        """Start answering replay requests (the socket is the thread's from now on)."""
        if self._replay is not None and self._thread is None:
            self._thread = threading.Thread(
                target=self._serve_replay, name=f"kv-replay-{self.topic}", daemon=True
            )
            self._thread.start()

    def publish(self, events: Sequence[ev.KVEvent], ts: float | None = None) -> int | None:
        """Sends one batch (one engine step); returns its seq, None for no events."""
        if not events:
            return None
        seq = next(self._seq)
        payload = encode_batch(events, time.time() if ts is None else ts, self.data_parallel_rank)
        seq8 = seq.to_bytes(8, "big")
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart((self._topic_bytes, seq8, payload), flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1
        return seq

    def _serve_replay(self) -> None:
        sock = self._replay
        assert sock is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 3:
                log.warning("invalid replay request of %d frames", len(frames))
                continue
            try:
                self._answer(sock, frames[0], int.from_bytes(frames[2], "big"))
            except zmq.ZMQError as exc:  # one client's failure must not end the service
                log.warning("replay answer failed: %s", exc)

    def _answer(self, sock: zmq.Socket[Any], client: bytes, start: int) -> None:
        for seq, payload in list(self._buffer):  # a snapshot: the loop keeps appending
            if seq >= start:
                sock.send_multipart(
                    (client, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload)
                )
        sock.send_multipart((client, b"", b"", END_SEQ, b""))
        self.replays_served += 1

    @property
    def replay_serving(self) -> bool:
        """Whether the replay thread is running (for diagnostics)."""
        return self._thread is not None and self._thread.is_alive()

    async def aclose(self) -> None:
        await asyncio.to_thread(self._join)
        self.close()

    def _join(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None

    def close(self) -> None:
        self._join()  # the replay socket is closed only once its thread is done with it
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
