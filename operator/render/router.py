"""The router and the indexer of an InferencePool, configured from its spec.

Both read one ConfigMap (``router.yaml``, a RouterConfig) and find engines by
Kubernetes discovery, so they need a ServiceAccount that may list and watch pods.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import yaml
from kvplane.operator.api import InferencePoolSpec, KVCacheTierSpec, KVTransfer, TierBackend
from kvplane.operator.render import k8s, names, stores
from kvplane.operator.render.engines import adapter
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import plan_tiers, quantity_bytes
from kvplane.router.config import RouterConfig

from kvplane.types import Json

CONFIG_DIR: Final = "/etc/kvplane"
CONFIG_KEY: Final = "router.yaml"
CONFIG_PATH: Final = f"{CONFIG_DIR}/{CONFIG_KEY}"
MODELS_DIR: Final = "/models"
TOKENIZER_DIR: Final = f"{MODELS_DIR}/tokenizer"
# Where the init container sees the same emptyDir: not /models, which could shadow
# a model directory baked into the engine image that it copies from.
INIT_MOUNT: Final = "/kvplane-out"
API_KEYS_DIR: Final = f"{CONFIG_DIR}/api-keys"
# Admin keys (explain, /docs, residency headers): the optional Secret <router>-admin-keys.
ADMIN_KEYS_DIR: Final = f"{CONFIG_DIR}/admin-keys"
# No spec value: leave the length check to the engine, which knows the model's limit.
UNBOUNDED_MODEL_LEN: Final = 2**31 - 1

# The tokenizer init container runs this with the image's python. Hub ids go through
# huggingface_hub (a transformers dependency, so in the router image) fetching only
# tokenizer files; a local path (weights baked into the engine image) is copied.
TOKENIZER_FILES: Final = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
FETCH_TOKENIZER: Final = f"""\
import os, shutil, sys
src, rev, dest = (os.environ[k] for k in ("SOURCE", "REVISION", "DEST"))
files = {list(TOKENIZER_FILES)!r}
os.makedirs(dest, exist_ok=True)
if os.path.isdir(src):
    for f in files:
        if os.path.isfile(os.path.join(src, f)):
            shutil.copy(os.path.join(src, f), os.path.join(dest, f))
else:
    from huggingface_hub import snapshot_download
    snapshot_download(src, revision=rev, local_dir=dest, allow_patterns=files)
vocab = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
if not any(os.path.isfile(os.path.join(dest, f)) for f in vocab):
    sys.exit(f"no tokenizer files in {{src}}@{{rev}}")
print("tokenizer:", sorted(os.listdir(dest)))
"""


def discovery_selector(ipool_name: str, disaggregated: bool) -> str:
    """Engine pods of the pool; with P/D the prefill pods too, told apart by the role
    label that discovery copies into each backend's labels."""
    roles = "decode,prefill" if disaggregated else "decode"
    return f"{names.LABEL_POOL}={names.fit(ipool_name)},{names.LABEL_ROLE} in ({roles})"


def pd_config(ipool: InferencePoolSpec, transfer: KVTransfer) -> Json:
    """The router's ``pd`` section: the handoff protocol the rendered engines speak
    and the port their bootstrap servers listen on (the NIXL side channel travels
    inside the prefill pod's answer, so the router needs no port for it)."""
    return adapter(ipool.engine.kind).router_pd(transfer)


def router_config(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    tiers: Sequence[KVCacheTierSpec],
    generation: str,
    *,
    disaggregated: bool = False,
    transfer: KVTransfer | None = None,
    store_pods: int = 1,
) -> Json:
    """The RouterConfig as a plain dict (validated: a bad render fails here, not in
    the router pod). Only what the operator decides is written; the rest is the
    router's own defaults. ``store_pods``: the most engine pods that contribute to a
    remote tier (its size is their ``capacityPerPod`` together)."""
    model = ipool.model
    route = ipool.router
    tier_costs: Json = {}
    plan = plan_tiers(tiers)
    for tier in (plan.dram, plan.nvme, plan.remote):
        if tier is not None:
            tier_costs[tier.tier.value] = {
                "bandwidth_gbps": tier.bandwidth_gbps,
                "latency_ms": tier.latency_ms,
            }
    cost: Json = {
        "prefill_tokens_per_s": route.cost.prefill_tokens_per_s,
        "running_step_ms_per_request": route.cost.running_step_ms_per_request,
        "load_cap": route.cost.load_cap,
        "tentative_ttl_s": route.cost.tentative_ttl_s,
        "prefill_attention_ms_per_mpair": route.cost.prefill_attention_ms_per_mpair,
    }
    if route.cost.tail_guard is not None:
        cost["tail_guard"] = route.cost.tail_guard
    if tier_costs:
        cost["tiers"] = tier_costs
    shared = shared_stores(plan.remote, ipool, store_pods)
    unreported = unreported_tier(plan.dram, ipool)
    config: Json = {
        "pool": ipool_name,
        "model": {
            "name": model.served_name,
            "tokenizer": TOKENIZER_DIR,
            "revision": model.revision,
            "block_size": ipool.engine.block_size,
            "max_model_len": model.max_model_len or UNBOUNDED_MODEL_LEN,
            "kv_bytes_per_token": model.kv_bytes(),
            "generation": generation,
        },
        "discovery": {
            "namespace": namespace,
            "selector": discovery_selector(ipool_name, disaggregated),
            "http_port": names.ENGINE_HTTP_PORT,
            "kv_events_port": names.KV_EVENTS_PORT,
            "replay_port": names.KV_REPLAY_PORT,
            "topic": "",  # each pod has its own socket; its topic names the pod
        },
        "policy": route.policy,
        **({"policy_options": dict(route.policy_options)} if route.policy_options else {}),
        "cost": cost,
        "index": {"backend": "redis", "url": stores.index_url(ipool_name, namespace, ipool)},
    }
    if shared:
        config["shared_stores"] = shared
    if unreported is not None:
        config["unreported_tier"] = unreported
    if model.lora_adapters:  # requests naming one are this pool's, keyed apart
        config["model"]["lora_adapters"] = [a.name for a in model.lora_adapters]
    if ipool.tracing is not None:
        config["tracing"] = {
            "endpoint": ipool.tracing.endpoint,
            "sampling_ratio": ipool.tracing.sampling_ratio,
            "service_name": "kvplane-router",
        }
    if disaggregated:
        # without it the router would send whole requests to prefill pods
        config["pd"] = pd_config(ipool, transfer or KVTransfer())
    if route.api_keys_secret_ref is not None:  # the mounted Secrets (router_objects)
        config["auth"] = {"api_keys": API_KEYS_DIR, "admin_keys": ADMIN_KEYS_DIR}
    RouterConfig.model_validate(config)
    return config


def shared_stores(
    remote: KVCacheTierSpec | None, ipool: InferencePoolSpec, store_pods: int
) -> list[Json]:
    """A remote tier is a store every pod of the pool writes to and reads from: its
    blocks are resident for all of them at the tier's link, and outlive their writer.
    Neither Mooncake Store nor an LMCache remote tells vLLM what it evicts, so its size
    bounds what the index keeps: the pods' ``capacityPerPod`` together (a Mooncake
    client contributes that much to the store), in blocks; a tier without a capacity is
    counted as one longest prompt (``maxModelLen``) per pod, so that the index never
    grows without bound."""
    if remote is None:
        return []
    per_pod = blocks_per_pod(remote, ipool)
    link = {"bandwidth_gbps": remote.bandwidth_gbps, "latency_ms": remote.latency_ms}
    name = f"{remote.tier.value}-{remote.backend.value}".lower()
    return [{"name": name, "link": link, "capacity_blocks": per_pod * max(1, store_pods)}]


def unreported_tier(dram: KVCacheTierSpec | None, ipool: InferencePoolSpec) -> Json | None:
    """LMCache (0.5.6) reports what its CPU tier stores in chunks of its ``chunk_size``
    tokens, which the index cannot key by the engines' blocks, and the in-process
    connector the operator renders (LMCacheConnectorV1) reports no evictions: the index
    infers that tier from HBM's events, as a write-through tier with LRU eviction of
    ``capacityPerPod`` (``RouterConfig.unreported_tier``; with ``evictionPolicy: lfu``
    an approximation)."""
    if dram is None or dram.backend is not TierBackend.LMCACHE:
        return None
    return {"tier": dram.tier.value, "blocks": blocks_per_pod(dram, ipool)}


def blocks_per_pod(tier: KVCacheTierSpec, ipool: InferencePoolSpec) -> int:
    """A tier's ``capacityPerPod`` in blocks of the engines' block size; unsized, room
    for one longest prompt (``maxModelLen``), so that the index never grows without
    bound."""
    block_bytes = ipool.model.kv_bytes() * ipool.engine.block_size
    per_pod = quantity_bytes(tier.capacity_per_pod) // block_bytes
    if per_pod > 0:
        return per_pod
    return -(-(ipool.model.max_model_len or UNBOUNDED_MODEL_LEN) // ipool.engine.block_size)


def router_config_yaml(config: Json) -> str:
    return yaml.safe_dump(config, sort_keys=False)


def config_map(ipool_name: str, namespace: str, config: Json) -> Json:
    labels = names.object_labels(ipool_name, Role.ROUTER, "kvplane-router")
    return k8s.config_map(
        names.router_name(ipool_name), namespace, labels, {CONFIG_KEY: router_config_yaml(config)}
    )


def discovery_rbac(
    name: str, namespace: str, labels: dict[str, str], cluster_role: str = names.DISCOVERY_ROLE
) -> list[Json]:
    """A ServiceAccount bound in its own namespace to the discovery ClusterRole (read
    pods: all discovery needs). A binding, not a Role of its own: the operator may
    bind that one ClusterRole and write no Role anywhere."""
    meta = k8s.metadata(name, namespace, labels)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": meta,
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": cluster_role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}],
        },
    ]


def _hub_env(ipool: InferencePoolSpec) -> list[Json]:
    """The engines' hub settings (HF_TOKEN, HF_ENDPOINT, ...) serve the tokenizer fetch."""
    return [dict(e) for e in ipool.engine.env if str(e.get("name", "")).startswith("HF_")]


def _tokenizer_init(ipool: InferencePoolSpec, image: str) -> Json:
    """Fetch the tokenizer into an emptyDir before the router starts.

    An init container, not a volume of the engines' weights: the router runs on CPU
    nodes without the model volume, and needs only a few small files. A hub id is
    fetched with the router's own image (small, already pulled); a local path
    exists only in the engine image, so that image copies it.
    """
    source = ipool.model.tokenizer or ipool.model.source
    local = source.startswith("/")
    return {
        "name": "tokenizer",
        "image": ipool.engine.image if local else image,
        "command": ["python3", "-c", FETCH_TOKENIZER],
        "env": [
            {"name": "SOURCE", "value": source},
            {"name": "REVISION", "value": ipool.model.revision},
            {"name": "DEST", "value": f"{INIT_MOUNT}/tokenizer"},
            *_hub_env(ipool),
        ],
        "volumeMounts": [{"name": "models", "mountPath": INIT_MOUNT}],
        "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
    }


def router_objects(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    tiers: Sequence[KVCacheTierSpec],
    generation: str,
    *,
    default_image: str,
    disaggregated: bool = False,
    transfer: KVTransfer | None = None,
    discovery_role: str = names.DISCOVERY_ROLE,
    store_pods: int = 1,
) -> list[Json]:
    """ConfigMap, RBAC, Deployment and Service of the router.

    ``default_image`` is the operator's own image (it contains ``kvplane``), used
    unless the spec names a router image; ``discovery_role`` the ClusterRole that
    lets it read pods.
    """
    config = router_config(
        ipool_name,
        namespace,
        ipool,
        tiers,
        generation,
        disaggregated=disaggregated,
        transfer=transfer,
        store_pods=store_pods,
    )
    cm = config_map(ipool_name, namespace, config)
    name = names.router_name(ipool_name)
    labels = names.object_labels(ipool_name, Role.ROUTER, "kvplane-router")
    selector = names.selector_labels(ipool_name, Role.ROUTER)
    image = ipool.router.image or default_image

    mounts: list[Json] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "models", "mountPath": MODELS_DIR, "readOnly": True},
    ]
    volumes: list[Json] = [
        {"name": "config", "configMap": {"name": name}},
        {"name": "models", "emptyDir": {"sizeLimit": "1Gi"}},
    ]
    if ipool.router.api_keys_secret_ref is not None:
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_DIR, "readOnly": True})
        volumes.append(
            {"name": "api-keys", "secret": {"secretName": ipool.router.api_keys_secret_ref.name}}
        )
        mounts.append({"name": "admin-keys", "mountPath": ADMIN_KEYS_DIR, "readOnly": True})
        admin = {"secretName": f"{name}-admin-keys", "optional": True}
        volumes.append({"name": "admin-keys", "secret": admin})
    container: Json = {
        "name": "router",
        "image": image,
        "command": [
            "kvplane",
            "router",
            "--config",
            CONFIG_PATH,
            "--host",
            "0.0.0.0",
            "--port",
            str(names.ROUTER_PORT),
        ],
        "env": stores.index_env(ipool_name, ipool),
        "ports": [k8s.port(names.PORT_HTTP, names.ROUTER_PORT)],
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
        "volumeMounts": mounts,
        # Not /health: it is 503 until a backend is healthy, which would pull every
        # router out of its Service while the engines load (clients get connection
        # refused instead of the router's explanatory 503), and restart routers
        # during an engine outage. Ready = accepting connections; alive = the event
        # loop still answers HTTP (/metrics is always 200).
        "readinessProbe": k8s.tcp_probe(names.PORT_HTTP, period=5, failures=3),
        "livenessProbe": k8s.http_probe("/metrics", names.PORT_HTTP, period=15, failures=4),
    }
    if not container["env"]:
        del container["env"]
    pod: Json = {
        "serviceAccountName": name,
        "initContainers": [_tokenizer_init(ipool, image)],
        "containers": [container],
        "volumes": volumes,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
    }
    pod_annotations = {
        names.ANNOTATION_GENERATION: generation,
        names.ANNOTATION_CONFIG_HASH: k8s.content_hash(cm["data"][CONFIG_KEY]),
    }
    deployment = k8s.deployment(
        name,
        namespace,
        labels,
        selector,
        labels,
        pod,
        replicas=ipool.router.replicas,
        strategy={"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
        annotations={names.ANNOTATION_GENERATION: generation},
        pod_annotations=pod_annotations,
    )
    svc = k8s.service(
        name,
        namespace,
        labels,
        selector,
        [(names.PORT_HTTP, ipool.router.port, names.PORT_HTTP)],
        service_type=ipool.router.service_type.value,
    )
    return [cm, *discovery_rbac(name, namespace, labels, discovery_role), deployment, svc]


def indexer_objects(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    tiers: Sequence[KVCacheTierSpec],
    generation: str,
    *,
    default_image: str,
    disaggregated: bool = False,
    transfer: KVTransfer | None = None,
    discovery_role: str = names.DISCOVERY_ROLE,
    store_pods: int = 1,
) -> list[Json]:
    """RBAC, Deployment and metrics Service of the indexer (the router's ConfigMap).

    Exactly one indexer writes the Redis index: Recreate, so a rollout never runs
    two (both would ingest every event and fight over incarnations). It needs no
    tokenizer: events carry token ids and the config carries the generation.
    """
    config = router_config(
        ipool_name,
        namespace,
        ipool,
        tiers,
        generation,
        disaggregated=disaggregated,
        transfer=transfer,
        store_pods=store_pods,
    )
    name = names.indexer_name(ipool_name)
    labels = names.object_labels(ipool_name, Role.INDEXER, "kvplane-indexer")
    selector = names.selector_labels(ipool_name, Role.INDEXER)
    container: Json = {
        "name": "indexer",
        "image": ipool.router.image or default_image,
        "command": [
            "kvplane",
            "indexer",
            "--config",
            CONFIG_PATH,
            "--metrics-port",
            str(names.INDEXER_METRICS_PORT),
        ],
        "env": stores.index_env(ipool_name, ipool),
        "ports": [k8s.port(names.PORT_METRICS, names.INDEXER_METRICS_PORT)],
        "resources": {"requests": {"cpu": "500m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}},
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}],
        "readinessProbe": k8s.http_probe("/metrics", names.PORT_METRICS, period=10, failures=3),
        "livenessProbe": k8s.http_probe("/metrics", names.PORT_METRICS, period=15, failures=4),
    }
    if not container["env"]:
        del container["env"]
    pod: Json = {
        "serviceAccountName": name,
        "containers": [container],
        "volumes": [{"name": "config", "configMap": {"name": names.router_name(ipool_name)}}],
        "enableServiceLinks": False,
    }
    pod_annotations = {
        names.ANNOTATION_GENERATION: generation,
        names.ANNOTATION_CONFIG_HASH: k8s.content_hash(router_config_yaml(config)),
    }
    deployment = k8s.deployment(
        name,
        namespace,
        labels,
        selector,
        labels,
        pod,
        replicas=1,
        strategy=k8s.RECREATE,
        annotations={names.ANNOTATION_GENERATION: generation},
        pod_annotations=pod_annotations,
    )
    svc = k8s.service(
        name,
        namespace,
        labels,
        selector,
        [(names.PORT_METRICS, names.INDEXER_METRICS_PORT, names.PORT_METRICS)],
    )
    return [*discovery_rbac(name, namespace, labels, discovery_role), deployment, svc]
