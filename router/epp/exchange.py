"""One HTTP request's external-processing stream: the phases Envoy reports, in order,
and the picker's answer to each.

Envoy tells the body modes on the first message (``protocol_config``). In
``FULL_DUPLEX_STREAMED`` (GIE's reference configuration) the headers' answer waits for
the whole body, which is then decided on and sent back in chunks; in ``BUFFERED`` the
headers go on at once and the body's answer carries the destination (and may replace
the body). A request without a body goes to the least loaded pod. Errors are the
gateway's immediate answers in OpenAI's shape: 400 for a body the router refuses,
404 for an unknown model, 413 over the size limit, 503 when no pod can take it.
"""

from __future__ import annotations

import json
import logging
import uuid

from kvplane.router.app import models_of
from kvplane.router.epp import messages as msg
from kvplane.router.epp.messages import ProcessingRequest, ProcessingResponse
from kvplane.router.epp.picker import ROUTE_KINDS, Pick, Picker, RequestHead, Ticket
from kvplane.router.errors import APIError

log = logging.getLogger("kvplane.router.epp")

_MODES = msg.BodyMode


class Exchange:
    def __init__(self, picker: Picker) -> None:
        self._picker = picker
        self._head: RequestHead | None = None
        self._request_mode = msg.FULL_DUPLEX
        self._response_mode = msg.FULL_DUPLEX
        self._body: list[bytes] = []
        self._size = 0
        self._ticket: Ticket | None = None
        self._done = False

    async def on(self, req: ProcessingRequest) -> list[ProcessingResponse]:
        """The answers to one message from the data plane (possibly none yet)."""
        phase = msg.phase_of(req)
        if self._done and phase in ("request_body", "request_trailers"):
            return []  # answered already (a refusal): the rest of the body routes nothing
        try:
            if phase == "request_headers":
                return await self._request_headers(req)
            if phase == "request_body":
                return await self._request_body(req)
            if phase == "response_headers":
                return self._response_headers(req)
            if phase == "response_body":
                return self._response_body(req)
            if phase == "response_trailers":
                self._end()
            return [msg.proceed(phase)] if phase else []
        except APIError as exc:
            self._done = True
            request_id = self._head.request_id if self._head is not None else ""
            return [msg.immediate(exc, {"x-request-id": request_id} if request_id else None)]

    def close(self) -> None:
        """The stream ended: whatever the response did, the request is over."""
        self._end()

    # --- request ----------------------------------------------------------------

    async def _request_headers(self, req: ProcessingRequest) -> list[ProcessingResponse]:
        if req.HasField("protocol_config"):
            self._request_mode = req.protocol_config.request_body_mode
            self._response_mode = req.protocol_config.response_body_mode
        h = msg.header_map(req.request_headers)
        request_id = h.get("x-request-id") or f"kvp-{uuid.uuid4().hex}"
        path = h.get(":path", "/").split("?", 1)[0]
        method, subset = h.get(":method", "GET"), msg.subset_hint(req)
        self._head = RequestHead(method, path, h, request_id, subset)  # a refusal's id
        # the router's auth (the first pool's, as the router applies it): 401/403/404
        role = self._picker.gate.role(path, _raw(h))
        self._head = RequestHead(method, path, h, request_id, subset, role)
        if self._head.method == "GET" and path == "/v1/models":  # every pool's, not one pod's
            listing = json.dumps(await models_of(self._picker.registry)).encode()
            self._done = True
            return [msg.answer(200, listing, {"content-type": "application/json"})]
        if req.request_headers.end_of_stream or self._request_mode == _MODES.NONE:
            return [self._route(await self._pick(b""), None, "request_headers")]
        if self._request_mode == msg.FULL_DUPLEX:
            return []  # answered with the body
        if self._request_mode == _MODES.BUFFERED:
            return [msg.proceed("request_headers")]
        name = _MODES.Name(self._request_mode)
        raise APIError(
            500,
            f"the endpoint picker needs the request body FULL_DUPLEX_STREAMED "
            f"or BUFFERED (the data plane sends it {name})",
        )

    async def _request_body(self, req: ProcessingRequest) -> list[ProcessingResponse]:
        chunk = req.request_body
        self._body.append(chunk.body)
        self._size += len(chunk.body)
        limit = self._picker.settings.max_body_bytes
        if self._size > limit:
            raise APIError(413, f"request body too large (over {limit} bytes)")
        if not chunk.end_of_stream:
            return []
        body = b"".join(self._body)
        self._body = []
        pick = await self._pick(body)
        out = body if pick.body is None else pick.body
        if self._request_mode == msg.FULL_DUPLEX:
            return [
                self._route(pick, out, "request_headers"),
                *msg.streamed_body("request_body", out),
            ]
        return [self._route(pick, out, "request_body", replace=pick.body is not None)]

    async def _pick(self, body: bytes) -> Pick:
        assert self._head is not None
        pick = await self._picker.pick(self._head, body)
        self._ticket = pick.ticket
        return pick

    def _route(
        self, pick: Pick, body: bytes | None, phase: str, replace: bool = False
    ) -> ProcessingResponse:
        assert self._head is not None
        headers = {"x-request-id": self._head.request_id, **pick.headers}
        if body is not None:
            headers["content-length"] = str(len(body))
        return msg.destination(
            pick.endpoints, headers, phase, body if replace else None, self._picker.strip
        )

    # --- response ---------------------------------------------------------------

    def _response_headers(self, req: ProcessingRequest) -> list[ProcessingResponse]:
        h = msg.header_map(req.response_headers)
        try:
            status = int(h.get(":status", "0"))
        except ValueError:
            status = 0
        extra: dict[str, str] = {}
        if self._ticket is not None:
            served = msg.served_endpoint(req)
            router = self._ticket.router
            pod = self._picker.endpoints(router).pod(served) if served else None
            extra = self._ticket.served(pod, status)
        if req.response_headers.end_of_stream:
            self._end()
        return [msg.response_headers(extra)]

    def _response_body(self, req: ProcessingRequest) -> list[ProcessingResponse]:
        chunk = req.response_body
        if self._ticket is not None:
            self._ticket.body(chunk.body)
        if chunk.end_of_stream:
            self._end()
        if self._response_mode == msg.FULL_DUPLEX:
            return msg.streamed_body("response_body", chunk.body, chunk.end_of_stream)
        return [msg.proceed("response_body")]

    def _end(self) -> None:
        if self._done:
            return
        self._done = True
        ticket = self._ticket
        if ticket is None:
            return
        ticket.end()
        m = ticket.router.metrics
        route = ROUTE_KINDS.get(self._head.path, "other") if self._head else "other"
        status = str(ticket.status) if ticket.status else "error"
        m.requests.labels(**m.labels, route=route, status=status).inc()


def _raw(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
