"""The CRDs in crds/ are generated from operator/api.py and must not drift from it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from kvplane.operator import api
from kvplane.operator.crdgen import all_crds, render_yaml

CRDS = Path(__file__).resolve().parents[1] / "crds"


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_committed_crds_are_current(name: str) -> None:
    path = CRDS / name
    assert path.is_file(), f"{path} missing: run `kvplane crds`"
    assert path.read_text() == render_yaml(all_crds()[name]), f"{path} stale: run `kvplane crds`"


def _walk(node: object, path: str = "") -> list[str]:
    """Every place a structural schema forbids: refs, anyOf/oneOf, untyped nodes."""
    bad: list[str] = []
    if isinstance(node, dict):
        for key in ("$ref", "anyOf", "oneOf", "allOf", "$defs"):
            if key in node:
                bad.append(f"{path}/{key}")
        if "properties" in node and node.get("type") != "object":
            bad.append(f"{path} has properties but is not an object")
        for key, value in node.items():
            bad += _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            bad += _walk(value, f"{path}[{i}]")
    return bad


@pytest.mark.parametrize("name", sorted(all_crds()))
def test_schemas_are_structural(name: str) -> None:
    crd = yaml.safe_load((CRDS / name).read_text())
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    assert "kvplane" in crd["spec"]["names"]["categories"]
    assert _walk(version["schema"]["openAPIV3Schema"]) == []


def test_models_round_trip_camel_case() -> None:
    spec = api.InferencePoolSpec.model_validate(
        {"model": {"servedName": "m", "source": "org/m", "kvBytesPerToken": 1024}}
    )
    assert spec.engine.block_size == 16 and spec.router.replicas == 2
    assert spec.model_dump(by_alias=True, exclude_none=True)["model"]["servedName"] == "m"
    shape = api.ModelShape(layers=32, kv_heads=8, head_dim=128)
    assert shape.kv_bytes_per_token() == 131072  # Llama-3.1-8B, bf16
