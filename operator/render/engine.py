"""The Deployment of one PrefillPool or DecodePool: engine pods the router discovers.

Pods carry the labels discovery selects on and listen on the fixed ports of
``names``. The selector leaves the generation out, so a new model identity rolls the
same Deployment (new pods get the new generation label) instead of orphaning pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from kvplane.operator.api import (
    Autoscaling,
    EnginePoolSpec,
    InferencePoolSpec,
    KVCacheTierSpec,
    KVTransfer,
    ScaleSignal,
    TierVolume,
)
from kvplane.operator.render import autoscaling, k8s, names
from kvplane.operator.render.engines import EnginePod, adapter
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import NVME_MOUNT, RenderError

from kvplane.types import Json

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
    engine = EnginePod(ipool, role, pool, tiers, transfer)
    impl = adapter(ipool.engine.kind)
    plan = engine.plan
    name = names.engine_name(ipool_name, role, pool_name)
    selector = names.selector_labels(ipool_name, role, pool_name)
    labels = names.object_labels(ipool_name, role, impl.kind.value, pool_name, generation)
    annotations = {names.ANNOTATION_GENERATION: generation}

    ports = [
        k8s.port(names.PORT_HTTP, names.ENGINE_HTTP_PORT),
        k8s.port(names.PORT_KV_EVENTS, names.KV_EVENTS_PORT),
        k8s.port(names.PORT_KV_REPLAY, names.KV_REPLAY_PORT),
        *(k8s.port(n, p) for n, p in impl.transfer_ports(engine)),
    ]

    mounts: list[Json] = [{"name": "dshm", "mountPath": SHM_MOUNT}]
    # NCCL and the engines' worker processes share tensors through /dev/shm, which
    # the container runtime caps at 64 MiB.
    volumes: list[Json] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if plan.nvme is not None:
        mounts.append({"name": "kv-nvme", "mountPath": NVME_MOUNT})
        volumes.append({"name": "kv-nvme", **_nvme_volume(plan.nvme.volume, selector)})
    pod_annotations = dict(annotations)
    for cm in impl.config_mounts(ipool_name, tiers):
        mounts.append({"name": cm.volume, "mountPath": cm.mount_path, "readOnly": True})
        volumes.append({"name": cm.volume, "configMap": {"name": cm.config_map}})
        pod_annotations[names.ANNOTATION_CONFIG_HASH] = k8s.content_hash(cm.content)

    container: Json = {
        "name": "engine",
        "image": ipool.engine.image,
        "command": list(impl.command),
        "args": impl.args(engine),
        "env": impl.env(engine),
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
    if engine.transfer is not None and engine.transfer.protocol == "rdma":
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


def engine_autoscaler(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    pool_name: str,
    role: Role,
    pool: EnginePoolSpec,
) -> Json | None:
    """An autoscaling/v2 HPA on the pool's own signal, or None for a fixed-size pool.
    The engine Deployment then leaves ``replicas`` to the HPA.

    KV cache pressure and queue depth are per-pod engine metrics (``Pods``, named by
    the engine adapter as the Prometheus adapter exposes them); predicted TTFT is the
    pool router's p90 (``External``, selected by the router's ``pool`` label) held at
    the pool's ``slo.ttftMs``. The Prometheus adapter rules that serve them:
    ``render/autoscaling.py``."""
    scaling = pool.autoscaling
    if scaling is None:
        return None
    name = names.engine_name(ipool_name, role, pool_name)
    labels = names.object_labels(ipool_name, role, ipool.engine.kind.value, pool_name)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": k8s.metadata(name, namespace, labels),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": max(1, scaling.min_replicas),
            "maxReplicas": scaling.max_replicas,
            "metrics": [autoscaler_metric(ipool_name, ipool, scaling)],
        },
    }


def autoscaler_metric(ipool_name: str, ipool: InferencePoolSpec, scaling: Autoscaling) -> Json:
    """One autoscaling/v2 metric source for the pool's signal."""
    if scaling.signal is ScaleSignal.PREDICTED_TTFT:
        seconds = ipool.slo.ttft_ms / 1000 if ipool.slo is not None else scaling.target
        return {
            "type": "External",
            "external": {
                "metric": {
                    "name": autoscaling.PREDICTED_TTFT_METRIC,
                    "selector": {"matchLabels": {"pool": ipool_name}},
                },
                "target": {"type": "Value", "value": f"{round(seconds * 1000)}m"},
            },
        }
    metric = adapter(ipool.engine.kind).scale_metrics[scaling.signal]
    return {
        "type": "Pods",
        "pods": {
            "metric": {"name": autoscaling.hpa_metric_name(metric)},
            "target": {"type": "AverageValue", "averageValue": f"{round(scaling.target * 1000)}m"},
        },
    }


def engine_config_maps(
    ipool_name: str, namespace: str, ipool: InferencePoolSpec, tiers: Sequence[KVCacheTierSpec]
) -> list[Json]:
    """The ConfigMaps the InferencePool's engines mount (LMCache's config for vLLM)."""
    out = []
    for cm in adapter(ipool.engine.kind).config_mounts(ipool_name, tiers):
        labels = {**names.common_labels(ipool_name, cm.component, cm.component)}
        labels[names.LABEL_POOL] = names.fit(ipool_name)
        out.append(k8s.config_map(cm.config_map, namespace, labels, {cm.key: cm.content}))
    return out
