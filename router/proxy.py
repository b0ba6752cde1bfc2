"""Forward a request to the chosen pod: retries before the first byte, streaming
pass-through after it, and the in-flight accounting the cost model reads.

Before anything reaches the client a failed attempt moves to the next pod of the
decision's ranking, and whose fault it was decides what happens to the pod:

* unreachable (connect refused or timed out): marked unhealthy until the scraper
  reaches its ``/health`` again;
* a stream whose first chunk does not come within ``first_byte_timeout_s`` plus
  ``STALL_FACTOR`` x the pod's predicted TTFT: the engine took the request and
  stalls (a hung engine still answers ``/health``), so the pod is demoted for a
  back-off (``Pool.demote``) and the request goes elsewhere;
* the request refused (connection closed without an answer, or a 5xx): judged
  by the next pod. If another pod serves it, the refusing pods are demoted (they
  fail what others serve: every later request would pay the extra attempt); if
  ``POISON_AFTER`` pods refuse it, the request is at fault: it ends there (502, or
  the engine's own 5xx answer) and no pod is demoted;
* a non-streamed request whose engine computes nothing (its token counters, read
  by the scraper, stand still) for as long as a stream's first chunk may take: the
  engine is hung behind a fine ``/health``; as for a stalled stream the pod is
  demoted and the request goes elsewhere (the answer of a non-streamed request
  comes whole at its end, so its first byte says nothing until then);
* a non-streamed request with no answer within ``read_timeout_s`` while its engine
  computes: the engine accepted it and is generating, so it is neither retried
  (another pod would generate it all again) nor held against the pod: 504.

Once bytes have reached the client nothing can be retried: a stream that breaks
ends with an SSE error event and ``[DONE]``, never a hang (reads have a timeout).
A client that leaves aborts the backend request, streamed or not (the engine
stops generating for nobody).

The response is written straight to the ASGI ``send`` callable: no response
object or async generator per request (see forwarder.py for the client side).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvplane.router.errors import APIError, sse_error
from kvplane.router.forwarder import (
    BackendUnavailable,
    Cause,
    Forwarder,
    ResponseBroken,
    UpstreamResponse,
)
from kvplane.router.load import Attempt
from kvplane.router.pool import BackendState, Pool
from kvplane.router.telemetry import RouterMetrics
from starlette.types import Receive, Send

log = logging.getLogger("kvplane.router.proxy")

_PASS_BACK = (b"content-type", b"x-request-id")
STALL_FACTOR = 4.0  # a stream's first chunk may take this many predicted TTFTs (+ the floor)
POISON_AFTER = 2  # pods that refuse one request before it is judged to be at fault
CLIENT_GONE = 499  # the status a request whose client left is counted under
_RECHECK_S = 0.25  # how often a non-streamed request's wait looks at its engine's progress


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
    predicted_ttft_s: Mapping[str, float] = field(default_factory=dict)  # per pod
    # reads a successful answer's body (whole, or each streamed chunk) before the client
    # gets it: what the router must learn from an answer (a stored response's id)
    tap: Callable[[bytes], Awaitable[None]] | None = None


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


async def _unless_still(
    post: Coroutine[Any, Any, UpstreamResponse], state: BackendState, still_s: float
) -> UpstreamResponse:
    """``post``'s response head, unless the engine computes nothing for ``still_s``
    while it waits (``BackendState.still_for``): then the request is abandoned
    (closing its connection aborts it in the engine) and BackendUnavailable raised."""
    if state.stats.progress is None:  # no progress figure (SGLang): nothing to watch
        return await post
    task = asyncio.ensure_future(post)
    since = time.monotonic()
    try:
        while True:
            still = state.still_for(since)
            if still >= still_s:
                raise BackendUnavailable(
                    f"the engine computed nothing for {still:.1f} s with the request in "
                    "flight (its /health answers)",
                    Cause.STALLED,
                )
            # wake when the next scrape could prove it: at the deadline, or soon after
            done, _ = await asyncio.wait({task}, timeout=max(still_s - still, _RECHECK_S))
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


class _ClientWatch:
    """While armed, a client that leaves cancels the task waiting on a backend (the
    backend connection closes as the wait unwinds, so the engine aborts the request)."""

    def __init__(self) -> None:
        self.task = asyncio.current_task()
        self.armed = True
        self.left = False

    def __call__(self, gone: asyncio.Future[None]) -> None:
        if gone.cancelled():
            return
        self.left = True
        if self.armed and self.task is not None:
            self.task.cancel()


class Proxy:
    def __init__(
        self,
        forwarder: Forwarder,
        pool: Pool,
        metrics: RouterMetrics,
        max_attempts: int,
        first_byte_timeout_s: float = 30.0,
    ) -> None:
        self._fwd = forwarder
        self._pool = pool
        self._m = metrics
        self._max_attempts = max_attempts
        self._first_byte_s = first_byte_timeout_s
        self._ttft: dict[str, Any] = {}  # per-pod histogram children: labels() costs

    async def send(self, d: Dispatch, receive: Receive, send: Send) -> int:
        """Try pods in ``d.ranked`` order and write the answer to ``send`` with
        ``d.observer.headers_for(pod, attempts)`` added; returns its status. Raises
        APIError (nothing sent) when no attempt gave an answer to relay."""
        gone = asyncio.ensure_future(_until_disconnect(receive))
        watch = _ClientWatch()
        gone.add_done_callback(watch)
        try:
            return await self._attempts(d, gone, watch, send)
        except asyncio.CancelledError:
            if not watch.left or watch.task is None:
                raise
            watch.task.uncancel()  # our own cancel: the client left
            return CLIENT_GONE
        finally:
            gone.cancel()

    async def _attempts(
        self, d: Dispatch, gone: asyncio.Future[None], watch: _ClientWatch, send: Send
    ) -> int:
        last_error = "no backend attempted"
        tried = 0
        refused: list[str] = []  # pods that refused this request (closed, 5xx)
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
            # a stream's first chunk is due by then; a non-streamed answer may take
            # longer, as long as its engine computes
            stall_s = self._first_byte_s + STALL_FACTOR * d.predicted_ttft_s.get(pod, 0.0)
            first_s = stall_s if d.stream else None
            attempt.begin()
            try:
                lines = d.header_lines + state.header_lines
                post = self._fwd.post(state.backend.url, d.path, lines, d.body, first_s)
                resp = await (post if d.stream else _unless_still(post, state, stall_s))
            except BackendUnavailable as exc:
                attempt.end()
                last_error = f"{pod}: {exc}"
                self._failed(pod, exc.cause, str(exc), d.stream, refused)
                continue
            except BaseException:
                attempt.end()
                raise
            if resp.status >= 500:
                try:
                    content = await resp.read()
                except ResponseBroken:
                    content = b""
                finally:
                    resp.release()
                    attempt.end()
                detail = content[:300].decode(errors="replace")
                last_error = f"{pod}: HTTP {resp.status} {detail}".strip()
                log.warning("backend %s answered %s; trying another pod", pod, resp.status)
                refused.append(pod)
                if len(refused) >= POISON_AFTER:  # the request's fault: pass the answer on
                    return await self._relay_whole(d, resp, pod, tried, content, send, refused)
                continue
            first: bytes | None = None
            if d.stream and resp.status == 200:
                assert first_s is not None
                left = first_s - (time.perf_counter() - attempt.started)
                try:
                    first = await resp.next_chunk(max(left, 0.001))
                except ResponseBroken as exc:
                    resp.release()
                    attempt.end()
                    last_error = f"{pod}: {exc}"
                    cause = Cause.TIMEOUT if exc.timed_out else Cause.CLOSED
                    self._failed(pod, cause, str(exc), True, refused)
                    continue
                except BaseException:
                    resp.release()
                    attempt.end()
                    raise
            state.answered()
            for pod_at_fault in refused:  # failed what this pod serves
                self._pool.demote(pod_at_fault, "failed a request another pod served")
            self._observe_ttft(pod, time.perf_counter() - attempt.started)
            head = _response_head(resp, d.observer.headers_for(pod, tried))
            status = resp.status
            if d.stream and status == 200:
                watch.armed = False  # from here the relay aborts the backend itself
                await self._relay(resp, attempt, pod, d, head, first, gone, send)
                return status
            try:
                content = await resp.read()
            except ResponseBroken as exc:
                last_error = f"{pod}: response broke: {exc}"
                continue
            finally:
                resp.release()
                attempt.end()
            watch.armed = False
            cached = reported_cached_tokens(content)
            if cached is not None:
                d.observer.reported(cached)
            if d.tap is not None and status == 200:
                await d.tap(content)
            head[b"content-length"] = b"%d" % len(content)
            await send({"type": "http.response.start", "status": status, "headers": head.items()})
            await send({"type": "http.response.body", "body": content})
            return status
        raise APIError(502, f"every backend attempt failed ({tried} tried); last: {last_error}")

    def _failed(self, pod: str, cause: Cause, why: str, stream: bool, refused: list[str]) -> None:
        """An attempt with no answer to relay: what it says of the pod (module doc)."""
        if cause is Cause.CONNECT:
            self._pool.mark_unhealthy(pod, f"unreachable: {why}")
        elif cause is Cause.BUSY:
            raise APIError(503, f"the router is at its limit of requests in flight: {why}")
        elif cause is Cause.STALLED or (cause is Cause.TIMEOUT and stream):
            self._pool.demote(pod, f"stalled: {why}")
        elif cause is Cause.TIMEOUT:
            raise APIError(
                504,
                f"backend {pod} took the request but did not answer within "
                f"{self._fwd.read_timeout_s:g} s (read_timeout_s); not retried elsewhere",
            )
        else:
            log.warning("backend %s closed the connection without an answer: %s", pod, why)
            refused.append(pod)
            if len(refused) >= POISON_AFTER:
                raise APIError(
                    502,
                    f"the request was refused by {len(refused)} backends "
                    f"({', '.join(refused)}: connection closed without an answer); "
                    "not retried further",
                )

    async def _relay_whole(
        self,
        d: Dispatch,
        resp: UpstreamResponse,
        pod: str,
        tried: int,
        content: bytes,
        send: Send,
        refused: list[str],
    ) -> int:
        """An engine's error answer for a request several pods refused, relayed as is."""
        log.warning("request refused by %s: passing the last answer on", ", ".join(refused))
        head = _response_head(resp, d.observer.headers_for(pod, tried))
        head[b"content-length"] = b"%d" % len(content)
        await send({"type": "http.response.start", "status": resp.status, "headers": head.items()})
        await send({"type": "http.response.body", "body": content})
        return resp.status

    def close(self) -> None:
        self._fwd.close()

    def retain(self, urls: Iterable[str]) -> None:
        """Forget connection pools of backends that left the pool."""
        self._fwd.retain(urls)

    def forget(self, pod: str) -> None:
        """A pod left: drop what is kept per pod."""
        self._ttft.pop(pod, None)

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
        d: Dispatch,
        head: dict[bytes, bytes],
        first: bytes | None,
        gone: asyncio.Future[None],
        send: Send,
    ) -> None:
        """Streams the body piece by piece (``first`` already read); a client that
        leaves drops the backend connection, so the engine stops generating for nobody."""

        def client_left(f: asyncio.Future[None]) -> None:
            if not f.cancelled():
                # Free the pod first: the socket closes on a later loop turn, so by the
                # time the engine sees the close the router no longer counts it busy.
                attempt.end()
                resp.abort()

        gone.add_done_callback(client_left)
        observer, tap = d.observer, d.tap
        try:
            await send({"type": "http.response.start", "status": 200, "headers": head.items()})
            chunk = first
            while chunk is not None:
                attempt.first()
                if b"cached_tokens" in chunk:
                    cached = reported_cached_tokens(chunk)
                    if cached is not None:
                        observer.reported(cached)
                if tap is not None:
                    await tap(chunk)
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                try:
                    chunk = await resp.next_chunk()
                except ResponseBroken as exc:
                    if not gone.done():
                        log.warning("stream from %s broke: %s", pod, exc)
                    msg = sse_error(f"backend {pod} stream broke: {exc}")
                    await send({"type": "http.response.body", "body": msg, "more_body": True})
                    break
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.remove_done_callback(client_left)
            attempt.end()
            resp.release()
