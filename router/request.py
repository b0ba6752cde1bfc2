"""Request body -> what routing needs, or a 4xx with a message saying why not.

The body itself is forwarded untouched (bytes), so fields the router does not
know (vLLM extras such as ``kv_transfer_params``, ``vllm_xargs``) pass through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
from kvplane.router.errors import APIError
from kvplane.router.tokens import ChatOptions

from kvplane.fields import FieldTypeError, opt_bool

_decoder = msgspec.json.Decoder()


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str  # "completions" | "chat"
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    prompt: Any = None
    messages: list[Any] | None = None
    chat: ChatOptions | None = None
    add_special_tokens: bool = True
    size: int = 0  # body bytes: what rendering and encoding it may cost


def _max_tokens(body: dict[str, Any]) -> int | None:
    for name in ("max_completion_tokens", "max_tokens"):
        v = body.get(name)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise APIError(400, f"'{name}' must be a non-negative integer", param=name)
        return v
    return None


def parse_request(raw: bytes, kind: str | None = None) -> ParsedRequest:
    """``kind``: "chat" or "completions" (the route's); None: chat when the body has a
    ``messages`` field (the explain endpoint takes either)."""
    try:
        return _parse(raw, kind)
    except FieldTypeError as exc:
        raise APIError(400, f"'{exc.key}' must be a {exc.expected}", param=exc.key) from exc


def _parse(raw: bytes, kind: str | None) -> ParsedRequest:
    if not raw:
        raise APIError(400, "request body is empty; expected a JSON object")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise APIError(400, f"malformed JSON body: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise APIError(400, f"request body is not valid UTF-8 (byte {exc.start})") from None
    except RecursionError:
        raise APIError(400, "malformed JSON body: nested too deeply") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if kind is None:
        kind = "chat" if "messages" in body else "completions"
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "missing required field 'model'", param="model")
    stream = opt_bool(body, "stream", False)
    max_tokens = _max_tokens(body)
    if kind == "chat":
        messages = body.get("messages")
        if messages is None:
            raise APIError(400, "missing required field 'messages'", param="messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty array", param="messages")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError(400, "'tools' must be an array", param="tools")
        template = body.get("chat_template")
        if template is not None and not isinstance(template, str):
            raise APIError(400, "'chat_template' must be a string", param="chat_template")
        opts = ChatOptions(
            add_generation_prompt=opt_bool(body, "add_generation_prompt", True),
            continue_final_message=opt_bool(body, "continue_final_message", False),
            add_special_tokens=opt_bool(body, "add_special_tokens", False),
            chat_template=template,
            tools=tools,
            documents=body.get("documents"),
            chat_template_kwargs=kwargs,
        )
        if opts.add_generation_prompt and opts.continue_final_message:
            raise APIError(
                400, "'add_generation_prompt' and 'continue_final_message' cannot both be true"
            )
        return ParsedRequest(
            kind, body, model, stream, max_tokens, messages=messages, chat=opts, size=len(raw)
        )
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "missing required field 'prompt'", param="prompt")
    if isinstance(prompt, str | list) and len(prompt) == 0:
        raise APIError(400, "'prompt' must not be empty", param="prompt")
    return ParsedRequest(
        kind,
        body,
        model,
        stream,
        max_tokens,
        prompt=prompt,
        add_special_tokens=opt_bool(body, "add_special_tokens", True),
        size=len(raw),
    )
