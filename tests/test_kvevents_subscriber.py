"""The KV-event subscriber against an emulated engine publisher on loopback.

``Publisher`` speaks the real ZMQ protocol of vLLM 0.33 (engine-interfaces.md
§1.2, §1.3, §1.5): an XPUB socket (PUB plus a way to wait for the subscription)
sending ``[topic, seq8, payload]``, and a ROUTER replay socket answering
``[cid, b"", start8]`` with the buffered batches and an END_SEQ terminator.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.config import Backend
from kvplane.router.index.base import Blocks
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.kvevents.service import Indexer, resolve_endpoint
from kvplane.router.kvevents.subscriber import (
    BatchReceived,
    EngineSubscriber,
    IncarnationChanged,
    StreamLost,
    Update,
    classify,
    contiguous_suffix,
)
from kvplane.router.tiers import Tier

TOPIC = b"kv@pod-a@model"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
TIMEOUT = 5.0


class _Event(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class Stored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class Cleared(_Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class Publisher:
    """An engine's event publisher: live PUB stream, replay buffer, ROUTER replay."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        buffer_steps: int = 100,
        old_replay_shape: bool = False,
        answer_replay: bool = True,
        publisher_id: bytes = b"",
    ) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.old_replay_shape = old_replay_shape
        self.answer_replay = answer_replay
        self.publisher_id = publisher_id
        self.replay_requests: list[int] = []
        self._server = asyncio.create_task(self._serve_replay())

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def subscribed(self) -> bytes:
        """Wait for a subscriber's subscription message (XPUB)."""
        msg: bytes = await asyncio.wait_for(self.pub.recv(), TIMEOUT)
        return msg

    async def publish(self, *events: Any, send: bool = True, payload: bytes | None = None) -> int:
        """One engine step; ``send=False`` emulates a message PUB dropped at the HWM."""
        seq = self.seq
        self.seq += 1
        body = (
            payload
            if payload is not None
            else msgspec.msgpack.encode(Batch(float(seq), list(events)))
        )
        self.buffer.append((seq, body))
        if send:
            seq8 = seq.to_bytes(8, "big") + self.publisher_id
            await self.pub.send_multipart([TOPIC, seq8, body])
        return seq

    def restart(self, publisher_id: bytes = b"") -> None:
        """A new engine process: seq from 0, empty replay buffer."""
        self.seq = 0
        self.buffer.clear()
        self.publisher_id = publisher_id

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                continue
            cid, start = frames[0], int.from_bytes(frames[2], "big")
            self.replay_requests.append(start)
            if not self.answer_replay:
                continue
            for seq, body in list(self.buffer):
                if seq < start:
                    continue
                seq8 = seq.to_bytes(8, "big")
                if self.old_replay_shape:
                    await self.router.send_multipart([cid, b"", seq8, body])
                else:
                    await self.router.send_multipart([cid, b"", TOPIC, seq8, body])
            end = (
                [cid, b"", END_SEQ, b""] if self.old_replay_shape else [cid, b"", b"", END_SEQ, b""]
            )
            await self.router.send_multipart(end)

    async def close(self) -> None:
        self._server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._server
        self.pub.close(linger=0)
        self.router.close(linger=0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    # every socket (ours and the subscriber's) must be closed by now: term() would hang
    await asyncio.wait_for(asyncio.to_thread(context.term), TIMEOUT)


@contextlib.asynccontextmanager
async def running(**kw: Any) -> AsyncIterator[Publisher]:
    pub = Publisher(**kw)
    try:
        yield pub
    finally:
        await pub.close()


def counter() -> Any:
    n = iter(range(1000))
    return lambda: f"inc{next(n)}"


def subscriber(
    ctx: zmq.asyncio.Context, pub: Publisher, replay: bool = True, **kw: Any
) -> EngineSubscriber:
    return EngineSubscriber(
        "pod-a",
        pub.endpoint,
        replay_endpoint=pub.replay_endpoint if replay else None,
        topic="kv@",
        context=ctx,
        new_incarnation=counter(),
        **({"idle_probe_s": 60.0} | kw),  # probes only where a test asks for them
    )


async def take(gen: AsyncGenerator[Update, None], n: int) -> list[Update]:
    return [await asyncio.wait_for(anext(gen), TIMEOUT) for _ in range(n)]


def summary(updates: list[Update]) -> list[tuple[str, str, int | str]]:
    """(kind, incarnation, seq or reason) per update, for compact assertions."""
    out: list[tuple[str, str, int | str]] = []
    for u in updates:
        if isinstance(u, IncarnationChanged):
            out.append(("inc", u.incarnation, u.reason))
        else:
            assert isinstance(u, BatchReceived) and u.batch.ts == float(u.seq)
            out.append(("batch", u.incarnation, u.seq))
    return out


@contextlib.asynccontextmanager
async def stream(
    ctx: zmq.asyncio.Context, pub: Publisher, **kw: Any
) -> AsyncIterator[tuple[EngineSubscriber, AsyncGenerator[Update, None]]]:
    """A subscriber whose subscription the publisher has seen."""
    sub = subscriber(ctx, pub, **kw)
    gen = sub.updates()
    try:
        assert summary(await take(gen, 1)) == [("inc", "inc0", "start")]
        assert await pub.subscribed() == b"\x01kv@"
        # on connect the subscriber asks the replay buffer for what it already holds
        expected = [0] if kw.get("replay", True) else []
        assert pub.replay_requests == expected
        pub.replay_requests.clear()
        sub.stats.replays = 0
        yield sub, gen
    finally:
        await gen.aclose()


def test_classify_and_contiguous_suffix() -> None:
    assert classify(None, b"", 7, b"") == "first"
    assert classify(3, b"", 4, b"") == "next"
    assert classify(3, b"", 6, b"") == "gap"
    assert classify(3, b"", 0, b"") == "restart"
    assert classify(3, b"", 3, b"") == "restart"
    assert classify(3, b"p1", 3, b"p1") == "duplicate"
    assert classify(3, b"p1", 0, b"p2") == "restart"
    assert contiguous_suffix({3, 4, 6, 7}, 8) == 6
    assert contiguous_suffix({3, 4}, 8) == 8
    assert contiguous_suffix(set(), 5) == 5


async def test_live_stream_in_order(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx) as pub, stream(ctx, pub) as (sub, gen):
        for _ in range(3):
            await pub.publish(Cleared())
        assert summary(await take(gen, 3)) == [("batch", "inc0", s) for s in range(3)]
        assert sub.stats.gaps == 0 and sub.stats.replays == 0


@pytest.mark.parametrize("old_shape", [False, True])
async def test_gap_is_filled_from_replay(ctx: zmq.asyncio.Context, old_shape: bool) -> None:
    async with running(ctx=ctx, old_replay_shape=old_shape) as pub, stream(ctx, pub) as (sub, gen):
        await pub.publish(Cleared())
        await pub.publish(Cleared(), send=False)
        await pub.publish(Cleared(), send=False)
        await pub.publish(Cleared())
        await pub.publish(Cleared())
        assert summary(await take(gen, 5)) == [("batch", "inc0", s) for s in range(5)]
        assert pub.replay_requests == [1]
        assert (sub.stats.gaps, sub.stats.replays, sub.stats.replay_failures) == (1, 1, 0)


async def test_replay_not_covering_the_gap_starts_a_new_incarnation(
    ctx: zmq.asyncio.Context,
) -> None:
    async with running(ctx=ctx, buffer_steps=2) as pub, stream(ctx, pub) as (sub, gen):
        await pub.publish(Cleared())
        for _ in range(4):
            await pub.publish(Cleared(), send=False)  # seqs 1..4; buffer keeps 3, 4
        await pub.publish(Cleared())  # seq 5, evicting 3
        got = summary(await take(gen, 4))
        assert got == [
            ("batch", "inc0", 0),
            ("inc", "inc1", "gap"),
            ("batch", "inc1", 4),  # what the buffer still joins up with seq 5
            ("batch", "inc1", 5),
        ]
        assert sub.stats.replay_failures == 1 and sub.incarnation == "inc1"


async def test_lost_last_message_is_recovered_by_the_idle_probe(
    ctx: zmq.asyncio.Context,
) -> None:
    # no later message shows this gap: only asking the replay buffer finds it
    async with running(ctx=ctx) as pub, stream(ctx, pub, idle_probe_s=0.2) as (sub, gen):
        await pub.publish(Cleared())
        await pub.publish(Cleared(), send=False)
        assert summary(await take(gen, 2)) == [("batch", "inc0", 0), ("batch", "inc0", 1)]
        assert pub.replay_requests[0] == 1 and sub.stats.tail_recoveries == 1
        await pub.publish(Cleared())  # the stream goes on from there, no gap, no restart
        assert summary(await take(gen, 1)) == [("batch", "inc0", 2)]
        assert (sub.stats.gaps, sub.stats.restarts, sub.stats.tail_recoveries) == (0, 0, 1)


async def test_first_message_lost_before_any_live_one_is_recovered(
    ctx: zmq.asyncio.Context,
) -> None:
    # a fresh engine's first step published before the subscription reached it
    async with running(ctx=ctx) as pub, stream(ctx, pub, idle_probe_s=0.2) as (sub, gen):
        await pub.publish(Cleared(), send=False)
        assert summary(await take(gen, 1)) == [("batch", "inc0", 0)]
        await pub.publish(Cleared())
        assert summary(await take(gen, 1)) == [("batch", "inc0", 1)]
        assert sub.stats.gaps == 0 and sub.stats.restarts == 0


async def test_idle_probe_past_the_buffer_starts_a_new_incarnation(
    ctx: zmq.asyncio.Context,
) -> None:
    async with (
        running(ctx=ctx, buffer_steps=2) as pub,
        stream(ctx, pub, idle_probe_s=0.2) as (sub, gen),
    ):
        await pub.publish(Cleared())
        for _ in range(4):
            await pub.publish(Cleared(), send=False)  # seqs 1..4; the buffer keeps 3, 4
        got = summary(await take(gen, 4))
        assert got == [
            ("batch", "inc0", 0),
            ("inc", "inc1", "gap"),
            ("batch", "inc1", 3),
            ("batch", "inc1", 4),
        ]
        assert sub.stats.replay_failures == 1


async def test_gap_without_replay_endpoint(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx) as pub, stream(ctx, pub, replay=False) as (_, gen):
        await pub.publish(Cleared())
        await pub.publish(Cleared(), send=False)
        await pub.publish(Cleared())
        got = summary(await take(gen, 3))
        assert got == [("batch", "inc0", 0), ("inc", "inc1", "gap"), ("batch", "inc1", 2)]


async def test_silent_replay_socket_is_bounded_by_the_timeout(ctx: zmq.asyncio.Context) -> None:
    async with (
        running(ctx=ctx, answer_replay=False) as pub,
        stream(ctx, pub, replay_timeout_s=0.3) as (_, gen),
    ):
        await pub.publish(Cleared())
        await pub.publish(Cleared(), send=False)
        await pub.publish(Cleared())
        got = summary(await take(gen, 3))
        assert got == [("batch", "inc0", 0), ("inc", "inc1", "gap"), ("batch", "inc1", 2)]
        assert pub.replay_requests == [1]


async def test_restart_to_seq_zero_is_a_new_incarnation(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx) as pub, stream(ctx, pub) as (sub, gen):
        for _ in range(3):
            await pub.publish(Cleared())
        pub.restart()
        await pub.publish(Cleared())
        await pub.publish(Cleared())
        got = summary(await take(gen, 6))
        assert got[3:] == [("inc", "inc1", "restart"), ("batch", "inc1", 0), ("batch", "inc1", 1)]
        assert sub.stats.restarts == 1 and pub.replay_requests == []


async def test_restart_whose_first_messages_were_lost_catches_up(
    ctx: zmq.asyncio.Context,
) -> None:
    async with running(ctx=ctx) as pub, stream(ctx, pub) as (_, gen):
        for _ in range(5):
            await pub.publish(Cleared())
        pub.restart()
        await pub.publish(Cleared(), send=False)
        await pub.publish(Cleared())  # seq 1 <= last (4): restart, replay [0, 1)
        got = summary(await take(gen, 8))
        assert got[5:] == [("inc", "inc1", "restart"), ("batch", "inc1", 0), ("batch", "inc1", 1)]
        assert pub.replay_requests == [0]


async def test_first_connect_mid_stream_catches_up_from_the_buffer(
    ctx: zmq.asyncio.Context,
) -> None:
    async with running(ctx=ctx) as pub:
        for _ in range(4):  # before anybody listens
            await pub.publish(Cleared(), send=False)
        async with stream(ctx, pub) as (sub, gen):
            await pub.publish(Cleared())
            assert summary(await take(gen, 5)) == [("batch", "inc0", s) for s in range(5)]
            # 0..3 came from the replay at connect (see stream()), 4 live: no gap
            assert pub.replay_requests == [] and sub.stats.gaps == 0


async def test_publisher_id_frames(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx, publisher_id=b"A" * 16) as pub, stream(ctx, pub) as (sub, gen):
        await pub.publish(Cleared())
        pub.seq = 0  # same publisher repeating a seq: a duplicate, not a restart
        await pub.publish(Cleared())
        await pub.publish(Cleared())
        pub.restart(publisher_id=b"B" * 16)
        await pub.publish(Cleared())
        got = summary(await take(gen, 4))
        assert got == [
            ("batch", "inc0", 0),
            ("batch", "inc0", 1),
            ("inc", "inc1", "restart"),
            ("batch", "inc1", 0),
        ]
        assert sub.stats.duplicates == 1


async def test_malformed_messages_are_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx) as pub, stream(ctx, pub) as (sub, gen):
        await pub.publish(payload=b"\xc1garbage")
        await pub.pub.send_multipart([TOPIC, b"\x01"])  # wrong frame count
        await pub.publish(Cleared())
        assert summary(await take(gen, 1)) == [("batch", "inc0", 1)]
        assert sub.stats.decode_errors == 2 and sub.stats.gaps == 0


async def test_resync_starts_over_and_catches_up(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx) as pub, stream(ctx, pub) as (sub, gen):
        await pub.publish(Cleared())
        assert summary(await take(gen, 1)) == [("batch", "inc0", 0)]
        notice = sub.resync()
        assert (notice.incarnation, notice.previous, notice.reason) == ("inc1", "inc0", "resync")
        await pub.publish(Cleared())
        assert summary(await take(gen, 2)) == [("batch", "inc1", 0), ("batch", "inc1", 1)]


async def test_dropped_connection_is_reported_and_reconnect_starts_over(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = Publisher(ctx)
    port = pub.port
    async with stream(ctx, pub) as (_sub, gen):
        await pub.publish(Cleared())
        assert summary(await take(gen, 1)) == [("batch", "inc0", 0)]
        await pub.close()  # the engine dies: its sockets close
        lost = await take(gen, 1)
        assert lost == [StreamLost("pod-a", "inc0")]
        pub2 = Publisher(ctx)  # the engine comes back on the same port
        pub2.pub.close(linger=0)
        pub2.pub = ctx.socket(zmq.XPUB)
        pub2.pub.setsockopt(zmq.LINGER, 0)
        pub2.pub.bind(f"tcp://127.0.0.1:{port}")
        try:
            assert summary(await take(gen, 1)) == [("inc", "inc1", "start")]
        finally:
            await pub2.close()


async def test_clean_shutdown_by_cancellation(ctx: zmq.asyncio.Context) -> None:
    async with running(ctx=ctx) as pub:
        sub = subscriber(ctx, pub)
        seen: list[Update] = []

        async def consume() -> None:
            async with contextlib.aclosing(sub.updates()) as gen:
                async for update in gen:
                    seen.append(update)

        task = asyncio.create_task(consume())
        await pub.subscribed()
        await pub.publish(Cleared())
        for _ in range(500):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        assert summary(seen) == [("inc", "inc0", "start"), ("batch", "inc0", 0)]
    # the ctx fixture's term() proves the subscriber's socket was closed


# --- the Indexer: subscribers + ingestion into one index -----------------------------

BS = 4
GEN = "g1"
TOKENS = list(range(100, 116))
KEYS = block_keys(TOKENS, BS, generation_root(GEN))


def stored_event(n_blocks: int) -> Stored:
    hashes = [0xE000 + i for i in range(n_blocks)]
    return Stored(hashes, None, TOKENS[: n_blocks * BS], BS, None, "GPU", None, 0)


async def wait_for_prefix(index: MemoryIndex, pod: str, want: int) -> None:
    for _ in range(500):
        got = (await index.lookup(KEYS, [pod]))[pod][Tier.HBM]
        if got == want:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{pod}: HBM prefix {got}, want {want}")


async def test_indexer_end_to_end(ctx: zmq.asyncio.Context) -> None:
    index = MemoryIndex()
    async with running(ctx=ctx) as pub:
        backend = Backend(
            name="pod-a",
            url="http://127.0.0.1:8000",
            kv_events=f"tcp://*:{pub.port}",
            replay=pub.replay_endpoint,
            topic="kv@",
        )
        indexer = Indexer(index, generation=GEN, block_size=BS, backends=[backend], context=ctx)
        await indexer.start()
        try:
            await pub.subscribed()
            for _ in range(100):  # the start notice follows the connect-time catch-up
                if "pod-a" in await index.incarnations():
                    break
                await asyncio.sleep(0.02)
            first = (await index.incarnations())["pod-a"]
            await pub.publish(stored_event(3))
            await wait_for_prefix(index, "pod-a", 3)
            pub.restart()
            await pub.publish(Cleared())
            await wait_for_prefix(index, "pod-a", 0)
            assert (await index.incarnations())["pod-a"] != first
            await pub.publish(stored_event(4))
            await wait_for_prefix(index, "pod-a", 4)
            assert indexer.stream_stats()["pod-a"].restarts == 1
            assert indexer.ingest_stats.stored == 2
            # a label-only change keeps the stream; removal drops the pod
            await indexer.set_backends([backend.model_copy(update={"labels": {"x": "y"}})])
            assert indexer.incarnation("pod-a") is not None
            await indexer.set_backends([])
            assert "pod-a" not in await index.incarnations()
            assert indexer.backends == []
        finally:
            await indexer.stop()


def test_resolve_endpoint() -> None:
    url = "http://10.0.0.7:8000"
    assert resolve_endpoint("tcp://*:5557", url) == "tcp://10.0.0.7:5557"
    assert resolve_endpoint("tcp://0.0.0.0:5557", url) == "tcp://10.0.0.7:5557"
    assert resolve_endpoint("tcp://engine:5557", url) == "tcp://engine:5557"
    assert resolve_endpoint("tcp://*:5557", "http://[fd00::1]:8000") == "tcp://[fd00::1]:5557"
    assert resolve_endpoint("ipc:///tmp/kv", url) == "ipc:///tmp/kv"


class FlakyIndex(MemoryIndex):
    """A MemoryIndex whose next store can be made to fail (an index outage)."""

    fail_next_store = False

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        if self.fail_next_store:
            self.fail_next_store = False
            raise ConnectionError("index unreachable")
        await super().store(pod, incarnation, blocks, tier)


async def test_indexer_resyncs_a_pod_after_an_index_write_failure(
    ctx: zmq.asyncio.Context,
) -> None:
    index = FlakyIndex()
    async with running(ctx=ctx) as pub:
        backend = Backend(
            name="pod-a",
            url="http://127.0.0.1:8000",
            kv_events=pub.endpoint,
            replay=pub.replay_endpoint,
        )
        indexer = Indexer(index, generation=GEN, block_size=BS, backends=[backend], context=ctx)
        await indexer.start()
        try:
            await pub.subscribed()
            await pub.publish(stored_event(2))
            await wait_for_prefix(index, "pod-a", 2)
            before = indexer.incarnation("pod-a")
            index.fail_next_store = True
            tail = Stored([0xE002, 0xE003], 0xE001, TOKENS[2 * BS :], BS, None, "GPU", None, 0)
            await pub.publish(tail)
            await wait_for_prefix(index, "pod-a", 0)  # new incarnation: nothing counts
            assert indexer.incarnation("pod-a") != before
            await pub.publish()  # next message: catch up from the replay buffer
            await wait_for_prefix(index, "pod-a", 4)
        finally:
            await indexer.stop()
