"""Client connection pools for the benchmarks' load generators and proxies (httpx)."""

from __future__ import annotations

import resource

import httpx

from kvplane.router.serving import raise_fd_limit


def client_limits(requests: int, budget: int) -> httpx.Limits:
    """A pool in which no request waits for a connection (up to ``budget``) and no idle
    connection is closed: open loop means every request is sent at its arrival. Under a
    cap httpcore 1.0.9 queues requests, and its pool then closes connections it has
    assigned to queued requests (encode/httpcore#1110; a client ``ReadError``) and, past
    ``max_keepalive_connections`` counted over all connections, every one released."""
    cap = max(1, min(requests, budget))
    return httpx.Limits(max_connections=cap, max_keepalive_connections=cap)


def fd_budget() -> int:
    """Connections this process can hold: half its descriptor limit, raised to the hard
    one first (as the router's server does)."""
    raise_fd_limit()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else max(64, soft // 2)
