"""Ports chosen for processes that bind them later (kvplane.local.ports)."""

from __future__ import annotations

import socket

from kvplane.local import ports


def test_chosen_ports_are_free_distinct_and_outside_the_ephemeral_range() -> None:
    lo, hi = ports._ephemeral()
    chosen = [p for _ in range(100) for p in ports.free_ports(3)]
    assert len(set(chosen)) == len(chosen), "no port is handed out twice in a row"
    assert all(not lo <= p <= hi and p >= ports.LOWEST for p in chosen)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", chosen[-1]))


def test_a_port_the_kernel_assigns_is_never_one_chosen_here() -> None:
    """What an engine's own get_open_port or an outgoing connection gets (port 0)."""
    chosen = set(ports.free_ports(50, host=""))
    socks = [socket.socket() for _ in range(200)]
    try:
        for sock in socks:
            sock.bind(("", 0))
        assert not chosen & {s.getsockname()[1] for s in socks}
    finally:
        for sock in socks:
            sock.close()


def test_a_port_in_use_is_skipped() -> None:
    """The port the chooser would hand out next is taken: it hands out another."""
    chooser = ports._CHOOSER
    assert chooser._gap is not None
    with socket.socket() as held:
        while True:  # the next port the chooser walks to, held here
            nxt = chooser._gap[chooser._next]
            try:
                held.bind(("127.0.0.1", nxt))
                break
            except OSError:  # taken by someone else already: the chooser skips it too
                chooser._next = (chooser._next + 1) % len(chooser._gap)
        assert ports.free_port() != nxt


def test_the_widest_gap_beside_the_ephemeral_range() -> None:
    assert ports._gap((32768, 60999)) == range(10000, 32768)
    assert ports._gap((10000, 60000)) == range(60001, 65536)
    assert ports._gap((1024, 65535)) is None  # no room: the kernel chooses
