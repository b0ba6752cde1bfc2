"""NVIDIA Dynamo's KV router (PyPI ``ai-dynamo`` 1.6.1) as a peer of ``kvplane bench routing``.

Two ways to run it, one per fleet:

- on kvplane's simulated engines (``dynamo``, ``dynamo-<settings>``): Dynamo's
  runtime-free selection service (``python -m dynamo.select_service``, in the Dynamo
  virtualenv of ``scripts/setup-dynamo.sh``) with every engine registered with its
  real ``max_num_batched_tokens`` and KV block count, its vLLM ZMQ KV-event and replay
  endpoints; in front, :mod:`kvplane.bench.peers.dynamo_proxy` runs the frontend's
  decision loop (tokenize, ``select_and_reserve``, forward, ``prefill_complete`` at the
  first token, free at the end);
- on Dynamo's own simulated engines (``dynamo-frontend``, ``dynamo-frontend-<settings>``,
  fleet ``dynamo-mocker``): the real ``python -m dynamo.frontend --router-mode kv``, its
  tokenizer included (:mod:`kvplane.bench.peers.dynamo_mocker`).

Settings are Dynamo's documented router knobs (docs/components/router/
router-configuration.md, "Tuning Guidelines"), given as the ``DYN_ROUTER_*``
environment variables both processes read at start; a router name lists presets after
the base name, e.g. ``dynamo-credit2-predict5``. Knobs in seconds are Dynamo's wall
seconds, so they are multiplied by the fleet's time scale (simulated seconds run that
many times slower than real ones).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from kvplane.bench.procs import HOST, Proc, spawn
from kvplane.local.ports import free_port

DYNAMO_VERSION: Final = "1.6.1"
MODEL_ROUTING_NAME: Final = "sim"  # the model name workers are registered under
SETUP_SCRIPT: Final = Path(__file__).resolve().parents[3] / "scripts" / "setup-dynamo.sh"

# preset -> (environment variable, value, True if the value is in wall seconds)
PRESETS: Final[dict[str, tuple[str, str, bool]]] = {
    # "Higher values steer requests toward workers with better cache overlap and
    # reduce TTFT" (values above 1 allowed, "use them deliberately")
    "credit2": ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT", "2.0", False),
    # "helps prevent busy, cache-rich workers from repeatedly winning"
    "decay1": ("DYN_ROUTER_KV_OVERLAP_SCORE_CREDIT_DECAY", "1.0", False),
    # "Use --router-predicted-ttl-secs 5 when the workload fires bursts of sibling
    # requests with shared prefixes"
    "predict5": ("DYN_ROUTER_PREDICTED_TTL_SECS", "5", True),
    # prompt-side load (after the overlap credits) counts 2 or 4 times against decode blocks
    "prefill2": ("DYN_ROUTER_PREFILL_LOAD_SCALE", "2.0", False),
    "prefill4": ("DYN_ROUTER_PREFILL_LOAD_SCALE", "4.0", False),
    # softmax sampling over normalised costs instead of the deterministic minimum
    "temp05": ("DYN_ROUTER_TEMPERATURE", "0.5", False),
    # hold requests while every worker has more than 1 x max_num_batched_tokens of
    # prefill in flight ("fcfs ... optimizes tail TTFT")
    "queue1": ("DYN_ROUTER_QUEUE_THRESHOLD", "1.0", False),
}
SELECTOR_PREFIX: Final = "dynamo"
FRONTEND_PREFIX: Final = "dynamo-frontend"


@dataclass(frozen=True, slots=True)
class DynamoSetting:
    """A router label and the ``DYN_ROUTER_*`` environment it stands for."""

    label: str
    presets: tuple[str, ...]

    @classmethod
    def parse(cls, label: str, base: str) -> DynamoSetting:
        rest = label.removeprefix(base)
        names = tuple(p for p in rest.split("-") if p)
        unknown = [p for p in names if p not in PRESETS]
        if (rest and not rest.startswith("-")) or unknown:
            raise ValueError(
                f"unknown Dynamo setting in {label!r}: {unknown or rest} "
                f"(presets: {', '.join(PRESETS)})"
            )
        return cls(label, names)

    def env(self, time_scale: float) -> dict[str, str]:
        out: dict[str, str] = {}
        for p in self.presets:
            var, value, seconds = PRESETS[p]
            out[var] = f"{float(value) * time_scale:g}" if seconds else value
        return out

    def describe(self) -> str:
        if not self.presets:
            return "defaults"
        return ", ".join(f"{PRESETS[p][0]}={PRESETS[p][1]}" for p in self.presets)


def is_selector_peer(name: str) -> bool:
    """``dynamo`` or ``dynamo-<presets>`` (kvplane's engines through the selection service)."""
    return (name == SELECTOR_PREFIX or name.startswith(SELECTOR_PREFIX + "-")) and not (
        is_frontend_peer(name)
    )


def is_frontend_peer(name: str) -> bool:
    """``dynamo-frontend`` or ``dynamo-frontend-<presets>`` (Dynamo end to end)."""
    return name == FRONTEND_PREFIX or name.startswith(FRONTEND_PREFIX + "-")


# --------------------------------------------------------------------------- venv


def cache_dir() -> Path:
    return Path(os.environ.get("KVPLANE_CACHE") or Path.home() / ".cache" / "kvplane")


def dynamo_python() -> Path:
    return cache_dir() / "dynamo-venv" / "bin" / "python"


def ensure_dynamo(timeout: float = 1800.0) -> Path:
    """Run ``scripts/setup-dynamo.sh`` (instant once done) and return the venv's python."""
    subprocess.run(
        ["bash", str(SETUP_SCRIPT)], check=True, timeout=timeout, stdin=subprocess.DEVNULL
    )
    return dynamo_python()


def dynamo_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Quiet logs (Dynamo logs every selection at INFO) plus ``extra``."""
    return {"DYN_LOG": "warn", "NO_COLOR": "1", **(extra or {})}


# --------------------------------------------------------------------------- selector


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """An engine as Dynamo's selection service registers it."""

    worker_id: int
    name: str
    url: str
    kv_events: str
    replay: str
    block_size: int
    max_num_batched_tokens: int
    total_kv_blocks: int

    def record(self, model: str = MODEL_ROUTING_NAME) -> dict[str, object]:
        return {
            "worker_id": self.worker_id,
            "model_name": model,
            "endpoint": self.url,
            "block_size": self.block_size,
            "kv_events_endpoints": {"0": self.kv_events},
            "replay_endpoint": self.replay,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "total_kv_blocks": self.total_kv_blocks,
        }


@dataclass
class RunningPeer:
    """The processes of a peer that serves one OpenAI endpoint on ``port``."""

    name: str
    port: int
    procs: list[Proc]
    notes: dict[str, object] = field(default_factory=dict)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()

    def alive(self) -> bool:
        return all(p.alive() for p in self.procs)

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in self.procs)

    @property
    def pids(self) -> list[int]:
        return [p.popen.pid for p in self.procs]


def _http(
    method: str, url: str, body: object | None = None, timeout: float = 10.0
) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("content-type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return int(r.status), r.read()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read()
    except OSError:
        return 0, b""


def start_selector(
    setting: DynamoSetting,
    workers: Sequence[WorkerSpec],
    rundir: Path,
    time_scale: float,
    timeout: float = 60.0,
) -> tuple[Proc, str]:
    """``python -m dynamo.select_service`` with ``workers`` registered; its base URL."""
    port = free_port()
    argv = [str(ensure_dynamo()), "-m", "dynamo.select_service", "--port", str(port)]
    proc = spawn(f"{setting.label}-selector", argv, rundir, dynamo_env(setting.env(time_scale)))
    base = f"http://{HOST}:{port}"
    deadline = time.monotonic() + timeout
    while _http("GET", base + "/health")[0] != 200:
        if not proc.alive() or time.monotonic() > deadline:
            proc.stop()
            raise RuntimeError(f"dynamo.select_service did not start:\n{proc.tail()}")
        time.sleep(0.2)
    for w in workers:
        status, body = _http("POST", base + "/workers", w.record())
        if status not in (200, 201):
            proc.stop()
            raise RuntimeError(f"registering {w.name} with Dynamo failed: {status} {body[:300]!r}")
    return proc, base


def start_selector_peer(
    name: str,
    workers: Sequence[WorkerSpec],
    tokenizer: Path,
    rundir: Path,
    time_scale: float,
    python: str,
    token_table: Path | None = None,
) -> RunningPeer:
    """The selection service and the proxy in front of it (``python`` runs the proxy;
    ``token_table``: the ids of the prompts the run will send, see dynamo_proxy)."""
    setting = DynamoSetting.parse(name, SELECTOR_PREFIX)
    selector, base = start_selector(setting, workers, rundir, time_scale)
    port = free_port()
    cfg = {
        "selector": base,
        "tokenizer": str(tokenizer),
        "model": MODEL_ROUTING_NAME,
        "host": HOST,
        "port": port,
        "engines": [{"worker_id": w.worker_id, "name": w.name, "url": w.url} for w in workers],
        **({"token_table": str(token_table)} if token_table else {}),
    }
    cfg_path = rundir / f"{name}-proxy.json"
    cfg_path.write_text(json.dumps(cfg, indent=1))
    argv = [python, "-m", "kvplane.bench.peers.dynamo_proxy", "--config", str(cfg_path)]
    proxy = spawn(f"{name}-proxy", argv, rundir)
    return RunningPeer(name, port, [selector, proxy], {"dynamo settings": setting.describe()})
