"""Forward a request to the chosen pod: retries before the first byte, streaming
pass-through after it, and the in-flight accounting the cost model reads.

A backend that fails before sending a response (connection refused or reset,
5xx) is retried on the next pod of the decision's ranking. Once bytes have
reached the client nothing can be retried: a stream that breaks ends with an
SSE error event and ``[DONE]``, never a hang (reads have a timeout).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import httpx
from kvplane.router.errors import APIError, sse_error
from kvplane.router.pool import BackendState, Pool
from kvplane.router.telemetry import RouterMetrics
from starlette.responses import Response, StreamingResponse

log = logging.getLogger("kvplane.router.proxy")

_HOP = {
    "host",
    "content-length",
    "connection",
    "keep-alive",
    "transfer-encoding",
    "upgrade",
    "te",
    "trailer",
    "proxy-authorization",
    "proxy-connection",
    "accept-encoding",
}
_PASS_BACK = {"content-type", "x-request-id"}


@dataclass
class Attempt:
    """One send to one pod, with the accounting to undo when it ends."""

    state: BackendState
    uncached_tokens: int
    started: float
    first_byte: bool = False
    done: bool = False

    def begin(self) -> None:
        s = self.state
        s.pending_tokens += self.uncached_tokens
        s.pending_requests += 1
        s.inflight += 1

    def first(self) -> None:
        if not self.first_byte:
            self.first_byte = True
            self.state.pending_tokens -= self.uncached_tokens
            self.state.pending_requests -= 1

    def end(self) -> None:
        if not self.done:
            self.first()
            self.done = True
            self.state.inflight -= 1


def forward_headers(headers: Mapping[str, str], request_id: str) -> dict[str, str]:
    out = {k: v for k, v in headers.items() if k.lower() not in _HOP}
    out["x-request-id"] = request_id
    return out


def reported_cached_tokens(payload: bytes) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` from a response or SSE chunk."""
    if b"cached_tokens" not in payload:
        return None
    for part in payload.split(b"\n"):
        line = part[5:].strip() if part.startswith(b"data:") else part.strip()
        if b"cached_tokens" not in line:
            continue
        try:
            usage = json.loads(line).get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            value = details.get("cached_tokens")
        except (ValueError, AttributeError):
            continue
        if isinstance(value, int):
            return value
    return None


class Proxy:
    def __init__(
        self, client: httpx.AsyncClient, pool: Pool, metrics: RouterMetrics, max_attempts: int
    ) -> None:
        self._client = client
        self._pool = pool
        self._m = metrics
        self._max_attempts = max_attempts

    async def send(
        self,
        path: str,
        body: bytes,
        headers: dict[str, str],
        ranked: list[str],
        uncached_tokens: Mapping[str, int],
        stream: bool,
        response_headers: Callable[[str, int], dict[str, str]],
        on_reported: Callable[[int], None],
    ) -> Response:
        """Try pods in ``ranked`` order; the response carries ``response_headers(pod, n)``."""
        labels = self._m.labels
        last_error = "no backend attempted"
        tried = 0
        for pod in ranked:
            state = self._pool.states.get(pod)
            if state is None or not state.healthy:
                continue
            if tried >= self._max_attempts:
                break
            tried += 1
            if tried > 1:
                self._m.retries.labels(**labels, pod=pod).inc()
            attempt = Attempt(state, uncached_tokens.get(pod, 0), time.perf_counter())
            attempt.begin()
            url = state.backend.url.rstrip("/") + path
            try:
                req = self._client.build_request("POST", url, content=body, headers=headers)
                resp = await self._client.send(req, stream=True)
            except httpx.TransportError as exc:
                attempt.end()
                self._pool.mark_unhealthy(pod)
                last_error = f"{pod}: {type(exc).__name__}: {exc}"
                log.warning("backend %s failed before the first byte: %s", pod, exc)
                continue
            if resp.status_code >= 500:
                try:
                    detail = (await resp.aread())[:300].decode(errors="replace")
                except httpx.HTTPError:
                    detail = ""
                await resp.aclose()
                attempt.end()
                last_error = f"{pod}: HTTP {resp.status_code} {detail}".strip()
                log.warning("backend %s answered %s; trying another pod", pod, resp.status_code)
                continue
            ttft = time.perf_counter() - attempt.started
            self._m.backend_ttft.labels(**labels, pod=pod).observe(ttft)
            extra = response_headers(pod, tried)
            passed = {k: v for k, v in resp.headers.items() if k.lower() in _PASS_BACK}
            if stream and resp.status_code == 200:
                return StreamingResponse(
                    self._relay(resp, attempt, pod, on_reported),
                    status_code=resp.status_code,
                    headers={**passed, **extra},
                )
            try:
                content = await resp.aread()
            except httpx.HTTPError as exc:
                last_error = f"{pod}: response broke: {exc}"
                continue
            finally:
                await resp.aclose()
                attempt.end()
            cached = reported_cached_tokens(content)
            if cached is not None:
                on_reported(cached)
            return Response(content, status_code=resp.status_code, headers={**passed, **extra})
        raise APIError(502, f"every backend attempt failed ({tried} tried); last: {last_error}")

    async def _relay(
        self,
        resp: httpx.Response,
        attempt: Attempt,
        pod: str,
        on_reported: Callable[[int], None],
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
