"""Free TCP ports for the processes kvplane starts on one machine (local engines, the
simulator's fleets, benchmark routers, test servers)."""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` right now (all bound at once, then
    released; ``""`` for every interface)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
