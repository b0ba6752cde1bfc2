"""Labels, resource names, fixed ports and the generation tag of rendered objects.

Everything another component has to agree on lives here: the router discovers engine
pods by these labels and dials these ports, and the operator finds its objects by
these names. Changing a value here is a wire-protocol change.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Final

from kvplane.operator.api import InferencePoolSpec
from kvplane.router import generation as _generation

# --- labels ------------------------------------------------------------------------

LABEL_POOL: Final = "kvplane.io/pool"
LABEL_ROLE: Final = "kvplane.io/role"
LABEL_ENGINE_POOL: Final = "kvplane.io/engine-pool"
LABEL_GENERATION: Final = "kvplane.io/generation"
ANNOTATION_GENERATION: Final = "kvplane.io/generation"
ANNOTATION_CONFIG_HASH: Final = "kvplane.io/config-hash"

APP_NAME: Final = "app.kubernetes.io/name"
APP_INSTANCE: Final = "app.kubernetes.io/instance"
APP_COMPONENT: Final = "app.kubernetes.io/component"
APP_PART_OF: Final = "app.kubernetes.io/part-of"
APP_MANAGED_BY: Final = "app.kubernetes.io/managed-by"

PART_OF: Final = "kvplane"
MANAGED_BY: Final = "kvplane-operator"

GPU_RESOURCE: Final = "nvidia.com/gpu"

# The ClusterRole (pods: get, list, watch) that each router and indexer is bound to in
# its namespace; the chart installs it and lets the operator bind it and nothing else.
DISCOVERY_ROLE: Final = "kvplane-discovery"


class Role(StrEnum):
    """The ``kvplane.io/role`` label: what a pod does for its InferencePool."""

    PREFILL = "prefill"
    DECODE = "decode"
    ROUTER = "router"
    PICKER = "picker"  # the Gateway API endpoint picker (kvplane epp)
    INDEXER = "indexer"
    REDIS = "redis"
    MOONCAKE = "mooncake"


ENGINE_ROLES: Final = (Role.PREFILL, Role.DECODE)

# --- ports -------------------------------------------------------------------------
# Fixed inside the pod: every engine listens on the same ports, so discovery needs
# only the pod IP (RouterConfig.discovery carries the same numbers).

ENGINE_HTTP_PORT: Final = 8000
KV_EVENTS_PORT: Final = 5557
KV_REPLAY_PORT: Final = 5558
NIXL_SIDE_CHANNEL_PORT: Final = 5600
BOOTSTRAP_PORT: Final = 8998  # vLLM MooncakeConnector and SGLang P/D bootstrap server
ROUTER_PORT: Final = 8000
INDEXER_METRICS_PORT: Final = 9090
REDIS_PORT: Final = 6379
MOONCAKE_RPC_PORT: Final = 50051
MOONCAKE_METADATA_PORT: Final = 8080
MOONCAKE_METRICS_PORT: Final = 9003

# Container port names (IANA_SVC_NAME: at most 15 characters, unique per pod).
PORT_HTTP: Final = "http"
PORT_KV_EVENTS: Final = "kv-events"
PORT_KV_REPLAY: Final = "kv-replay"
PORT_NIXL: Final = "nixl"
PORT_BOOTSTRAP: Final = "bootstrap"
PORT_METRICS: Final = "metrics"
PORT_REDIS: Final = "redis"
PORT_RPC: Final = "rpc"
PORT_METADATA: Final = "metadata"

# --- names -------------------------------------------------------------------------

MAX_NAME: Final = 63  # Service names and label values are DNS labels


def fit(name: str, limit: int = MAX_NAME) -> str:
    """``name``, or a truncated form with a hash suffix so distinct names stay distinct."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-')}-{digest}"


def prefill_name(pool: str) -> str:
    return fit(f"{pool}-prefill")


def decode_name(pool: str, decode_pool: str) -> str:
    return fit(f"{pool}-decode-{decode_pool}")


def engine_name(pool: str, role: Role, engine_pool: str) -> str:
    """One PrefillPool per InferencePool, so its name needs no pool suffix."""
    return prefill_name(pool) if role is Role.PREFILL else decode_name(pool, engine_pool)


def router_name(pool: str) -> str:
    return fit(f"{pool}-router")


def picker_name(pool: str) -> str:
    return fit(f"{pool}-epp")


def indexer_name(pool: str) -> str:
    return fit(f"{pool}-indexer")


def redis_name(pool: str) -> str:
    return fit(f"{pool}-redis")


def mooncake_name(pool: str) -> str:
    return fit(f"{pool}-mooncake")


def engines_policy_name(pool: str) -> str:
    return fit(f"{pool}-engines")


def lmcache_config_name(pool: str) -> str:
    return fit(f"{pool}-lmcache")


def service_host(name: str, namespace: str) -> str:
    """Fully qualified, so the address also works from pods in other namespaces."""
    return f"{name}.{namespace}.svc"


# --- label sets --------------------------------------------------------------------


def selector_labels(pool: str, role: Role, engine_pool: str | None = None) -> dict[str, str]:
    """Immutable Deployment selector: never the generation, so a new model identity
    rolls the same Deployment instead of orphaning its pods."""
    labels = {LABEL_POOL: fit(pool), LABEL_ROLE: role.value}
    if engine_pool is not None:
        # several DecodePools share pool and role; their selectors must not overlap
        labels[LABEL_ENGINE_POOL] = fit(engine_pool)
    return labels


def common_labels(pool: str, component: str, app: str) -> dict[str, str]:
    """The app.kubernetes.io set every object carries (kubectl, dashboards, cost tools)."""
    return {
        APP_NAME: app,
        APP_INSTANCE: fit(pool),
        APP_COMPONENT: component,
        APP_PART_OF: PART_OF,
        APP_MANAGED_BY: MANAGED_BY,
    }


def object_labels(
    pool: str,
    role: Role,
    app: str,
    engine_pool: str | None = None,
    generation: str | None = None,
) -> dict[str, str]:
    labels = {**common_labels(pool, role.value, app), **selector_labels(pool, role, engine_pool)}
    if generation is not None:
        labels[LABEL_GENERATION] = generation
    return labels


# --- generation --------------------------------------------------------------------

HASH_ALGO: Final = "sha256_cbor"  # vLLM --prefix-caching-hash-algo: cross-language, seeded


def generation_tag(spec: InferencePoolSpec, namespace: str, pool: str) -> str:
    """The pool and its model identity as a 12-hex tag (a valid label value).

    Wraps the router's tag (served name, revision, tokenizer, block size, pool) and
    folds into its tokenizer slot what else changes the engines' KV bytes or block
    hashes: the weights' source, the engine kind, the hash algorithm and the hash
    seed. The pool is ``namespace/name``: two pools of one model never share index
    keys, so deleting one never removes the other's residency. The router gets this
    tag in its config, so it never needs the weights to agree.
    """
    identity = json.dumps(
        {
            "source": spec.model.source,
            "tokenizer": spec.model.tokenizer or spec.model.source,
            "engine": spec.engine.kind.value,
            "hash_algo": HASH_ALGO,
            "hash_seed": spec.engine.hash_seed,
        },
        sort_keys=True,
    )
    return _generation.generation_tag(
        spec.model.served_name,
        spec.model.revision,
        identity,
        spec.engine.block_size,
        pool=f"{namespace}/{pool}",
    )


def python_hash_seed(seed: str) -> str:
    """A PYTHONHASHSEED value CPython accepts for the spec's ``hashSeed``.

    CPython refuses to start unless PYTHONHASHSEED is ``random`` or an integer in
    [0, 2**32-1] (the API default ``kvplane`` would crash every engine), while vLLM
    only needs every pod to see the same string. So integers pass through and any
    other text maps to a stable integer derived from it.
    """
    if seed.isdigit() and int(seed) <= 0xFFFFFFFF:
        return str(int(seed))
    return str(int.from_bytes(hashlib.sha256(seed.encode()).digest()[:4], "big"))


def revision_hash_seed(seed: str, revision: str) -> str:
    """The engines' PYTHONHASHSEED: the spec's ``hashSeed`` with the model revision folded
    in, so that block hashes (and the store keys made of them) differ per revision."""
    return python_hash_seed(f"{seed}@{revision}")
