"""A small OpenAI-shaped HTTP engine for router API tests that need faults real
vLLM cannot be made to produce on demand: a stream that breaks after its first
chunk, a 500 before the first byte. It is a real HTTP server on loopback (the
router talks to it over TCP like to any engine); behaviour that must match the
engine exactly is tested against real vLLM in test_router_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvplane.local.serve import serve_in_thread


@dataclass
class FakeEngine:
    name: str
    model: str = "tiny"
    mode: str = "ok"  # ok | fail500 | break_stream
    seen_request_ids: list[str] = field(default_factory=list)
    seen_headers: list[dict[str, str]] = field(default_factory=list)
    requests: int = 0
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.requests += 1
            self.seen_request_ids.append(request.headers.get("x-request-id", ""))
            self.seen_headers.append(dict(request.headers))
            if self.mode == "fail500":
                return JSONResponse({"error": {"message": "engine failed"}}, status_code=500)
            chat = request.url.path.endswith("chat/completions")
            if body.get("stream"):
                return StreamingResponse(self._stream(chat), media_type="text/event-stream")
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": self.name}}
                if chat
                else {"index": 0, "text": self.name}
            )
            return JSONResponse(
                {
                    "id": "cmpl-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": self.model,
                    "choices": [{**choice, "finish_reason": "stop"}],
                    "usage": {
                        "prompt_tokens": 1,
                        "completion_tokens": 1,
                        "total_tokens": 2,
                        "prompt_tokens_details": {"cached_tokens": 0},
                    },
                }
            )

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def health(_: Request) -> Response:
            return Response(status_code=200)

        async def metrics(_: Request) -> Response:
            return PlainTextResponse(
                f'vllm:num_requests_waiting{{engine="0",model_name="{self.model}"}} 0.0\n'
                f'vllm:num_requests_running{{engine="0",model_name="{self.model}"}} 0.0\n'
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="{self.model}"}} 0.0\n'
            )

        return Starlette(
            routes=[
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/v1/models", models),
                Route("/health", health),
                Route("/metrics", metrics),
            ]
        )

    async def _stream(self, chat: bool) -> AsyncIterator[bytes]:
        for i in range(3):
            delta = {"delta": {"content": f"t{i}"}} if chat else {"text": f"t{i}"}
            chunk = {
                "id": "cmpl-1",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "choices": [{"index": 0, **delta}],
            }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.01)
            if self.mode == "break_stream":
                raise ConnectionAbortedError("engine died mid-stream")
        yield b"data: [DONE]\n\n"


@contextlib.contextmanager
def serve_engines(*engines: FakeEngine) -> Iterator[list[FakeEngine]]:
    """Serve every engine on its own port, each from a background thread."""
    with contextlib.ExitStack() as stack:
        for eng in engines:
            eng.port = stack.enter_context(serve_in_thread(eng.app(), eng.port or None))
        yield list(engines)
