from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.redis_server import RedisServer, running_redis

pytest_plugins = ["support.vllm_fixtures", "support.k8s_fixtures"]


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with running_redis() as server:
        yield server
