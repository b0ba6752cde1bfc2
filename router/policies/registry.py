"""Policies by name. A policy module registers its class with ``@register``; every
module of this package is imported on first use, so adding a policy is adding its
module (and its test)."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping
from typing import Any, Protocol

from kvplane.router.cost import CostModel
from kvplane.router.policies.base import Options, Policy, PolicyContext


class PolicyClass(Protocol):
    name: str
    options: type[Options]

    def __call__(self, ctx: PolicyContext) -> Policy: ...


_REGISTRY: dict[str, PolicyClass] = {}
_INFRA = {"base", "registry"}
_loaded: list[bool] = []  # set once every module of the package is imported


def register(cls: Any) -> Any:
    """Class decorator: the class's ``name`` becomes a policy name."""
    name = cls.name
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"policy {name!r} registered twice")
    _REGISTRY[name] = cls
    return cls


def _load() -> Mapping[str, PolicyClass]:
    if not _loaded:
        package = importlib.import_module("kvplane.router.policies")
        for mod in pkgutil.iter_modules(package.__path__):
            if mod.name not in _INFRA:
                importlib.import_module(f"kvplane.router.policies.{mod.name}")
        _loaded.append(True)
    return _REGISTRY


def policy_names() -> list[str]:
    """Every registered policy, ``cost`` (the default) first."""
    names = sorted(_load())
    return sorted(names, key=lambda n: n != "cost")


def options_model(name: str) -> type[Options]:
    """The policy's options model; raises ValueError for an unknown name."""
    return _get(name).options


def check_policy(name: str) -> str:
    """``name`` if it is a policy (for config validators), else ValueError."""
    _get(name)
    return name


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """The policy's options are valid, else pydantic's ValidationError."""
    _get(name).options.model_validate(dict(options))


def make_policy(name: str, cost: CostModel, options: Mapping[str, Any] | None = None) -> Policy:
    cls = _get(name)
    return cls(PolicyContext(cost, cls.options.model_validate(dict(options or {}))))


def _get(name: str) -> PolicyClass:
    registry = _load()
    try:
        return registry[name]
    except KeyError:
        known = ", ".join(policy_names())
        raise ValueError(f"unknown policy {name!r} (known: {known})") from None


def labelled() -> dict[str, str]:
    """kvplane's policies under the labels the benchmarks and the simulator's
    discrete-event mode run them as: ``kvplane`` (the cost policy), ``kvplane-<name>``."""
    return {("kvplane" if n == "cost" else f"kvplane-{n}"): n for n in policy_names()}
