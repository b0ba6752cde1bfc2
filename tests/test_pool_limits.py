"""The load generators' client pools (kvplane.bench.pool_limits): every request of an
open-loop replay is on the wire at once, and a released connection is kept for the next
request, against a real loopback HTTP server and the httpx/httpcore the benchmarks use.
"""

from __future__ import annotations

import asyncio

import httpcore
import httpx
import pytest

from kvplane.bench.pool_limits import client_limits, fd_budget

pytestmark = pytest.mark.timeout(120)

WAVE = 100  # above the 64 idle connections the replay used to keep


def test_limits_cover_every_request_up_to_the_budget() -> None:
    assert fd_budget() >= 64
    for requests, budget, cap in ((2000, 10_000, 2000), (2000, 500, 500), (0, 9, 1)):
        limits = client_limits(requests, budget)
        assert limits.max_connections == limits.max_keepalive_connections == cap


async def _wave(limits: httpx.Limits) -> tuple[int, int]:
    """The most requests a server held at once for a wave of ``WAVE`` concurrent
    requests through httpcore's pool (what an httpx client with ``limits`` runs on), and
    the connections the pool keeps after it."""
    held = 0
    most = 0
    full = asyncio.Event()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal held, most
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                held += 1
                most = max(most, held)
                if held == WAVE:
                    full.set()
                await full.wait()  # answer once the whole wave is in
                held -= 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    # no keep-alive expiry here: a slow machine must not expire what the wave released
    pool = httpcore.AsyncConnectionPool(
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=None,
    )
    async with server, pool:
        url = f"http://127.0.0.1:{port}/"
        answers = await asyncio.wait_for(
            asyncio.gather(*(pool.request("GET", url) for _ in range(WAVE))), 60
        )
        assert all(a.status == 200 for a in answers)
        kept = sum(1 for c in pool.connections if c.is_idle())
    return most, kept


def test_a_wave_is_on_the_wire_at_once_and_its_connections_are_kept() -> None:
    most, kept = asyncio.run(_wave(client_limits(WAVE, fd_budget())))
    assert most == WAVE, "no request waited for a pool connection"
    # httpcore 1.0.9 compares every connection, not the idle ones, with
    # max_keepalive_connections: with fewer kept than open, released connections would
    # be closed down to that number
    assert kept == WAVE
