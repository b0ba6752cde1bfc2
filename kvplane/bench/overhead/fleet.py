"""The processes under test: the routers (kvplane, its Redis-backed variants, vllm-router)
and the Redis they share."""

from __future__ import annotations

import contextlib
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvplane.bench.overhead.scope import MODEL, ROUTERS
from kvplane.bench.procs import HOST, Proc
from kvplane.bench.procs import spawn as _spawn
from kvplane.local.ports import free_port


@dataclass
class RouterSpec:
    name: str
    port: int
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stop_signal: int = signal.SIGTERM


REDIS_SINGLE = "kvplane-r1"  # one process on the Redis index: the index's cost alone


def kvplane_variant(workers: int) -> str:
    """The row name of kvplane with ``workers`` processes."""
    return "kvplane" if workers <= 1 else f"kvplane-w{workers}"


def router_specs(
    names: Sequence[str],
    backend_ports: Sequence[int],
    tokenizer_dir: Path,
    rundir: Path,
    kvplane_cmd: str,
    vllm_router_cmd: str,
    kvplane_workers: Sequence[int],
    kvplane_profile: Path | None,
    redis_url: str | None = None,
    redis_single: bool = False,
) -> list[RouterSpec]:
    """The exact command line of every router under test.

    ``kvplane`` expands to one spec per count in ``kvplane_workers``: one process
    with the in-memory index, or N worker processes on the Redis index at
    ``redis_url`` (one database per variant, so that their marks stay apart);
    ``redis_single`` adds one process on the Redis index (``kvplane-r1``).
    """
    specs: list[RouterSpec] = []
    workers = [f"http://{HOST}:{p}" for p in backend_ports]
    for name in names:
        if name == "kvplane":
            for db, n in enumerate(kvplane_workers):
                url = f"{redis_url}/{db}" if n > 1 and redis_url else None
                specs.append(
                    _kvplane_spec(
                        n, backend_ports, tokenizer_dir, rundir, kvplane_cmd, kvplane_profile, url
                    )
                )
            if redis_single and redis_url:
                url = f"{redis_url}/{len(kvplane_workers)}"
                specs.append(
                    _kvplane_spec(
                        1,
                        backend_ports,
                        tokenizer_dir,
                        rundir,
                        kvplane_cmd,
                        None,
                        url,
                        REDIS_SINGLE,
                    )
                )
        elif name.startswith("vllm-router-"):
            port = free_port()
            policy = name.removeprefix("vllm-router-")
            argv = [vllm_router_cmd, "--host", HOST, "--port", str(port), "--worker-urls"]
            argv += workers
            argv += ["--policy", policy, "--prometheus-port", str(free_port())]
            argv += ["--log-level", "warning"]
            specs.append(RouterSpec(name, port, argv, {"NO_COLOR": "1"}))
        else:
            raise SystemExit(f"bench overhead: unknown router {name!r} (choose from {ROUTERS})")
    return specs


def _kvplane_spec(
    workers: int,
    backend_ports: Sequence[int],
    tokenizer_dir: Path,
    rundir: Path,
    kvplane_cmd: str,
    profile: Path | None,
    redis_url: str | None,
    name: str | None = None,
) -> RouterSpec:
    name = name or kvplane_variant(workers)
    port = free_port()
    if workers > 1 and redis_url is None:
        raise SystemExit("bench overhead: kvplane with several workers needs the Redis index")
    cfg = rundir / f"{name}-router.yaml"
    index_url = redis_url if workers > 1 or name == REDIS_SINGLE else None
    cfg.write_text(_kvplane_config(tokenizer_dir, backend_ports, index_url))
    tail = ["router", "--config", str(cfg), "--host", HOST, "--port", str(port)]
    if workers > 1:
        tail += ["--workers", str(workers)]
        profile = None  # cProfile sees the supervisor only, not the worker processes
    if profile is not None:
        argv = [sys.executable, "-m", "cProfile", "-o", str(profile)]
        argv += ["-m", "kvplane.cli", "--log-level", "warning", *tail]
    else:
        argv = [kvplane_cmd, "--log-level", "warning", *tail]
    sig = signal.SIGINT if profile is not None else signal.SIGTERM
    return RouterSpec(name, port, argv, stop_signal=sig)


def _kvplane_config(
    tokenizer_dir: Path, backend_ports: Sequence[int], redis_url: str | None = None
) -> str:
    backends = "\n".join(
        f"  - name: noop-{i}\n    url: http://{HOST}:{p}" for i, p in enumerate(backend_ports)
    )
    index = f"  backend: redis\n  url: {redis_url}\n" if redis_url else "  backend: memory\n"
    return (
        f"model:\n  name: {MODEL}\n  tokenizer: {tokenizer_dir}\n  block_size: 16\n"
        f"  max_model_len: 131072\nbackends:\n{backends}\npolicy: cost\n"
        f"index:\n{index}"
    )


def start_redis(rundir: Path, procs: list[Proc]) -> str:
    """A throwaway ``redis-server`` on a free loopback port (no persistence); its URL."""
    import shutil

    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("bench overhead: kvplane workers need redis-server (apt install)")
    port = free_port()
    workdir = rundir / "redis"
    workdir.mkdir(exist_ok=True)
    argv = [exe, "--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
    argv += ["--dir", str(workdir), "--databases", "16"]
    proc = _spawn("redis", argv, rundir)
    procs.append(proc)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and proc.alive():
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), 0.5) as s:
            s.sendall(b"PING\r\n")
            if s.recv(16).startswith(b"+PONG"):
                return f"redis://{HOST}:{port}"
        time.sleep(0.05)
    raise SystemExit(f"bench overhead: redis-server did not start:\n{proc.tail()}")
