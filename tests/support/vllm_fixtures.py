"""pytest plugin with real vLLM engines (register via ``pytest_plugins``).

Fixtures:

* ``vllm_venv`` (session): runs ``scripts/setup-vllm.sh`` (a few ms once done;
  about 2 minutes and ~6 GiB of downloads on a fresh machine); the venv path.
* ``tiny_model`` (session): the tiny random-weight Llama with the DeepSeek tokenizer
  (built once into ``$KVPLANE_CACHE/models``, ~6 s); its directory.
* ``vllm_engines`` (session): two engines ``e0`` and ``e1`` started together (~25 s
  on 2 cores) and stopped at the end of the session. They are shared: tests must
  not kill or reconfigure them, and should use prompts of their own (a unique
  prefix) when they count cache hits or events.
* ``vllm_engine_factory`` (function): ``factory(names, **start_engines_kwargs)``
  starts private engines (e.g. to SIGKILL one, or with a tiny KV cache), stopped at
  the end of the test.

Engine logs go to pytest's temporary directory (``vllm-logs*``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from kvplane.local.tiny_model import ensure_tiny_model, ensure_vllm_venv
from kvplane.local.vllm_engines import VllmEngine, start_engines, stop_engines

EngineFactory = Callable[..., list[VllmEngine]]


@pytest.fixture(scope="session")
def vllm_venv() -> Path:
    return ensure_vllm_venv()


@pytest.fixture(scope="session")
def tiny_model(vllm_venv: Path) -> Path:
    return ensure_tiny_model(python=vllm_venv / "bin" / "python")


@pytest.fixture(scope="session")
def vllm_engines(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmEngine]]:
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    engines = start_engines(["e0", "e1"], model_dir=tiny_model, log_dir=log_dir)
    try:
        yield engines
    finally:
        stop_engines(engines)


@pytest.fixture
def vllm_engine_factory(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineFactory]:
    started: list[VllmEngine] = []

    def factory(names: Sequence[str] | int = 1, **kwargs: object) -> list[VllmEngine]:
        kwargs.setdefault("model_dir", tiny_model)
        kwargs.setdefault("log_dir", tmp_path_factory.mktemp("vllm-logs-private"))
        engines = start_engines(names, **kwargs)  # type: ignore[arg-type]
        started.extend(engines)
        return engines

    try:
        yield factory
    finally:
        stop_engines(started)
