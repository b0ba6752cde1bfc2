"""Free TCP ports for the processes kvplane starts on one machine (local engines, the
simulator's fleets, benchmark routers, test servers).

A port is chosen here and bound later by another process (an engine's API server binds
its port seconds after it starts). Ports are therefore taken from outside the kernel's
ephemeral range (``net.ipv4.ip_local_port_range``): every port a process gets without
asking for one (``bind`` to port 0, the source port of an outgoing connection, such as
an engine's own ``get_open_port`` or a client's socket) comes from that range, so none
can take a port chosen here before its owner binds it. Within this process the choices
walk the range from a random start, so a port is not handed out twice in a row.
"""

from __future__ import annotations

import contextlib
import random
import socket
import threading
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST = 10000  # below: the ports well-known services listen on
_MIN_SPAN = 1000  # a smaller gap beside the ephemeral range: let the kernel choose


def _gap(ephemeral: tuple[int, int]) -> range | None:
    """The widest run of ports outside the ephemeral range ``[lo, hi]``, above LOWEST."""
    lo, hi = ephemeral
    gaps = [range(LOWEST, max(LOWEST, lo)), range(max(LOWEST, hi + 1), 65536)]
    best = max(gaps, key=len)
    return best if len(best) >= _MIN_SPAN else None


def _ephemeral() -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return (32768, 60999)  # Linux's default
    return (lo, hi)


class _Chooser:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gap = _gap(_ephemeral())
        self._next = random.randrange(len(self._gap)) if self._gap else 0

    def take(self, count: int, host: str) -> list[int]:
        with self._lock, contextlib.ExitStack() as stack:
            if self._gap is None:
                return _kernel_ports(stack, count, host)
            ports: list[int] = []
            for _ in range(len(self._gap)):
                port = self._gap[self._next]
                self._next = (self._next + 1) % len(self._gap)
                sock = socket.socket()
                try:
                    sock.bind((host, port))
                except OSError:
                    sock.close()
                    continue
                stack.enter_context(sock)  # held until all are found: distinct
                ports.append(port)
                if len(ports) == count:
                    return ports
            raise OSError(f"no {count} free ports in {self._gap.start}-{self._gap.stop - 1}")


def _kernel_ports(stack: contextlib.ExitStack, count: int, host: str) -> list[int]:
    socks = [stack.enter_context(socket.socket()) for _ in range(count)]
    for sock in socks:
        sock.bind((host, 0))
    return [int(sock.getsockname()[1]) for sock in socks]


_CHOOSER = _Chooser()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` right now, outside the ephemeral range
    (all bound at once, then released; ``""`` for every interface)."""
    return _CHOOSER.take(count, host)


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]
