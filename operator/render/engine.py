"""The Deployment of one PrefillPool or DecodePool: engine pods the router discovers.

Pods carry the labels discovery selects on and listen on the fixed ports of
``names``. The selector leaves the generation out, so a new model identity rolls the
same Deployment (new pods get the new generation label) instead of orphaning pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from kvplane.operator.api import (
    Connector,
    Engine,
    EnginePoolSpec,
    InferencePoolSpec,
    KVCacheTierSpec,
    KVTransfer,
    ScaleSignal,
    TierVolume,
)
from kvplane.operator.render import k8s, names, sglang, stores, vllm
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    LMCACHE_CONFIG_DIR,
    NVME_MOUNT,
    RenderError,
    plan_tiers,
)

Json = dict[str, Any]

SHM_MOUNT: Final = "/dev/shm"
# Weights are downloaded and loaded before /health answers: allow an hour.
STARTUP_PERIOD_S: Final = 10
STARTUP_FAILURES: Final = 360
TERMINATION_GRACE_S: Final = 120


def pd_transfer(
    prefill: EnginePoolSpec | None, decodes: Sequence[EnginePoolSpec]
) -> KVTransfer | None:
    """The InferencePool's one P/D transfer: None without a PrefillPool, else the
    kvTransfer the pools set (they must agree), NIXL by default."""
    if prefill is None:
        return None
    chosen = {p.kv_transfer for p in (prefill, *decodes) if p.kv_transfer is not None}
    if len(chosen) > 1:
        raise RenderError("prefill and decode pools set different kvTransfer settings")
    return chosen.pop() if chosen else KVTransfer()


def _resources(pool: EnginePoolSpec) -> Json:
    """The pool's overrides with the GPUs added (extended resources: limits, and
    requests too when the override sets requests, since the two must be equal)."""
    resources: Json = {k: dict(v) for k, v in (pool.resources or {}).items()}
    gpus = str(pool.gpus_per_replica)
    resources.setdefault("limits", {})[names.GPU_RESOURCE] = gpus
    if "requests" in resources:
        resources["requests"][names.GPU_RESOURCE] = gpus
    return resources


def _nvme_volume(volume: TierVolume | None, selector: dict[str, str]) -> Json:
    """hostPath for a node's NVMe, else a per-pod ephemeral PVC of the storage class
    (deleted with the pod: a KV cache is not data), else an emptyDir on node storage."""
    if volume is not None and volume.host_path:
        return {"hostPath": {"path": volume.host_path, "type": "DirectoryOrCreate"}}
    size = volume.size if volume is not None else "100Gi"
    if volume is not None and volume.storage_class_name:
        return {
            "ephemeral": {
                "volumeClaimTemplate": {
                    "metadata": {"labels": dict(selector)},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "storageClassName": volume.storage_class_name,
                        "resources": {"requests": {"storage": size}},
                    },
                }
            }
        }
    return {"emptyDir": {"sizeLimit": size}}


def _spread(constraints: Sequence[Json], selector: dict[str, str]) -> list[Json]:
    """A constraint without labelSelector counts no pods; default it to this pool's."""
    out = []
    for c in constraints:
        c = dict(c)
        c.setdefault("labelSelector", {"matchLabels": dict(selector)})
        out.append(c)
    return out


def engine_deployment(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    pool_name: str,
    role: Role | str,
    pool: EnginePoolSpec,
    tiers: Sequence[KVCacheTierSpec],
    generation: str,
    *,
    transfer: KVTransfer | None = None,
) -> Json:
    """The engine Deployment; ``transfer`` is :func:`pd_transfer` of the InferencePool
    (None: aggregated, where only DecodePools exist)."""
    role = Role(role)
    if role not in names.ENGINE_ROLES:
        raise RenderError(f"engine role must be prefill or decode, not {role.value}")
    transfer = vllm.effective_transfer(role, transfer)
    kind = ipool.engine.kind
    plan = plan_tiers(tiers)
    name = names.engine_name(ipool_name, role, pool_name)
    selector = names.selector_labels(ipool_name, role, pool_name)
    labels = names.object_labels(ipool_name, role, kind.value, pool_name, generation)
    annotations = {names.ANNOTATION_GENERATION: generation}

    if kind is Engine.VLLM:
        command = vllm.COMMAND
        args = vllm.vllm_args(ipool, role, pool, tiers, transfer=transfer)
        env = vllm.vllm_env(ipool, role, pool, tiers, transfer=transfer)
    else:
        command = sglang.COMMAND
        args = sglang.sglang_args(ipool, role, pool, tiers, transfer=transfer)
        env = sglang.sglang_env(ipool, role, pool, tiers, transfer=transfer)

    ports = [
        k8s.port(names.PORT_HTTP, names.ENGINE_HTTP_PORT),
        k8s.port(names.PORT_KV_EVENTS, names.KV_EVENTS_PORT),
        k8s.port(names.PORT_KV_REPLAY, names.KV_REPLAY_PORT),
    ]
    if transfer is not None:
        if kind is Engine.VLLM and transfer.connector is Connector.NIXL:
            ports.append(k8s.port(names.PORT_NIXL, transfer.side_channel_port))
        elif role is Role.PREFILL:  # vLLM Mooncake and every SGLang P/D backend
            ports.append(k8s.port(names.PORT_BOOTSTRAP, transfer.bootstrap_port))

    mounts: list[Json] = [{"name": "dshm", "mountPath": SHM_MOUNT}]
    # NCCL and the engines' worker processes share tensors through /dev/shm, which
    # the container runtime caps at 64 MiB.
    volumes: list[Json] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if plan.nvme is not None:
        mounts.append({"name": "kv-nvme", "mountPath": NVME_MOUNT})
        volumes.append({"name": "kv-nvme", **_nvme_volume(plan.nvme.volume, selector)})
    pod_annotations = dict(annotations)
    if kind is Engine.VLLM and plan.uses_lmcache:
        mounts.append({"name": "lmcache-config", "mountPath": LMCACHE_CONFIG_DIR, "readOnly": True})
        volumes.append(
            {
                "name": "lmcache-config",
                "configMap": {"name": names.lmcache_config_name(ipool_name)},
            }
        )
        pod_annotations[names.ANNOTATION_CONFIG_HASH] = k8s.content_hash(
            stores.lmcache_config(tiers)
        )

    container: Json = {
        "name": "engine",
        "image": ipool.engine.image,
        "command": list(command),
        "args": args,
        "env": env,
        "ports": ports,
        "resources": _resources(pool),
        "volumeMounts": mounts,
        "startupProbe": k8s.http_probe(
            "/health", names.PORT_HTTP, period=STARTUP_PERIOD_S, failures=STARTUP_FAILURES
        ),
        "readinessProbe": k8s.http_probe("/health", names.PORT_HTTP, period=5, failures=3),
        "livenessProbe": k8s.http_probe(
            "/health", names.PORT_HTTP, period=15, failures=4, timeout=10
        ),
    }
    secrets = sorted(
        {t.credentials_secret_ref.name for t in tiers if t.credentials_secret_ref is not None}
    )
    if secrets:
        # store credentials (AWS_*, a Redis password, ...) arrive as the Secret's keys
        container["envFrom"] = [{"secretRef": {"name": s}} for s in secrets]
    if transfer is not None and transfer.protocol == "rdma":
        # RDMA registers (pins) the KV cache memory: needs an unlimited memlock
        container["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}

    pod: Json = {
        "containers": [container],
        "volumes": volumes,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
        # Service links inject env like VLLM_PORT=tcp://... when a Service is named
        # "vllm", which vLLM reads as its own setting and fails on.
        "enableServiceLinks": False,
    }
    if pool.node_selector:
        pod["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod["tolerations"] = [dict(t) for t in pool.tolerations]
    if pool.affinity:
        pod["affinity"] = dict(pool.affinity)
    if pool.topology_spread_constraints:
        pod["topologySpreadConstraints"] = _spread(pool.topology_spread_constraints, selector)

    # GPUs are the scarce resource: roll within the replicas' own GPUs (one pod
    # down at a time) instead of surging into GPUs that may not exist.
    strategy = {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    return k8s.deployment(
        name,
        namespace,
        labels,
        selector,
        labels,
        pod,
        replicas=None if pool.autoscaling else pool.desired_replicas(),
        strategy=strategy,
        annotations=annotations,
        pod_annotations=pod_annotations,
    )


# Per-pod engine metrics as a Prometheus adapter exposes them (":" is not allowed in
# custom metric names, so vllm:kv_cache_usage_perc becomes vllm_kv_cache_usage_perc).
_SCALE_METRICS = {
    (Engine.VLLM, ScaleSignal.KV_CACHE_PRESSURE): "vllm_kv_cache_usage_perc",
    (Engine.VLLM, ScaleSignal.QUEUE_DEPTH): "vllm_num_requests_waiting",
    (Engine.SGLANG, ScaleSignal.KV_CACHE_PRESSURE): "sglang_token_usage",
    (Engine.SGLANG, ScaleSignal.QUEUE_DEPTH): "sglang_num_queue_reqs",
}


def engine_autoscaler(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    pool_name: str,
    role: Role,
    pool: EnginePoolSpec,
) -> Json | None:
    """An autoscaling/v2 HPA on the pool's own signal (KV cache pressure or queue
    depth per pod), or None for a fixed-size pool. The engine Deployment then
    leaves ``replicas`` to the HPA."""
    scaling = pool.autoscaling
    if scaling is None:
        return None
    name = names.engine_name(ipool_name, role, pool_name)
    metric = _SCALE_METRICS[(ipool.engine.kind, scaling.signal)]
    target = f"{round(scaling.target * 1000)}m"
    labels = names.object_labels(ipool_name, role, ipool.engine.kind.value, pool_name)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": k8s.metadata(name, namespace, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": max(1, scaling.min_replicas),
            "maxReplicas": scaling.max_replicas,
            "metrics": [
                {
                    "type": "Pods",
                    "pods": {
                        "metric": {"name": metric},
                        "target": {"type": "AverageValue", "averageValue": target},
                    },
                }
            ],
        },
    }
