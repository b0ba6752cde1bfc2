"""Operator settings: typed, from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from kvplane.operator.render.names import DISCOVERY_ROLE

FIELD_MANAGER = "kvplane-operator"
MANAGED_BY = "kvplane-operator"


@dataclass(frozen=True)
class OperatorSettings:
    image: str = "ghcr.io/kvplane/kvplane:0.1.0"  # router and indexer image
    # the periodic pass: compare every pool with the cache (writes only what differs)
    resync_s: float = 30.0
    namespaces: list[str] = field(default_factory=list)  # empty: cluster-wide
    peering: str | None = None  # kopf peering object for HA (None: standalone)
    # a replica that stops renewing its place in the peering for this long is taken
    # for dead, and a standby takes over (one that exits cleanly is replaced at once)
    peering_lifetime_s: int = 60
    # a new pool is first rendered once its inputs were unchanged this long, so that
    # pools, engine pools and tiers applied together roll out once
    settle_s: float = 2.0
    concurrency: int = 8  # pools reconciled at once
    # the ClusterRole (pods get, list, watch) each router and indexer is bound to
    discovery_role: str = DISCOVERY_ROLE

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> OperatorSettings:
        e = os.environ if env is None else env
        namespaces = [n for n in e.get("KVPLANE_WATCH_NAMESPACES", "").split(",") if n]
        d = OperatorSettings
        return OperatorSettings(
            image=e.get("KVPLANE_IMAGE", d.image),
            resync_s=float(e.get("KVPLANE_RESYNC_SECONDS", d.resync_s)),
            namespaces=namespaces,
            peering=e.get("KVPLANE_PEERING") or None,
            peering_lifetime_s=int(e.get("KVPLANE_PEERING_LIFETIME_SECONDS", d.peering_lifetime_s)),
            settle_s=float(e.get("KVPLANE_SETTLE_SECONDS", d.settle_s)),
            concurrency=int(e.get("KVPLANE_CONCURRENCY", d.concurrency)),
            discovery_role=e.get("KVPLANE_DISCOVERY_CLUSTERROLE", d.discovery_role),
        )
