"""A lean HTTP/1.1 client for the proxy's hot path.

Why not httpx here: per request it builds request and response models, header
objects, an anyio stream and several layers of async generators, which profiled as
most of the router's added latency on a shared 8K-token prompt when the proxy used
it (bench/HISTORY.md). Here a
request is one ``writelines`` of pre-joined bytes on a pooled keep-alive
connection, and the response is parsed by httptools (llhttp) from the protocol
callbacks; the body is handed over as the parser yields it, so a stream passes
through chunk by chunk.

Failure semantics the proxy relies on:

* :class:`BackendUnavailable`: no response head. Nothing reached the client, so
  the request may go to another pod; its ``cause`` tells the proxy whose fault it
  may be: ``CONNECT`` (refused or timed out: the pod is unreachable), ``CLOSED``
  (closed, reset or a malformed answer after the request was sent: the pod, or
  the request itself), ``TIMEOUT`` (no head in time: the engine took the request)
  or ``BUSY`` (the router's own in-flight cap). A reused keep-alive connection
  that the backend had closed is retried once on a fresh one first.
* :class:`ResponseBroken`: the response broke after its head.

Every wait is bounded: connecting by the connect timeout, each read (the head,
every body chunk) by the read timeout. A reader that falls behind pauses the
socket (bounded buffering, so a slow client slows the backend down rather than
filling the router's memory).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from collections.abc import Iterable
from enum import Enum
from typing import cast
from urllib.parse import urlsplit

import httptools

# Pause reading a backend once this much body is buffered and unread; resume below LOW.
HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class Cause(Enum):
    CONNECT = "connect"
    CLOSED = "closed"
    TIMEOUT = "timeout"
    BUSY = "busy"
    STALLED = "stalled"  # the engine took it but computes nothing (router/proxy.py)


class BackendUnavailable(Exception):
    """The backend gave no response head; nothing was relayed to the client."""

    def __init__(self, message: str, cause: Cause) -> None:
        super().__init__(message)
        self.cause = cause


class ResponseBroken(Exception):
    """The backend's response broke after its head (``timed_out``: no data in time)."""

    def __init__(self, message: str, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _Connection(asyncio.Protocol):
    """One keep-alive connection and the state of the response being read on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self.lost = False
        self.active = False  # a request is in flight on it
        self.error: BaseException | None = None
        self.reset()

    def reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.got_bytes = False
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self._interim = False
        self._until_eof = False

    @property
    def reusable(self) -> bool:
        return not self.lost and self.error is None and self.complete and self.keep_alive

    def close(self) -> None:
        if self._transport is not None and not self.lost:
            self._transport.close()
        self.lost = True

    # -- asyncio.Protocol --------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.active:  # bytes on an idle connection: nothing can follow it safely
            self.close()
            return
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except Exception as exc:  # malformed response (httptools errors, upgrades)
            self.error = exc
            self.close()
        self.wake()

    def eof_received(self) -> bool:
        if self.head_done and self._until_eof and not self.complete:
            self.complete = True  # a body delimited by the end of the connection
            self.keep_alive = False
        self.wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.active and not self.complete and self.error is None:
            self.error = exc or ConnectionResetError("connection closed by the backend")
        self.wake()

    # -- httptools callbacks -----------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self._interim = True  # 100 Continue and friends: the real answer follows
            self.headers = []
            return
        self.status = status
        self.head_done = True
        names = {n for n, _ in self.headers}
        self._until_eof = (
            b"content-length" not in names
            and b"transfer-encoding" not in names
            and status not in (204, 304)
        )
        self.wake()

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > HIGH_WATER and not self._paused and self._transport is not None:
            self._transport.pause_reading()
            self._paused = True

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self.keep_alive = self._parser.should_keep_alive()

    # -- waiting -----------------------------------------------------------
    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self, timeout_s: float) -> None:
        fut = self._loop.create_future()
        self._waiter = fut
        timer = self._loop.call_later(timeout_s, _expire, fut)
        try:
            await fut
        finally:
            timer.cancel()
            self._waiter = None

    def _failed(self) -> bool:
        return self.error is not None or (self.lost and not self.complete)

    # -- one exchange ------------------------------------------------------
    async def send(self, parts: list[bytes], timeout_s: float) -> None:
        """Writes a request and waits for its response head."""
        assert self._transport is not None
        self.reset()
        self.active = True
        self._transport.writelines(parts)
        while not self.head_done:
            if self._failed():
                raise BackendUnavailable(_describe(self.error, "connection closed"), Cause.CLOSED)
            try:
                await self._wait(timeout_s)
            except TimeoutError:
                raise BackendUnavailable(
                    f"no response head within {timeout_s:g} s", Cause.TIMEOUT
                ) from None

    def take(self) -> bytes | None:
        """The next buffered body piece, if any."""
        if not self.chunks:
            return None
        piece = self.chunks.popleft()
        self.buffered -= len(piece)
        if self._paused and self.buffered <= LOW_WATER and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return piece

    async def more(self, timeout_s: float) -> None:
        """Waits for more body (or its end); raises if the response broke."""
        if self._failed():
            raise ResponseBroken(_describe(self.error, "connection closed mid-response"))
        try:
            await self._wait(timeout_s)
        except TimeoutError:
            raise ResponseBroken(f"no data within {timeout_s:g} s", timed_out=True) from None


def _describe(exc: BaseException | None, default: str) -> str:
    if exc is None:
        return default
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class UpstreamResponse:
    """A backend's answer: status and headers now, the body whole or piece by piece.

    ``release()`` must end every response: it returns a fully read connection to
    the pool and closes any other (a half-read response cannot be reused).
    """

    __slots__ = ("_conn", "_forwarder", "_origin", "_read_s", "_released")

    def __init__(
        self, conn: _Connection, origin: _Origin, forwarder: Forwarder, read_s: float
    ) -> None:
        self._conn = conn
        self._origin = origin
        self._forwarder = forwarder
        self._read_s = read_s
        self._released = False

    @property
    def status(self) -> int:
        return self._conn.status

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        """Response headers, names lower-cased, in order."""
        return self._conn.headers

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet taken."""
        return self._conn.buffered

    async def read(self) -> bytes:
        """The whole body."""
        conn = self._conn
        parts: list[bytes] = []
        while True:
            piece = conn.take()
            while piece is not None:
                parts.append(piece)
                piece = conn.take()
            if conn.complete:
                return b"".join(parts)
            await conn.more(self._read_s)

    async def next_chunk(self, timeout_s: float | None = None) -> bytes | None:
        """The next body piece as the backend sent it; None at the end. ``timeout_s``:
        the longest wait for it (default: the read timeout)."""
        conn = self._conn
        while True:
            piece = conn.take()
            if piece is not None:
                return piece
            if conn.complete:
                return None
            await conn.more(self._read_s if timeout_s is None else timeout_s)

    def abort(self) -> None:
        """Drops the connection now (the client went away): a pending read fails."""
        if not self._released:
            self._conn.close()
            self._conn.wake()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        conn = self._conn
        conn.active = False
        if conn.reusable and not conn.chunks:
            self._origin.put(conn)
        else:
            conn.close()
        self._forwarder._slots.release()


class _Origin:
    """A backend base URL: its address, request-line prefix and idle connections."""

    def __init__(self, url: str, max_idle: int) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        self.tls = parts.scheme == "https"
        self.host = parts.hostname
        self.port = parts.port or (443 if self.tls else 80)
        default = 443 if self.tls else 80
        netloc = f"[{self.host}]" if ":" in self.host else self.host
        if parts.port is not None and parts.port != default:
            netloc += f":{parts.port}"
        self.prefix = parts.path.rstrip("/").encode()
        self.host_line = b"host: " + netloc.encode("ascii" if netloc.isascii() else "idna")
        self.idle: list[_Connection] = []
        self.max_idle = max_idle

    def take_idle(self) -> _Connection | None:
        while self.idle:
            conn = self.idle.pop()
            if not conn.lost:
                return conn
        return None

    def put(self, conn: _Connection) -> None:
        if len(self.idle) < self.max_idle:
            self.idle.append(conn)
        else:
            conn.close()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()


class Forwarder:
    """POSTs (the proxy) and GETs (the scraper's polls, each with a forwarder of its
    own) to backends over pooled keep-alive connections.

    ``max_inflight`` bounds responses open at once (each holds a connection); a
    request beyond it waits, at most the read timeout, for one to end.
    """

    def __init__(
        self,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_inflight: int = 1000,
        max_idle_per_backend: int = 200,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._max_idle = max_idle_per_backend
        self._origins: dict[str, _Origin] = {}
        self._slots = asyncio.Semaphore(max_inflight)
        self._tls: ssl.SSLContext | None = None

    def _origin(self, url: str) -> _Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(url, self._max_idle)
        return origin

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = asyncio.get_running_loop()
        tls: ssl.SSLContext | None = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            _, conn = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop), origin.host, origin.port, ssl=tls
                ),
                self.connect_timeout_s,
            )
        except TimeoutError:
            raise BackendUnavailable(
                f"connect timed out after {self.connect_timeout_s:g} s", Cause.CONNECT
            ) from None
        except OSError as exc:
            raise BackendUnavailable(_describe(exc, "connect failed"), Cause.CONNECT) from exc
        return conn

    async def post(
        self,
        url: str,
        path: bytes,
        header_lines: bytes,
        body: bytes,
        head_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """Sends ``POST url+path`` and returns once the response head is in.

        ``header_lines`` are complete ``name: value\\r\\n`` lines (no host or
        content-length: this client writes those). Raises
        :class:`BackendUnavailable` when no head arrives within ``head_timeout_s``
        (default: the read timeout).
        """
        return await self._request(b"POST", url, path, header_lines, body, head_timeout_s)

    async def get(self, url: str, path: bytes, header_lines: bytes) -> UpstreamResponse:
        """Sends ``GET url+path`` and returns once the response head is in, as ``post``."""
        return await self._request(b"GET", url, path, header_lines, b"", None)

    async def _request(
        self,
        method: bytes,
        url: str,
        path: bytes,
        header_lines: bytes,
        body: bytes,
        head_timeout_s: float | None,
    ) -> UpstreamResponse:
        head_s = self.read_timeout_s if head_timeout_s is None else head_timeout_s
        origin = self._origin(url)
        head = b"".join(
            (
                method,
                b" ",
                origin.prefix,
                path,
                b" HTTP/1.1\r\n",
                origin.host_line,
                b"\r\n",
                header_lines,
                b"content-length: %d\r\n\r\n" % len(body) if method == b"POST" else b"\r\n",
            )
        )
        parts = [head, body] if body else [head]
        if self._slots.locked():
            try:
                await asyncio.wait_for(self._slots.acquire(), self.read_timeout_s)
            except TimeoutError:
                raise BackendUnavailable(
                    "too many requests in flight to the backends", Cause.BUSY
                ) from None
        else:
            await self._slots.acquire()
        try:
            for fresh in (False, True):
                conn = None if fresh else origin.take_idle()
                reused = conn is not None
                if conn is None:
                    conn = await self._connect(origin)
                try:
                    await conn.send(parts, head_s)
                except BackendUnavailable:
                    conn.active = False
                    stale = reused and conn.lost and not conn.got_bytes
                    conn.close()
                    if stale and not fresh:
                        continue  # the backend had closed this idle connection
                    raise
                except BaseException:
                    conn.active = False
                    conn.close()
                    raise
                return UpstreamResponse(conn, origin, self, self.read_timeout_s)
            raise BackendUnavailable("connection closed", Cause.CLOSED)  # pragma: no cover
        except BaseException:
            self._slots.release()
            raise

    def retain(self, urls: Iterable[str]) -> None:
        """Drops the pools of backends not in ``urls`` (pods that went away)."""
        keep = set(urls)
        for url in [u for u in self._origins if u not in keep]:
            self._origins.pop(url).close()

    def close(self) -> None:
        for origin in self._origins.values():
            origin.close()
        self._origins.clear()
