"""Small OpenAI-shaped HTTP engines for router tests that need faults real vLLM
cannot be made to produce on demand: a stream that breaks after its first chunk, a
500 before the first byte, a generation that stalls while ``/health`` answers
(``FakeEngine``); a connection closed without an answer, and a client that leaves
mid-generation seen by the engine (``RawEngine``: Starlette cannot close a
connection without answering). Both are real HTTP servers on loopback (the router
talks to them over TCP like to any engine); behaviour that must match the engine
exactly is tested against real vLLM in test_router_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
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
    mode: str = "ok"  # ok | fail500 | break_stream | stall
    seen_request_ids: list[str] = field(default_factory=list)
    seen_headers: list[dict[str, str]] = field(default_factory=list)
    requests: int = 0
    port: int = 0
    released: threading.Event = field(default_factory=threading.Event)  # ends a stall

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
            if self.mode == "stall":  # took the request, never produces a token
                if body.get("stream"):
                    return StreamingResponse(self._stalled(), media_type="text/event-stream")
                await self._stall()
                return JSONResponse({"error": {"message": "stalled"}}, status_code=500)
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

    async def _stall(self) -> None:
        for _ in range(600):  # bounded: 60 s
            if self.released.is_set():
                return
            await asyncio.sleep(0.1)

    async def _stalled(self) -> AsyncIterator[bytes]:
        await self._stall()
        yield b"data: [DONE]\n\n"

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


def _completion(name: str, model: str) -> bytes:
    return json.dumps(
        {
            "id": "cmpl-raw",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": name, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
    ).encode()


@dataclass
class RawEngine:
    """An engine on a bare asyncio server: it closes the connection without an answer
    when the body holds ``close_marker`` (or always, ``close_all``), and generates for
    ``generate_s`` seconds, counting the requests whose client left meanwhile."""

    name: str
    model: str = "tiny"
    close_marker: bytes | None = None
    close_all: bool = False
    generate_s: float = 0.0
    requests: int = 0
    aborted: int = 0
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
                lines = head.split("\r\n")
                path = lines[0].split(" ")[1]
                headers = dict(
                    (k.strip().lower(), v.strip())
                    for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                )
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if path.endswith("completions"):
                    self.requests += 1
                    if self.close_all or (self.close_marker and self.close_marker in body):
                        return  # closed without an answer (finally)
                    if self.generate_s and await self._client_left(reader):
                        self.aborted += 1
                        return
                    answer = _completion(self.name, self.model)
                elif path == "/metrics":
                    answer = b"vllm:num_requests_waiting 0.0\nvllm:num_requests_running 0.0\n"
                elif path == "/v1/models":
                    answer = json.dumps({"object": "list", "data": [{"id": self.model}]}).encode()
                else:
                    answer = b"{}"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(answer), answer)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def _client_left(self, reader: asyncio.StreamReader) -> bool:
        """Generate for ``generate_s``; True if the client closed meanwhile."""
        try:
            return await asyncio.wait_for(reader.read(1), self.generate_s) == b""
        except TimeoutError:
            return False


@contextlib.contextmanager
def serve_raw(engine: RawEngine) -> Iterator[RawEngine]:
    """Serve ``engine`` on a free loopback port from a background thread."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    server: list[asyncio.Server] = []

    async def start() -> None:
        srv = await asyncio.start_server(engine.handle, "127.0.0.1", 0)
        engine.port = srv.sockets[0].getsockname()[1]
        server.append(srv)
        started.set()

    thread = threading.Thread(target=loop.run_forever, daemon=True, name=f"raw-{engine.name}")
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        yield engine
    finally:

        async def stop() -> None:
            server[0].close()

        asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(15)
