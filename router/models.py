"""Several pools behind one router or picker: the request's ``model`` names the pool.

A pool's LoRA adapters (``model.lora_adapters``) are served models too: a request
naming one goes to the pool whose engines hold it. Each pool keeps its own router
state (``app.Router``: tokenizer, index, pods, load, policy), exactly as a single-pool
router does; the registry only finds it by the served model name. A config file holds
one pool (a ``RouterConfig``) or several (``pools: [...]``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from kvplane.router.config import RouterConfig
from kvplane.router.errors import APIError

if TYPE_CHECKING:
    from kvplane.router.app import Router


def load_pools(path: str | Path) -> list[RouterConfig]:
    """The pools of a config file: ``pools: [<router config>, ...]`` or one config."""
    data: Any = yaml.safe_load(Path(path).read_text())
    return parse_pools(data)


def parse_pools(data: Any) -> list[RouterConfig]:
    if isinstance(data, dict) and set(data) == {"pools"}:
        items = data["pools"]
        if not isinstance(items, list) or not items:
            raise ValueError("'pools' must be a non-empty list of router configs")
        configs = [RouterConfig.model_validate(item) for item in items]
    else:
        configs = [RouterConfig.model_validate(data)]
    names = [n for c in configs for n in (c.model.name, *c.model.lora_adapters)]
    if len(names) != len(set(names)):
        raise ValueError(f"each pool serves its own model and adapters; served twice: {names}")
    pools = [c.pool for c in configs]
    if len(pools) != len(set(pools)):
        raise ValueError(f"pool names must be unique: {pools}")
    return configs


class ModelRegistry:
    """Served model name (a base model or one of its LoRA adapters) -> the pool's router."""

    def __init__(self, routers: Sequence[Router]) -> None:
        self._pools = {r.config.model.name: r for r in routers}
        self._routers = {
            name: r
            for r in routers
            for name in (r.config.model.name, *r.config.model.lora_adapters)
        }

    def __iter__(self) -> Iterator[Router]:
        return iter(self._pools.values())

    def __len__(self) -> int:
        return len(self._pools)

    def names(self) -> list[str]:
        """The pools' base models."""
        return list(self._pools)

    def resolve(self, model: str) -> Router:
        """The pool serving ``model``; a 404 in OpenAI's shape when none does."""
        router = self._routers.get(model)
        if router is None:
            served = ", ".join(f"`{n}`" for n in self._routers)  # adapters included
            raise APIError(
                404,
                f"The model `{model}` does not exist. This router serves {served}.",
                param="model",
                code="model_not_found",
            )
        return router
