"""The stores an InferencePool runs next to its engines: the residency index's Redis
and a Mooncake Store master."""

from __future__ import annotations

import base64
import math
from collections.abc import Sequence
from typing import Final

from kvplane.operator.api import (
    Engine,
    InferencePoolSpec,
    KVCacheTierSpec,
    ManagedRedis,
)
from kvplane.operator.render import k8s, names
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    RenderError,
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


# The managed Redis' password: a Secret the operator creates once with a random password
# (``index_secret``; rendering names it and never holds the password).
INDEX_PASSWORD_KEY: Final = "password"
INDEX_CONF_KEY: Final = "redis.conf"  # ``requirepass``: kept off the command line
REDIS_CONF_DIR: Final = "/etc/kvplane-redis"


def index_secret_name(ipool_name: str) -> str:
    return f"{names.redis_name(ipool_name)}-auth"


def index_password_ref(ipool_name: str, ipool: InferencePoolSpec) -> tuple[str, str] | None:
    """(Secret, key) holding the index's password: the managed Redis' own, or an external
    index's ``passwordSecretRef``; None for an external index without one."""
    external = ipool.index.external
    if external is None:
        return index_secret_name(ipool_name), INDEX_PASSWORD_KEY
    ref = external.password_secret_ref
    return None if ref is None else (ref.name, ref.key)


def index_secret(ipool_name: str, namespace: str, password: str) -> Json:
    """The managed Redis' password Secret (the operator creates it when it is missing)."""
    labels = names.object_labels(ipool_name, Role.REDIS, "redis")
    data = {
        INDEX_PASSWORD_KEY: password,
        INDEX_CONF_KEY: f"requirepass {password}\n",
    }
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": k8s.metadata(index_secret_name(ipool_name), namespace, labels),
        "type": "Opaque",
        "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()},
    }


def index_url(ipool_name: str, namespace: str, ipool: InferencePoolSpec) -> str:
    """What the router and indexer put in ``index.url``."""
    if ipool.index.external is not None:
        return ipool.index.external.url
    host = names.service_host(names.redis_name(ipool_name), namespace)
    return f"redis://{host}:{names.REDIS_PORT}/0"


def redis_objects(ipool_name: str, namespace: str, ipool: InferencePoolSpec) -> list[Json]:
    """A single cache-only Redis: residency is rebuilt from KV events and the replay
    buffers, so persistence would only slow it down and LRU eviction is safe (a lost
    key is a missed cache hit, never a wrong answer). It requires the password of the
    Secret ``index_secret_name`` (its config file sets ``requirepass``; ``redis-cli``
    in the probes reads it from ``REDISCLI_AUTH``)."""
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
            f"{REDIS_CONF_DIR}/{INDEX_CONF_KEY}",
            "--port",
            str(names.REDIS_PORT),
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
        "env": [_secret_env("REDISCLI_AUTH", index_secret_name(ipool_name), INDEX_PASSWORD_KEY)],
        "volumeMounts": [{"name": "auth", "mountPath": REDIS_CONF_DIR, "readOnly": True}],
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
    auth = {
        "secretName": index_secret_name(ipool_name),
        "items": [{"key": INDEX_CONF_KEY, "path": INDEX_CONF_KEY}],
    }
    pod = {
        "containers": [container],
        "enableServiceLinks": False,
        "volumes": [{"name": "auth", "secret": auth}],
    }
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


def _secret_env(name: str, secret: str, key: str) -> Json:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def index_env(ipool_name: str, ipool: InferencePoolSpec) -> list[Json]:
    """The index password for the router and the indexer (never in their ConfigMap)."""
    ref = index_password_ref(ipool_name, ipool)
    return [] if ref is None else [_secret_env("KVPLANE_INDEX_PASSWORD", *ref)]


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
    generation: str,
) -> list[Json]:
    """A Mooncake Store master when a remote mooncake tier's url names ``<pool>-mooncake``.

    The master only keeps metadata (engines contribute the memory segments), so it
    is small; it also serves the transfer engine's HTTP metadata and /metrics, /health.
    Its image is the tier's ``masterImage``, else the engine image of an SGLang pool
    (SGLang images ship ``mooncake_master``); the vLLM images are not known to, so a
    vLLM pool must name one (e.g. an image with the ``mooncake-transfer-engine`` wheel).
    The pod carries the pool's generation (model, revision, tokenizer, block size): a new
    one recreates the master, which keeps its objects in memory, so no key of another
    revision survives a rollout there.
    """
    tier = managed_mooncake(ipool_name, namespace, tiers)
    if tier is None:
        return []
    image = tier.master_image
    if image is None and ipool.engine.kind is Engine.SGLANG:
        image = ipool.engine.image
    if image is None:
        raise RenderError(
            "a managed Mooncake master for a vLLM pool needs the tier's masterImage: "
            "vLLM images are not known to ship mooncake_master"
        )
    name = names.mooncake_name(ipool_name)
    labels = names.object_labels(ipool_name, Role.MOONCAKE, "mooncake-master")
    selector = names.selector_labels(ipool_name, Role.MOONCAKE)
    container: Json = {
        "name": "master",
        "image": image,
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
            name,
            namespace,
            labels,
            selector,
            labels,
            pod,
            replicas=1,
            strategy=k8s.RECREATE,
            pod_annotations={names.ANNOTATION_GENERATION: generation},
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
