"""A lean HTTP/1.1 server on asyncio + httptools for the simulated engines.

A fleet runs many engines in one process and event loop, under load from routers
that keep connections alive and stream every response; a framework's per-request
and per-chunk machinery (ASGI scopes, middleware, a task per body read) would be a
sizeable share of the loop's time on a 2-core machine and would distort the modeled
latencies. This server parses with httptools (the C parser uvicorn uses), runs one
task per request, writes a plain response in one ``write`` and a streamed one as
chunked transfer encoding, honours keep-alive and pipelining (responses in order),
applies back-pressure to slow readers, and tells a streaming handler when its client
went away (so the engine can abort the request, as vLLM does).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import msgspec

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder().encode

MAX_BODY_BYTES = 256 * 1024 * 1024
MAX_PIPELINED = 64

_REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Payload Too Large",
    500: "Internal Server Error",
    501: "Not Implemented",
    503: "Service Unavailable",
}


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # lower-case names
    body: bytes
    client_gone: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(slots=True)
class StreamingResponse:
    """``chunks`` is consumed as the client reads; it is closed (``aclose``) when the
    client disconnects, so a ``finally`` in the generator sees the abort."""

    chunks: AsyncIterator[bytes]
    status: int = 200
    content_type: str = "text/event-stream; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


def _head(status: int, content_type: str, extra: tuple[tuple[str, str], ...], tail: str) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}"]
    if content_type:
        lines.append(f"content-type: {content_type}")
    lines += [f"{k}: {v}" for k, v in extra]
    lines.append(tail)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Connection(asyncio.Protocol):
    def __init__(self, handler: Handler, on_close: Callable[[_Connection], None]) -> None:
        self.handler = handler
        self.on_close = on_close
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers: dict[str, str] = {}
        self.body = bytearray()
        self.pending: deque[tuple[Request, bool]] = deque()
        self.current: asyncio.Task[None] | None = None
        self.current_request: Request | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.closed = False

    # -- asyncio.Protocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.writable.set()
        if self.current_request is not None:
            self.current_request.client_gone.set()
        if self.current is not None:
            self.current.cancel()
        self.pending.clear()
        self.on_close(self)

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(400, "upgrade not supported")
        except httptools.HttpParserError as exc:
            self._fail(400, f"malformed request: {exc}")

    # -- httptools callbacks -------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = {}
        self.body = bytearray()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.body += body
        if len(self.body) > MAX_BODY_BYTES:
            self._fail(413, "request body too large")

    def on_message_complete(self) -> None:
        url = httptools.parse_url(self.url)
        path = (url.path or b"/").decode("latin-1")
        query = (url.query or b"").decode("latin-1")
        method = self.parser.get_method().decode("latin-1")
        req = Request(method, path, query, self.headers, bytes(self.body))
        keep_alive = bool(self.parser.should_keep_alive())
        self.pending.append((req, keep_alive))
        if len(self.pending) > MAX_PIPELINED and self.transport is not None:
            self.transport.pause_reading()
        if self.current is None:
            self._next()

    # -- request processing --------------------------------------------------
    def _next(self) -> None:
        if self.closed or not self.pending:
            self.current = None
            self.current_request = None
            return
        if self.transport is not None and len(self.pending) <= MAX_PIPELINED // 2:
            self.transport.resume_reading()
        req, keep_alive = self.pending.popleft()
        self.current_request = req
        self.current = asyncio.get_running_loop().create_task(self._serve(req, keep_alive))
        self.current.add_done_callback(lambda _t: self._next())

    async def _serve(self, req: Request, keep_alive: bool) -> None:
        try:
            resp = await self.handler(req)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.path)
            resp = Response(500, b'{"detail":"Internal Server Error"}')
        conn = "keep-alive" if keep_alive else "close"
        if isinstance(resp, Response):
            body = b"" if req.method == "HEAD" else resp.body
            tail = f"content-length: {len(resp.body)}\r\nconnection: {conn}"
            self._write(_head(resp.status, resp.content_type, resp.headers, tail) + body)
        else:
            tail = f"transfer-encoding: chunked\r\nconnection: {conn}"
            self._write(_head(resp.status, resp.content_type, resp.headers, tail))
            try:
                async for chunk in resp.chunks:
                    if self.closed:
                        break
                    if chunk:
                        self._write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    if not self.writable.is_set():
                        await self.writable.wait()
                else:
                    self._write(b"0\r\n\r\n")
            finally:
                aclose = getattr(resp.chunks, "aclose", None)
                if aclose is not None:
                    with contextlib.suppress(Exception):
                        await aclose()
        if not keep_alive and self.transport is not None:
            self.transport.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _fail(self, status: int, message: str) -> None:
        body = _encode({"detail": message})
        tail = f"content-length: {len(body)}\r\nconnection: close"
        self._write(_head(status, "application/json", (), tail) + body)
        if self.transport is not None:
            self.transport.close()


class HttpServer:
    """One listening port served by ``handler``; ``port=0`` picks a free one."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._conns: set[_Connection] = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def factory() -> asyncio.Protocol:
            conn = _Connection(self.handler, self._conns.discard)
            self._conns.add(conn)
            return conn

        self._server = await loop.create_server(
            factory, self.host, self.port, reuse_address=True, backlog=1024
        )
        sock: Any = self._server.sockets[0]
        self.port = int(sock.getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None
