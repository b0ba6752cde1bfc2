"""A fleet of Dynamo's own simulated engines (``python -m dynamo.mocker``) for
``kvplane bench routing --fleet dynamo-mocker``.

The mocker is Dynamo's vLLM-scheduler simulator with its own timing model (AISimulate's
built-in polynomials); kvplane's results on it do not rest on kvplane's simulator. Every
mocker is its own process and publishes vLLM-format ZMQ KV events (with a replay
socket). All mockers are one worker set (one Dynamo namespace); each side reaches them
through one real ``dynamo.frontend`` (its Rust tokenizer and TCP request plane
included), so both sides pay the same hop:

- for Dynamo: ``dynamo.frontend --router-mode kv``, Dynamo's KV router, which names the
  worker it chose when asked (``nvext.extra_fields: ["worker_id"]``);
- for kvplane: ``dynamo.frontend --router-mode direct``, which sends each request to
  the worker its ``x-worker-instance-id`` header names. kvplane's router is told of
  every mocker as a backend at that one url with its own header
  (``Backend.headers``), and its indexer reads the mockers' ZMQ events.

A mocker's instance id is found from its request-plane port (``DYN_TCP_RPC_PORT``, set
per mocker), which the frontend's ``/health`` lists with the id.

Discovery is a file store private to the run (``DYN_FILE_KV``), with ZMQ event and TCP
request planes: no etcd, no NATS.

The mockers' clocks run ``time_scale`` times slower than their modeled GPU
(``--speedup-ratio 1/time_scale``), as kvplane's simulator does, so that a 2-core
machine keeps up. Their KV capacity, block size and scheduler budget are the ones the
benchmark's engine profile gives kvplane's simulator.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import httpx
import psutil

from kvplane.bench.floor import GridModel
from kvplane.bench.peers.dynamo import (
    FRONTEND_PREFIX,
    DynamoSetting,
    RunningPeer,
    _http,
    dynamo_env,
    ensure_dynamo,
)
from kvplane.bench.procs import HOST, Proc, spawn
from kvplane.bench.routers import EngineEndpoint
from kvplane.local.ports import free_ports

# Llama-3.1-8B's public config (the mocker reads the architecture; the vocabulary is the
# tokenizer's, so that generated ids decode)
LLAMA_8B_CONFIG: Final[dict[str, Any]] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
TOKENIZER_FILES: Final = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class MockerSpec:
    """What every mocker of the fleet is told (the benchmark's engine profile)."""

    model: str
    tokenizer: Path
    block_size: int
    kv_blocks: int
    max_num_batched_tokens: int
    max_model_len: int
    kv_bytes_per_token: int
    time_scale: float
    host_blocks: int = 0  # a CPU tier (Dynamo's native host offload), 0 for none
    host_gbps: float = 50.0


def model_dir(spec: MockerSpec, dest: Path) -> Path:
    """A model directory the mocker and the frontend accept: the benchmark's tokenizer,
    a chat template (the frontend requires one) and Llama-3.1-8B's config."""
    from kvplane.local.tiny_model import CHAT_TEMPLATE

    dest.mkdir(parents=True, exist_ok=True)
    tok_cfg = json.loads((spec.tokenizer / "tokenizer_config.json").read_text())
    tok_cfg.setdefault("chat_template", CHAT_TEMPLATE)
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    (dest / "tokenizer.json").write_bytes((spec.tokenizer / "tokenizer.json").read_bytes())
    tok = json.loads((dest / "tokenizer.json").read_text())
    vocab = len(tok["model"]["vocab"]) + len(tok.get("added_tokens", []))
    (dest / "config.json").write_text(json.dumps({**LLAMA_8B_CONFIG, "vocab_size": vocab}))
    return dest


def mocker_argv(
    spec: MockerSpec, model_path: Path, namespace: str, kv: int, replay: int
) -> list[str]:
    argv = [str(ensure_dynamo()), "-m", "dynamo.mocker", "--model-path", str(model_path)]
    argv += ["--model-name", spec.model, "--endpoint", f"dyn://{namespace}.backend.generate"]
    argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    argv += ["--block-size", str(spec.block_size)]
    argv += ["--num-gpu-blocks-override", str(spec.kv_blocks)]
    argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    argv += ["--max-model-len", str(spec.max_model_len)]
    argv += ["--kv-bytes-per-token", str(spec.kv_bytes_per_token)]
    argv += ["--speedup-ratio", f"{1.0 / spec.time_scale:g}"]
    argv += ["--zmq-kv-events-ports", str(kv), "--zmq-replay-ports", str(replay)]
    if spec.host_blocks:
        argv += ["--num-host-blocks", str(spec.host_blocks)]
        argv += ["--host-offload-h2d-bandwidth-gbps", f"{spec.host_gbps:g}"]
        argv += ["--host-offload-d2h-bandwidth-gbps", f"{spec.host_gbps:g}"]
    return argv


def frontend_argv(port: int, namespace: str | None, router_mode: str) -> list[str]:
    argv = [str(ensure_dynamo()), "-m", "dynamo.frontend", "--router-mode", router_mode]
    argv += ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    argv += ["--http-host", HOST, "--http-port", str(port)]
    if namespace is not None:
        argv += ["--namespace", namespace]
    return argv


def instance_ids(port: int) -> dict[int, int]:
    """Request-plane port -> instance id of every ``generate`` endpoint a frontend sees."""
    status, body = _http("GET", f"http://{HOST}:{port}/health")
    if status != 200:
        return {}
    out: dict[int, int] = {}
    for inst in json.loads(body).get("instances", []):
        address = str(inst.get("transport", {}).get("tcp", ""))  # host:port/...
        if inst.get("endpoint") == "generate" and address:
            out[int(address.split("/", 1)[0].rsplit(":", 1)[1])] = int(inst["instance_id"])
    return out


def _models_ready(port: int, model: str) -> bool:
    status, body = _http("GET", f"http://{HOST}:{port}/v1/models")
    return status == 200 and model.encode() in body


# the header Dynamo's frontend in --router-mode direct picks the worker by
WORKER_HEADER: Final = "x-worker-instance-id"


@dataclass
class MockerFleet:
    """N mockers in one namespace; ``endpoints`` as kvplane routes to them (behind a
    direct-mode frontend, when started with one)."""

    spec: MockerSpec
    rundir: Path
    names: list[str]
    namespace: str
    kv_events: list[str]
    replays: list[str]
    rpc_ports: list[int]
    procs: list[Proc] = field(default_factory=list)
    worker_names: dict[int, str] = field(default_factory=dict)  # Dynamo instance id -> name
    direct: Proc | None = None  # the direct-mode frontend kvplane routes through
    direct_url: str = ""

    @property
    def endpoints(self) -> list[EngineEndpoint]:
        """Each mocker as kvplane's router is told of it: the direct frontend's url with
        the mocker's instance id, the mocker's events, ids handed over as the
        frontend takes them (``nvext.token_data``: it then renders and encodes nothing)
        and the size of its host tier, which its events do not report."""
        ids = {name: str(wid) for wid, name in self.worker_names.items()}
        return [
            EngineEndpoint(
                n,
                self.direct_url,
                k,
                r,
                {WORKER_HEADER: ids[n]} if n in ids else {},
                "dynamo",
                self.spec.host_blocks,
            )
            for n, k, r in zip(self.names, self.kv_events, self.replays, strict=True)
        ]

    @property
    def env(self) -> dict[str, str]:
        return {"DYN_FILE_KV": str(self.rundir / "dynamo-discovery")}

    def stop(self) -> None:
        if self.direct is not None:
            self.direct.stop()
        for p in reversed(self.procs):
            p.stop()

    def tail(self) -> str:
        procs = [*self.procs, *([self.direct] if self.direct else [])]
        return "\n".join(f"--- {p.name}\n{p.tail()}" for p in procs if not p.alive())

    def _serve(self, name: str, mode: str, env: dict[str, str], timeout: float) -> RunningPeer:
        """A frontend over every mocker, ready once it sees them all; names the mockers
        by their instance ids."""
        (port,) = free_ports(1)
        proc = spawn(name, frontend_argv(port, self.namespace, mode), self.rundir, env)
        deadline = time.monotonic() + timeout
        while len(ids := instance_ids(port)) < len(self.names) or not _models_ready(
            port, self.spec.model
        ):
            if not proc.alive() or time.monotonic() > deadline:
                proc.stop()
                dead = self.tail()
                raise RuntimeError(
                    f"dynamo.frontend ({mode}) did not see the fleet:\n{proc.tail()}\n{dead}"
                )
            time.sleep(0.5)
        self.worker_names = {ids[p]: n for p, n in zip(self.rpc_ports, self.names, strict=True)}
        return RunningPeer(name, port, [proc])

    def start_frontend(self, router: str, timeout: float = 120.0) -> RunningPeer:
        """The real ``dynamo.frontend --router-mode kv`` over the mockers, with
        ``router``'s settings."""
        setting = DynamoSetting.parse(router, FRONTEND_PREFIX)
        env = dynamo_env({**self.env, **setting.env(self.spec.time_scale)})
        peer = self._serve(router, "kv", env, timeout)
        peer.notes["dynamo settings"] = setting.describe()
        return peer

    def start_direct(self, timeout: float = 120.0) -> None:
        """``dynamo.frontend --router-mode direct`` for kvplane to route through."""
        peer = self._serve("frontend-direct", "direct", dynamo_env(self.env), timeout)
        self.direct = peer.procs[0]
        self.direct_url = f"http://{HOST}:{peer.port}"


# A port picked free can be taken before the mocker binds it (by another bind to a
# random port, such as the other mockers' own sockets): the fleet is started again on
# other ports, this many times.
FLEET_ATTEMPTS: Final = 3
_CLASH: Final = "Address already in use"


def start_fleet(spec: MockerSpec, engines: int, rundir: Path, *, direct: bool) -> MockerFleet:
    """Start ``engines`` mockers in one namespace, each serving on its request-plane
    port; with ``direct``, also the direct-mode frontend kvplane routes through (waiting
    until it sees every mocker)."""
    mdir = model_dir(spec, rundir / "dynamo-model")
    for attempt in range(1, FLEET_ATTEMPTS + 1):
        fleet = _spawn_fleet(spec, engines, rundir, mdir)
        try:
            clash = _wait_bound(fleet, timeout=120.0)
            if clash is None:
                if direct:
                    fleet.start_direct()
                return fleet
        except BaseException:
            fleet.stop()
            raise
        fleet.stop()
        if attempt == FLEET_ATTEMPTS:
            raise RuntimeError(f"mockers could not bind their ports:\n{clash}")
    raise AssertionError("unreachable")


def _spawn_fleet(spec: MockerSpec, engines: int, rundir: Path, mdir: Path) -> MockerFleet:
    ports = free_ports(3 * engines)
    run = f"kvp{time.monotonic_ns() % 10**8}"
    fleet = MockerFleet(
        spec=spec,
        rundir=rundir,
        names=[f"m{i}" for i in range(engines)],
        namespace=f"{run}-pool",
        kv_events=[f"tcp://{HOST}:{ports[3 * i]}" for i in range(engines)],
        replays=[f"tcp://{HOST}:{ports[3 * i + 1]}" for i in range(engines)],
        rpc_ports=[ports[3 * i + 2] for i in range(engines)],
    )
    try:
        for i in range(engines):
            env = dynamo_env({**fleet.env, "DYN_TCP_RPC_PORT": str(fleet.rpc_ports[i])})
            argv = mocker_argv(spec, mdir, fleet.namespace, ports[3 * i], ports[3 * i + 1])
            fleet.procs.append(spawn(f"mocker-{i}", argv, rundir, env))
    except BaseException:
        fleet.stop()
        raise
    return fleet


def _listens(proc: Proc, port: int) -> bool:
    """Whether ``proc`` listens on ``port`` (the request plane binds the host's address,
    not loopback, so a connection to HOST could not tell)."""
    try:
        conns = psutil.Process(proc.popen.pid).net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in conns)


def _wait_bound(fleet: MockerFleet, timeout: float) -> str | None:
    """Waits until every mocker listens on its request-plane port (its
    event and replay sockets are bound before it serves). Returns the log of a mocker
    that found one of its ports taken (the fleet must start again elsewhere), None once
    all serve; raises when one dies of anything else or the wait runs out."""
    deadline = time.monotonic() + timeout
    waiting = list(zip(fleet.procs, fleet.rpc_ports, strict=True))
    while waiting:
        for proc, port in list(waiting):
            if _CLASH in proc.tail(200):
                return f"--- {proc.name}\n{proc.tail()}"
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
            if _listens(proc, port):
                waiting.remove((proc, port))
        if waiting and time.monotonic() > deadline:
            names = ", ".join(p.name for p, _ in waiting)
            raise RuntimeError(f"mockers not serving after {timeout:.0f} s: {names}")
        if waiting:
            time.sleep(0.2)
    return None


WORKER_ID_BODY: Final[dict[str, Any]] = {"nvext": {"extra_fields": ["worker_id"]}}


# --------------------------------------------------------------------------- floor

CALIBRATION_NEW: Final = (64, 1024, 4096, 8192, 16384, 32768)
CALIBRATION_CACHED: Final = (0, 8192, 32768)


def _ttft_ms(client: httpx.Client, url: str, model: str, prompt: str, time_scale: float) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "stream": True}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: {") and '"text":"' in line and '"text":""' not in line:
                return (time.perf_counter() - t0) * 1000.0 / time_scale
    raise RuntimeError("calibration: no token received")


def calibrate(
    spec: MockerSpec, rundir: Path, text: Callable[[int, int], str], repeats: int = 2
) -> GridModel:
    """The mocker's idle-engine TTFT on a grid of (new, cached) tokens, measured on one
    fresh mocker at the benchmark's time scale: the floor's timing model for the mocker
    fleet. ``text(seed, n)`` is a prompt of exactly ``n`` tokens (BOS included) whose
    first ``m`` tokens are those of ``text(seed, m)``. A warm-up request goes first (the
    first one to a fresh frontend and mocker is slower), and each cell is the least of
    ``repeats`` measurements, each with a prompt of its own: the floor is a lower bound,
    and a busy machine only adds to it."""
    fleet = start_fleet(spec, 1, rundir / "calibration", direct=True)
    url = fleet.direct_url
    rows: list[list[float]] = [[0.0] * len(CALIBRATION_CACHED) for _ in CALIBRATION_NEW]
    try:
        with httpx.Client(timeout=600.0, headers=fleet.endpoints[0].headers) as client:
            _ttft_ms(client, url, spec.model, text(0, CALIBRATION_NEW[0]), spec.time_scale)
            seed = 0
            for j, cached in enumerate(CALIBRATION_CACHED):
                for i, new in enumerate(CALIBRATION_NEW):
                    best = float("inf")
                    for _ in range(repeats):
                        seed += 1
                        if cached:  # cache the prefix first (whole blocks)
                            prefix = text(seed, cached + 1)
                            _ttft_ms(client, url, spec.model, prefix, spec.time_scale)
                        prompt = text(seed, cached + new)
                        best = min(best, _ttft_ms(client, url, spec.model, prompt, spec.time_scale))
                    rows[i][j] = round(best, 3)
    finally:
        fleet.stop()
    return GridModel(CALIBRATION_NEW, CALIBRATION_CACHED, tuple(tuple(r) for r in rows))
