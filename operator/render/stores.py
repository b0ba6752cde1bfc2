"""The stores an InferencePool runs next to its engines: the residency index's Redis
and a Mooncake Store master."""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvplane.operator.api import (
    InferencePoolSpec,
    KVCacheTierSpec,
    ManagedRedis,
)
from kvplane.operator.render import k8s, names
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    is_managed_mooncake,
    quantity_bytes,
)

from kvplane.types import Json

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
