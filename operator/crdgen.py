"""Typed models -> CustomResourceDefinition manifests (pure).

Pydantic emits JSON Schema (2020-12) with ``$defs`` and ``anyOf`` for optional
fields; the API server wants a *structural* OpenAPI v3 schema: everything
inline, one type per node, OpenAPI-style ``exclusiveMinimum``. ``structural()``
does that translation and nothing else, so the models stay the only place where
a field, default, range or CEL rule is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvplane.operator import api
from pydantic import BaseModel

_DROP = {"title", "$defs", "discriminator"}
_OPTIONAL = "x-kvplane-optional"  # internal marker, removed before output


@dataclass(frozen=True)
class Kind:
    kind: str
    plural: str
    short_names: list[str]
    spec: type[BaseModel]
    status: type[BaseModel]
    columns: list[dict[str, Any]] = field(default_factory=list)
    scale: bool = False
    rules: list[Any] = field(default_factory=list)  # CEL on the whole object (metadata.name)


def _age() -> dict[str, Any]:
    return {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}


def _ready() -> dict[str, Any]:
    return {
        "name": "Ready",
        "type": "string",
        "jsonPath": '.status.conditions[?(@.type=="Ready")].status',
    }


def _pool_columns() -> list[dict[str, Any]]:
    return [
        {"name": "Pool", "type": "string", "jsonPath": ".spec.poolRef.name"},
        {"name": "Replicas", "type": "integer", "jsonPath": ".status.replicas"},
        {"name": "Ready Replicas", "type": "integer", "jsonPath": ".status.readyReplicas"},
        {"name": "GPUs", "type": "integer", "jsonPath": ".spec.gpusPerReplica", "priority": 1},
        _ready(),
        _age(),
    ]


KINDS: list[Kind] = [
    Kind(
        "InferencePool",
        "inferencepools",
        ["ipool"],
        api.InferencePoolSpec,
        api.InferencePoolStatus,
        [
            {"name": "Model", "type": "string", "jsonPath": ".spec.model.servedName"},
            {"name": "Engine", "type": "string", "jsonPath": ".spec.engine.kind"},
            {"name": "Mode", "type": "string", "jsonPath": ".status.mode"},
            {"name": "Endpoint", "type": "string", "jsonPath": ".status.routerEndpoint"},
            {
                "name": "Generation",
                "type": "string",
                "jsonPath": ".status.generationTag",
                "priority": 1,
            },
            _ready(),
            _age(),
        ],
        rules=[api.POOL_NAME_RULE],
    ),
    Kind(
        "PrefillPool",
        "prefillpools",
        ["ppool"],
        api.EnginePoolSpec,
        api.EnginePoolStatus,
        _pool_columns(),
        scale=True,
    ),
    Kind(
        "DecodePool",
        "decodepools",
        ["dpool"],
        api.EnginePoolSpec,
        api.EnginePoolStatus,
        _pool_columns(),
        scale=True,
    ),
    Kind(
        "KVCacheTier",
        "kvcachetiers",
        ["kvtier"],
        api.KVCacheTierSpec,
        api.KVCacheTierStatus,
        [
            {"name": "Tier", "type": "string", "jsonPath": ".spec.tier"},
            {"name": "Backend", "type": "string", "jsonPath": ".spec.backend"},
            {"name": "Capacity", "type": "string", "jsonPath": ".spec.capacityPerPod"},
            {"name": "GB/s", "type": "number", "jsonPath": ".spec.bandwidthGbps"},
            {"name": "Ready", "type": "boolean", "jsonPath": ".status.ready"},
            {
                "name": "In Use",
                "type": "string",
                "jsonPath": '.status.conditions[?(@.type=="InUse")].status',
            },
            _age(),
        ],
    ),
]


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Inline ``$ref``s, collapse ``Optional`` and translate JSON Schema idioms."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural(merged, defs)
    any_of = schema.get("anyOf")
    if any_of is not None:
        options = [s for s in any_of if s.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"not structural: anyOf {any_of}")
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        # an Optional field: absent means "not set", so it must not be defaulted to {}
        return {**structural({**options[0], **rest}, defs), _OPTIONAL: True}
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP or (key == "default" and value is None):
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = structural(value, defs)
        elif key in ("exclusiveMinimum", "exclusiveMaximum"):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        else:
            out[key] = value
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out["type"] = "object"
    if "enum" in out and "type" not in out:
        out["type"] = "string"
    if out.get("type") == "object" and "properties" in out:
        required = set(out.get("required", []))
        for name, sub in out["properties"].items():
            # objects whose fields all default: default {} so the API server fills them in
            if (
                name not in required
                and not sub.pop(_OPTIONAL, False)
                and sub.get("type") == "object"
                and "properties" in sub
                and not sub.get("required")
                and "default" not in sub
            ):
                sub["default"] = {}
    return out


def _strip_markers(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_markers(v) for k, v in node.items() if k != _OPTIONAL}
    if isinstance(node, list):
        return [_strip_markers(v) for v in node]
    return node


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    out: dict[str, Any] = _strip_markers(
        structural(model.model_json_schema(by_alias=True, mode="validation"))
    )
    return out


def crd(kind: Kind) -> dict[str, Any]:
    version: dict[str, Any] = {
        "name": api.VERSION,
        "served": True,
        "storage": True,
        "subresources": {"status": {}},
        "additionalPrinterColumns": kind.columns,
        "schema": {
            "openAPIV3Schema": {
                "type": "object",
                "description": (kind.spec.__doc__ or kind.kind).strip().splitlines()[0],
                "required": ["spec"],
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"type": "object"},
                    "spec": _schema(kind.spec),
                    "status": _schema(kind.status),
                },
                **({"x-kubernetes-validations": kind.rules} if kind.rules else {}),
            }
        },
    }
    if kind.scale:
        version["subresources"]["scale"] = {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
        }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{kind.plural}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": kind.kind,
                "listKind": f"{kind.kind}List",
                "plural": kind.plural,
                "singular": kind.kind.lower(),
                "shortNames": kind.short_names,
                "categories": ["kvplane"],
            },
            "versions": [version],
        },
    }


def all_crds() -> dict[str, dict[str, Any]]:
    """File name -> manifest, for ``crds/``."""
    return {f"{api.GROUP}_{k.plural}.yaml": crd(k) for k in KINDS}


def render_yaml(manifest: dict[str, Any]) -> str:
    import yaml

    header = "# Generated by `kvplane crds` from operator/api.py. Do not edit.\n"
    return header + yaml.safe_dump(manifest, sort_keys=False, width=100)
