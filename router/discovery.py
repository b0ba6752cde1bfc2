"""Where backends come from. Static config now; Kubernetes discovery (watching
the pool's pods by label, respecting readiness) implements the same protocol."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

from kvplane.router.config import Backend


class Discovery(Protocol):
    def watch(self) -> AsyncIterator[list[Backend]]:
        """Yield the full backend set now and after every change."""
        ...


class StaticDiscovery:
    def __init__(self, backends: Sequence[Backend]) -> None:
        self._backends = list(backends)

    async def watch(self) -> AsyncIterator[list[Backend]]:
        yield list(self._backends)
