"""Pods as the gateway names them: ``ip:port``.

A backend is known to the router by name and URL; the data plane routes to an IP
address and port (Envoy's ``ORIGINAL_DST`` cluster and ``override_host`` policy parse
an address, not a host name), so a URL's host name is resolved once, when the backend
appears.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from kvplane.router.pool import Pool


def endpoint_of(url: str) -> str:
    """``http://10.0.0.5:8000`` -> ``10.0.0.5:8000`` (IPv6 in brackets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = ipaddress.ip_address(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


class Endpoints:
    """Pod name <-> ``ip:port`` for a pool, kept in step with its backends."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._by_url: dict[str, str] = {}
        self._pods: dict[str, str] = {}  # ip:port -> pod

    def _refresh(self) -> None:
        states = self._pool.states
        urls = {name: s.backend.url for name, s in states.items()}
        if len(self._pods) == len(urls) and all(u in self._by_url for u in urls.values()):
            return
        by_url = {u: self._by_url.get(u) or endpoint_of(u) for u in urls.values()}
        self._by_url = by_url
        self._pods = {by_url[u]: name for name, u in urls.items()}

    def of(self, pod: str) -> str:
        self._refresh()
        return self._by_url[self._pool.states[pod].backend.url]

    def pod(self, endpoint: str) -> str | None:
        self._refresh()
        return self._pods.get(endpoint)

    def outside(self, allowed: list[str]) -> frozenset[str]:
        """Pods whose endpoint is not in ``allowed`` (a data plane's subset hint)."""
        self._refresh()
        keep = set(allowed)  # an address without a port allows every port
        return frozenset(
            pod
            for ep, pod in self._pods.items()
            if ep not in keep and ep.rsplit(":", 1)[0].strip("[]") not in keep
        )
