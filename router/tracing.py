"""OpenTelemetry spans for the router's request path, exported over OTLP/HTTP.

Off unless the router config has ``tracing`` (the InferencePool's ``spec.tracing``).
A request then gets a server span (``kvplane.request``, the child of the client's W3C
``traceparent`` when it sent one) with children for the steps of its path:
``kvplane.tokenize``, ``kvplane.choose`` (index lookup and cost; ``kvplane.index_lookup``
inside it), ``kvplane.proxy`` (the engine request, retries included), or for P/D
``kvplane.pd.prefill`` and ``kvplane.pd.decode`` per leg. The engine requests carry the
W3C ``traceparent`` of the span that sent them, so vLLM's own spans
(``--otlp-traces-endpoint``) join the trace.

The hooks in the request path cost a context-variable read when tracing is off: the
tracer of the request being served lives in a ``ContextVar`` that only a traced
request sets, and every hook returns at once without one. The SDK is imported only when
a router turns tracing on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplane.router.config import TracingConfig
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span, Tracer

_current: ContextVar[Tracer | None] = ContextVar("kvplane_tracer", default=None)
_TRACE_HEADERS = (b"traceparent", b"tracestate")
Attrs = Mapping[str, str | int | float | bool]


class Tracing:
    """A router's tracer (one per router app: several may share a process)."""

    def __init__(self, provider: TracerProvider | None) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("kvplane.router") if provider is not None else None

    @classmethod
    def of(cls, spec: TracingConfig | None, pool: str) -> Tracing:
        if spec is None:
            return cls(None)
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        resource = Resource.create({"service.name": spec.service_name, "kvplane.pool": pool})
        provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(spec.sampling_ratio))
        )
        exporter = OTLPSpanExporter(endpoint=spec.endpoint.rstrip("/") + "/v1/traces", timeout=5)
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
        return cls(provider)

    @property
    def on(self) -> bool:
        return self._tracer is not None

    def begin(self, raw_headers: Sequence[tuple[bytes, bytes]], route: str) -> Any:
        """Start the request's server span and make it current; ``end`` takes the token.
        None (and nothing done) when tracing is off."""
        tracer = self._tracer
        if tracer is None:
            return None
        from opentelemetry import context, propagate, trace

        carrier = {
            k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers if k in _TRACE_HEADERS
        }
        parent = propagate.extract(carrier) if carrier else None
        span = tracer.start_span(
            "kvplane.request",
            context=parent,
            kind=trace.SpanKind.SERVER,
            attributes={"http.route": route},
        )
        ctx = trace.set_span_in_context(span, parent)
        return (span, context.attach(ctx), _current.set(tracer))

    def end(self, token: Any, status: str) -> None:
        if token is None:
            return
        from opentelemetry import context, trace

        span, ctx_token, var_token = token
        _current.reset(var_token)
        context.detach(ctx_token)
        span.set_attribute("http.response.status_code", status)
        if not status.isdigit() or int(status) >= 500:
            span.set_status(trace.StatusCode.ERROR)
        span.end()

    def shutdown(self) -> None:
        if self._provider is not None:
            self._provider.shutdown()  # flushes what is batched


OFF = Tracing(None)


@contextlib.contextmanager
def _span(tracer: Tracer, name: str, client: bool, attrs: Attrs) -> Iterator[Span]:
    from opentelemetry import trace

    kind = trace.SpanKind.CLIENT if client else trace.SpanKind.INTERNAL
    with tracer.start_as_current_span(name, kind=kind, attributes=dict(attrs)) as s:
        yield s


_NULL = contextlib.nullcontext()


def on() -> bool:
    """Whether the request being served is traced (guard attribute-building with it)."""
    return _current.get() is not None


def span(name: str, client: bool = False) -> Any:
    """A child span of the current request (a shared no-op context when it is not
    traced). Attributes go on with ``set_attributes``."""
    tracer = _current.get()
    if tracer is None:
        return _NULL
    return _span(tracer, name, client, {})


def record(name: str, started: float) -> None:
    """A child span for a step already done: from ``started`` (``time.perf_counter``)
    to now."""
    tracer = _current.get()
    if tracer is None:
        return
    now_pc, now_ns = time.perf_counter(), time.time_ns()
    start_ns = now_ns - int((now_pc - started) * 1e9)
    tracer.start_span(name, start_time=start_ns).end(end_time=now_ns)


def set_attributes(**attrs: str | int | float | bool) -> None:
    """Attributes on the current span (the request's, or a step's); call it under
    ``on()``, so that an untraced request does not even build them."""
    if _current.get() is None:
        return
    from opentelemetry import trace

    trace.get_current_span().set_attributes(attrs)


def headers(raw: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """The client's raw headers with W3C trace context of the current span instead of
    the client's own (unchanged when the request is not traced)."""
    if _current.get() is None:
        return raw
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    out = [(k, v) for k, v in raw if k not in _TRACE_HEADERS]
    out += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in carrier.items()]
    return out


def inject(hdrs: dict[str, str]) -> dict[str, str]:
    """``hdrs`` with the current span's W3C trace context (a copy; as is when untraced)."""
    if _current.get() is None:
        return hdrs
    from opentelemetry import propagate

    out = {k: v for k, v in hdrs.items() if k.lower() not in ("traceparent", "tracestate")}
    propagate.inject(out)
    return out
