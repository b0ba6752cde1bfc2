"""Pool-wide KV stores: which pods write to and read from which store, at what cost.

A block in a shared store is not any one pod's: the index records it under the store's
*holder* (``store:<name>``, a pseudo-pod that never dies) instead of the pod whose
event reported it, and a lookup counts the holder's blocks for every pod that reads
the store (``index.shared.SharedTierIndex``). The store's blocks leave the index when
the store's own events say so (BlockRemoved with the remote medium), not when the
writer dies. The cost model loads them at the store's link, not the default remote
tier's.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from kvplane.router.config import SharedStoreSpec, TierCost
from kvplane.router.tiers import Tier

HOLDER_PREFIX: Final = "store:"
HOLDER_INCARNATION: Final = "shared"  # a store's holder has one incarnation, forever

# pod -> the holders whose blocks also count as that pod's (its stores')
SharedReads = Mapping[str, Sequence[str]]


def holder_of(store: str) -> str:
    return HOLDER_PREFIX + store


def is_holder(pod: str) -> bool:
    return pod.startswith(HOLDER_PREFIX)


@dataclass(frozen=True, slots=True)
class SharedStores:
    """The pool's shared stores (``RouterConfig.shared_stores``); empty: none."""

    specs: tuple[SharedStoreSpec, ...] = ()

    @classmethod
    def of(cls, specs: Iterable[SharedStoreSpec]) -> SharedStores:
        return cls(tuple(specs))

    def __bool__(self) -> bool:
        return bool(self.specs)

    def stores_of(self, pod: str) -> tuple[SharedStoreSpec, ...]:
        """The stores ``pod`` reads (and writes), in config order."""
        return tuple(s for s in self.specs if s.pods is None or pod in s.pods)

    def writes_to(self, pod: str) -> str | None:
        """The holder a pod's remote-tier blocks go to: its first store (None: none,
        they stay the pod's own)."""
        stores = self.stores_of(pod)
        return holder_of(stores[0].name) if stores else None

    def reads(self, pods: Sequence[str]) -> dict[str, tuple[str, ...]]:
        """Per pod that reads a store, the holders it reads."""
        out: dict[str, tuple[str, ...]] = {}
        for pod in pods:
            stores = self.stores_of(pod)
            if stores:
                out[pod] = tuple(holder_of(s.name) for s in stores)
        return out

    def tier_costs(self, pod: str, tiers: Mapping[Tier, TierCost]) -> Mapping[Tier, TierCost]:
        """The tier costs a pod loads at: the remote tier at its link to its store (its
        ``pod_links`` entry, else the store's ``link``; the slowest when it reads
        several, never credited faster than it may be)."""
        stores = self.stores_of(pod)
        if not stores:
            return tiers
        links = (s.pod_links.get(pod, s.link) for s in stores)
        link = min(links, key=lambda c: c.bandwidth_gbps)
        return {**tiers, Tier.REMOTE: link}

    def capacity(self, holder: str) -> int | None:
        """The modelled size of a holder's store in blocks (None: its events say)."""
        for spec in self.specs:
            if holder_of(spec.name) == holder:
                return spec.capacity_blocks
        return None

    def store_of(self, pod: str) -> str | None:
        """The name of the store a pod's remote-tier loads come from (explain, metrics)."""
        stores = self.stores_of(pod)
        return stores[0].name if stores else None
