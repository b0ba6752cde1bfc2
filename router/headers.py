"""Header policy, in one place: which client request headers reach the engines (for both
ways of sending a leg: the raw forwarder's wire lines and httpx header dicts for the P/D
legs), and how many and how large request heads may be (the server enforces it while
reading, ``serving.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from kvplane.router.config import Backend, RouterConfig

# Request headers that describe one connection, not the request (RFC 9110 7.6.1),
# plus the ones the sending client sets itself. ``accept-encoding`` is dropped so that
# a backend answers uncompressed: the body is relayed as is. Headers that a request's
# ``Connection`` field names are dropped too (``HeaderPolicy``).
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
        b"x-request-id",  # the router sends the request's own id
    }
)
# The client's credentials for the router, not for the engines (unless configured).
CREDENTIALS: Final = frozenset({b"authorization", b"cookie"})


def _named_by_connection(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """Field names listed in ``Connection`` (RFC 9110 7.6.1): hop-by-hop for this request."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(t.strip().lower() for t in value.split(b","))
    return named


@dataclass(frozen=True, slots=True)
class HeaderPolicy:
    drop: frozenset[bytes]  # never forwarded
    max_headers: int
    max_header_bytes: int

    @classmethod
    def of(cls, config: RouterConfig) -> HeaderPolicy:
        auth, server = config.auth, config.server
        kept = {b"authorization"} if auth.forward_authorization else set()
        if auth.forward_cookie:
            kept.add(b"cookie")
        # the backends' own headers are the router's to send: a client's are dropped
        owned = {name.encode("latin-1") for b in config.backends for name in b.headers}
        drop = HOP_BY_HOP | (CREDENTIALS - kept) | owned
        return cls(drop, server.max_headers, server.max_header_bytes)

    def too_large(self, count: int, head_bytes: int) -> str | None:
        """Why a request head is refused (431), or None."""
        if count > self.max_headers:
            return f"too many request header fields ({count} > {self.max_headers})"
        if head_bytes > self.max_header_bytes:
            return f"request head too large (over {self.max_header_bytes} bytes)"
        return None

    def _dropped(self, headers: list[tuple[bytes, bytes]]) -> frozenset[bytes]:
        for name, _ in headers:
            if name == b"connection":
                return self.drop | _named_by_connection(headers)
        return self.drop

    def lines(self, headers: list[tuple[bytes, bytes]], request_id: bytes) -> bytes:
        """Request headers to forward as ``name: value`` lines (names as servers give them:
        lower case), the request's id added."""
        drop = self._dropped(headers)
        out = [b"%s: %s\r\n" % (name, value) for name, value in headers if name not in drop]
        out.append(b"x-request-id: " + request_id + b"\r\n")
        return b"".join(out)

    def forward(self, headers: list[tuple[bytes, bytes]], request_id: str) -> dict[str, str]:
        """Request headers for an httpx leg (the P/D path), first value of each name."""
        drop = self._dropped(headers)
        out: dict[str, str] = {}
        for name, value in headers:
            if name not in drop:
                out.setdefault(name.decode("latin-1"), value.decode("latin-1"))
        out["x-request-id"] = request_id
        return out


def backend_lines(backend: Backend) -> bytes:
    """The backend's own headers (``Backend.headers``) as wire lines."""
    return b"".join(
        b"%s: %s\r\n" % (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in backend.headers.items()
    )
