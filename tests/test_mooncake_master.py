"""The operator's rendered Mooncake master command runs on the real ``mooncake_master``.

``scripts/setup-mooncake.sh`` installs the binary from the PyPI ``mooncake-transfer-engine``
wheel (it starts on CPU). The test starts the rendered command with only the three port
values swapped for free ones (the machine is shared) and the bind hosts for 127.0.0.1,
then waits for ``/health`` on the metrics port, as the rendered readiness probe does.
gflags rejects unknown flags, so a flag the binary lacks fails the start.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvplane.operator.api import InferencePoolSpec, KVCacheTierSpec
from kvplane.operator.render import names
from kvplane.operator.render.stores import mooncake_objects

from kvplane.local.ports import free_ports

ROOT = Path(__file__).resolve().parent.parent
POOL, NAMESPACE = "llama", "serving"


def _mooncake() -> tuple[str, str]:
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup-mooncake.sh")],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.splitlines()
    return out[0], out[1]


def _rendered_command() -> list[str]:
    ipool = InferencePoolSpec.model_validate(
        {
            "model": {
                "servedName": "m",
                "source": "org/m",
                "revision": "0" * 40,
                "kvBytesPerToken": 1,
            },
            "engine": {"kind": "sglang"},
        }
    )
    tier = KVCacheTierSpec.model_validate(
        {
            "tier": "remote",
            "backend": "mooncake",
            "bandwidthGbps": 20,
            "url": f"mooncake://{names.mooncake_name(POOL)}.{NAMESPACE}.svc:50051",
        }
    )
    deployment = mooncake_objects(POOL, NAMESPACE, ipool, [tier], "gen")[0]
    command: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    return command


def _health(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def test_rendered_master_flags_start_the_real_master(tmp_path: Path) -> None:
    binary, libs = _mooncake()
    rpc, metadata, metrics = free_ports(3)
    ports = {
        "-rpc_port": rpc,
        "-http_metadata_server_port": metadata,
        "-metrics_port": metrics,
    }
    command = _rendered_command()
    assert command[0] == "mooncake_master"
    args = []
    for flag in command[1:]:
        name, _, value = flag.partition("=")
        if name in ports:
            value = str(ports[name])
        elif value == "0.0.0.0":
            value = "127.0.0.1"
        args.append(f"{name}={value}")
    log = (tmp_path / "master.log").open("w")
    env = {**os.environ, "LD_LIBRARY_PATH": libs}
    proc = subprocess.Popen([binary, *args], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        for _ in range(600):  # bounded: the probe's own wait, on a busy machine
            if _health(metrics):
                break
            if proc.poll() is not None:
                pytest.fail((tmp_path / "master.log").read_text()[-2000:])
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)
        assert _health(metrics), (tmp_path / "master.log").read_text()[-2000:]
    finally:
        proc.terminate()
        proc.wait()
        log.close()


def test_the_real_master_rejects_an_unknown_flag() -> None:
    """What makes the test above a check of the flags: gflags refuses unknown ones."""
    binary, libs = _mooncake()
    env = {**os.environ, "LD_LIBRARY_PATH": libs}
    done = subprocess.run(
        [binary, "-no_such_flag=1"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode != 0 and "unknown command line flag" in done.stderr
