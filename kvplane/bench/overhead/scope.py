"""What the router-overhead benchmark compares: the routers, the prompt regimes and sizes."""

from __future__ import annotations

ROUTERS = (
    "kvplane",
    "vllm-router-round_robin",
    "vllm-router-cache_aware",
    "vllm-router-kv_aware",
)
REGIMES = ("fresh", "shared")
DEFAULT_SIZES = (1024, 8192, 32768)
TARGET_TOKENS = 8192
MODEL = "noop"
SECTION = "## Router overhead"
