"""A Gateway API inference gateway on one machine: ``kvplane epp`` and real Envoy in
front of it, as one process tree that stops on SIGTERM (benchmarks spawn it as they
spawn a router).

Run: ``python -m kvplane.local.gateway --config router.yaml --port 8000``.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvplane.local.envoy import GatewaySpec, running_envoy
from kvplane.local.ports import free_port

START_TIMEOUT_S = 180.0


def picker_ready(address: str, timeout_s: float = 2.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            req = health_pb2.HealthCheckRequest(service="readiness")
            answer = stub.Check(req, timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


@contextlib.contextmanager
def picker_process(
    config: Path, port: int, log: Path, extra: Sequence[str] = ()
) -> Iterator[subprocess.Popen[bytes]]:
    """``kvplane epp`` on ``port``, once its readiness service says SERVING."""
    argv = [str(Path(sys.executable).parent / "kvplane"), "--log-level", "warning", "epp"]
    argv += ["--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--metrics-port", "0", *extra]
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not picker_ready(f"127.0.0.1:{port}"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvplane epp did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--config", required=True, help="the picker's router config")
    p.add_argument("--port", type=int, required=True, help="Envoy's listener")
    p.add_argument("--log-dir", default=None)
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    with contextlib.ExitStack() as stack:
        log_dir = Path(args.log_dir or stack.enter_context(tempfile.TemporaryDirectory()))
        port = free_port()
        stack.enter_context(picker_process(Path(args.config), port, log_dir / "epp.log"))
        spec = GatewaySpec(f"127.0.0.1:{port}")
        stack.enter_context(running_envoy(spec, log_dir, args.port))
        print(f"gateway on 127.0.0.1:{args.port}, picker on 127.0.0.1:{port}", flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
