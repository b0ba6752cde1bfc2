"""A bounded soak (``kvplane bench soak``'s machinery, a few minutes on loopback): a
simulated fleet with small KV caches (blocks are evicted, the index turns over), the
router as ``kvplane router`` runs it, open-loop traffic that keeps adding new prompts.
Once warm, the router's RSS and file descriptors and the Redis index's keys and memory
must stay flat, no request may fail, and the router's log stays quiet."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from kvplane.bench import soak

WINDOW_S = 10.0
WARMUP = 3
WINDOWS = 8
RATE = 10.0
CLIENT_CONNECTIONS = 64  # the client's keep-alive pool: the router's FDs vary by as much


def run(tmp_path: Path, index: str) -> soak.SoakRun:
    args = argparse.Namespace(
        minutes=WINDOW_S * WINDOWS / 60 + 0.05,
        window_s=WINDOW_S,
        rate=RATE,
        engines=2,
        gpu_blocks=256,
        tokenizer_cache_tokens=50_000,  # full within the warm-up
        tokenizer=None,
        seed=7,
        quiet=True,
    )
    result = soak.soak_one(args, tmp_path, index)
    assert len(result.windows) >= WINDOWS
    return result


def assert_flat(result: soak.SoakRun) -> None:
    warm, last = result.windows[WARMUP - 1], result.windows[-1]
    assert sum(w.errors for w in result.windows) == 0, result.windows
    assert sum(w.requests for w in result.windows) > RATE * WINDOW_S * WINDOWS / 2
    assert last.rss_mb <= warm.rss_mb * 1.05 + 8, [w.rss_mb for w in result.windows]
    assert last.fds <= warm.fds + CLIENT_CONNECTIONS, [w.fds for w in result.windows]
    # startup lines only: no line per scrape or per request at the default level
    assert result.router_log_lines < 40


def test_soak_memory_index(tmp_path: Path) -> None:
    assert_flat(run(tmp_path, "memory"))


@pytest.mark.redis
def test_soak_redis_index(tmp_path: Path) -> None:
    result = run(tmp_path, "redis")
    assert_flat(result)
    warm, last = result.windows[WARMUP - 1], result.windows[-1]
    assert warm.index_keys is not None and last.index_keys is not None
    assert last.index_keys <= warm.index_keys * 1.05 + 32, [w.index_keys for w in result.windows]
    assert warm.index_mb is not None and last.index_mb is not None
    assert last.index_mb <= warm.index_mb * 1.1 + 0.25, [w.index_mb for w in result.windows]
