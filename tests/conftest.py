from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
from support.redis_server import RedisServer, running_redis

# TODO(lead): unconditional once support/vllm_fixtures.py lands
pytest_plugins = (
    ["support.vllm_fixtures"] if importlib.util.find_spec("support.vllm_fixtures") else []
)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server
