"""The picker's decision and its accounting, free of the wire protocol.

A request is decided by the pool's own ``RoutingPipeline`` (or, with P/D, by its
``PDService``) exactly as the HTTP router decides it, and then accounted as the
router's proxy accounts a send (``load.Attempt``): its uncached prompt tokens are
pending prefill on the pod until the first response byte, and the request is in
flight there until the response ends, whatever phase Envoy reports it in. The pod
that serves is marked as holding the prompt's blocks (``app.Answer``).

With P/D over NIXL the picker runs the prefill leg itself and sends the decode pod
the body carrying the prefill pod's ``kv_transfer_params``; Mooncake's and SGLang's
concurrent legs need the router, which can retry both legs as a pair.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

from kvplane.router.app import Answer, Router
from kvplane.router.auth import Disclosure, Role, disclose, disclosure
from kvplane.router.config import PDConnector
from kvplane.router.epp.endpoints import Endpoints
from kvplane.router.errors import APIError
from kvplane.router.headers import CREDENTIALS, HeaderPolicy
from kvplane.router.load import Attempt
from kvplane.router.models import ModelRegistry
from kvplane.router.pd import protocols
from kvplane.router.pd.choice import PDReason
from kvplane.router.pd.handoff import ClientError, PDRouted, Served
from kvplane.router.proxy import reported_cached_tokens
from kvplane.router.request import parse_request

ROUTE_KINDS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


@dataclass(frozen=True, slots=True)
class PickerSettings:
    fallbacks: int = 0  # endpoints after the first, for a data plane that retries them
    max_body_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class RequestHead:
    """What the request-headers phase told of the request."""

    method: str
    path: str
    headers: dict[str, str]
    request_id: str
    subset: list[str] | None = None  # the data plane's envoy.lb.subset_hint
    role: Role = Role.USER  # the caller's, by the router's auth (auth.Gate)


class Ticket:
    """One picked request from the choice to the end of its response."""

    def __init__(
        self,
        router: Router,
        ranked: list[str],
        uncached: dict[str, int],
        prompt_tokens: int,
    ) -> None:
        self.router = router
        self.ranked = ranked
        self.uncached = uncached
        self.prompt_tokens = prompt_tokens
        self.pod = ranked[0]
        self.attempt = self._begin(self.pod)
        self.status = 0

    def _begin(self, pod: str) -> Attempt | None:
        state = self.router.pool.states.get(pod)
        if state is None:
            return None
        attempt = Attempt(state, self.uncached.get(pod, 0), time.perf_counter(), self.prompt_tokens)
        attempt.begin()
        return attempt

    def served(self, pod: str | None, status: int) -> dict[str, str]:
        """The response started (``pod``: where the data plane says it was served, if
        it says); the headers to add to it."""
        self.status = status
        if pod is not None and pod != self.pod:  # a fallback endpoint took it
            if self.attempt is not None:
                self.attempt.end()
            self.pod, self.attempt = pod, self._begin(pod)
        if status >= 500:
            return {}
        return self._answered(self.pod, self.attempts)

    @property
    def attempts(self) -> int:
        return self.ranked.index(self.pod) + 1 if self.pod in self.ranked else 1

    def _answered(self, pod: str, attempts: int) -> dict[str, str]:
        return {}

    def body(self, chunk: bytes) -> None:
        """A piece of the response body went by."""
        if self.attempt is not None:
            self.attempt.first()
        if b"cached_tokens" in chunk:
            cached = reported_cached_tokens(chunk)
            if cached is not None:
                self._reported(cached)

    def _reported(self, cached: int) -> None:
        pass

    def end(self) -> None:
        """The exchange is over (answered, failed, or the client left)."""
        if self.attempt is not None:
            self.attempt.end()


class RoutedTicket(Ticket):
    """An aggregated decision (``RoutingPipeline``)."""

    def __init__(self, router: Router, answer: Answer, ranked: list[str], n: int) -> None:
        d = answer.dispatch(b"", b"", b"", False)
        super().__init__(router, ranked, dict(d.uncached_tokens), n)
        self.answer = answer

    def _answered(self, pod: str, attempts: int) -> dict[str, str]:
        return self.answer.headers_for(pod, attempts)

    def _reported(self, cached: int) -> None:
        self.answer.reported(cached)

    def end(self) -> None:
        super().end()
        self.answer.done()


class PDTicket(Ticket):
    """A P/D decision (``PDService``): the decode leg through the data plane."""

    def __init__(
        self,
        router: Router,
        routed: PDRouted,
        ranked: list[str],
        served: Served,
        request_id: str,
        level: Disclosure,
    ) -> None:
        d = routed.decision
        n = len(routed.tokens)
        aggregated = served.prefill is None
        uncached = {
            p: (n - d.aggregated[p].prefill_terms.cached_tokens if p in d.aggregated else n)
            if aggregated
            else 0
            for p in ranked
        }
        super().__init__(router, ranked, uncached, n)
        self.routed, self.plan, self.request_id = routed, served, request_id
        self.level = level
        self.predicted: int | None = None

    def _answered(self, pod: str, attempts: int) -> dict[str, str]:
        assert self.router.pd is not None
        p = self.plan
        served = Served(p.reason, pod, p.prefill, p.prefill_attempts, attempts)
        headers, option = self.router.pd.answered(self.routed, served, self.request_id)
        self.predicted = option.prefill_terms.cached_tokens if option is not None else None
        return disclose(headers, self.level)

    def _reported(self, cached: int) -> None:
        if self.plan.prefill is None:  # a handed-off prompt's reuse was on the prefill pod
            m = self.router.metrics
            m.reported_cached.labels(**m.labels).inc(cached)
            if self.predicted is not None:
                m.predicted_cached.labels(**m.labels).inc(self.predicted)


@dataclass
class Pick:
    """Where a request goes: ``endpoints`` (``ip:port``, best first), the body to send
    when it is not the client's, the request headers to set, and its ticket."""

    endpoints: list[str]
    ticket: Ticket | None
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)


class Picker:
    def __init__(self, registry: ModelRegistry, settings: PickerSettings) -> None:
        self.registry = registry
        self.settings = settings
        self.gate = next(iter(registry)).gate  # the router's auth: the first pool's
        # the client's credentials stay at the gateway, as at the router (auth.forward_*)
        drop = HeaderPolicy.of(next(iter(registry)).config).drop
        self.strip = sorted(name.decode() for name in drop & CREDENTIALS)
        self._endpoints = {id(r): Endpoints(r.pool) for r in registry}
        for r in registry:
            if r.config.pd is not None and r.config.pd.connector is not PDConnector.NIXL:
                raise ValueError(
                    f"pool {r.config.pool}: the endpoint picker hands P/D requests off over "
                    f"NIXL; {r.config.pd.connector.value} needs the router (kvplane router)"
                )

    def endpoints(self, router: Router) -> Endpoints:
        return self._endpoints[id(router)]

    def _exclude(self, router: Router, head: RequestHead) -> frozenset[str]:
        if head.subset is None:
            return frozenset()
        return self.endpoints(router).outside(head.subset)

    def _targets(self, router: Router, ranked: list[str]) -> list[str]:
        eps = self.endpoints(router)
        return [eps.of(p) for p in ranked[: 1 + self.settings.fallbacks]]

    async def pick(self, head: RequestHead, body: bytes) -> Pick:
        """The endpoints for a request with a body; APIError (4xx/503) when there are
        none or the request is refused."""
        kind = ROUTE_KINDS.get(head.path)
        if kind is None or head.method != "POST":
            return self.pick_any(head, body)
        req = parse_request(body, kind)
        router = self.registry.resolve(req.model)
        started = time.perf_counter()
        exclude = self._exclude(router, head)
        if router.pd is not None:
            pick = await self._pick_pd(router, head, body, exclude)
        else:
            routed = await router.pipeline.route(req, exclude, defer_tail=True)
            d = routed.decision
            ranked = [p for p in d.ranked if p not in exclude]
            level = disclosure(head.role, router.config.auth)
            answer = Answer(router, routed, head.request_id, level)
            ticket = RoutedTicket(router, answer, ranked, routed.prompt.n_tokens)
            pick = Pick(self._targets(router, ranked), ticket)
        m = router.metrics
        m.added.labels(**m.labels).observe(time.perf_counter() - started)
        return pick

    async def _pick_pd(
        self, router: Router, head: RequestHead, raw: bytes, exclude: frozenset[str]
    ) -> Pick:
        pd = router.pd
        assert pd is not None
        req = parse_request(raw, ROUTE_KINDS[head.path])
        routed = await pd.route(req)
        d = routed.decision
        pd.admit(routed)
        headers = {"x-request-id": head.request_id}
        plan = Served(d.reason, d.decode, None, 0, 0)
        body: bytes | None = None
        if d.disaggregated:
            body_obj = dict(req.body)
            routed.booking.hold(router.pool.states.get(d.decode), len(routed.tokens))
            try:
                prefill, params, tries = await pd.nixl_prefill(routed, body_obj, head.path, headers)
            except ClientError as exc:
                raise APIError(exc.status, exc.content.decode(errors="replace")[:500]) from exc
            finally:
                routed.booking.release()
            if prefill is not None and params is not None:
                body = json.dumps(protocols.nixl_decode_body(body_obj, params)).encode()
                plan = Served(PDReason.DISAGGREGATED, d.decode, prefill, tries, 0)
            else:
                reason = PDReason.PREFILL_FAILED if prefill is None else PDReason.NO_KV_PARAMS
                plan = Served(reason, d.decode, None, tries, 0)
        first = plan.decode
        ranked = [first, *(p for p in d.decode_ranked if p != first)]
        ranked = [p for p in ranked if p not in exclude and p != plan.prefill]
        if not ranked:
            raise APIError(503, "no decode pod within the data plane's endpoint subset")
        level = disclosure(head.role, router.config.auth)
        ticket = PDTicket(router, routed, ranked, plan, head.request_id, level)
        return Pick(self._targets(router, ranked), ticket, body)

    def pick_any(self, head: RequestHead, body: bytes) -> Pick:
        """A request the router does not route by its prompt: the least loaded healthy
        pod of the pool its body names, else of the first pool."""
        router = next(iter(self.registry))
        model = _model_of(body)
        if model is not None:
            router = self.registry.resolve(model)
        exclude = self._exclude(router, head)
        states = router.pool.states
        pods = [p for p in router.pool.healthy() if p not in exclude]
        if not pods:
            raise APIError(503, f"no healthy backend for model '{router.config.model.name}'")
        ranked = sorted(pods, key=lambda p: (states[p].inflight, states[p].pending_tokens))
        return Pick(self._targets(router, ranked), Ticket(router, ranked, {}, 0))


def _model_of(body: bytes) -> str | None:
    if not body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None
