"""The router's HTTP server: uvicorn with bounds one client cannot get past.

uvicorn (0.54) bounds none of these itself: its keep-alive timer starts only after a
response and stops at the first byte of the next request, so a connection that sends
nothing, or a head a byte at a time, stays open for ever; its httptools protocol reads
request heads of any size; and ``limit_concurrency`` counts idle connections, so once
they fill it every new request (``/health`` too) is a plain-text 503. A subclass of its
httptools protocol (``BoundedHttpToolsProtocol``) adds, per connection:

* a head timeout: a request line and headers must arrive within ``header_timeout_s`` of
  the connection opening or of the first byte of a later request (an idle keep-alive
  connection is closed after ``keep_alive_s`` as before);
* a body timeout: the body within ``body_timeout_s`` of the head;
* the head bounds of ``HeaderPolicy``: more fields or bytes are a 431 in OpenAI's shape,
  a malformed head a 400 in that shape (not uvicorn's plain text);
* a connection cap: at ``max_connections`` a new connection closes the connection that
  has waited longest for a request head (nothing is lost: no request is in progress on
  it, and HTTP lets a server close an idle connection), or is itself closed when every
  connection has a request in progress. So a flood of idle or slow connections cannot
  keep others out, and the router never runs out of file descriptors.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

import uvicorn
from kvplane.router.config import RouterConfig
from kvplane.router.headers import HeaderPolicy
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger("kvplane.router.serving")

# File descriptors kept for everything but client connections: backend connections
# (the forwarder's in-flight cap plus idle pools), Redis, ZMQ, the tokenizer files.
FD_RESERVE_SHARE = 0.5
# how long a refused connection may go on sending before it is closed (_linger)
LINGER_S = 2.0


@dataclass(frozen=True, slots=True)
class Limits:
    headers: HeaderPolicy
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int

    @classmethod
    def of(cls, config: RouterConfig) -> Limits:
        s = config.server
        return cls(
            HeaderPolicy.of(config),
            s.header_timeout_s,
            s.body_timeout_s,
            connection_cap(s.max_connections),
        )


def connection_cap(wanted: int) -> int:
    """``wanted``, or less where the file-descriptor limit would not leave room for the
    backend side (``FD_RESERVE_SHARE`` of it)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    room = max(8, int(soft * (1 - FD_RESERVE_SHARE)))
    if wanted > room:
        log.warning(
            "server.max_connections %d lowered to %d: the file-descriptor limit is %d",
            wanted,
            room,
            soft,
        )
    return min(wanted, room)


def raise_fd_limit() -> None:
    """Soft file-descriptor limit up to the hard one (as vLLM's server does at start)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as exc:
            log.info("file-descriptor limit stays %d (%s)", soft, exc)


class RouterServerConfig(uvicorn.Config):
    """uvicorn's config plus the router's ``Limits`` (pickled into ``--workers``)."""

    def __init__(self, app: Any, router: RouterConfig, **kwargs: Any) -> None:
        kwargs.setdefault("timeout_keep_alive", router.server.keep_alive_s)
        kwargs.setdefault("access_log", False)
        super().__init__(app, http=BoundedHttpToolsProtocol, **kwargs)
        self.limits = Limits.of(router)


class _HeadRefused(Exception):
    """Raised from a parser callback: the head breaks a bound (answered 431)."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, config: uvicorn.Config, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        limits = getattr(config, "limits", None)
        if limits is None:
            raise TypeError("BoundedHttpToolsProtocol needs a RouterServerConfig")
        self.limits: Limits = limits
        self.waiting = True  # for a request head: no request in progress
        self.idle_since = 0.0
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0  # received while waiting for a head
        self._head_fields = 0  # parsed of the current head
        self._head_parsed = 0
        self._refusal: str | None = None
        self._lingering = False  # answered a refusal: what still comes is discarded

    # -- connections -------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def _make_room(self) -> None:
        idle = [
            c
            for c in self.connections
            if c is not self and isinstance(c, BoundedHttpToolsProtocol) and c.waiting
        ]
        if not idle:
            log.warning(
                "connection refused: all %d connections have a request in progress "
                "(server.max_connections)",
                len(self.connections) - 1,
            )
            self.transport.close()
            return
        oldest = min(idle, key=lambda c: c.idle_since)
        log.debug("closing the longest idle connection for a new one (server.max_connections)")
        oldest.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timers()
        super().connection_lost(exc)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _await_head(self) -> None:
        self.waiting = True
        self.idle_since = self.loop.time()
        self._head_bytes = 0

    def _timed_out(self) -> None:
        if not self.transport.is_closing():
            log.debug("closing a connection: no complete request in time")
            self.transport.close()

    # -- reading a request -------------------------------------------------
    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self.waiting:
            self._head_bytes += len(data)
        super().data_received(data)
        too_long = self._head_bytes > self.limits.headers.max_header_bytes
        if self.waiting and too_long and not self.transport.is_closing():
            self._refusal = self.limits.headers.too_large(0, self._head_bytes)
            self.send_400_response("")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_fields = self._head_parsed = 0
        if self._head_timer is None:  # a later request on a kept-alive connection
            self._head_timer = self.loop.call_later(self.limits.header_timeout_s, self._timed_out)

    def on_url(self, url: bytes) -> None:
        self._head_bytes_parsed(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_fields += 1
        self._head_bytes_parsed(len(name) + len(value))
        super().on_header(name, value)

    def _head_bytes_parsed(self, n: int) -> None:
        # counted as parsed too: one read can hold a whole oversized head
        self._head_parsed += n
        why = self.limits.headers.too_large(self._head_fields, self._head_parsed)
        if why is not None:
            self._refusal = why
            raise _HeadRefused(why)

    def on_headers_complete(self) -> None:
        self.waiting = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._body_timer = self.loop.call_later(self.limits.body_timeout_s, self._body_timed_out)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if not self.transport.is_closing():
            log.debug("closing a connection: request body not complete in time")
            self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.pipeline and not self.transport.is_closing():
            self._await_head()

    # -- refusing a head ---------------------------------------------------
    def send_400_response(self, msg: str) -> None:
        """A head that cannot be served: 431 for a bound, else 400; OpenAI's shape."""
        status, message = (431, self._refusal) if self._refusal else (400, msg)
        body = json.dumps(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": status,
                }
            }
        ).encode()
        self.transport.write(
            b"".join(
                (
                    STATUS_LINE[status],
                    b"content-type: application/json\r\n",
                    b"content-length: %d\r\n" % len(body),
                    b"connection: close\r\n\r\n",
                    body,
                )
            )
        )
        self._linger()

    def _linger(self) -> None:
        """Half-close after a refusal and discard what the client still sends, for at
        most ``LINGER_S``: closing with unread input makes the kernel reset the
        connection, and a reset can destroy the answer before the client reads it."""
        self._lingering = True
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)


def run(router: RouterConfig, host: str, port: int, workers: int, log_level: str) -> None:
    """Serve ``kvplane.router.server:app_from_env`` (the config path in its environment)."""
    raise_fd_limit()
    config = RouterServerConfig(
        "kvplane.router.server:app_from_env",
        router,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_level=log_level,
    )
    server = uvicorn.Server(config)
    if workers > 1:
        from uvicorn.supervisors import Multiprocess

        Multiprocess(config, sockets=[config.bind_socket()]).run()
    else:
        server.run()
