"""Is this replica the active one? The operator writes only while it is.

kopf pauses a replica's watch streams while a live peer of higher (or equal)
priority is listed in the peering object (``kopf._core.engines.peering``), but the
operator's own machinery (its cache, per-pool retries, the periodic pass) runs
beside kopf, so it asks the same question of the same object before every write:
a peer is live until its ``lastseen`` plus ``lifetime``; a paused replica is one
that sees a live other peer with a higher priority, or with its own priority (kopf
pauses all of those). Without a peering object kopf stays paused, and so do we.
Stricter than kopf in one way: a replica that is not (or no longer) listed as live
itself does not write, so a stopping leader, which removes itself before its last
tasks end, never overlaps with its successor. ``--standalone`` replicas are always
active.

The replica knows itself by kopf's identity (``POD_ID``, which ``kvplane operator``
sets when the environment does not); when it is unknown, a live entry with our
priority is taken to be ourselves unless there are several.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from dataclasses import dataclass

from kvplane.types import Json


@dataclass(frozen=True)
class Peering:
    """This replica's place in kopf peering (None name: standalone)."""

    name: str | None
    priority: int = 0
    identity: str | None = None
    clusterwide: bool = True

    @property
    def kind(self) -> str:
        return "ClusterKopfPeering" if self.clusterwide else "KopfPeering"


def _live(peers: Json, now: dt.datetime) -> dict[str, int]:
    """identity -> priority of the peers whose keep-alive has not expired."""
    out = {}
    for identity, info in peers.items():
        if not isinstance(info, dict):
            continue
        lastseen = info.get("lastseen")
        lifetime = dt.timedelta(seconds=int(info.get("lifetime", 60)))
        if lastseen is None:
            continue
        seen = dt.datetime.fromisoformat(str(lastseen))
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=dt.UTC)
        if seen + lifetime > now:
            out[identity] = int(info.get("priority", 0))
    return out


def pauses(me: Peering, peering_object: Json, now: dt.datetime) -> bool:
    """Would kopf pause this replica, given one peering object's status?"""
    live = _live(peering_object.get("status") or {}, now)
    if me.identity is not None:
        if me.identity not in live:
            return True  # not registered yet, or gone (a stopping replica removes itself)
        others = [p for ident, p in live.items() if ident != me.identity]
        return any(p >= me.priority for p in others)
    same = sum(p == me.priority for p in live.values())
    return any(p > me.priority for p in live.values()) or same != 1


def active(me: Peering, peering_objects: Iterable[Json], now: dt.datetime) -> bool:
    """Active when standalone, or when the peering objects (one cluster-wide, or one
    per watched namespace) exist and none of them pauses this replica."""
    if me.name is None:
        return True
    found = [o for o in peering_objects if o["metadata"]["name"] == me.name]
    return bool(found) and not any(pauses(me, o, now) for o in found)
