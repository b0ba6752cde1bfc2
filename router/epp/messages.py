"""Envoy external-processing messages of the endpoint-picker protocol, built and read
with Envoy's own protobufs (the ``xds-protos`` package): pure functions, no I/O.

Names and rules follow the Gateway API Inference Extension's proposal 004
(docs/proposals/004-endpoint-picker-protocol): the picked endpoints go out as one
value, ``ip:port[,ip:port...]``, in both the ``x-gateway-destination-endpoint`` request
header and the ``envoy.lb`` dynamic metadata (never two different values); the data
plane may restrict the choice with ``envoy.lb.subset_hint`` and reports the endpoint
that served in ``envoy.lb``/``x-gateway-destination-endpoint-served``. A body that
Envoy streams to the picker in ``FULL_DUPLEX_STREAMED`` mode only reaches the
upstream as the picker sends it back, in chunks of at most ``BODY_CHUNK_BYTES``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    ProcessingRequest,
    ProcessingResponse,
)
from envoy.type.v3 import http_status_pb2
from google.protobuf import json_format, struct_pb2
from kvplane.router.errors import APIError

DESTINATION: Final = "x-gateway-destination-endpoint"
SERVED: Final = "x-gateway-destination-endpoint-served"
LB_NAMESPACE: Final = "envoy.lb"
SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
# GIE's reference picker keeps a margin under the 64 KiB some data planes allow per chunk
BODY_CHUNK_BYTES: Final = 62000

BodyMode = processing_mode_pb2.ProcessingMode.BodySendMode
FULL_DUPLEX: Final = BodyMode.FULL_DUPLEX_STREAMED

__all__ = ["ProcessingRequest", "ProcessingResponse"]


def header_map(headers: pb.HttpHeaders) -> dict[str, str]:
    """Lower-case name -> value (the first of repeated names); pseudo-headers kept."""
    out: dict[str, str] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("latin-1") if h.raw_value else h.value
        out.setdefault(h.key.lower(), value)
    return out


def _set(headers: Mapping[str, str]) -> list[base_pb2.HeaderValueOption]:
    return [
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k, raw_value=v.encode("latin-1")),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
        for k, v in headers.items()
    ]


def _metadata(namespace: str, fields: Mapping[str, str]) -> struct_pb2.Struct:
    out = struct_pb2.Struct()
    out.fields[namespace].struct_value.update(dict(fields))
    return out


def filter_metadata(req: pb.ProcessingRequest) -> dict[str, Any]:
    """The request's ``metadata_context.filter_metadata`` as plain values."""
    if not req.HasField("metadata_context"):
        return {}
    return {
        ns: json_format.MessageToDict(s) for ns, s in req.metadata_context.filter_metadata.items()
    }


def _endpoint_list(value: object) -> list[str]:
    """A comma-separated string or a list of them (gateways write either)."""
    parts: list[str] = []
    for item in value if isinstance(value, list) else [value]:
        if isinstance(item, str):
            parts.extend(p.strip() for p in item.split(",") if p.strip())
    return parts


def subset_hint(req: pb.ProcessingRequest) -> list[str] | None:
    """The endpoints the data plane allows, or None when it sets no subset."""
    ns = filter_metadata(req).get(SUBSET_NAMESPACE)
    if not isinstance(ns, dict) or SUBSET_KEY not in ns:
        return None
    return _endpoint_list(ns[SUBSET_KEY])


def served_endpoint(req: pb.ProcessingRequest) -> str | None:
    """The endpoint that served, where the data plane reports it."""
    ns = filter_metadata(req).get(LB_NAMESPACE)
    if not isinstance(ns, dict):
        return None
    served = _endpoint_list(ns.get(SERVED))
    return served[0] if served else None


def destination(
    endpoints: Sequence[str],
    headers: Mapping[str, str],
    phase: str = "request_headers",
    body: bytes | None = None,
    remove: Sequence[str] = (),
) -> pb.ProcessingResponse:
    """The answer that routes: the endpoint list in the destination header and in the
    ``envoy.lb`` metadata, ``headers`` set on the request, the route re-evaluated.
    ``phase``: the message it answers (``request_body`` where headers were answered
    already, in ``BUFFERED`` mode, which may also replace the ``body``); ``remove``:
    request headers the engine must not see."""
    value = ",".join(endpoints)
    common = pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=_set({DESTINATION: value, **headers}), remove_headers=list(remove)
        ),
        clear_route_cache=True,
    )
    if body is not None:
        common.body_mutation.body = body
    msg = (
        pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common))
        if phase == "request_headers"
        else pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    )
    msg.dynamic_metadata.CopyFrom(_metadata(LB_NAMESPACE, {DESTINATION: value}))
    return msg


def streamed_body(phase: str, body: bytes, end: bool = True) -> list[pb.ProcessingResponse]:
    """``body`` sent back in ``FULL_DUPLEX_STREAMED`` chunks; ``phase`` is
    ``request_body`` or ``response_body``."""
    spans = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)]
    spans = spans or [b""]
    out = []
    for i, span in enumerate(spans):
        streamed = pb.StreamedBodyResponse(body=span, end_of_stream=end and i == len(spans) - 1)
        common = pb.CommonResponse(body_mutation=pb.BodyMutation(streamed_response=streamed))
        out.append(pb.ProcessingResponse(**{phase: pb.BodyResponse(response=common)}))
    return out


def proceed(phase: str) -> pb.ProcessingResponse:
    """Let the message's phase go on unchanged."""
    if phase in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{phase: pb.HeadersResponse()})
    if phase in ("request_trailers", "response_trailers"):
        return pb.ProcessingResponse(**{phase: pb.TrailersResponse()})
    return pb.ProcessingResponse(**{phase: pb.BodyResponse()})


def response_headers(headers: Mapping[str, str]) -> pb.ProcessingResponse:
    """Headers added to the response on its way back to the client."""
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=_set(headers)))
    return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))


def answer(status: int, body: bytes, headers: Mapping[str, str]) -> pb.ProcessingResponse:
    """The gateway answers the client itself with ``body``."""
    mutation = pb.HeaderMutation(set_headers=_set(headers))
    reply = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=mutation, body=body
    )
    return pb.ProcessingResponse(immediate_response=reply)


def immediate(error: APIError, headers: Mapping[str, str] | None = None) -> pb.ProcessingResponse:
    """The gateway answers the client itself, in OpenAI's error shape."""
    mutation = pb.HeaderMutation(
        set_headers=_set({"content-type": "application/json", **(headers or {})})
    )
    answer = pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=mutation,
        body=json.dumps(error.body()).encode(),
        details=f"kvplane_epp_{error.status}",
    )
    return pb.ProcessingResponse(immediate_response=answer)


def phase_of(req: pb.ProcessingRequest) -> str:
    phase: str | None = req.WhichOneof("request")
    return phase or ""
