"""The load client: a bare asyncio HTTP/1.1 client on uvloop with pre-encoded requests,
so that the load generator costs little next to what it measures (httpx costs more per
request than a router adds at small prompts)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Sequence

from kvplane.bench.overhead.scope import MODEL
from kvplane.bench.procs import HOST


class _Conn:
    """One keep-alive HTTP/1.1 connection: write a pre-encoded request, read one response."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.used = False

    @classmethod
    async def open(cls, host: str, port: int) -> _Conn:
        reader, writer = await asyncio.open_connection(host, port, limit=1 << 22)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer)

    async def request(self, data: bytes) -> tuple[int, bytes, bool]:
        """Returns (status, body, keep_alive)."""
        self.used = True
        self.writer.write(data)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length = -1
        chunked = False
        keep = True
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name = name.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
            elif name == "connection" and value.strip().lower() == "close":
                keep = False
        if chunked:
            body = bytearray()
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    while (await self.reader.readuntil(b"\r\n")) != b"\r\n":
                        pass
                    break
                body += await self.reader.readexactly(size + 2)
                del body[-2:]
            return status, bytes(body), keep
        if length >= 0:
            return status, await self.reader.readexactly(length), keep
        return status, await self.reader.read(), False

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class Target:
    """Where requests go: one router, or the backends directly (taken in turn)."""

    MAX_INFLIGHT = 512  # bounds sockets when a router stalls under open-loop load
    MAX_IDLE = 64

    def __init__(self, name: str, ports: Sequence[int], path: str = "/v1/completions") -> None:
        self.name = name
        self.ports = list(ports)
        self.path = path
        self._idle: dict[int, list[_Conn]] = {p: [] for p in self.ports}
        self._next = 0
        self._slots: asyncio.Semaphore | None = None

    def encode(self, body: bytes) -> list[bytes]:
        """The full request bytes, one variant per port (the Host header differs)."""
        return [
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s"
            % (self.path.encode(), HOST.encode(), p, len(body), body)
            for p in self.ports
        ]

    async def send(self, variants: Sequence[bytes]) -> bool:
        """One request (to the next port in turn); True on 200 with a completion body.

        At most MAX_INFLIGHT at once: beyond that a request waits for a slot, and
        the wait counts in its latency (the step fails, as it should).
        """
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.MAX_INFLIGHT)
        async with self._slots:
            return await self._send(variants)

    async def _send(self, variants: Sequence[bytes]) -> bool:
        i = self._next % len(self.ports)
        self._next += 1
        port = self.ports[i]
        data = variants[i]
        idle = self._idle[port]
        for attempt in (0, 1):
            conn = idle.pop() if idle and attempt == 0 else await _Conn.open(HOST, port)
            reused = conn.used
            try:
                status, body, keep = await conn.request(data)
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                conn.close()
                if reused and attempt == 0 and not getattr(exc, "partial", b""):
                    continue  # the server closed an idle keep-alive connection: retry once
                return False
            except asyncio.CancelledError:
                conn.close()
                raise
            if keep and len(idle) < self.MAX_IDLE:
                idle.append(conn)
            else:
                conn.close()
            return status == 200 and b'"choices"' in body
        return False

    async def timed(self, variants: Sequence[bytes]) -> float | None:
        t0 = time.perf_counter()
        ok = await self.send(variants)
        return time.perf_counter() - t0 if ok else None

    def close(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
            conns.clear()


def _body(prompt: str) -> bytes:
    import msgspec

    req = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "stream": False}
    return msgspec.json.encode(req)
