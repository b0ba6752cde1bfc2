"""The base of index decorators: every call passes to the wrapped index; a decorator
overrides what it adds to (``GuardedIndex``, ``InstrumentedIndex``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvplane.router.index.base import Blocks, PrefixMatches, ResidencyIndex
from kvplane.router.tiers import Tier


class IndexWrapper:
    def __init__(self, inner: ResidencyIndex) -> None:
        self.inner = inner
        self.in_process = inner.in_process

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        return await self.inner.lookup(keys, pods)

    async def begin_incarnation(self, pod: str, incarnation: str) -> None:
        await self.inner.begin_incarnation(pod, incarnation)

    async def drop_pod(self, pod: str) -> None:
        await self.inner.drop_pod(pod)

    async def store(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        await self.inner.store(pod, incarnation, blocks, tier)

    async def remove(self, pod: str, incarnation: str, blocks: Blocks, tier: Tier) -> None:
        await self.inner.remove(pod, incarnation, blocks, tier)

    async def clear(self, pod: str, incarnation: str, tier: Tier) -> None:
        await self.inner.clear(pod, incarnation, tier)

    async def mark_tentative(self, pod: str, blocks: Blocks, ttl_s: float) -> None:
        await self.inner.mark_tentative(pod, blocks, ttl_s)

    async def incarnations(self) -> Mapping[str, str]:
        return await self.inner.incarnations()

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()
