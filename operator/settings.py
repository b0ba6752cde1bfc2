"""Operator settings: typed, from the environment (the chart sets them)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

FIELD_MANAGER = "kvplane-operator"
MANAGED_BY = "kvplane-operator"


@dataclass(frozen=True)
class OperatorSettings:
    image: str = "ghcr.io/kvplane/kvplane:0.1.0"  # router and indexer image
    resync_s: float = 30.0  # drift repair: re-apply every object at least this often
    namespaces: list[str] = field(default_factory=list)  # empty: cluster-wide
    peering: str | None = None  # kopf peering object for HA (None: standalone)

    @staticmethod
    def from_env(env: dict[str, str] | None = None) -> OperatorSettings:
        e = os.environ if env is None else env
        namespaces = [n for n in e.get("KVPLANE_WATCH_NAMESPACES", "").split(",") if n]
        return OperatorSettings(
            image=e.get("KVPLANE_IMAGE", OperatorSettings.image),
            resync_s=float(e.get("KVPLANE_RESYNC_SECONDS", OperatorSettings.resync_s)),
            namespaces=namespaces,
            peering=e.get("KVPLANE_PEERING") or None,
        )
