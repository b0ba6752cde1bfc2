"""Which client request headers reach the engines, for both ways of sending a leg: the
raw forwarder's wire lines and httpx header dicts (the P/D legs)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

# Request headers that describe one connection, not the request (RFC 9110 7.6.1),
# plus the ones the sending client sets itself. ``accept-encoding`` is dropped so that
# a backend answers uncompressed: the body is relayed as is.
HOP_BY_HOP: Final = frozenset(
    {
        b"host",
        b"content-length",
        b"connection",
        b"keep-alive",
        b"transfer-encoding",
        b"upgrade",
        b"te",
        b"trailer",
        b"proxy-authorization",
        b"proxy-connection",
        b"accept-encoding",
        b"expect",
    }
)
_HOP_STR: Final = frozenset(h.decode() for h in HOP_BY_HOP)


def header_lines(headers: Iterable[tuple[bytes, bytes]], request_id: bytes) -> bytes:
    """Request headers to forward as ``name: value`` lines: hop-by-hop ones and the
    client's own ``x-request-id`` dropped, the request's id added."""
    out = [
        b"%s: %s\r\n" % (name, value)
        for name, value in headers
        if name not in HOP_BY_HOP and name != b"x-request-id"
    ]
    out.append(b"x-request-id: " + request_id + b"\r\n")
    return b"".join(out)


def forward_headers(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    """Request headers for an httpx leg (the P/D path): hop-by-hop ones dropped."""
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP_STR}
    out["x-request-id"] = request_id
    return out
