"""vLLM's answers on its OpenAI surface beyond completions and chat, as pure functions:
``/v1/embeddings``, ``/v1/score``, ``/v1/rerank`` and ``/v1/responses`` (whole and as
server-sent events), in the shapes of vLLM 0.32's protocol models
(``vllm/entrypoints/pooling/{embed,scoring}/protocol.py``,
``vllm/entrypoints/openai/responses/protocol.py``): keys in vLLM's order, ``null``
included. Embeddings and scores are deterministic functions of the token ids (a
simulator computes no model), so equal inputs give equal vectors on every engine.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from kvplane.router.request import response_messages  # one reading of the input
from kvplane.sim.openai_api import ApiError, encode

EMBED_DIM: Final = 32  # the simulated model's embedding width (``dimensions`` may cut it)


def embedding(ids: Sequence[int], dimensions: int | None = None) -> list[float]:
    """A unit vector of the token ids (their hashed bag: inputs sharing tokens are near)."""
    vec = [0.0] * EMBED_DIM
    for t in ids:
        h = hashlib.blake2b(t.to_bytes(8, "little", signed=True), digest_size=8).digest()
        vec[h[0] % EMBED_DIM] += 1.0 if h[1] & 1 else -1.0
    vec = vec[: dimensions or EMBED_DIM]
    norm = math.sqrt(sum(v * v for v in vec)) or 1.0
    return [v / norm for v in vec]


def similarity(a: Sequence[int], b: Sequence[int]) -> float:
    """A relevance score in [0, 1] of two inputs (cosine of their embeddings)."""
    dot = sum(x * y for x, y in zip(embedding(a), embedding(b), strict=True))
    return (dot + 1.0) / 2.0


def pooling_usage(prompt_tokens: int) -> dict[str, Any]:
    """vLLM's ``UsageInfo`` of a pooling request (no completion)."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def embedding_response(
    rid: str, created: int, model: str, vectors: Sequence[list[float]], tokens: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": model,
        "data": [
            {"index": i, "object": "embedding", "embedding": v} for i, v in enumerate(vectors)
        ],
        "usage": pooling_usage(tokens),
    }


def score_response(
    rid: str, created: int, model: str, scores: Sequence[float], tokens: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "list",
        "created": created,
        "model": model,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": pooling_usage(tokens),
    }


def rerank_response(
    rid: str, model: str, ranked: Sequence[tuple[int, str, float]], tokens: int
) -> dict[str, Any]:
    """``ranked``: (document index, its text, relevance score), best first."""
    return {
        "id": rid,
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "results": [
            {"index": i, "document": {"text": text, "multi_modal": None}, "relevance_score": s}
            for i, text, s in ranked
        ],
    }


def texts(value: Any, param: str) -> list[str]:
    """A pooling request's text input: a string or a list of strings, else vLLM's 400."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise ApiError(400, f"'{param}' must be a string or a list of strings", param=param)


# ---- /v1/responses -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ResponsesParams:
    """A ``/v1/responses`` request, validated (what the simulator serves of it)."""

    messages: list[dict[str, str]]  # instructions and input, as chat messages
    instructions: str | None
    previous_response_id: str | None
    max_output_tokens: int | None
    stream: bool
    store: bool
    raw: dict[str, Any]


def parse_responses(obj: dict[str, Any]) -> ResponsesParams:
    if obj.get("input") in (None, "", []):
        raise ApiError(400, "Field required: input", param="input")
    messages = response_messages(obj)
    if messages is None:
        raise ApiError(400, "the simulator serves text message input only", param="input")
    prev = obj.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise ApiError(400, "'previous_response_id' must be a string", param="previous_response_id")
    max_out = obj.get("max_output_tokens")
    if max_out is not None and (type(max_out) is not int or max_out < 1):
        raise ApiError(400, "max_output_tokens must be at least 1", param="max_output_tokens")
    instructions = obj.get("instructions")
    return ResponsesParams(
        messages,
        instructions if isinstance(instructions, str) else None,
        prev,
        max_out,
        obj.get("stream") is True,
        obj.get("store") is not False,
        obj,
    )


def response_not_found(response_id: str) -> ApiError:
    """vLLM's answer to an unknown ``previous_response_id`` (``_make_not_found_error``)."""
    return ApiError(
        404, f"Response with id '{response_id}' not found.", "invalid_request_error", "response_id"
    )


def output_message(msg_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "id": msg_id,
        "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}]
        if text or status == "completed"
        else [],
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def responses_usage(input_tokens: int, cached: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": input_tokens + output_tokens,
    }


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """What every rendering of one response shares."""

    rid: str
    msg_id: str
    created: int
    model: str
    max_output_tokens: int
    params: ResponsesParams


def responses_response(
    h: ResponseHead, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    raw = h.params.raw
    return {
        "id": h.rid,
        "created_at": h.created,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": h.params.instructions,
        "metadata": raw.get("metadata"),
        "model": h.model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": raw.get("parallel_tool_calls", True),
        "temperature": raw.get("temperature", 1.0),
        "tool_choice": raw.get("tool_choice", "auto" if raw.get("tools") else "none"),
        "tools": raw.get("tools") or [],
        "top_p": raw.get("top_p", 1.0),
        "background": bool(raw.get("background", False)),
        "max_output_tokens": h.max_output_tokens,
        "max_tool_calls": raw.get("max_tool_calls"),
        "previous_response_id": h.params.previous_response_id,
        "prompt": None,
        "reasoning": raw.get("reasoning"),
        "service_tier": raw.get("service_tier", "auto"),
        "status": status,
        "text": raw.get("text"),
        "top_logprobs": raw.get("top_logprobs"),
        "truncation": raw.get("truncation", "disabled"),
        "usage": usage,
        "user": raw.get("user"),
        "presence_penalty": raw.get("presence_penalty") or 0.0,
        "frequency_penalty": raw.get("frequency_penalty") or 0.0,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "input_messages": None,
        "output_messages": None,
    }


class ResponseEvents:
    """One streamed response's server-sent events, numbered as vLLM numbers them."""

    def __init__(self, head: ResponseHead) -> None:
        self.h = head
        self.seq = 0

    def _event(self, type_: str, **fields: Any) -> bytes:
        fields.update(sequence_number=self.seq, type=type_)
        payload = dict(sorted(fields.items()))  # OpenAI's event models: fields by name
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + encode(payload) + b"\n\n"

    def opening(self) -> bytes:
        """created, in_progress, and the message and its text part opened."""
        h = self.h
        started = responses_response(h, "in_progress", [], None)
        return b"".join(
            [
                self._event("response.created", response=started),
                self._event("response.in_progress", response=started),
                self._event(
                    "response.output_item.added",
                    item=output_message(h.msg_id, "", "in_progress"),
                    output_index=0,
                ),
                self._event(
                    "response.content_part.added",
                    content_index=0,
                    item_id=h.msg_id,
                    output_index=0,
                    part={"annotations": [], "text": "", "type": "output_text", "logprobs": []},
                ),
            ]
        )

    def delta(self, text: str) -> bytes:
        return self._event(
            "response.output_text.delta",
            content_index=0,
            delta=text,
            item_id=self.h.msg_id,
            logprobs=[],
            output_index=0,
        )

    def closing(self, text: str, status: str, usage: dict[str, Any]) -> bytes:
        h = self.h
        part: dict[str, Any] = {"annotations": [], "text": text, "type": "output_text"}
        part["logprobs"] = None
        message = output_message(h.msg_id, text)
        return b"".join(
            [
                self._event(
                    "response.output_text.done",
                    content_index=0,
                    item_id=h.msg_id,
                    logprobs=[],
                    output_index=0,
                    text=text,
                ),
                self._event(
                    "response.content_part.done",
                    content_index=0,
                    item_id=h.msg_id,
                    output_index=0,
                    part=part,
                ),
                self._event("response.output_item.done", item=message, output_index=0),
                self._event(
                    "response.completed",
                    response=responses_response(h, status, [message], usage),
                ),
            ]
        )
