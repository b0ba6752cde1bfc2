"""Who may call the router, and what each caller is told.

Callers present OpenAI-style ``Authorization: Bearer <key>``. Keys come from files (a
mounted Kubernetes Secret is a directory of them, updated by an atomic symlink swap), which
a background task re-reads when their stat changes: a rotated key works, and a revoked one
stops working, without a restart. Keys are compared in constant time (``hmac.compare_digest``
on SHA-256 digests, every key compared) and never logged.

Three roles: ``USER`` (an API key, or anyone where no API keys are configured), ``ADMIN``
(an admin key, or anyone with ``auth.open_admin``) and, for endpoints that need nothing,
``PUBLIC``. Admin endpoints (``/kvplane/*``, ``/docs``, ``/redoc``, ``/openapi.json``) are
off without admin keys. What a response reveals of routing follows the role (``Disclosure``):
residency and predicted-cache figures only to admins, pod and reason only where configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
from collections.abc import Iterable, Mapping
from enum import IntEnum
from pathlib import Path
from typing import Final

from kvplane.router.config import AuthSpec, MetricsAccess
from kvplane.router.errors import APIError

log = logging.getLogger("kvplane.router.auth")

ROLE_KEY: Final = "kvplane.role"  # where the gate leaves the caller's role in the ASGI scope

ADMIN_PATHS: Final = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
ADMIN_PREFIX: Final = "/kvplane/"
PUBLIC_PATHS: Final = frozenset({"/health"})

# Response headers any caller may see with ``auth.route_headers``: where the request went.
# Every other ``x-kvplane-*`` header (predicted TTFT, predicted cached tokens, transfer
# figures) tells what the pods hold, so only admins see those.
ROUTE_HEADERS: Final = frozenset(
    {
        "x-kvplane-pod",
        "x-kvplane-reason",
        "x-kvplane-attempts",
        "x-kvplane-prompt-tokens",
        "x-kvplane-pd",
        "x-kvplane-pd-connector",
        "x-kvplane-prefill-pod",
        "x-kvplane-decode-pod",
        "x-kvplane-prefill-attempts",
    }
)


class Role(IntEnum):
    PUBLIC = 0
    USER = 1
    ADMIN = 2


class Disclosure(IntEnum):
    """What a response tells its caller of the routing decision."""

    NONE = 0  # x-request-id only
    ROUTE = 1  # pod, reason, attempts, prompt tokens
    ALL = 2  # also residency: predicted cached tokens, predicted TTFT, transfers


def disclosure(role: Role, spec: AuthSpec) -> Disclosure:
    if role is Role.ADMIN:
        return Disclosure.ALL
    return Disclosure.ROUTE if spec.route_headers else Disclosure.NONE


def disclose(headers: Mapping[str, str], level: Disclosure) -> dict[str, str]:
    """The headers a caller at ``level`` may see (non-kvplane headers all pass)."""
    if level is Disclosure.ALL:
        return dict(headers)
    return {
        k: v
        for k, v in headers.items()
        if not k.startswith("x-kvplane-") or (level is Disclosure.ROUTE and k in ROUTE_HEADERS)
    }


def read_keys(path: Path) -> list[bytes]:
    """Keys in a file (one per line, blank lines and ``#`` comments skipped) or in every
    visible file of a directory (Kubernetes' ``..data`` entries are hidden)."""
    files = (
        sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.is_file())
        if path.is_dir()
        else [path]
    )
    keys: list[bytes] = []
    for f in files:
        for line in f.read_bytes().splitlines():
            key = line.strip()
            if key and not key.startswith(b"#"):
                keys.append(key)
    return keys


def _stamp(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    """What changes when a key source does: each entry's inode, mtime and size (stat
    follows the Secret's symlinks, so a swap of ``..data`` changes every file's)."""
    entries = [path, *sorted(path.iterdir())] if path.is_dir() else [path]
    out = []
    for p in entries:
        st = p.stat()
        out.append((p.name, st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(out)


class KeySet:
    """Accepted keys, held as SHA-256 digests and compared in constant time: every key is
    compared, whichever matches, so timing tells nothing of which or how many matched."""

    def __init__(self, keys: Iterable[bytes] = ()) -> None:
        self._digests = tuple({hashlib.sha256(k).digest() for k in keys})

    def __len__(self) -> int:
        return len(self._digests)

    def accepts(self, token: bytes) -> bool:
        digest = hashlib.sha256(token).digest()
        ok = False
        for d in self._digests:
            ok |= hmac.compare_digest(d, digest)
        return ok


class KeySource:
    """One configured key file or directory and the keys last read from it."""

    def __init__(self, path: str, what: str) -> None:
        self.path = Path(path)
        self.what = what
        self.keys = KeySet()
        self._stamp: tuple[tuple[str, int, int, int], ...] | None = None

    def refresh(self) -> bool:
        """Re-read the keys if the source changed; True if they were re-read. A source
        that cannot be read keeps the keys it had (a Secret mid-update, a typo: said once)."""
        try:
            stamp = _stamp(self.path)
            if stamp == self._stamp:
                return False
            keys = read_keys(self.path)
        except OSError as exc:
            if self._stamp != ():
                log.warning(
                    "%s keys at %s cannot be read (%s); keeping the %d loaded",
                    self.what,
                    self.path,
                    type(exc).__name__,
                    len(self.keys),
                )
                self._stamp = ()
            return False
        self.keys = KeySet(keys)
        self._stamp = stamp
        log.info("%s keys loaded from %s: %d", self.what, self.path, len(self.keys))
        return True


def bearer_token(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.strip().partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key")


class Gate:
    """Decides each request's role from its path and credentials, or refuses it."""

    def __init__(self, spec: AuthSpec) -> None:
        self.spec = spec
        self.api = KeySource(spec.api_keys, "API") if spec.api_keys else None
        self.admin = KeySource(spec.admin_keys, "admin") if spec.admin_keys else None
        self._task: asyncio.Task[None] | None = None
        for source in self._sources():
            source.refresh()
        if self.api is None:
            log.info("no API keys configured (auth.api_keys): the OpenAI routes are open")

    def _sources(self) -> list[KeySource]:
        return [s for s in (self.api, self.admin) if s is not None]

    # -- the reload task ---------------------------------------------------
    async def start(self) -> None:
        if self._sources() and self._task is None:
            self._task = asyncio.create_task(self._watch(), name="kvplane-keys")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.spec.reload_interval_s)
            for source in self._sources():
                await asyncio.to_thread(source.refresh)

    # -- per request -------------------------------------------------------
    def _is_admin(self, token: bytes | None) -> bool:
        if self.spec.open_admin:
            return True
        return token is not None and self.admin is not None and self.admin.keys.accepts(token)

    def role(self, path: str, headers: Iterable[tuple[bytes, bytes]]) -> Role:
        """The caller's role for ``path``; raises the 401/403/404 that refuses it."""
        if path in PUBLIC_PATHS:
            return Role.PUBLIC
        token = bearer_token(headers)
        if path in ADMIN_PATHS or path.startswith(ADMIN_PREFIX):
            return self._admin_role(token)
        if path == "/metrics":
            if self.spec.metrics is MetricsAccess.OPEN:
                return Role.PUBLIC
            if self.spec.metrics is MetricsAccess.ADMIN:
                return self._admin_role(token)
        if self._is_admin(token):
            return Role.ADMIN
        if self.api is None:
            return Role.USER
        if token is None:
            raise _unauthorized(
                "You didn't provide an API key. Send it as 'Authorization: Bearer <key>'."
            )
        if not self.api.keys.accepts(token):
            raise _unauthorized("Incorrect API key provided.")
        return Role.USER

    def _admin_role(self, token: bytes | None) -> Role:
        if self._is_admin(token):
            return Role.ADMIN
        if self.admin is None:
            raise APIError(404, "Admin endpoints are off: configure auth.admin_keys.")
        if token is None:
            raise _unauthorized("This endpoint needs an admin key: 'Authorization: Bearer <key>'.")
        if self.api is not None and self.api.keys.accepts(token):
            raise APIError(403, "This endpoint needs an admin key.", code="permission_denied")
        raise _unauthorized("Incorrect API key provided.")
