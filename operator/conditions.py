"""Status conditions, computed from observed state (pure).

Conditions follow the Kubernetes convention: ``type``, ``status``, ``reason``,
``message``, ``lastTransitionTime`` (kept when the status does not change, so
watchers see real transitions) and ``observedGeneration`` (the spec generation
they describe).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Problem:
    """Something that keeps a pool from Ready that waiting will not fix.

    ``reason`` (CamelCase) says which kind: ``InvalidReferences`` (a named pool or
    tier is missing or disagrees), ``InvalidSpec`` (the spec cannot be rendered),
    ``ApplyRefused`` (the API server refused a rendered object), ``ReconcileFailed``
    (the API server kept failing; retried with back-off), ``PoolNotFound`` (an engine
    pool's poolRef names no InferencePool)."""

    reason: str
    message: str


@dataclass(frozen=True)
class Workload:
    """What a Deployment reports, reduced to what readiness needs."""

    name: str
    desired: int
    ready: int
    updated: int
    observed_current: bool  # the Deployment controller saw its latest spec

    @property
    def rolled_out(self) -> bool:
        return self.observed_current and self.updated >= self.desired and self.ready >= self.desired


def workload_of(deployment: Mapping[str, Any] | None, name: str, desired: int) -> Workload:
    if deployment is None:
        return Workload(name, desired, 0, 0, False)
    status = deployment.get("status", {})
    meta = deployment.get("metadata", {})
    return Workload(
        name,
        desired,
        int(status.get("readyReplicas", 0)),
        int(status.get("updatedReplicas", 0)),
        int(status.get("observedGeneration", 0)) >= int(meta.get("generation", 0)),
    )


def condition(
    type_: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == type_), None)
    since = (
        before.get("lastTransitionTime", now)
        if before is not None and before.get("status") == status
        else now
    )
    return {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def pool_conditions(
    workloads: Sequence[Workload],
    problems: Sequence[Problem],
    generation: int,
    previous: Sequence[Mapping[str, Any]],
    now: str,
) -> list[dict[str, Any]]:
    """Ready: every workload rolled out and no problem. Progressing: a rollout is
    under way. Degraded: a problem the operator cannot fix by waiting (the reason is
    the first problem's)."""
    pending = [w for w in workloads if not w.rolled_out]
    ready = not pending and not problems
    messages = "; ".join(p.message for p in problems)
    if problems:
        ready_msg = messages
    elif pending:
        ready_msg = ", ".join(f"{w.name} {w.ready}/{w.desired} ready" for w in pending)
    else:
        ready_msg = f"{len(workloads)} workloads ready"
    return [
        condition(
            "Ready",
            ready,
            "AllReady" if ready else ("Degraded" if problems else "RollingOut"),
            ready_msg,
            generation,
            previous,
            now,
        ),
        condition(
            "Progressing",
            bool(pending),
            "RollingOut" if pending else "Stable",
            ", ".join(w.name for w in pending) if pending else "no rollout in progress",
            generation,
            previous,
            now,
        ),
        condition(
            "Degraded",
            bool(problems),
            problems[0].reason if problems else "AsExpected",
            messages if problems else "no problems",
            generation,
            previous,
            now,
        ),
    ]
