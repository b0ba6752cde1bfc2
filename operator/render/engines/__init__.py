"""Engine adapters by engine kind: one module per engine (``vllm``, ``sglang``), each
owning its command, arguments, environment, ports, metric names and P/D protocol
(``base.EngineAdapter``)."""

from __future__ import annotations

from typing import Final

from kvplane.operator.api import Engine
from kvplane.operator.render.engines.base import ConfigMount, EngineAdapter, EnginePod
from kvplane.operator.render.engines.sglang import SglangAdapter
from kvplane.operator.render.engines.vllm import VllmAdapter

ADAPTERS: Final[dict[Engine, EngineAdapter]] = {a.kind: a for a in (VllmAdapter(), SglangAdapter())}


def adapter(kind: Engine) -> EngineAdapter:
    return ADAPTERS[kind]


__all__ = ["ADAPTERS", "ConfigMount", "EngineAdapter", "EnginePod", "adapter"]
