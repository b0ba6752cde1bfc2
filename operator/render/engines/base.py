"""What an engine adapter is: one engine's whole contract with kvplane's renderers.

An adapter owns its engine's command, arguments and environment, the extra ports its
P/D transfer listens on, the metric names its autoscaling reads, the handoff protocol
the router must speak to it, and the config files it mounts. The renderers ask the
adapter of the pool's ``engine.kind`` and never branch on the engine themselves.
Helpers both engines share (the KV event publisher, the parallelism check, the
downward env) live here too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from kvplane.operator.api import (
    Engine,
    EnginePoolSpec,
    InferencePoolSpec,
    KVCacheTierSpec,
    KVTransfer,
    ScaleSignal,
)
from kvplane.operator.render import names
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import RenderError, TierPlan, plan_tiers

from kvplane.types import Json


@dataclass(frozen=True)
class EnginePod:
    """One engine pool to render: the InferencePool, the pool and its role, the tiers,
    and the InferencePool's P/D transfer (None: aggregated)."""

    ipool: InferencePoolSpec
    role: Role
    pool: EnginePoolSpec
    tiers: Sequence[KVCacheTierSpec] = ()
    pool_transfer: KVTransfer | None = None
    plan: TierPlan = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", plan_tiers(self.tiers))

    @property
    def transfer(self) -> KVTransfer | None:
        """A prefill pod always transfers (NIXL unless told otherwise); a decode pod only
        when the InferencePool is disaggregated."""
        if self.role is Role.PREFILL and self.pool_transfer is None:
            return KVTransfer()
        return self.pool_transfer


@dataclass(frozen=True)
class ConfigMount:
    """A ConfigMap of one file that an engine mounts read-only (its content hash rolls
    the pods); one per InferencePool, shared by its engine pools."""

    volume: str
    config_map: str
    mount_path: str  # a directory: the file is ``key`` in it
    key: str
    content: str
    component: str  # the ConfigMap's component label


class EngineAdapter(Protocol):
    kind: ClassVar[Engine]
    command: ClassVar[list[str]]
    # the engine's own per-pod Prometheus metric for each engine autoscaling signal
    # (render/autoscaling.py: the name the Prometheus adapter serves it under)
    scale_metrics: ClassVar[Mapping[ScaleSignal, str]]

    def args(self, pod: EnginePod) -> list[str]: ...

    def env(self, pod: EnginePod) -> list[Json]: ...

    def transfer_ports(self, pod: EnginePod) -> list[tuple[str, int]]:
        """(name, port) the pod's P/D transfer listens on."""

    def router_pd(self, transfer: KVTransfer) -> Json:
        """The router's ``pd`` section: the handoff protocol these engines speak."""

    def config_mounts(self, ipool_name: str, tiers: Sequence[KVCacheTierSpec]) -> list[ConfigMount]:
        """Config files the engines of the InferencePool read (none for most)."""


def compact_json(value: Json) -> str:
    """JSON for a command-line flag: no spaces, so it stays one shell word."""
    return json.dumps(value, separators=(",", ":"))


def check_parallelism(pool: EnginePoolSpec) -> None:
    """One engine per pod: GPUs beyond TP would be data parallel, and DP ranks offset
    the KV event ports (rank 1's PUB 5558 collides with the replay port)."""
    if pool.gpus_per_replica != pool.tensor_parallel_size:
        raise RenderError(
            f"gpusPerReplica ({pool.gpus_per_replica}) must equal tensorParallelSize "
            f"({pool.tensor_parallel_size}): data-parallel engines publish KV events on "
            "one port per rank, which discovery does not follow"
        )


def kv_events_config(served_name: str) -> Json:
    """Bind PUB and replay on every pod (the router dials each pod), one topic per pod.

    ``$(POD_NAME)`` is expanded by the kubelet from the container's env, which keeps
    the topic unique per pod without a wrapper script.
    """
    return {
        "publisher": "zmq",
        "endpoint": f"tcp://*:{names.KV_EVENTS_PORT}",
        "replay_endpoint": f"tcp://*:{names.KV_REPLAY_PORT}",
        "topic": f"kv@$(POD_NAME)@{served_name}",
    }


def downward_env() -> list[Json]:
    """POD_NAME / POD_IP first, so later values and the args can use ``$(POD_IP)``."""
    return [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
    ]


def identity_env(ipool: InferencePoolSpec) -> list[Json]:
    """The downward env and the hash seed: equal block hashes on every pod of one model
    revision (vLLM seeds the first block's parent hash with it, SGLang its own hashing),
    and different ones across revisions, so that every store keyed by block hashes
    (the offloading and Mooncake connectors, LMCache's chunk keys) keeps revisions apart
    while a rollout runs both."""
    seed = names.revision_hash_seed(ipool.engine.hash_seed, ipool.model.revision)
    return [*downward_env(), {"name": "PYTHONHASHSEED", "value": seed}]
