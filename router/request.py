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


# What the router must find in each load-routed endpoint's body (one of the fields),
# checked before a pod is chosen; the engine validates the rest and answers its own 400.
LOAD_ROUTED: dict[str, tuple[str, ...]] = {
    "embeddings": ("input", "messages"),
    "tokenize": ("prompt", "messages"),
    "detokenize": ("tokens",),
    "score": ("queries", "data_1", "text_1"),
    "rerank": ("query",),
}


MAX_RESPONSE_ID = 256  # characters; vLLM's ids are "resp_" and 32 hex digits


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    kind: str  # "completions" | "chat" | "responses" | a key of LOAD_ROUTED
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    prompt: Any = None
    messages: list[Any] | None = None
    chat: ChatOptions | None = None
    add_special_tokens: bool = True
    size: int = 0  # body bytes: what rendering and encoding it may cost
    previous_response_id: str | None = None  # /v1/responses: the conversation's last turn
    store: bool = True  # /v1/responses: the engine keeps the answer (OpenAI's default)

    @property
    def by_load(self) -> bool:
        """Routed by load alone: no prompt whose prefix a pod could hold."""
        return self.kind in LOAD_ROUTED or (self.kind == "responses" and self.messages is None)


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
    if kind in LOAD_ROUTED:
        return _load_routed(body, kind, len(raw))
    if kind == "responses":
        return _responses(body, len(raw))
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


def _model(body: dict[str, Any], required: bool) -> str:
    """The body's ``model``; "" where it may be left out (the first pool serves it)."""
    model = body.get("model")
    if model is None and not required:
        return ""
    if not isinstance(model, str) or not model:
        raise APIError(400, "missing required field 'model'", param="model")
    return model


def _load_routed(body: dict[str, Any], kind: str, size: int) -> ParsedRequest:
    """vLLM takes these without a ``model`` (its one served model); the router then
    sends them to its first pool."""
    model = _model(body, required=False)
    fields = LOAD_ROUTED[kind]
    if all(body.get(f) in (None, "", []) for f in fields):
        raise APIError(400, f"missing required field '{fields[0]}'", param=fields[0])
    return ParsedRequest(kind, body, model, False, None, size=size)


def _responses(body: dict[str, Any], size: int) -> ParsedRequest:
    """``/v1/responses``: its ``instructions`` and ``input`` are a chat prompt (vLLM renders
    them through the chat template), routed by the prefix they share with earlier ones;
    ``previous_response_id`` pins the request to the pod that stored that response."""
    model = _model(body, required=True)
    if body.get("input") in (None, "", []):
        raise APIError(400, "missing required field 'input'", param="input")
    prev = body.get("previous_response_id")
    if prev is not None and (not isinstance(prev, str) or not 0 < len(prev) <= MAX_RESPONSE_ID):
        raise APIError(
            400,
            f"'previous_response_id' must be a string of at most {MAX_RESPONSE_ID} characters",
            param="previous_response_id",
        )
    max_tokens = body.get("max_output_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        param = "max_output_tokens"
        raise APIError(400, f"'{param}' must be a positive integer", param=param)
    messages = response_messages(body)
    return ParsedRequest(
        "responses",
        body,
        model,
        opt_bool(body, "stream", False),
        max_tokens,
        messages=messages,
        chat=ChatOptions() if messages is not None else None,
        size=size,
        previous_response_id=prev,
        store=opt_bool(body, "store", True),
    )


def response_messages(body: dict[str, Any]) -> list[dict[str, str]] | None:
    """A Responses request's prompt as chat messages (``instructions`` as the system
    message, then ``input``), or None where an input item is not a plain text message
    (tool calls and their outputs, images: such a request is routed by load)."""
    out: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list):
        return None
    for item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            return None
        role, content = item.get("role"), item.get("content")
        if not isinstance(role, str):
            return None
        if isinstance(content, list):  # input_text / output_text parts
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
                return None
            content = "\n".join(t for t in texts if isinstance(t, str))  # as chat parts
        if not isinstance(content, str):
            return None
        out.append({"role": role, "content": content})
    return out or None
