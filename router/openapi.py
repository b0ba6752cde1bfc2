"""The OpenAPI schema of the router, with the forwarded routes FastAPI cannot see.

``/v1/completions``, ``/v1/chat/completions`` and the rest of ``app.ROUTES`` are raw ASGI
endpoints (request.py parses their bodies, so that unknown vLLM fields pass through
untouched); the models below only
describe those bodies (what request.py reads, extra fields allowed) for ``/openapi.json``,
API clients and the property-based tests, which fuzz the routes from this schema.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema

_REF = "#/components/schemas/{model}"


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class CompletionRequest(_Open):
    model: str = Field(min_length=1)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="text, texts (routed by the first), token ids or lists of them"
    )
    max_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False
    add_special_tokens: bool = True


class TextPart(_Open):
    type: Literal["text", "input_text"]
    text: str


class ChatMessage(_Open):
    role: str
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Open):
    model: str = Field(min_length=1)
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    stream: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = Field(
        default=None, description="refused unless model.trust_request_chat_template"
    )
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


_ERRORS = {
    "400": "malformed or invalid request",
    "401": "missing or wrong API key",
    "404": "unknown model",
    "413": "request body too large",
    "502": "every backend attempt failed",
    "503": "no healthy backend",
    "504": "the backend did not answer in time",
}


def _operation(summary: str, body: str | None) -> dict[str, Any]:
    error = {"application/json": {"schema": {"$ref": _REF.format(model="ErrorResponse")}}}
    responses: dict[str, Any] = {
        "200": {
            "description": "the engine's answer (JSON, or server-sent events when streaming)",
            "content": {"application/json": {"schema": {"type": "object"}}},
        }
    }
    responses.update({code: {"description": d, "content": error} for code, d in _ERRORS.items()})
    return {
        "summary": summary,
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": _body_schema(body)}},
        },
        "responses": responses,
    }


def _body_schema(body: str | None) -> dict[str, Any]:
    """A described body's reference, or any JSON object (the engine's to validate)."""
    return {"$ref": _REF.format(model=body)} if body else {"type": "object"}


def router_openapi(app: FastAPI, forwarded: Iterable[tuple[str, str]] = ()) -> dict[str, Any]:
    """FastAPI's schema of the app plus the routes it cannot see (cached on the app):
    the two completion routes with their bodies, ``forwarded`` (kind, path) ones with
    any JSON object for a body."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema(
        [
            (CompletionRequest, "validation"),
            (ChatCompletionRequest, "validation"),
            (ErrorResponse, "validation"),
        ],
        ref_template=_REF,
    )
    schema.setdefault("components", {}).setdefault("schemas", {}).update(defs["$defs"])
    paths = schema.setdefault("paths", {})
    for kind, path in forwarded:
        paths[path] = {"post": _operation(f"Forwarded to the engine ({kind})", None)}
    paths["/v1/completions"] = {"post": _operation("Create a completion", "CompletionRequest")}
    paths["/v1/chat/completions"] = {
        "post": _operation("Create a chat completion", "ChatCompletionRequest")
    }
    app.openapi_schema = schema
    return schema
