"""LoRA adapters in the simulated engine, as vLLM serves them.

vLLM (``--enable-lora --lora-modules name=path --max-loras N``) folds
``("lora", name, path)`` into the extra keys of every block hash of an adapter request
(``vllm/v1/core/kv_cache_utils.py``), publishes those blocks with ``lora_id``,
``lora_name`` and the adapter's name as each block's ``extra_keys`` entry, lets at most
``max_loras`` adapters into one batch (``vllm/v1/core/sched/scheduler.py``: a waiting
request of another adapter is skipped) and reports ``vllm:lora_requests_info``. The
simulator also charges ``load_ms`` when an adapter enters a GPU slot (an LRU of
``max_loras`` slots).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LoraRequest:
    """One adapter, as vLLM's ``LoRARequest`` (ids count from 1 in load order)."""

    name: str
    lora_id: int
    path: str

    def extra_keys(self) -> tuple[Any, ...]:
        """The adapter's part of every block hash's extra keys (vLLM's tagged form)."""
        return (("lora", self.name, self.path),)


@dataclass(frozen=True, slots=True)
class LoraConfig:
    adapters: tuple[LoraRequest, ...] = ()
    max_loras: int = 1
    load_ms: float = 5.0  # an adapter entering a GPU slot (simulated, not vLLM's figure)

    def by_name(self) -> dict[str, LoraRequest]:
        return {a.name: a for a in self.adapters}


def adapters_of(modules: Iterable[str]) -> tuple[LoraRequest, ...]:
    """``--lora-modules`` values (``name=path``) as requests, ids from 1 in order."""
    out: list[LoraRequest] = []
    for i, item in enumerate(modules, start=1):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path, not {item!r}")
        out.append(LoraRequest(name, i, path))
    return tuple(out)


def info_labels(max_loras: int, running: Sequence[str], waiting: Sequence[str]) -> dict[str, str]:
    """The labels of vLLM's ``vllm:lora_requests_info`` (names comma-joined)."""
    return {
        "max_lora": str(max_loras),
        "running_lora_adapters": ",".join(running),
        "waiting_lora_adapters": ",".join(waiting),
    }
