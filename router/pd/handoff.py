"""Serving one request through a prefill pod and a decode pod: the async edge.

- NIXL is sequential: the prefill leg returns the KV handle, then the decode leg
  carries it. A prefill pod that fails is replaced by the next-ranked one (up to
  ``pd.max_prefill_attempts``), then the decode pod prefills the request itself.
- Mooncake and SGLang are concurrent: both legs go out at once and the router
  waits for the prefill leg to finish and the decode leg to answer. A failed leg
  cancels the other (an engine aborts a request whose connection closes, freeing
  its blocks) and the pair is tried again with a fresh transfer id / room.
- A decode leg failing before its first byte (connection error, 5xx) moves to the
  next decode pod. Once bytes flow nothing is retried: a broken stream ends with
  an SSE error event, as in the aggregated proxy.

Every outcome is a reason label (``x-kvplane-reason``, ``kvplane_router_pd_decisions``)
or a leg failure (``kvplane_router_pd_leg_failures{leg,outcome}``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from kvplane.router import tracing
from kvplane.router.config import BackendRole, PDConnector, PDSpec, RouterConfig
from kvplane.router.cost import CostModel
from kvplane.router.errors import APIError, describe, sse_error
from kvplane.router.index.base import Blocks, PrefixMatches, ResidencyIndex
from kvplane.router.load import Attempt, Booking
from kvplane.router.pd import protocols
from kvplane.router.pd.choice import PDCandidates, PDDecision, PDReason, choose_pd
from kvplane.router.pd.cost import OptionCost, PDCostModel
from kvplane.router.pipeline import RoutingPipeline
from kvplane.router.pool import Pool
from kvplane.router.proxy import reported_cached_tokens
from kvplane.router.request import ParsedRequest
from kvplane.router.telemetry import RouterMetrics
from kvplane.router.tiers import Tier
from starlette.responses import Response, StreamingResponse

log = logging.getLogger("kvplane.router.pd")

_PASS_BACK = {"content-type", "x-request-id"}


class LegFailed(Exception):
    """A leg failed before any byte reached the client."""

    def __init__(self, pod: str, detail: str) -> None:
        super().__init__(f"{pod}: {detail}")
        self.pod = pod


class ClientError(Exception):
    """The prefill pod rejected the request itself (4xx): the client gets that answer."""

    def __init__(self, status: int, content: bytes, headers: Mapping[str, str]) -> None:
        super().__init__(status)
        self.status, self.content, self.headers = status, content, dict(headers)


@dataclass(frozen=True, slots=True)
class PDRouted:
    tokens: list[int]
    keys: list[int]
    decision: PDDecision
    matches: PrefixMatches | None
    booking: Booking = field(default_factory=Booking)
    max_tokens: int | None = None  # as requested (telemetry)


@dataclass
class Opened:
    """A decode leg that answered: its response (not yet read) and accounting."""

    pod: str
    response: httpx.Response
    attempt: Attempt


@dataclass
class Served:
    """How the request was finally served, for headers and metrics."""

    reason: str
    decode: str
    prefill: str | None
    prefill_attempts: int
    decode_attempts: int


def serves_both_ways(connector: PDConnector) -> bool:
    """A ``both`` pod also prefills for others: a NIXL engine is a KV producer and
    consumer at once (``kv_both``), so any pod can take either leg of a handoff."""
    return connector is PDConnector.NIXL


def can_aggregate(connector: PDConnector) -> bool:
    """A vLLM decode pod prefills a plain request itself; an SGLang decode-mode
    server only takes requests whose KV a prefill server sends."""
    return connector is not PDConnector.SGLANG


class BootstrapCache:
    """Engine ids a Mooncake prefill pod's bootstrap server reports, for a while."""

    def __init__(self, client: httpx.AsyncClient, ttl_s: float, timeout_s: float) -> None:
        self._client = client
        self._ttl = ttl_s
        self._timeout = timeout_s
        self._ids: dict[str, tuple[float, dict[int, str]]] = {}

    async def engine_ids(self, addr: str) -> dict[int, str]:
        hit = self._ids.get(addr)
        if hit is not None and hit[0] > time.monotonic():
            return hit[1]
        r = await self._client.get(addr + "/query", timeout=self._timeout)
        r.raise_for_status()
        ids = protocols.mooncake_engine_ids(r.json())
        self._ids[addr] = (time.monotonic() + self._ttl, ids)
        return ids

    def forget(self, addr: str) -> None:
        self._ids.pop(addr, None)


class PDService:
    """The P/D request path; built once per router when ``config.pd`` is set."""

    def __init__(
        self,
        config: RouterConfig,
        pipeline: RoutingPipeline,
        pool: Pool,
        index: ResidencyIndex,
        metrics: RouterMetrics,
        client: httpx.AsyncClient,
    ) -> None:
        assert config.pd is not None
        self.config = config
        self.pd: PDSpec = config.pd
        self.pipeline = pipeline
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.client = client
        self.model = PDCostModel(CostModel.of(config), config.pd)
        self.bootstrap = BootstrapCache(client, self.pd.bootstrap_cache_s, config.connect_timeout_s)
        self._tasks: set[asyncio.Task[Any]] = set()

    # --- choice ---------------------------------------------------------------------

    def candidates(self) -> tuple[list[str], list[str]]:
        """Healthy (prefill, decode) pods: ``prefill`` role, and ``decode`` or ``both``."""
        prefill: list[str] = []
        decode: list[str] = []
        flexible = serves_both_ways(self.pd.connector)
        for name in self.pool.healthy():
            role = self.pool.states[name].backend.role
            if role is not BackendRole.DECODE and (role is BackendRole.PREFILL or flexible):
                prefill.append(name)
            if role is not BackendRole.PREFILL:
                decode.append(name)
        return prefill, decode

    def alone(self, prefill: list[str]) -> list[str]:
        """Prefill pods that may serve a request they hold alone: NIXL's are kv_both
        (the operator renders them so), so a plain request runs there in full."""
        if not serves_both_ways(self.pd.connector):
            return []
        states = self.pool.states
        return [p for p in prefill if states[p].backend.role is BackendRole.PREFILL]

    async def route(self, req: ParsedRequest) -> PDRouted:
        tokens, keys = await self.pipeline.tokens_and_keys(req)
        multi = protocols.multi_sequence(req.body)
        with tracing.span("kvplane.choose"):
            routed = await self.decide(tokens, keys, multi, self.pipeline.adapter(req.model))
        return dataclasses.replace(routed, max_tokens=req.max_tokens)

    async def decide(
        self, tokens: list[int], keys: list[int], multi: bool = False, adapter: str | None = None
    ) -> PDRouted:
        prefill, decode = self.candidates()
        aggregate_ok = can_aggregate(self.pd.connector)
        if not decode or (not prefill and not aggregate_ok):
            raise APIError(
                503,
                f"no healthy {'decode' if not decode else 'prefill'} backend for model "
                f"'{self.config.model.name}' ({len(self.pool.states)} configured)",
            )
        matches = await self.pipeline.index.lookup(keys, prefill + decode)
        states = self.pool.states
        cands = PDCandidates(
            prefill=self.pool.loads(prefill),
            decode=self.pool.loads(decode),
            labels={p: states[p].backend.labels for p in prefill + decode},
            alone=self.alone(prefill),
        )
        decision = choose_pd(
            self.model,
            len(tokens),
            matches or {},
            cands,
            can_aggregate=aggregate_ok,
            multi_sequence=multi,
            adapter=adapter,
        )
        return PDRouted(tokens, keys, decision, matches)

    # --- the request ------------------------------------------------------------------

    async def serve(
        self,
        req: ParsedRequest,
        path: str,
        headers: dict[str, str],
        request_id: str,
        received: float,
    ) -> Response:
        routed = await self.route(req)
        d = routed.decision
        self.admit(routed)
        body = dict(req.body)
        m = self.metrics
        m.added.labels(**m.labels).observe(time.perf_counter() - received)
        if not d.disaggregated:
            return await self._aggregated(routed, body, path, headers, request_id, d.reason, 0)
        # The decode pod is booked while the prefill runs (its own leg starts later), so
        # that requests arriving meanwhile see it busy and decode work spreads.
        routed.booking.hold(self.pool.states.get(d.decode), len(routed.tokens))
        try:
            if self.pd.connector is PDConnector.NIXL:
                return await self._nixl(routed, body, path, headers, request_id)
            return await self._concurrent(routed, body, path, headers, request_id)
        finally:
            routed.booking.release()

    def admit(self, routed: PDRouted) -> None:
        """A routed request is taken: its prompt is counted, and the prefill work goes
        where it will run, for balancing and for the decode choice's exposure term."""
        d = routed.decision
        m = self.metrics
        m.prompt_tokens.labels(**m.labels).inc(len(routed.tokens))
        self.pool.observe_prompt(len(routed.tokens))
        uncached = len(routed.tokens) - d.chosen.prefill_terms.cached_tokens
        self.pool.note_routed(d.prefill or d.decode, uncached)

    def _count_leg(self, leg: str, outcome: str) -> None:
        m = self.metrics
        m.pd_leg_failures.labels(**m.labels, leg=leg, outcome=outcome).inc()

    def _decode_order(self, routed: PDRouted, first: str, exclude: str | None) -> list[str]:
        order = [first, *(p for p in routed.decision.decode_ranked if p != first)]
        return [p for p in order if p != exclude][: self.config.max_attempts]

    async def _aggregated(
        self,
        routed: PDRouted,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        request_id: str,
        reason: str,
        prefill_attempts: int,
    ) -> Response:
        """The decode pod prefills the request itself (with decode retries)."""
        d = routed.decision
        if reason == PDReason.PREFILL_FAILED or reason == PDReason.NO_KV_PARAMS:
            order = self._decode_order(routed, d.decode, None)
        else:
            order = d.decode_ranked[: self.config.max_attempts]
        raw = json.dumps(body).encode()
        return await self._decode_legs(
            routed, order, raw, body, path, headers, request_id, reason, None, prefill_attempts
        )

    async def _decode_legs(
        self,
        routed: PDRouted,
        order: list[str],
        raw: bytes,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        request_id: str,
        reason: str,
        prefill_pod: str | None,
        prefill_attempts: int,
    ) -> Response:
        """Send the decode leg down ``order`` until one pod answers (retries before the
        first byte). Without a prefill pod the decode pod prefills, so its uncached
        tokens count as pending prefill there."""
        d = routed.decision
        tries = 0
        for pod in order:
            tries += 1
            uncached = 0
            if prefill_pod is None:
                uncached = len(routed.tokens) - d.aggregated[pod].prefill_terms.cached_tokens
            try:
                opened = await self._open(pod, path, raw, headers, uncached, routed)
            except LegFailed as exc:
                self._decode_failed(exc, last=tries == len(order))
                continue
            served = Served(reason, pod, prefill_pod, prefill_attempts, tries)
            return await self._respond(routed, opened, body, request_id, served)
        raise APIError(502, f"every decode attempt failed ({tries} tried)")

    async def _nixl(
        self,
        routed: PDRouted,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        request_id: str,
    ) -> Response:
        d = routed.decision
        try:
            prefill_pod, params, tries = await self.nixl_prefill(routed, body, path, headers)
        except ClientError as exc:
            return self._client_error(exc, request_id)
        if prefill_pod is None:
            return await self._aggregated(
                routed, body, path, headers, request_id, PDReason.PREFILL_FAILED, tries
            )
        if params is None:
            self._count_leg("prefill", "no_kv_params")
            return await self._aggregated(
                routed, body, path, headers, request_id, PDReason.NO_KV_PARAMS, tries
            )
        raw = json.dumps(protocols.nixl_decode_body(body, params)).encode()
        order = self._decode_order(routed, d.decode, prefill_pod)
        return await self._decode_legs(
            routed,
            order,
            raw,
            body,
            path,
            headers,
            request_id,
            PDReason.DISAGGREGATED,
            prefill_pod,
            tries,
        )

    async def nixl_prefill(
        self, routed: PDRouted, body: dict[str, Any], path: str, headers: dict[str, str]
    ) -> tuple[str | None, dict[str, Any] | None, int]:
        """NIXL's prefill leg down the decision's prefill ranking: (the pod that
        prefilled or None, its ``kv_transfer_params`` or None, pods tried). Raises
        ClientError when a prefill pod refuses the request itself."""
        prefill_body = json.dumps(protocols.nixl_prefill_body(body)).encode()
        order = routed.decision.prefill_ranked[: self.pd.max_prefill_attempts]
        tries = 0
        for pod in order:
            tries += 1
            try:
                answer = await self._prefill(pod, path, prefill_body, headers, routed)
            except LegFailed as exc:
                log.warning("prefill leg failed: %s", exc)
                self._count_leg("prefill", "retried" if tries < len(order) else "fallback")
                continue
            return pod, protocols.kv_transfer_params(answer), tries
        return None, None, tries

    async def _concurrent(
        self,
        routed: PDRouted,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        request_id: str,
    ) -> Response:
        """Mooncake and SGLang: both legs at once, retried as a pair."""
        d = routed.decision
        prefills = iter(d.prefill_ranked[: self.pd.max_prefill_attempts])
        prefill = next(prefills)
        decodes = iter(self._decode_order(routed, d.decode, None))
        decode = next(decodes)
        ptries, dtries, attempt = 1, 1, 0
        while True:  # bounded: every pass consumes a prefill or a decode pod, or returns
            attempt += 1
            try:
                opened = await self._pair(
                    routed, body, path, headers, request_id, prefill, decode, attempt
                )
            except ClientError as exc:
                return self._client_error(exc, request_id)
            except _PairFailed as exc:
                log.warning("%s leg failed: %s", exc.leg, exc)
                if exc.leg == "prefill":
                    nxt = next(prefills, None)
                    if nxt is None:
                        outcome = "fallback" if can_aggregate(self.pd.connector) else "exhausted"
                        self._count_leg("prefill", outcome)
                        break
                    self._count_leg("prefill", "retried")
                    prefill, ptries = nxt, ptries + 1
                else:
                    nxt = next(decodes, None)
                    self._count_leg("decode", "retried" if nxt is not None else "exhausted")
                    if nxt is None:
                        raise APIError(
                            502, f"every decode attempt failed ({dtries} tried)"
                        ) from exc
                    decode, dtries = nxt, dtries + 1
                continue
            served = Served(PDReason.DISAGGREGATED, decode, prefill, ptries, dtries)
            return await self._respond(routed, opened, body, request_id, served)
        if not can_aggregate(self.pd.connector):
            raise APIError(502, f"every prefill attempt failed ({ptries} tried)")
        return await self._aggregated(
            routed, body, path, headers, request_id, PDReason.PREFILL_FAILED, ptries
        )

    async def _pair(
        self,
        routed: PDRouted,
        body: dict[str, Any],
        path: str,
        headers: dict[str, str],
        request_id: str,
        prefill: str,
        decode: str,
        attempt: int,
    ) -> Opened:
        state = self.pool.states.get(prefill)
        if state is None:
            raise _PairFailed("prefill", prefill, "gone")
        port = state.backend.bootstrap_port or self.pd.bootstrap_port
        leg_headers = dict(headers)
        if self.pd.connector is PDConnector.MOONCAKE:
            addr = protocols.bootstrap_addr(state.backend.url, port)
            try:
                ids = await self.bootstrap.engine_ids(addr)
            except (httpx.HTTPError, ValueError) as exc:
                raise _PairFailed("prefill", prefill, f"bootstrap {addr}: {exc}") from exc
            rank = protocols.pick_dp_rank(ids, request_id)
            xfer = protocols.transfer_id(request_id, attempt)
            p_body = protocols.mooncake_prefill_body(body, xfer)
            d_body = protocols.mooncake_decode_body(body, xfer, addr, ids[rank])
            if len(ids) > 1:
                leg_headers[protocols.DP_RANK_HEADER] = str(rank)
        else:
            host = protocols.host_of(state.backend.url)
            size = protocols.batch_size(body)
            rooms: int | list[int] = (
                [protocols.bootstrap_room() for _ in range(size)]
                if size is not None
                else protocols.bootstrap_room()
            )
            p_body = d_body = protocols.sglang_body(body, host, port, rooms)
        p_raw, d_raw = json.dumps(p_body).encode(), json.dumps(d_body).encode()
        p_task = asyncio.create_task(self._prefill(prefill, path, p_raw, leg_headers, routed))
        d_task = asyncio.create_task(self._open(decode, path, d_raw, leg_headers, 0, routed))
        try:
            pending: set[asyncio.Task[Any]] = {p_task, d_task}
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    error = task.exception()
                    if isinstance(error, ClientError):
                        raise error
                    if isinstance(error, LegFailed):
                        leg = "prefill" if task is p_task else "decode"
                        if leg == "prefill" and self.pd.connector is PDConnector.MOONCAKE:
                            self.bootstrap.forget(protocols.bootstrap_addr(state.backend.url, port))
                        raise _PairFailed(leg, error.pod, str(error)) from error
                    if error is not None:
                        raise error
        except BaseException:
            await _cancel_and_close(p_task, d_task)
            raise
        opened: Opened = d_task.result()
        return opened

    # --- legs -------------------------------------------------------------------------

    async def _prefill(
        self, pod: str, path: str, raw: bytes, headers: dict[str, str], routed: PDRouted
    ) -> Any:
        """POST the prefill leg and read its JSON (or drain its stream)."""
        state = self.pool.states.get(pod)
        if state is None or not state.healthy:
            raise LegFailed(pod, "not healthy")
        option = _option_for(routed.decision, pod)
        cached = option.prefill_terms.cached_tokens if option is not None else 0
        attempt = Attempt(
            state, len(routed.tokens) - cached, time.perf_counter(), len(routed.tokens)
        )
        attempt.begin()
        url = state.backend.url.rstrip("/") + path
        try:
            with tracing.span("kvplane.pd.prefill", True):
                if tracing.on():
                    tracing.set_attributes(pod=pod)
                r = await self.client.post(
                    url,
                    content=raw,
                    headers=tracing.inject({**headers, **state.backend.headers}),
                    timeout=self._prefill_timeout(),
                )
        except httpx.TransportError as exc:
            self.pool.mark_unhealthy(pod, f"prefill leg: {describe(exc)}")
            raise LegFailed(pod, describe(exc)) from exc
        finally:
            attempt.end()
        if r.status_code >= 500:
            raise LegFailed(pod, f"HTTP {r.status_code} {r.text[:300]}")
        if r.status_code >= 400:
            raise ClientError(r.status_code, r.content, r.headers)
        self._mark_tentative(pod, routed)
        try:
            return r.json()
        except ValueError:
            return None  # a drained SSE stream (SGLang gets the client's body as is)

    def _prefill_timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.pd.prefill_timeout_s, connect=self.config.connect_timeout_s)

    async def _open(
        self,
        pod: str,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        uncached: int,
        routed: PDRouted,
    ) -> Opened:
        """Send a decode leg and wait for its status line; failures before it are
        LegFailed (the caller retries elsewhere). From here the leg's ``Attempt`` counts
        the request on the decode pod, so the booking ends."""
        state = self.pool.states.get(pod)
        if state is None or not state.healthy:
            raise LegFailed(pod, "not healthy")
        attempt = Attempt(state, uncached, time.perf_counter(), len(routed.tokens))
        attempt.begin()
        routed.booking.release()
        url = state.backend.url.rstrip("/") + path
        try:
            with tracing.span("kvplane.pd.decode", True):
                if tracing.on():
                    tracing.set_attributes(pod=pod)  # the span ends at its first byte
                req = self.client.build_request(
                    "POST",
                    url,
                    content=raw,
                    headers=tracing.inject({**headers, **state.backend.headers}),
                )
                resp = await self.client.send(req, stream=True)
        except httpx.TransportError as exc:
            attempt.end()
            self.pool.mark_unhealthy(pod, f"decode leg: {describe(exc)}")
            raise LegFailed(pod, describe(exc)) from exc
        except BaseException:
            attempt.end()
            raise
        if resp.status_code >= 500:
            try:
                detail = (await resp.aread())[:300].decode(errors="replace")
            except httpx.HTTPError:
                detail = ""
            finally:
                await resp.aclose()
                attempt.end()
            raise LegFailed(pod, f"HTTP {resp.status_code} {detail}".strip())
        return Opened(pod, resp, attempt)

    def _decode_failed(self, exc: LegFailed, last: bool) -> None:
        log.warning("decode leg failed before its first byte: %s", exc)
        self._count_leg("decode", "exhausted" if last else "retried")

    def _mark_tentative(self, pod: str, routed: PDRouted) -> None:
        """The pod will hold the prompt's blocks until its events say otherwise."""
        held = routed.matches.get(pod, {}).get(Tier.HBM, 0) if routed.matches else 0
        if len(routed.keys) > held:
            task = asyncio.create_task(
                self.index.mark_tentative(
                    pod, Blocks.of_prompt(routed.keys, held), self.config.cost.tentative_ttl_s
                )
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _client_error(self, exc: ClientError, request_id: str) -> Response:
        passed = {k: v for k, v in exc.headers.items() if k.lower() in _PASS_BACK}
        return Response(
            exc.content, status_code=exc.status, headers={**passed, "x-request-id": request_id}
        )

    # --- the answer -------------------------------------------------------------------

    def _headers(self, routed: PDRouted, served: Served, request_id: str) -> dict[str, str]:
        d = routed.decision
        option = (
            _pair_option(d, served.prefill, served.decode)
            if served.prefill is not None
            else d.aggregated.get(served.decode)
        )
        out = {
            "x-request-id": request_id,
            "x-kvplane-pod": served.decode,
            "x-kvplane-reason": served.reason,
            "x-kvplane-pd": "disaggregated" if served.prefill is not None else "aggregated",
            "x-kvplane-pd-connector": self.pd.connector.value,
            "x-kvplane-decode-pod": served.decode,
            "x-kvplane-attempts": str(served.decode_attempts),
            "x-kvplane-prefill-attempts": str(served.prefill_attempts),
            "x-kvplane-prompt-tokens": str(len(routed.tokens)),
        }
        if served.prefill is not None:
            out["x-kvplane-prefill-pod"] = served.prefill
        if option is not None:
            out["x-kvplane-predicted-ttft-ms"] = f"{option.ttft_ms:.2f}"
            out["x-kvplane-predicted-cached-tokens"] = str(option.prefill_terms.cached_tokens)
            if option.link is not None:
                out["x-kvplane-pd-link"] = option.link.value
                out["x-kvplane-predicted-transfer-ms"] = f"{option.transfer_ms:.3f}"
                out["x-kvplane-predicted-transfer-bytes"] = str(option.transfer_bytes)
        return out

    def _record(self, routed: PDRouted, served: Served) -> OptionCost | None:
        m = self.metrics
        m.pd_decisions.labels(**m.labels, reason=served.reason).inc()
        m.decisions.labels(**m.labels, reason=served.reason, pod=served.decode).inc()
        if served.prefill is None:
            option = routed.decision.aggregated.get(served.decode)
        else:
            option = _pair_option(routed.decision, served.prefill, served.decode)
            m.pd_pairs.labels(**m.labels, prefill=served.prefill, decode=served.decode).inc()
        if option is not None and option.link is not None:
            link = option.link.value
            m.pd_transfer_bytes.labels(**m.labels, link=link).inc(option.transfer_bytes)
            m.pd_transfer_seconds.labels(**m.labels, link=link).observe(option.transfer_ms / 1000)
        terms = option.prefill_terms if option is not None else None
        m.chose(terms, routed.max_tokens, option.ttft_ms if option is not None else None)
        return option

    def answered(
        self, routed: PDRouted, served: Served, request_id: str
    ) -> tuple[dict[str, str], OptionCost | None]:
        """A decode pod answered: the outcome is recorded, the decode pod is marked as
        holding the prompt (a prefill pod was marked when its leg returned), and the
        response's headers say how it was served; also the option that was served,
        if the decision costed it."""
        option = self._record(routed, served)
        self._mark_tentative(served.decode, routed)
        return self._headers(routed, served, request_id), option

    async def _respond(
        self,
        routed: PDRouted,
        opened: Opened,
        body: Mapping[str, Any],
        request_id: str,
        served: Served,
    ) -> Response:
        m = self.metrics
        resp, attempt = opened.response, opened.attempt
        m.backend_ttft.labels(**m.labels, pod=opened.pod).observe(
            time.perf_counter() - attempt.started
        )
        answer_headers, option = self.answered(routed, served, request_id)
        headers = {
            **{k: v for k, v in resp.headers.items() if k.lower() in _PASS_BACK},
            **answer_headers,
        }
        predicted = option.prefill_terms.cached_tokens if option is not None else None
        aggregated = served.prefill is None

        def on_reported(cached: int) -> None:
            if aggregated:  # a handed-off prompt's reuse was on the prefill pod
                m.reported_cached.labels(**m.labels).inc(cached)
                if predicted is not None:
                    m.predicted_cached.labels(**m.labels).inc(predicted)

        if body.get("stream") is True and resp.status_code == 200:
            return StreamingResponse(
                _relay(resp, attempt, opened.pod, on_reported),
                status_code=resp.status_code,
                headers=headers,
            )
        try:
            content = await resp.aread()
        except httpx.HTTPError as exc:
            raise APIError(502, f"{opened.pod}: response broke: {exc}") from exc
        finally:
            await resp.aclose()
            attempt.end()
        cached = reported_cached_tokens(content)
        if cached is not None:
            on_reported(cached)
        return Response(content, status_code=resp.status_code, headers=headers)

    # --- explain ----------------------------------------------------------------------

    def explain(self, routed: PDRouted) -> dict[str, Any]:
        d = routed.decision

        def option(o: OptionCost) -> dict[str, Any]:
            return {
                "prefill": o.prefill,
                "decode": o.decode,
                "ttft_ms": o.ttft_ms,
                "score_ms": o.score_ms,
                "queue_ms": o.prefill_terms.queue_ms,
                "recompute_ms": o.prefill_terms.recompute_ms,
                "tier_transfer_ms": o.prefill_terms.transfer_ms,
                "cached_tokens": o.prefill_terms.cached_tokens,
                "link": o.link.value if o.link is not None else None,
                "transfer_tokens": o.transfer_tokens,
                "transfer_bytes": o.transfer_bytes,
                "transfer_ms": o.transfer_ms,
                "decode_ms": o.decode_ms,
                "interference_ms": o.interference_ms,
                "balance_ms": o.balance_ms,
                "backlog_ms": o.backlog_ms,
            }

        return {
            "pod": d.decode,
            "prefill_pod": d.prefill,
            "reason": d.reason,
            "connector": self.pd.connector.value,
            "prompt_tokens": len(routed.tokens),
            "blocks": len(routed.keys),
            "index_available": routed.matches is not None,
            "chosen": option(d.chosen),
            "decode_ranked": d.decode_ranked,
            "prefill_ranked": d.prefill_ranked,
            "options": [option(o) for o in d.options],
            "aggregated": [option(o) for o in d.aggregated.values()],
        }


class _PairFailed(Exception):
    def __init__(self, leg: str, pod: str, detail: str) -> None:
        super().__init__(detail if detail.startswith(f"{pod}:") else f"{pod}: {detail}")
        self.leg, self.pod = leg, pod


def _options(d: PDDecision) -> Iterator[OptionCost]:
    yield d.chosen
    yield from d.options


def _pair_option(d: PDDecision, prefill: str, decode: str) -> OptionCost | None:
    return next((o for o in _options(d) if o.prefill == prefill and o.decode == decode), None)


def _option_for(d: PDDecision, prefill: str) -> OptionCost | None:
    return next((o for o in _options(d) if o.prefill == prefill), None)


async def _cancel_and_close(*tasks: asyncio.Task[Any]) -> None:
    """Cancel legs still running; close a decode leg that had already answered."""
    for task in tasks:
        if not task.done():
            task.cancel()
    for task in tasks:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            result = await task
            if isinstance(result, Opened):
                await result.response.aclose()
                result.attempt.end()


async def _relay(
    resp: httpx.Response, attempt: Attempt, pod: str, on_reported: Callable[[int], None]
) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            attempt.first()
            if b"cached_tokens" in chunk:
                cached = reported_cached_tokens(chunk)
                if cached is not None:
                    on_reported(cached)
            yield chunk
    except httpx.HTTPError as exc:
        log.warning("stream from %s broke: %s", pod, exc)
        yield sse_error(f"backend {pod} stream broke: {type(exc).__name__}")
    finally:
        attempt.end()
        await resp.aclose()
