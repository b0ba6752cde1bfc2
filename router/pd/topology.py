"""Where two pods sit relative to each other, and what moving KV between them costs.

The link class comes from the backends' labels: Kubernetes' well-known
``kubernetes.io/hostname`` and ``topology.kubernetes.io/zone``, or the short
``node`` / ``zone`` keys that Kubernetes discovery writes (``spec.nodeName`` and
the pod's zone label). What is not known is assumed to be the common case, one
zone on different nodes: a guess that never makes a remote pair look local.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from kvplane.router.config import LinkClass, LinkCost, PDSpec

NODE_KEYS = ("kubernetes.io/hostname", "node")
ZONE_KEYS = ("topology.kubernetes.io/zone", "zone")


def _first(labels: Mapping[str, str], keys: tuple[str, ...]) -> str | None:
    for key in keys:
        value = labels.get(key)
        if value:
            return value
    return None


def node_of(labels: Mapping[str, str]) -> str | None:
    return _first(labels, NODE_KEYS)


def zone_of(labels: Mapping[str, str]) -> str | None:
    return _first(labels, ZONE_KEYS)


class Place(NamedTuple):
    """Where a pod sits, as far as its labels say (None: not labelled)."""

    node: str | None
    zone: str | None


def place_of(labels: Mapping[str, str]) -> Place:
    return Place(node_of(labels), zone_of(labels))


def place_class(a: Place, b: Place) -> LinkClass:
    """Same node when both name the same node; across zones only when both name
    their zones and they differ; otherwise one zone."""
    if a.node is not None and a.node == b.node:
        return LinkClass.SAME_NODE
    if a.zone is not None and b.zone is not None and a.zone != b.zone:
        return LinkClass.CROSS_ZONE
    return LinkClass.SAME_ZONE


def link_class(a: Mapping[str, str], b: Mapping[str, str]) -> LinkClass:
    """The class of the link between pods labelled ``a`` and ``b`` (``place_class``)."""
    return place_class(place_of(a), place_of(b))


def link_cost(cls: LinkClass, pd: PDSpec) -> LinkCost:
    """The configured link; a class left out of the config borrows the next slower one
    (so a partial config never makes a link faster than configured ones)."""
    order = (LinkClass.SAME_NODE, LinkClass.SAME_ZONE, LinkClass.CROSS_ZONE)
    for candidate in order[order.index(cls) :]:
        if candidate in pd.links:
            return pd.links[candidate]
    slowest = min(pd.links.values(), key=lambda c: c.bandwidth_gbps, default=None)
    return slowest if slowest is not None else LinkCost(bandwidth_gbps=1.0, latency_ms=10.0)


def transfer_ms(tokens: int, kv_bytes_per_token: int, link: LinkCost) -> float:
    """Moving ``tokens`` of KV over ``link``: latency plus bytes over bandwidth."""
    if tokens <= 0:
        return 0.0
    return link.latency_ms + tokens * kv_bytes_per_token / (link.bandwidth_gbps * 1e9) * 1000.0
