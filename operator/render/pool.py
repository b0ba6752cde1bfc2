"""Every object of one InferencePool, in apply order (config and stores first).

The controller's whole render step in one pure call, so what it applies is exactly
what the golden tests pin.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvplane.operator.api import EnginePoolSpec, InferencePoolSpec, KVCacheTierSpec
from kvplane.operator.render import names, stores
from kvplane.operator.render.engine import (
    engine_autoscaler,
    engine_config_maps,
    engine_deployment,
    pd_transfer,
)
from kvplane.operator.render.gateway import gateway_objects
from kvplane.operator.render.names import Role
from kvplane.operator.render.network import network_policies
from kvplane.operator.render.router import indexer_objects, router_objects
from kvplane.operator.render.security import harden

from kvplane.types import Json


def inference_pool_objects(
    ipool_name: str,
    namespace: str,
    ipool: InferencePoolSpec,
    *,
    prefill: tuple[str, EnginePoolSpec] | None,
    decodes: Mapping[str, EnginePoolSpec],
    tiers: Sequence[KVCacheTierSpec],
    default_image: str,
    generation: str | None = None,
    discovery_role: str = names.DISCOVERY_ROLE,
) -> list[Json]:
    """``prefill``: (PrefillPool name, spec) or None (aggregated); ``decodes``: the
    DecodePools by name; ``generation`` defaults to :func:`names.generation_tag`;
    ``discovery_role`` is the ClusterRole routers and indexers are bound to."""
    generation = generation or names.generation_tag(ipool, namespace, ipool_name)
    transfer = pd_transfer(prefill[1] if prefill else None, list(decodes.values()))
    disaggregated = prefill is not None
    objects: list[Json] = []
    # policies before the pods they guard: no engine ever listens unprotected
    objects += network_policies(ipool_name, namespace, ipool, transfer)
    objects += engine_config_maps(ipool_name, namespace, ipool, tiers)
    objects += stores.redis_objects(ipool_name, namespace, ipool)
    objects += stores.mooncake_objects(ipool_name, namespace, ipool, tiers, generation)
    engines = [(prefill[0], Role.PREFILL, prefill[1])] if prefill is not None else []
    engines += [(name, Role.DECODE, spec) for name, spec in sorted(decodes.items())]
    for name, role, spec in engines:
        objects.append(
            engine_deployment(
                ipool_name,
                namespace,
                ipool,
                name,
                role,
                spec,
                tiers,
                generation,
                transfer=transfer,
            )
        )
        hpa = engine_autoscaler(ipool_name, namespace, ipool, name, role, spec)
        if hpa is not None:
            objects.append(hpa)
    # the most engine pods at once: each adds its capacityPerPod to a remote store
    store_pods = sum(
        spec.autoscaling.max_replicas if spec.autoscaling else spec.desired_replicas()
        for _, _, spec in engines
    )
    for render in (router_objects, indexer_objects):
        objects += render(
            ipool_name,
            namespace,
            ipool,
            tiers,
            generation,
            default_image=default_image,
            disaggregated=disaggregated,
            transfer=transfer,
            discovery_role=discovery_role,
            store_pods=store_pods,
        )
    objects += gateway_objects(ipool_name, namespace, ipool, generation, default_image)
    return [harden(o) for o in objects]
