"""The HTTP surface: OpenAI-compatible routes, health, metrics and explain.

Handlers stay thin: parse (request.py), route (pipeline.py), forward (proxy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import httpx
from fastapi import FastAPI, Request
from kvplane.router import runtime, tracing
from kvplane.router.auth import ROLE_KEY, Disclosure, Gate, Role, disclose, disclosure
from kvplane.router.config import RouterConfig, TokenForwarding
from kvplane.router.discovery import Discovery, StaticDiscovery
from kvplane.router.errors import APIError, describe
from kvplane.router.forwarder import Forwarder
from kvplane.router.generation import generation_tag
from kvplane.router.headers import HeaderPolicy
from kvplane.router.index.base import Blocks, ResidencyIndex
from kvplane.router.index.guarded import GuardedIndex
from kvplane.router.index.instrumented import InstrumentedIndex
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.shared import with_shared_stores
from kvplane.router.kvevents.service import Indexer
from kvplane.router.models import ModelRegistry
from kvplane.router.openapi import router_openapi
from kvplane.router.pd.handoff import PDService
from kvplane.router.pipeline import Routed, RoutingPipeline
from kvplane.router.pool import Pool, Scraper
from kvplane.router.proxy import Dispatch, Proxy
from kvplane.router.request import ParsedRequest, parse_request
from kvplane.router.responses import (
    MemoryHomes,
    ResponseHomes,
    ResponseTap,
    SharedHomes,
    not_found,
)
from kvplane.router.shared import SharedStores
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.tiers import Tier
from kvplane.router.token_forward import with_token_ids
from kvplane.router.tokens import PromptTokenizer, tokenizer_fingerprint
from kvplane.router.tracing import OFF, Tracing
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvplane.router")


def pool_generation(config: RouterConfig) -> str:
    m = config.model
    if m.generation:
        return m.generation
    tokenizer = tokenizer_fingerprint(m.tokenizer)
    return generation_tag(m.name, m.revision, tokenizer, m.block_size, pool=config.pool)


def make_index(config: RouterConfig, generation: str, owner: str | None = None) -> ResidencyIndex:
    """The configured index; ``owner``: an indexer's id when streams are leased. With
    shared stores, remote-tier blocks are the stores' (``index.shared``)."""
    backend = make_backend(config, generation, owner)
    return with_shared_stores(backend, SharedStores.of(config.shared_stores))


def make_backend(
    config: RouterConfig, generation: str, owner: str | None = None
) -> MemoryIndex | RedisIndex:
    """The configured index backend itself (``make_index`` wraps it)."""
    if config.index.backend == "redis":
        return make_redis_index(config, generation, owner)
    return MemoryIndex()


def make_redis_index(config: RouterConfig, generation: str, owner: str | None = None) -> RedisIndex:
    return RedisIndex(
        config.index.url,
        generation,
        # lookups are cut at lookup_timeout_ms by the GuardedIndex, not the socket
        config.index.io_timeout_ms / 1000,
        # the index's password comes from a Secret (the operator sets the env)
        password=os.environ.get("KVPLANE_INDEX_PASSWORD") or None,
        window_s=config.cost.tentative_ttl_s,  # a mark lives at most one window
        owner=owner,
        ca_file=config.index.tls_ca_file,
    )


# The OpenAI and vLLM endpoints the router forwards: (request kind, path). Completions,
# chat and responses are routed by their prompt's cached prefix; the rest by load
# (request.LOAD_ROUTED); a response continued by ``previous_response_id`` to the pod
# that stored it. vLLM's aliases are routes of their own, forwarded under their path.
ROUTES: tuple[tuple[str, str], ...] = (
    ("completions", "/v1/completions"),
    ("chat", "/v1/chat/completions"),
    ("responses", "/v1/responses"),
    ("embeddings", "/v1/embeddings"),
    ("tokenize", "/tokenize"),
    ("detokenize", "/detokenize"),
    ("score", "/v1/score"),
    ("score", "/score"),
    ("rerank", "/v1/rerank"),
    ("rerank", "/rerank"),
    ("rerank", "/v2/rerank"),
)


def make_homes(config: RouterConfig, index: ResidencyIndex) -> ResponseHomes:
    """Where stored responses live (responses.py): this replica's map, shared with the
    other replicas through the index when the index is in Redis."""
    spec = config.responses
    local = MemoryHomes(spec.max_entries, spec.ttl_s)
    if isinstance(index, RedisIndex):
        return SharedHomes(index.nodes, index.names.prefix, local, spec.ttl_s)
    return local


def make_discovery(config: RouterConfig) -> Discovery:
    """Kubernetes pod discovery when configured, else the static backend list."""
    if config.discovery is None:
        return StaticDiscovery(config.backends)
    from kvplane.router.discovery_k8s import KubernetesDiscovery

    return KubernetesDiscovery(config.discovery)


@dataclass
class Router:
    """Everything a request handler needs, built once per process."""

    config: RouterConfig
    generation: str
    tokenizer: PromptTokenizer
    index: ResidencyIndex
    pool: Pool
    metrics: RouterMetrics
    pipeline: RoutingPipeline
    proxy: Proxy
    client: httpx.AsyncClient  # /v1/models and the P/D legs; proxy and scraper have their own
    gate: Gate
    header_policy: HeaderPolicy
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    indexer: Indexer | None = None  # embedded KV event ingestion, if any
    scraper: Scraper | None = None
    pd: PDService | None = None  # the P/D path, when config.pd is set
    metric_children: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    tracing: Tracing = OFF  # OpenTelemetry spans per request (config.tracing)
    homes: ResponseHomes | None = None  # response id -> pod (previous_response_id)

    async def route(self, req: ParsedRequest) -> Routed:
        """The pod for a request: where its prompt's prefix is cached, the least loaded
        for a request with no such prompt, the one that stored the response it
        continues (a 404 in vLLM's words when none known does)."""
        prev = req.previous_response_id
        if prev is not None:
            assert self.homes is not None
            home = await self.homes.get(prev)
            if home is None or home not in self.pool.states:
                raise not_found(prev)
            routed = await self.pipeline.route_by_load(req, only=home)
            return replace(routed, decision=replace(routed.decision, reason="previous_response"))
        if req.by_load:
            return await self.pipeline.route_by_load(req)
        return await self.pipeline.route(req, defer_tail=True)

    def body_for(self, req: ParsedRequest, raw: bytes, routed: Routed) -> bytes:
        """What to send the backends: the client's body, with the prompt's token ids
        where the pool's backends take them (``forward_tokens``) and the router has them
        all (a long prompt no pod holds goes as text: ``RoutingPipeline``)."""
        form = self.config.forward_tokens
        if form is TokenForwarding.OFF or routed.prompt.partial:
            return raw
        return with_token_ids(form, req, raw, routed.prompt.tokens)


def build_router(
    config: RouterConfig,
    index: ResidencyIndex | None = None,
    metrics: RouterMetrics | None = None,
) -> Router:
    """One pool's router state; ``metrics``: another pool's, whose registry this pool's
    series join (one /metrics for several pools)."""
    generation = pool_generation(config)
    if metrics is None:
        metrics = RouterMetrics(config.pool, config.model.name)
    else:
        metrics = metrics.for_pool(config.pool, config.model.name)
    tokenizer = PromptTokenizer(
        config.model.tokenizer,
        config.model.chat_template,
        reuse_max_tokens=config.model.tokenizer_cache_tokens,
        max_prompt_ids=config.model.max_model_len,
    )
    index = index or make_index(config, generation)
    pool = Pool(config.demote_first_s, config.demote_max_s)
    # as many kept alive as open: httpcore 1.0.9 counts every connection against the
    # keep-alive cap and closes connections it has assigned to waiting requests
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    timeout = httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s)
    client = httpx.AsyncClient(limits=limits, timeout=timeout)
    timeout_s = config.index.lookup_timeout_ms / 1000
    guarded = GuardedIndex(InstrumentedIndex(index, metrics), timeout_s, metrics)
    pipeline = RoutingPipeline(config, tokenizer, guarded, pool, metrics, generation)
    forwarder = Forwarder(config.connect_timeout_s, config.read_timeout_s)
    proxy = Proxy(forwarder, pool, metrics, config.max_attempts, config.first_byte_timeout_s)
    router = Router(
        config,
        generation,
        tokenizer,
        index,
        pool,
        metrics,
        pipeline,
        proxy,
        client,
        Gate(config.auth),
        HeaderPolicy.of(config),
    )
    router.tracing = Tracing.of(config.tracing, config.pool)
    router.homes = make_homes(config, index)
    if config.pd is not None:
        router.pd = PDService(config, pipeline, pool, index, metrics, client)
    pool.on_demote = lambda pod: metrics.demotions.labels(**metrics.labels, pod=pod).inc()
    return router


def _headers(
    routed: Routed, request_id: str, pod: str, attempts: int, level: Disclosure
) -> dict[str, str]:
    """The response's headers, as much as the caller may see (auth.Disclosure)."""
    out = {"x-request-id": request_id}
    if level is Disclosure.NONE:
        return out
    d = routed.decision
    out["x-kvplane-pod"] = pod
    out["x-kvplane-reason"] = d.reason if pod == d.pod else f"retry_after_{d.pod}"
    out["x-kvplane-attempts"] = str(attempts)
    whole = routed.prompt.whole()  # None: a deferred tail still being encoded
    if whole is not None and whole[0]:  # none for a request routed by load
        out["x-kvplane-prompt-tokens"] = str(len(whole[0]))
    terms = d.terms.get(pod)
    if terms is not None and level is Disclosure.ALL:  # residency: admins only
        out["x-kvplane-predicted-ttft-ms"] = f"{terms.ttft_ms:.2f}"
        out["x-kvplane-predicted-cached-tokens"] = str(terms.cached_tokens)
    return out


def create_app(
    config: RouterConfig | Sequence[RouterConfig],
    discovery: Discovery | None = None,
    index: ResidencyIndex | None = None,
    embedded_indexer: bool | None = None,
) -> FastAPI:
    """The router app over one pool or several (``models.ModelRegistry``: the request's
    ``model`` picks the pool). ``embedded_indexer`` (default: when the index is in
    memory) runs KV event ingestion in this process; ``discovery`` and ``index`` are
    the first pool's."""
    configs = [config] if isinstance(config, RouterConfig) else list(config)
    config = configs[0]  # auth and server limits: the first pool's
    router = build_router(configs[0], index)
    registry = ModelRegistry(
        [router, *(build_router(c, metrics=router.metrics) for c in configs[1:])]
    )
    discoveries = {id(router): discovery or make_discovery(configs[0])}

    def embedded(r: Router) -> bool:
        memory = r.config.index.backend == "memory"
        return memory if embedded_indexer is None else embedded_indexer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for r in registry:
            found = discoveries.get(id(r)) or make_discovery(r.config)
            await runtime.start(r, found, embedded(r))
        runtime.settle()
        try:
            yield
        finally:
            for r in registry:
                await runtime.stop(r)

    app = _RouterApp(router.gate, title="kvplane router", lifespan=lifespan)
    app.state.router = router
    app.state.registry = registry
    app.openapi = lambda: router_openapi(app, ROUTES)  # type: ignore[method-assign]

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return exc.response()

    async def handle(scope: Scope, receive: Receive, send: Send, kind: str, path: str) -> None:
        received = time.perf_counter()
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = _request_id(raw_headers)
        level = disclosure(scope.get(ROLE_KEY, Role.USER), config.auth)
        status = "error"
        router = registry_default
        traced = router.tracing.begin(raw_headers, path)
        try:
            raw = await _read_body(scope, receive, config.server.max_body_bytes)
            req = parse_request(raw, kind)
            router = registry.resolve(req.model) if req.model else registry_default
            if router.pd is not None and kind in ("chat", "completions"):
                headers = router.header_policy.forward(raw_headers, request_id)
                response = await router.pd.serve(req, path, headers, request_id, received)
                _disclose_response(response, level)
                status = str(response.status_code)
                await response(scope, receive, send)
                return
            routed = await router.route(req)
            router.metrics.chose(routed.decision.terms.get(routed.decision.pod), req.max_tokens)
            answer = Answer(router, routed, request_id, level)
            with tracing.span("kvplane.proxy", True):
                if tracing.on():
                    tracing.set_attributes(pod=routed.decision.pod)
                lines = router.header_policy.lines(
                    tracing.headers(raw_headers), request_id.encode("latin-1")
                )
                body = router.body_for(req, raw, routed)
                dispatch = answer.dispatch(path.encode(), body, lines, req.stream)
                if req.kind == "responses" and req.store and router.homes is not None:
                    tap = ResponseTap(router.homes, req.stream, answer.served)
                    dispatch = replace(dispatch, tap=tap)
                _child(router, router.metrics.added, *router.metrics.labels.values()).observe(
                    time.perf_counter() - received
                )
                try:
                    status = str(await router.proxy.send(dispatch, receive, send))
                finally:
                    answer.done()
        except APIError as exc:
            status = str(exc.status)
            extra = {"x-request-id": request_id}
            if exc.status == 413:  # the rest of the body is not read: no reuse
                extra["connection"] = "close"
            await exc.response(extra)(scope, receive, send)
        except ClientDisconnect:
            pass  # gone before its body arrived: nobody to answer
        except Exception:
            status = "500"
            log.exception("request %s failed", request_id)
            with contextlib.suppress(RuntimeError):  # unless the answer had started
                error = APIError(500, f"internal error in the router (request {request_id})")
                await error.response({"x-request-id": request_id})(scope, receive, send)
        finally:
            values = router.metrics.labels.values()
            _child(router, router.metrics.requests, *values, kind, status).inc()
            router.tracing.end(traced, status)

    registry_default = router
    # Raw ASGI endpoints on the hot path: no Request object, no response object, and
    # dispatched ahead of FastAPI's middleware stack. Also routes, for 405 on GET.
    for kind, path in ROUTES:
        endpoint = _Endpoint(handle, kind, path)
        app.hot_routes[path] = endpoint
        app.router.routes.append(Route(path, endpoint, methods=["POST"]))

    @app.post("/kvplane/explain")
    async def explain(request: Request) -> Response:
        """Each candidate's cost terms for a request body, without sending it."""
        try:
            raw = await _read_body(request.scope, request.receive, config.server.max_body_bytes)
            req = parse_request(raw)  # chat when the body has "messages"
            pool = registry.resolve(req.model)
            if pool.pd is not None:
                return JSONResponse(pool.pd.explain(await pool.pd.route(req)))
            routed = await pool.pipeline.route(req)
        except APIError as exc:
            return exc.response()
        return JSONResponse(_explain_body(pool, routed))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        """A stored response (``?stream=true``: its events again), from the pod storing it."""
        return await _at_home(registry, request, response_id, "")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request) -> Response:
        return await _at_home(registry, request, response_id, "/cancel")

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(await models_of(registry))

    @app.get("/health")
    async def health() -> Response:
        healthy = sum(len(r.pool.healthy()) for r in registry)
        if not healthy:
            return APIError(503, "no healthy backend").response()
        return JSONResponse({"status": "ok", "healthy_backends": healthy})

    @app.get("/metrics")
    async def metrics() -> Response:
        now = time.monotonic()
        for r in registry:
            own = r.metrics.labels
            for name, st in r.pool.states.items():
                r.metrics.backend_healthy.labels(**own, pod=name).set(int(st.routable(now)))
                r.metrics.inflight.labels(**own, pod=name).set(st.inflight)
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class _RouterApp(FastAPI):
    """FastAPI behind the auth gate, whose completion routes skip its middleware stack
    (exception, telemetry and body-limit layers and route matching they do not use:
    they answer errors themselves), a measurable share of a request's router overhead."""

    def __init__(self, gate: Gate, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.gate = gate
        self.hot_routes: dict[str, _Endpoint] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            try:  # every HTTP request: its caller's role, or its refusal
                scope[ROLE_KEY] = self.gate.role(scope["path"], scope["headers"])
            except APIError as exc:
                await exc.response()(scope, receive, send)
                return
            if scope["method"] == "POST":
                endpoint = self.hot_routes.get(scope["path"])
                if endpoint is not None:
                    await endpoint(scope, receive, send)
                    return
        await super().__call__(scope, receive, send)


class _Endpoint:
    """A route's ASGI app (an instance, so Starlette does not wrap it in a Request)."""

    def __init__(self, handle: Any, kind: str, path: str) -> None:
        self._handle, self._kind, self._path = handle, kind, path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._handle(scope, receive, send, self._kind, self._path)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"request body too large (over {limit} bytes: server.max_body_bytes)")


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    """The whole request body, refused (413) as soon as it proves longer than ``limit``."""
    for name, value in scope["headers"]:
        if name == b"content-length" and value.isdigit() and int(value) > limit:
            raise _too_large(limit)
    message = await receive()
    body: bytes = message.get("body", b"")
    if not message.get("more_body", False):
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        return body
    parts, size = [body], len(body)
    while True:  # ends: the server sends more_body=False or a disconnect
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        part = message.get("body", b"")
        size += len(part)
        if size > limit:
            raise _too_large(limit)
        parts.append(part)
        if not message.get("more_body", False):
            return b"".join(parts)


def _request_id(raw_headers: list[tuple[bytes, bytes]]) -> str:
    """The client's ``x-request-id`` when it is a short printable token, else a new one
    (it is echoed in a response header and forwarded to the engine)."""
    for name, value in raw_headers:
        if name == b"x-request-id" and 0 < len(value) <= 128 and _PRINTABLE.fullmatch(value):
            return value.decode("ascii")
    return f"kvp-{uuid.uuid4().hex}"


_PRINTABLE = re.compile(rb"[\x21-\x7e]+")


async def _at_home(
    registry: ModelRegistry, request: Request, response_id: str, action: str
) -> Response:
    """A request about one stored response, relayed to the pod that stored it (streamed
    back as it comes); a 404 in vLLM's words when no pool knows the id."""
    for router in registry:
        home = await router.homes.get(response_id) if router.homes is not None else None
        if home is not None and home in router.pool.states:
            break
    else:
        error = not_found(response_id)
        error.param = "response_id"
        return error.response()
    state = router.pool.states[home]
    if not state.healthy:
        return APIError(
            503, f"backend {home}, which stored the response, is unavailable"
        ).response()
    request_id = _request_id(request.scope["headers"])
    upstream = router.client.build_request(
        request.method,
        f"{state.backend.url.rstrip('/')}/v1/responses/{response_id}{action}",
        params=request.query_params,
        headers={
            **router.header_policy.forward(request.scope["headers"], request_id),
            **state.backend.headers,
        },
        content=await request.body(),
    )
    try:
        answer = await router.client.send(upstream, stream=True)
    except httpx.HTTPError as exc:
        return APIError(502, f"backend {home}: {describe(exc)}").response()
    headers = {"x-request-id": request_id}
    kind = answer.headers.get("content-type")
    if kind:
        headers["content-type"] = kind

    async def relayed() -> AsyncIterator[bytes]:
        try:  # closed also when the client leaves mid-way (no background task runs then)
            async for chunk in answer.aiter_raw():
                yield chunk
        finally:
            await answer.aclose()

    return StreamingResponse(relayed(), answer.status_code, headers)


def _disclose_response(response: Response, level: Disclosure) -> None:
    """Drop the headers of a prepared response that the caller may not see."""
    if level is Disclosure.ALL:
        return
    shown = disclose(dict(response.headers), level)
    for name in list(response.headers.keys()):
        if name not in shown:
            del response.headers[name]


def _child(router: Router, metric: Any, *values: str) -> Any:
    """``metric.labels(*values)``, cached per router: labels() costs microseconds."""
    key = (metric, *values)
    child = router.metric_children.get(key)
    if child is None:
        child = router.metric_children[key] = metric.labels(*values)
    return child


class Answer:
    """How one routed request hears of its answer (the proxy's ``DispatchObserver``):
    the pod that takes it is marked as holding the prompt's blocks until its events say
    otherwise, and the engine's reported cached tokens feed the drift metrics."""

    def __init__(self, router: Router, routed: Routed, request_id: str, level: Disclosure) -> None:
        self._router, self._routed, self._request_id = router, routed, request_id
        self._level = level
        m = router.metrics
        lv = tuple(m.labels.values())
        d = routed.decision
        _child(router, m.decisions, *lv, d.reason, d.pod).inc()
        self._prompt_tokens = _child(router, m.prompt_tokens, *lv)
        self._served: str | None = None
        self._predicted = d.terms[d.pod].cached_tokens if d.pod in d.terms else None
        if not routed.prompt.partial:
            self._whole(routed.prompt.tokens, routed.prompt.keys)

    def dispatch(self, path: bytes, body: bytes, lines: bytes, stream: bool) -> Dispatch:
        d, n = self._routed.decision, self._routed.prompt.n_tokens  # n: an estimate if partial
        uncached = {p: n - t.cached_tokens for p, t in d.terms.items()} or dict.fromkeys(
            d.ranked, n
        )
        ttft = {p: t.ttft_ms / 1000 for p, t in d.terms.items()}
        return Dispatch(path, body, lines, d.ranked, uncached, n, stream, self, ttft)

    def served(self) -> str | None:
        """The pod whose answer is being relayed (None before one answered)."""
        return self._served

    def headers_for(self, pod: str, attempts: int) -> dict[str, str]:
        self._served = pod
        routed = self._routed
        # only the blocks the pod does not hold already need a mark (a shared prefix: few)
        held = routed.matches.get(pod, {}).get(Tier.HBM, 0) if routed.matches else 0
        self._mark(pod, routed.prompt.keys, held)
        return _headers(routed, self._request_id, pod, attempts, self._level)

    def reported(self, cached_tokens: int) -> None:
        m = self._router.metrics
        m.reported_cached.labels(**m.labels).inc(cached_tokens)
        if self._predicted is not None:
            m.predicted_cached.labels(**m.labels).inc(self._predicted)

    def done(self) -> None:
        """The answer is out: a partial prompt's tail is encoded now, off the request's
        path, and before a follow-up of this conversation can come."""
        if self._routed.prompt.partial:
            self._routed.prompt.when_whole(self._whole)

    def _whole(self, tokens: Sequence[int], keys: list[int]) -> None:
        self._prompt_tokens.inc(len(tokens))
        self._router.pool.observe_prompt(len(tokens))
        prompt = self._routed.prompt
        if prompt.partial and self._served is not None:  # the tail's blocks, now keyed
            self._mark(self._served, keys, len(prompt.keys))

    def _mark(self, pod: str, keys: list[int], start: int) -> None:
        """The pod will hold ``keys[start:]`` until its events say otherwise."""
        if len(keys) > start:
            ttl = self._router.config.cost.tentative_ttl_s
            blocks = Blocks.of_prompt(keys, start)
            task = asyncio.create_task(self._router.index.mark_tentative(pod, blocks, ttl))
            task.add_done_callback(_log_task_error)


def _log_task_error(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.debug("tentative mark failed: %s", task.exception())


def _explain_body(router: Router, routed: Routed) -> dict[str, Any]:
    d = routed.decision
    candidates = []
    for pod in d.ranked:
        st = router.pool.states[pod]
        t = d.terms.get(pod)
        entry: dict[str, Any] = {
            "pod": pod,
            "load": {
                "inflight": st.inflight,
                "pending_prefill_tokens": st.pending_tokens,
                "engine_waiting": st.stats.waiting,
                "engine_running": st.stats.running,
                "kv_usage": st.stats.kv_usage,
            },
        }
        if routed.matches is not None:
            entry["resident_blocks"] = {k.value: v for k, v in routed.matches.get(pod, {}).items()}
        if t is not None:
            entry.update(
                queue_ms=t.queue_ms,
                transfer_ms=t.transfer_ms,
                recompute_ms=t.recompute_ms,
                ttft_ms=t.ttft_ms,
                adapter_ms=t.adapter_ms,
                cached_tokens=t.cached_tokens,
                loaded_tokens={k.value: v for k, v in t.loaded_from.items()},
                loaded_ms={k.value: v for k, v in t.loaded_ms.items()},
            )
            if t.store is not None:
                entry["shared_store"] = t.store
            if t.peer is not None:
                entry["peer_pull"] = {
                    "pod": t.peer,
                    "link": t.peer_link.value if t.peer_link is not None else None,
                    "tokens": t.peer_tokens,
                    "ms": t.peer_ms,
                }
        candidates.append(entry)
    return {
        "pod": d.pod,
        "reason": d.reason,
        "policy": router.config.policy,
        "prompt_tokens": len(routed.tokens),
        "blocks": len(routed.keys),
        "block_size": router.config.model.block_size,
        "generation": router.generation,
        "candidates": candidates,
    }


async def models_of(registry: ModelRegistry) -> dict[str, Any]:
    """Every pool's models, in pool order (a router or picker serving several)."""
    seen: dict[str, dict[str, Any]] = {}
    for data in await asyncio.gather(*(_models(r) for r in registry)):
        for d in data["data"]:
            seen.setdefault(d["id"], d)
    return {"object": "list", "data": list(seen.values())}


async def _models(router: Router) -> dict[str, Any]:
    """Union of the backends' /v1/models (by id), falling back to the configured model."""

    async def one(url: str) -> list[dict[str, Any]]:
        try:
            r = await router.client.get(url.rstrip("/") + "/v1/models", timeout=2.0)
            data = r.json().get("data", []) if r.status_code == 200 else []
            return [d for d in data if isinstance(d, dict) and "id" in d]
        except (httpx.HTTPError, ValueError):
            return []

    urls = [s.backend.url for s in router.pool.states.values() if s.healthy]
    seen: dict[str, dict[str, Any]] = {}
    for data in await asyncio.gather(*(one(u) for u in urls)):
        for d in data:
            seen.setdefault(d["id"], d)
    if not seen:
        model = router.config.model
        created = int(time.time())
        seen[model.name] = {
            "id": model.name,
            "object": "model",
            "created": created,
            "owned_by": "kvplane",
        }
        for adapter in model.lora_adapters:  # as vLLM lists an adapter: its base is parent
            seen[adapter] = {
                "id": adapter,
                "object": "model",
                "created": created,
                "owned_by": "kvplane",
                "parent": model.name,
            }
    return {"object": "list", "data": list(seen.values())}
