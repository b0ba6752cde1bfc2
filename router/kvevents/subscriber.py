"""One engine's KV-event stream: a ZMQ SUB socket plus replay-based recovery.

The index may only hold what the engine really caches, so every break in the
stream is resolved one of two ways. A gap (lost messages) is filled from the
engine's replay buffer when it still holds the missing batches; otherwise, and
whenever the publisher restarted (seq back to 0, or below the last one, or a new
publisher id), the stream starts a new *incarnation*: the consumer drops the
pod's entries and rebuilds from what follows. A new incarnation first asks the
replay buffer for everything it holds before the current message, so a router
that connects to a long-running engine still learns its cache.

The consumer reads ``updates()``, an async iterator of ``IncarnationChanged``
notices and ``BatchReceived`` batches in stream order, and ``StreamLost`` when
the engine's connection drops (a killed engine closes its TCP connection at
once; ZMTP heartbeats catch a silent one): the pod's residency must then leave
the index, and a reconnect starts a new incarnation.
"""

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, Callable, Collection
from dataclasses import dataclass
from typing import Final, Literal

import zmq
import zmq.asyncio
from kvplane.router.backoff import Backoff
from kvplane.router.kvevents.decode import (
    DecodeError,
    decode_batch,
    parse_live,
    parse_replay,
)
from kvplane.router.kvevents.model import EventBatch
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger(__name__)

DEFAULT_REPLAY_TIMEOUT_S: Final = 5.0
RECONNECT_MIN_S: Final = 0.1
RECONNECT_MAX_S: Final = 5.0
CONNECT_WAIT_S: Final = 1.0  # first connection, before the start notice
# A quiet stream is checked against the replay buffer this often: a lost *last*
# message (sent before our subscription reached the engine, or dropped) is shown
# by no later seq, so only asking finds it. An answer with nothing new is one
# end-of-buffer frame.
IDLE_PROBE_S: Final = 3.0
SUB_RCVHWM: Final = 100_000  # the engine's default PUB hwm: a slow ingest must not drop

Step = Literal["first", "next", "gap", "restart", "duplicate"]
Reason = Literal["start", "restart", "gap", "resync"]


@dataclass(frozen=True, slots=True)
class IncarnationChanged:
    """Everything indexed for ``pod`` before this notice must stop counting."""

    pod: str
    incarnation: str
    previous: str | None
    reason: Reason


@dataclass(frozen=True, slots=True)
class BatchReceived:
    pod: str
    incarnation: str
    seq: int
    batch: EventBatch


@dataclass(frozen=True, slots=True)
class StreamLost:
    """The engine's connection dropped: nothing it held may count any more."""

    pod: str
    incarnation: str | None


Update = IncarnationChanged | BatchReceived | StreamLost


@dataclass(slots=True)
class StreamStats:
    """Monotonic counters of one engine stream."""

    messages: int = 0
    batches: int = 0  # decoded and handed to the consumer (live + replayed)
    decode_errors: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0  # a gap the replay buffer could not fill
    restarts: int = 0
    incarnations: int = 0
    duplicates: int = 0
    reconnects: int = 0
    tail_recoveries: int = 0  # idle probes that found batches the live stream lost


def new_incarnation_id() -> str:
    return uuid.uuid4().hex[:8]


def classify(last_seq: int | None, last_publisher: bytes, seq: int, publisher: bytes) -> Step:
    """Where a message's seq sits relative to the previous one.

    With a publisher id (24-byte seq frames) only a new id means a restart, so a
    repeated seq is a duplicate; without one, seq going backwards is a restart.
    """
    if last_seq is None:
        return "first"
    if publisher != last_publisher:
        return "restart"
    if seq == last_seq + 1:
        return "next"
    if seq > last_seq + 1:
        return "gap"
    return "duplicate" if publisher else "restart"


def contiguous_suffix(seqs: Collection[int], stop: int) -> int:
    """Smallest ``s`` with every seq in ``[s, stop)`` present (``stop`` if none):
    the part of a partial replay that joins up with the live message at ``stop``."""
    start = stop
    for _ in range(len(seqs)):
        if start - 1 not in seqs:
            break
        start -= 1
    return start


async def _wait_connected(monitor: zmq.asyncio.Socket, timeout_s: float) -> bool:
    """Whether the first connection comes up within ``timeout_s`` (an engine that is
    down just starts later: its CONNECTED event is then handled in the loop)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while (remaining := deadline - loop.time()) > 0:
        if not await monitor.poll(max(1, int(remaining * 1000))):
            return False
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event == zmq.EVENT_CONNECTED:
            return True
    return False


def _poller(sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> zmq.asyncio.Poller:
    poller = zmq.asyncio.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    return poller


class EngineSubscriber:
    """Subscribes to one engine's PUB endpoint; recovers through its replay socket."""

    def __init__(
        self,
        pod: str,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        context: zmq.asyncio.Context | None = None,
        replay_timeout_s: float = DEFAULT_REPLAY_TIMEOUT_S,
        new_incarnation: Callable[[], str] = new_incarnation_id,
        idle_probe_s: float = IDLE_PROBE_S,
    ) -> None:
        self.pod = pod
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.stats = StreamStats()
        self._ctx = context if context is not None else zmq.asyncio.Context.instance()
        self._replay_timeout_s = replay_timeout_s
        self._idle_probe_ms = max(1, int(idle_probe_s * 1000))
        self._make_id = new_incarnation
        self._incarnation: str | None = None
        self._last_seq: int | None = None
        self._publisher = b""
        # batches read from the replay buffer on connect, by seq: a live copy of one
        # of them (queued while we replayed) is a duplicate, not a restart
        self._replayed: dict[int, bytes] = {}

    @property
    def incarnation(self) -> str | None:
        return self._incarnation

    def resync(self) -> IncarnationChanged:
        """Start a new incarnation now (e.g. the index missed writes). The next
        message catches up from the replay buffer as after a first connect."""
        self._last_seq = None
        self._publisher = b""
        return self._begin("resync")

    async def updates(self) -> AsyncGenerator[Update, None]:
        """The stream, until cancelled or closed. Starts with an
        ``IncarnationChanged(reason="start")`` before any batch."""
        self._last_seq, self._publisher = None, b""
        sock, monitor = self._open()
        poller = _poller(sock, monitor)
        lost = False
        try:
            start = self._begin("start")
            caught_up: list[Update] = []
            if await _wait_connected(monitor, CONNECT_WAIT_S):
                caught_up = await self._catch_up_on_connect()
            yield start
            for update in caught_up:
                yield update
            backoff = Backoff(RECONNECT_MIN_S, RECONNECT_MAX_S)
            while True:
                try:
                    ready = dict(await poller.poll(self._idle_probe_ms))
                    if not ready:
                        if not lost and self.replay_endpoint is not None:
                            for update in await self._probe():
                                yield update
                        continue
                    if monitor in ready:
                        event = parse_monitor_message(await monitor.recv_multipart())["event"]
                        if event == zmq.EVENT_DISCONNECTED and not lost:
                            lost = True
                            log.warning("kv events %s: connection lost", self.pod)
                            yield StreamLost(self.pod, self._incarnation)
                        elif event == zmq.EVENT_CONNECTED:
                            if lost:
                                lost = False
                                self._last_seq, self._publisher = None, b""
                                yield self._begin("start")
                            if self._last_seq is None:
                                for update in await self._catch_up_on_connect():
                                    yield update
                    if sock not in ready:
                        continue
                    frames = await sock.recv_multipart()
                except zmq.ZMQError as exc:
                    if exc.errno == zmq.ETERM:
                        raise  # the context is gone: nothing to reopen
                    # zmq reconnects the transport by itself; this is the socket failing
                    delay = backoff.next()
                    log.warning("kv events %s: %s; reopening in %.1fs", self.pod, exc, delay)
                    self.stats.reconnects += 1
                    monitor.close(linger=0)
                    sock.close(linger=0)
                    await asyncio.sleep(delay)
                    sock, monitor = self._open()
                    poller = _poller(sock, monitor)
                    continue
                backoff.reset()
                for update in await self._on_message(frames):
                    yield update
        finally:
            monitor.close(linger=0)
            sock.close(linger=0)

    def _open(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        """A SUB socket and its monitor, attached before connecting so that the
        first CONNECTED event cannot be missed."""
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, SUB_RCVHWM)
        sock.setsockopt(zmq.RECONNECT_IVL, int(RECONNECT_MIN_S * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
        # ZMTP heartbeats: notice a silently dead engine and redial it
        sock.setsockopt(zmq.HEARTBEAT_IVL, 5_000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 15_000)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.endpoint)
        return sock, monitor

    def _begin(self, reason: Reason) -> IncarnationChanged:
        previous, self._incarnation = self._incarnation, self._make_id()
        self.stats.incarnations += 1
        if reason != "start":
            log.info(
                "kv events %s: new incarnation %s (%s), was %s",
                self.pod,
                self._incarnation,
                reason,
                previous,
            )
        return IncarnationChanged(self.pod, self._incarnation, previous, reason)

    async def _on_message(self, frames: list[bytes]) -> list[Update]:
        """One live message -> the updates it implies, recovering first if needed."""
        try:
            env = parse_live(frames)
        except DecodeError as exc:
            self.stats.decode_errors += 1
            log.debug("kv events %s: bad message: %s", self.pod, exc)
            return []
        self.stats.messages += 1
        if self._replayed:
            if self._replayed.get(env.seq) == env.payload:
                self.stats.duplicates += 1
                return []
            self._replayed = {}
            if self._publisher == b"" and env.publisher:  # replay frames carry no id
                self._publisher = env.publisher
        step = classify(self._last_seq, self._publisher, env.seq, env.publisher)
        out: list[Update] = []
        if step == "duplicate":
            self.stats.duplicates += 1
            return out
        if step == "gap" and self._last_seq is not None:
            self.stats.gaps += 1
            out += await self._fill_gap(self._last_seq + 1, env.seq)
        elif step == "restart":
            self.stats.restarts += 1
            out.append(self._begin("restart"))
            out += await self._catch_up(env.seq)
        elif step == "first":
            out += await self._catch_up(env.seq)
        out += self._decoded(env.seq, env.payload)
        self._last_seq, self._publisher = env.seq, env.publisher
        return out

    async def _catch_up_on_connect(self) -> list[Update]:
        """Learn what a running engine already holds as soon as we connect, instead
        of waiting for its next event (an idle engine may send none for a long time)."""
        got = await self._replay(0, 1 << 63)
        if not got or self._last_seq is not None:
            return []
        stop = max(got) + 1
        start = contiguous_suffix(got, stop)
        self._replayed = {seq: got[seq] for seq in range(start, stop)}
        self._last_seq, self._publisher = stop - 1, b""
        return self._decoded_range(got, start, stop)

    async def _probe(self) -> list[Update]:
        """Anything the engine published after the last seq we saw (idle stream)."""
        if self._last_seq is None:
            return await self._catch_up_on_connect()
        start = self._last_seq + 1
        got = await self._replay(start, 1 << 63)
        if not got:
            return []
        self.stats.tail_recoveries += 1
        stop = max(got) + 1
        log.info("kv events %s: seq %d..%d missed live, recovering", self.pod, start, stop - 1)
        self._replayed = got  # a late live copy of one of them is a duplicate
        self._last_seq = stop - 1
        return self._joined(got, start, stop)

    async def _fill_gap(self, start: int, stop: int) -> list[Update]:
        return self._joined(await self._replay(start, stop), start, stop)

    def _joined(self, got: dict[int, bytes], start: int, stop: int) -> list[Update]:
        """Seqs ``[start, stop)`` from a replay; when it no longer reaches back to
        ``start``, a new incarnation from where it joins up with ``stop``."""
        if all(seq in got for seq in range(start, stop)):
            return self._decoded_range(got, start, stop)
        self.stats.replay_failures += 1
        log.warning("kv events %s: seq %d..%d lost, not in replay", self.pod, start, stop - 1)
        out: list[Update] = [self._begin("gap")]
        return out + self._decoded_range(got, contiguous_suffix(got, stop), stop)

    async def _catch_up(self, stop: int) -> list[Update]:
        """Fresh incarnation at seq ``stop``: replay what the buffer still holds."""
        if stop == 0:
            return []
        got = await self._replay(0, stop)
        return self._decoded_range(got, contiguous_suffix(got, stop), stop)

    def _decoded_range(self, got: dict[int, bytes], start: int, stop: int) -> list[Update]:
        out: list[Update] = []
        for seq in range(start, stop):
            out += self._decoded(seq, got[seq])
        return out

    def _decoded(self, seq: int, payload: bytes) -> list[Update]:
        assert self._incarnation is not None
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.stats.decode_errors += 1
            log.debug("kv events %s: bad payload at seq %d: %s", self.pod, seq, exc)
            return []
        self.stats.batches += 1
        return [BatchReceived(self.pod, self._incarnation, seq, batch)]

    async def _replay(self, start: int, stop: int) -> dict[int, bytes]:
        """Payloads for seqs in ``[start, stop)`` from the replay socket, as far as
        the engine still buffers them and the timeout allows."""
        if self.replay_endpoint is None or stop <= start:
            return {}
        self.stats.replays += 1
        got: dict[int, bytes] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._replay_timeout_s
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while (remaining := deadline - loop.time()) > 0:
                if not await sock.poll(max(1, int(remaining * 1000))):  # POLLIN
                    log.warning("kv events %s: replay from %d timed out", self.pod, start)
                    break
                frames = await sock.recv_multipart()
                try:
                    env = parse_replay(frames)
                except DecodeError as exc:
                    self.stats.decode_errors += 1
                    log.debug("kv events %s: bad replay reply: %s", self.pod, exc)
                    continue
                if env is None or env.seq >= stop:
                    break  # end of buffer, or caught up with the live stream
                if env.seq >= start:
                    got[env.seq] = env.payload
        except zmq.ZMQError as exc:
            log.warning("kv events %s: replay failed: %s", self.pod, exc)
        finally:
            sock.close(linger=0)
        return got
