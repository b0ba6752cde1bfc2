"""Forward a request to the chosen pod: retries before the first byte, streaming
pass-through after it, and the in-flight accounting the cost model reads.

A backend that fails before sending a response (connection refused or reset,
read timeout, 5xx) is retried on the next pod of the decision's ranking. Once
bytes have reached the client nothing can be retried: a stream that breaks ends
with an SSE error event and ``[DONE]``, never a hang (reads have a timeout).

The response is written straight to the ASGI ``send`` callable: no response
object or async generator per request (see forwarder.py for the client side).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvplane.router.errors import APIError, sse_error
from kvplane.router.forwarder import (
    BackendUnavailable,
    Forwarder,
    ResponseBroken,
    UpstreamResponse,
)
from kvplane.router.load import Attempt
from kvplane.router.pool import Pool
from kvplane.router.telemetry import RouterMetrics
from starlette.types import Receive, Send

log = logging.getLogger("kvplane.router.proxy")

_PASS_BACK = (b"content-type", b"x-request-id")


class DispatchObserver(Protocol):
    """How the caller hears of a dispatch's progress."""

    def headers_for(self, pod: str, attempts: int) -> dict[str, str]:
        """``pod`` answered (after ``attempts`` tries): the headers to add to the response."""

    def reported(self, cached_tokens: int) -> None:
        """The engine reported how many prompt tokens it found cached."""


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One request for the proxy: what to send, where to try it, whom to tell."""

    path: bytes
    body: bytes
    header_lines: bytes  # the client's headers, ready for the wire (headers.header_lines)
    ranked: list[str]  # pods to try, best first
    uncached_tokens: Mapping[str, int]  # per pod: the prefill it would have to do
    prompt_tokens: int
    stream: bool
    observer: DispatchObserver


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


def _response_head(resp: UpstreamResponse, extra: Mapping[str, str]) -> dict[bytes, bytes]:
    out = {name: value for name, value in resp.headers if name in _PASS_BACK}
    for k, v in extra.items():
        out[k.encode("latin-1")] = v.encode("latin-1")
    return out


async def _until_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body is already read)."""
    while True:  # after the body, servers send nothing but the disconnect
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Proxy:
    def __init__(
        self, forwarder: Forwarder, pool: Pool, metrics: RouterMetrics, max_attempts: int
    ) -> None:
        self._fwd = forwarder
        self._pool = pool
        self._m = metrics
        self._max_attempts = max_attempts
        self._ttft: dict[str, Any] = {}  # per-pod histogram children: labels() costs

    async def send(self, d: Dispatch, receive: Receive, send: Send) -> int:
        """Try pods in ``d.ranked`` order and write the answer to ``send`` with
        ``d.observer.headers_for(pod, attempts)`` added; returns its status. Raises
        APIError (nothing sent) when every attempt failed before a response."""
        last_error = "no backend attempted"
        tried = 0
        for pod in d.ranked:
            state = self._pool.states.get(pod)
            if state is None or not state.healthy:
                continue
            if tried >= self._max_attempts:
                break
            tried += 1
            if tried > 1:
                self._m.retries.labels(**self._m.labels, pod=pod).inc()
            attempt = Attempt(
                state, d.uncached_tokens.get(pod, 0), time.perf_counter(), d.prompt_tokens
            )
            attempt.begin()
            try:
                resp = await self._fwd.post(state.backend.url, d.path, d.header_lines, d.body)
            except BackendUnavailable as exc:
                attempt.end()
                self._pool.mark_unhealthy(pod)
                last_error = f"{pod}: {exc}"
                log.warning("backend %s failed before the first byte: %s", pod, exc)
                continue
            except BaseException:
                attempt.end()
                raise
            if resp.status >= 500:
                try:
                    detail = (await resp.read())[:300].decode(errors="replace")
                except ResponseBroken:
                    detail = ""
                finally:
                    resp.release()
                    attempt.end()
                last_error = f"{pod}: HTTP {resp.status} {detail}".strip()
                log.warning("backend %s answered %s; trying another pod", pod, resp.status)
                continue
            self._observe_ttft(pod, time.perf_counter() - attempt.started)
            head = _response_head(resp, d.observer.headers_for(pod, tried))
            status = resp.status
            if d.stream and status == 200:
                await self._relay(resp, attempt, pod, d.observer, head, receive, send)
                return status
            try:
                content = await resp.read()
            except ResponseBroken as exc:
                last_error = f"{pod}: response broke: {exc}"
                continue
            finally:
                resp.release()
                attempt.end()
            cached = reported_cached_tokens(content)
            if cached is not None:
                d.observer.reported(cached)
            head[b"content-length"] = b"%d" % len(content)
            await send({"type": "http.response.start", "status": status, "headers": head.items()})
            await send({"type": "http.response.body", "body": content})
            return status
        raise APIError(502, f"every backend attempt failed ({tried} tried); last: {last_error}")

    def close(self) -> None:
        self._fwd.close()

    def retain(self, urls: Iterable[str]) -> None:
        """Forget connection pools of backends that left the pool."""
        self._fwd.retain(urls)

    def _observe_ttft(self, pod: str, seconds: float) -> None:
        child = self._ttft.get(pod)
        if child is None:
            child = self._ttft[pod] = self._m.backend_ttft.labels(**self._m.labels, pod=pod)
        child.observe(seconds)

    async def _relay(
        self,
        resp: UpstreamResponse,
        attempt: Attempt,
        pod: str,
        observer: DispatchObserver,
        head: dict[bytes, bytes],
        receive: Receive,
        send: Send,
    ) -> None:
        """Streams the body piece by piece; a client that leaves drops the backend
        connection, so the engine stops generating for nobody."""
        gone = asyncio.ensure_future(_until_disconnect(receive))

        def client_left(f: asyncio.Future[None]) -> None:
            if not f.cancelled():
                # Free the pod first: the socket closes on a later loop turn, so by the
                # time the engine sees the close the router no longer counts it busy.
                attempt.end()
                resp.abort()

        gone.add_done_callback(client_left)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": head.items()})
            while True:
                try:
                    chunk = await resp.next_chunk()
                except ResponseBroken as exc:
                    if not gone.done():
                        log.warning("stream from %s broke: %s", pod, exc)
                    msg = sse_error(f"backend {pod} stream broke: {exc}")
                    await send({"type": "http.response.body", "body": msg, "more_body": True})
                    break
                if chunk is None:
                    break
                attempt.first()
                if b"cached_tokens" in chunk:
                    cached = reported_cached_tokens(chunk)
                    if cached is not None:
                        observer.reported(cached)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            attempt.end()
            resp.release()
