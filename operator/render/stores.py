"""The stores an InferencePool runs next to its engines: the residency index's Redis,
a Mooncake Store master, and the LMCache configuration its vLLM engines read.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

import yaml
from kvplane.operator.api import (
    Compression,
    Engine,
    InferencePoolSpec,
    KVCacheTierSpec,
    ManagedRedis,
    TierBackend,
)
from kvplane.operator.render import k8s, names
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    NVME_MOUNT,
    RenderError,
    TierPlan,
    gib,
    is_managed_mooncake,
    plan_tiers,
    quantity_bytes,
    store_address,
)

Json = dict[str, Any]

LMCACHE_CONFIG_KEY: Final = "lmcache.yaml"

# --- Redis (residency index) -----------------------------------------------------


def managed_redis(ipool: InferencePoolSpec) -> ManagedRedis | None:
    """The managed Redis is the default: only ``index.external`` turns it off."""
    if ipool.index.external is not None:
        return None
    return ipool.index.managed or ManagedRedis()


def index_url(ipool_name: str, namespace: str, ipool: InferencePoolSpec) -> str:
    """What the router and indexer put in ``index.url``."""
    if ipool.index.external is not None:
        return ipool.index.external.url
    host = names.service_host(names.redis_name(ipool_name), namespace)
    return f"redis://{host}:{names.REDIS_PORT}/0"


def redis_objects(ipool_name: str, namespace: str, ipool: InferencePoolSpec) -> list[Json]:
    """A single cache-only Redis: residency is rebuilt from KV events and the replay
    buffers, so persistence would only slow it down and LRU eviction is safe (a lost
    key is a missed cache hit, never a wrong answer)."""
    spec = managed_redis(ipool)
    if spec is None:
        return []
    name = names.redis_name(ipool_name)
    labels = names.object_labels(ipool_name, Role.REDIS, "redis")
    selector = names.selector_labels(ipool_name, Role.REDIS)
    max_bytes = quantity_bytes(spec.memory)
    # fragmentation, buffers and the process itself live above maxmemory
    limit = f"{math.ceil(max_bytes * 1.25 / (1 << 20)) + 32}Mi"
    container: Json = {
        "name": "redis",
        "image": spec.image,
        "args": [
            "redis-server",
            "--port",
            str(names.REDIS_PORT),
            "--protected-mode",
            "no",  # the Service is the only way in; protected mode refuses remote clients
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory",
            str(max_bytes),
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        "ports": [k8s.port(names.PORT_REDIS, names.REDIS_PORT)],
        "resources": {
            "requests": {"cpu": "250m", "memory": limit},
            "limits": {"memory": limit},
        },
        "readinessProbe": {
            "exec": {"command": ["redis-cli", "-p", str(names.REDIS_PORT), "ping"]},
            "periodSeconds": 5,
            "timeoutSeconds": 3,
            "failureThreshold": 3,
        },
        "livenessProbe": k8s.tcp_probe(names.PORT_REDIS, period=10, failures=6),
    }
    pod = {"containers": [container], "enableServiceLinks": False}
    return [
        k8s.deployment(
            name, namespace, labels, selector, labels, pod, replicas=1, strategy=k8s.RECREATE
        ),
        k8s.service(
            name,
            namespace,
            labels,
            selector,
            [(names.PORT_REDIS, names.REDIS_PORT, names.PORT_REDIS)],
        ),
    ]


# --- Mooncake Store master --------------------------------------------------------


def managed_mooncake(
    ipool_name: str, namespace: str, tiers: Sequence[KVCacheTierSpec]
) -> KVCacheTierSpec | None:
    for tier in tiers:
        if is_managed_mooncake(tier, ipool_name, namespace):
            return tier
    return None


def mooncake_url(ipool_name: str, namespace: str) -> str:
    """The url a remote mooncake tier uses to ask for the managed master."""
    host = names.service_host(names.mooncake_name(ipool_name), namespace)
    return f"mooncake://{host}:{names.MOONCAKE_RPC_PORT}"


def mooncake_objects(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    tiers: Sequence[KVCacheTierSpec],
    *,
    image: str | None = None,
) -> list[Json]:
    """A Mooncake Store master when a remote mooncake tier's url names ``<pool>-mooncake``.

    The master only keeps metadata (engines contribute the memory segments), so it
    is small; it also serves the transfer engine's HTTP metadata and /metrics, /health.
    ``image`` defaults to the engine image: SGLang images ship ``mooncake_master``,
    and the API has no separate field for it.
    """
    tier = managed_mooncake(ipool_name, namespace, tiers)
    if tier is None:
        return []
    name = names.mooncake_name(ipool_name)
    labels = names.object_labels(ipool_name, Role.MOONCAKE, "mooncake-master")
    selector = names.selector_labels(ipool_name, Role.MOONCAKE)
    container: Json = {
        "name": "master",
        "image": image or ipool.engine.image,
        "command": [
            "mooncake_master",
            "-rpc_address=0.0.0.0",
            f"-rpc_port={names.MOONCAKE_RPC_PORT}",
            "-enable_http_metadata_server=true",
            "-http_metadata_server_host=0.0.0.0",
            f"-http_metadata_server_port={names.MOONCAKE_METADATA_PORT}",
            "-metrics_host=0.0.0.0",
            f"-metrics_port={names.MOONCAKE_METRICS_PORT}",
            "-enable_metric_reporting=true",
            "-eviction_high_watermark_ratio=0.9",
            "-eviction_ratio=0.05",
        ],
        "ports": [
            k8s.port(names.PORT_RPC, names.MOONCAKE_RPC_PORT),
            k8s.port(names.PORT_METADATA, names.MOONCAKE_METADATA_PORT),
            k8s.port(names.PORT_METRICS, names.MOONCAKE_METRICS_PORT),
        ],
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "readinessProbe": k8s.http_probe("/health", names.PORT_METRICS, period=5, failures=3),
        "livenessProbe": k8s.http_probe("/health", names.PORT_METRICS, period=10, failures=6),
    }
    pod = {"containers": [container], "enableServiceLinks": False}
    return [
        k8s.deployment(
            name, namespace, labels, selector, labels, pod, replicas=1, strategy=k8s.RECREATE
        ),
        k8s.service(
            name,
            namespace,
            labels,
            selector,
            [
                (names.PORT_RPC, names.MOONCAKE_RPC_PORT, names.PORT_RPC),
                (names.PORT_METADATA, names.MOONCAKE_METADATA_PORT, names.PORT_METADATA),
                (names.PORT_METRICS, names.MOONCAKE_METRICS_PORT, names.PORT_METRICS),
            ],
        ),
    ]


# --- LMCache ----------------------------------------------------------------------

_SERDE: Final = {
    Compression.NONE: "naive",
    Compression.CACHEGEN: "cachegen",
    Compression.KIVI: "kivi",
}


def _remote_url(tier: KVCacheTierSpec) -> str:
    """LMCache's ``remote_url`` scheme for each remote backend."""
    if tier.backend is TierBackend.S3:
        assert tier.url is not None  # CEL: remote tiers have a url
        return tier.url
    if tier.backend is TierBackend.REDIS and tier.url and tier.url.startswith("rediss://"):
        return tier.url
    scheme = {
        TierBackend.MOONCAKE: "mooncakestore",
        TierBackend.REDIS: "redis",
        TierBackend.LMCACHE_SERVER: "lm",
    }.get(tier.backend)
    if scheme is None:
        raise RenderError(f"LMCache has no remote backend {tier.backend.value}")
    suffix = "/" if tier.backend is TierBackend.MOONCAKE else ""
    return f"{scheme}://{store_address(tier).hostport}{suffix}"


def lmcache_config_dict(plan: TierPlan) -> Json:
    """LMCache settings shared by every pod of the pool (per-pod ones: vllm.py)."""
    lm_tiers = plan.lmcache_tiers
    if not lm_tiers:
        raise RenderError("no tier uses LMCache")
    chunks = {t.chunk_size for t in lm_tiers}
    if len(chunks) != 1:
        raise RenderError(f"LMCache tiers disagree on chunkSize: {sorted(chunks)}")
    config: Json = {"chunk_size": chunks.pop()}
    dram = plan.dram if plan.dram and plan.dram.backend is TierBackend.LMCACHE else None
    config["local_cpu"] = dram is not None
    if dram is not None:
        config["max_local_cpu_size"] = round(gib(dram.capacity_per_pod), 3)
    if plan.nvme is not None:
        nvme = plan.nvme
        size = nvme.capacity_per_pod
        if quantity_bytes(size) == 0 and nvme.volume is not None:
            size = nvme.volume.size
        config["local_disk"] = f"file://{NVME_MOUNT}/"
        config["max_local_disk_size"] = round(gib(size), 3)
    if plan.remote is not None:
        config["remote_url"] = _remote_url(plan.remote)
        config["remote_serde"] = _SERDE[plan.remote.compression]
    # same chunk hashes on every pod, so a shared remote store deduplicates across them
    config["pre_caching_hash_algorithm"] = "sha256_cbor_64bit"
    # forward LMCache's stores into vLLM's KV event stream: the router indexes them
    config["enable_kv_events"] = True
    return config


def lmcache_config(tiers: Sequence[KVCacheTierSpec]) -> str:
    """The YAML file at LMCACHE_CONFIG_FILE (sorted keys: stable ConfigMap content)."""
    return yaml.safe_dump(lmcache_config_dict(plan_tiers(tiers)), sort_keys=True)


def lmcache_configmap(
    ipool_name: str, namespace: str, ipool: InferencePoolSpec, tiers: Sequence[KVCacheTierSpec]
) -> Json | None:
    """The ConfigMap vLLM engines mount, or None when no LMCache tier applies."""
    if ipool.engine.kind is not Engine.VLLM or not plan_tiers(tiers).uses_lmcache:
        return None
    labels = {**names.common_labels(ipool_name, "lmcache", "lmcache"), names.LABEL_POOL: ipool_name}
    return k8s.config_map(
        names.lmcache_config_name(ipool_name),
        namespace,
        labels,
        {LMCACHE_CONFIG_KEY: lmcache_config(tiers)},
    )
