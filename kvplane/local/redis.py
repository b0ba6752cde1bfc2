"""Throwaway ``redis-server`` processes on loopback for tests and benchmarks: one server,
or a Redis Cluster of N primaries (cluster mode, slots split evenly by
``CLUSTER ADDSLOTSRANGE``, joined by ``CLUSTER MEET``). Cache only: no persistence."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import redis

from kvplane.local.ports import free_ports

HOST = "127.0.0.1"
SLOTS = 16384


@dataclass
class LocalRedis:
    ports: list[int]
    procs: list[subprocess.Popen[bytes]]
    workdir: Path
    cluster: bool = False
    logs: list[Path] = field(default_factory=list)
    password: str | None = None

    @property
    def url(self) -> str:
        """Any node's URL: a cluster client learns the others from it."""
        return f"redis://{HOST}:{self.ports[0]}/0"

    @property
    def port(self) -> int:
        return self.ports[0]

    def clients(self) -> list[redis.Redis]:
        return [redis.Redis(host=HOST, port=p, password=self.password) for p in self.ports]

    def used_memory(self) -> int:
        """Bytes of ``used_memory`` over every node."""
        total = 0
        for client in self.clients():
            with client:
                total += int(client.info("memory")["used_memory"])
        return total

    def dbsize(self) -> int:
        total = 0
        for client in self.clients():
            with client:
                total += int(client.dbsize())
        return total

    def flush(self) -> None:
        for client in self.clients():
            with client:
                client.flushall()

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _wait(check: Callable[[], object], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (redis.ConnectionError, redis.ResponseError) as exc:
            last = exc
        time.sleep(0.05)
    raise RuntimeError(f"redis: {what} not reached in {timeout_s}s ({last})")


def start(
    shards: int = 0,
    extra_args: Sequence[str] = (),
    *,
    form: bool = True,
    config_file: str | None = None,
    password: str | None = None,
) -> LocalRedis:
    """One plain server (``shards=0``) or a cluster of ``shards`` primaries (``form``:
    slots assigned and nodes met; else left to the caller). ``config_file`` comes first
    on each server's command line; ``password`` is what its clients authenticate with."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found (apt install redis-server)")
    workdir = Path(tempfile.mkdtemp(prefix="kvplane-redis-"))
    ports = free_ports(max(shards, 1) + shards)  # a cluster's nodes also need a bus port
    ports, bus_ports = ports[: max(shards, 1)], ports[max(shards, 1) :]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    for i, port in enumerate(ports):
        node_dir = workdir / str(port)
        node_dir.mkdir()
        argv = [exe] if config_file is None else [exe, config_file]
        argv += ["--port", str(port), "--bind", HOST, "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(node_dir), "--logfile", str(node_dir / "redis.log")]
        if shards:
            argv += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            argv += ["--cluster-port", str(bus_ports[i])]  # not port + 10000: may be > 65535
        argv += list(extra_args)
        logs.append(node_dir / "redis.log")
        procs.append(subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    local = LocalRedis(ports, procs, workdir, cluster=bool(shards), logs=logs, password=password)
    try:
        clients = local.clients()
        for client in clients:
            _wait(client.ping, "PONG")
        if shards and form:
            _form_cluster(clients, ports, bus_ports)
        for client in clients:
            client.close()
    except BaseException:
        local.stop()
        raise
    return local


def _form_cluster(clients: list[redis.Redis], ports: list[int], bus_ports: list[int]) -> None:
    n = len(clients)
    for i, client in enumerate(clients):
        first, last = i * SLOTS // n, (i + 1) * SLOTS // n - 1
        client.execute_command(  # type: ignore[no-untyped-call]
            "CLUSTER", "ADDSLOTSRANGE", first, last
        )
    for port, bus in zip(ports[1:], bus_ports[1:], strict=True):
        clients[0].execute_command("CLUSTER", "MEET", HOST, port, bus)  # type: ignore[no-untyped-call]

    def ready() -> bool:
        for client in clients:
            info = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text or f"cluster_known_nodes:{n}" not in text:
                return False
        return True

    _wait(ready, f"a cluster of {n}")


@contextmanager
def running(
    shards: int = 0,
    extra_args: Sequence[str] = (),
    *,
    form: bool = True,
    config_file: str | None = None,
    password: str | None = None,
) -> Iterator[LocalRedis]:
    local = start(shards, extra_args, form=form, config_file=config_file, password=password)
    try:
        yield local
    finally:
        local.stop()
