"""Everything an InferencePool should consist of, from its inputs (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplane.operator import api
from kvplane.operator.render import names
from kvplane.operator.render.names import Role
from kvplane.operator.render.pool import inference_pool_objects
from kvplane.operator.settings import OperatorSettings


@dataclass(frozen=True)
class EnginePool:
    name: str
    role: str  # "prefill" | "decode"
    spec: api.EnginePoolSpec


@dataclass(frozen=True)
class Rendered:
    objects: list[dict[str, Any]]
    generation: str
    router_endpoint: str
    engine_deployments: dict[str, str]  # engine pool name -> Deployment name


def desired_objects(
    name: str,
    namespace: str,
    spec: api.InferencePoolSpec,
    pools: list[EnginePool],
    tiers: list[api.KVCacheTierSpec],
    settings: OperatorSettings,
) -> Rendered:
    prefill = next(((p.name, p.spec) for p in pools if p.role == "prefill"), None)
    decodes = {p.name: p.spec for p in pools if p.role == "decode"}
    generation = names.generation_tag(spec, namespace, name)
    objects = inference_pool_objects(
        name,
        namespace,
        spec,
        prefill=prefill,
        decodes=decodes,
        tiers=tiers,
        default_image=settings.image,
        generation=generation,
        discovery_role=settings.discovery_role,
    )
    deployments = {p.name: names.engine_name(name, Role(p.role), p.name) for p in pools}
    endpoint = f"http://{names.service_host(names.router_name(name), namespace)}:{spec.router.port}"
    return Rendered(objects, generation, endpoint, deployments)
