"""Small real HTTP engines that play the prefill or decode side of a P/D handoff.

Each speaks the engine's side of one protocol as docs/pd.md describes it (from
vLLM 0.33's connectors and SGLang's disaggregation), on loopback:

- ``nixl``: a prefill pod answers a ``do_remote_decode`` request (one token, not
  streamed) with ``kv_transfer_params`` naming its engine id, request id, blocks
  and side channel; a decode pod given those params pulls the "KV" from that
  side channel (here an HTTP route of the prefill pod) and refuses a handle it
  cannot resolve, as vLLM's ``kv_load_failure_policy: fail`` does.
- ``mooncake``: a prefill pod runs a bootstrap server (``GET /query`` -> engine id
  per DP rank) and parks the prompt's KV under the request's ``transfer_id``; a
  decode pod checks the engine id on ``remote_bootstrap_addr`` and waits (bounded)
  for that transfer id, so the legs may arrive in any order.
- ``sglang``: both sides need ``bootstrap_host/port/room``; the prefill side
  publishes the room on its bootstrap server, the decode side collects it there.
  A decode-mode server rejects a request without them.

The "KV" is a fingerprint of the prompt: a decode pod that receives KV for another
prompt fails the request, so a router that mixes up legs fails the tests. Faults
are modes: ``fail500`` (5xx before any byte), ``no_kv_params`` (a prefill answer
without a handle, as vLLM for a prompt under one block). Tests stop a server to
make a pod die. Real vLLM runs the NIXL flow in test_pd_vllm.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from kvplane.local.ports import free_port
from kvplane.local.serve import serve_in_thread

WAIT_S = 10.0  # a decode side gives up on KV that never arrives (bounded wait)


def fingerprint(body: dict[str, Any]) -> str:
    """What the KV of a request stands for: its prompt or messages."""
    prompt = body.get("messages", body.get("prompt"))
    return hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()[:16]


@dataclass
class Seen:
    path: str
    body: dict[str, Any]
    request_id: str


@dataclass
class PDEngine:
    name: str
    protocol: str  # nixl | mooncake | sglang
    role: str  # prefill | decode
    model: str = "tiny"
    mode: str = "ok"  # ok | fail500 | no_kv_params
    running: float = 0.0  # what /metrics reports
    kv_usage: float = 0.0
    port: int = 0
    bootstrap_port: int = 0
    engine_id: str = field(default_factory=lambda: f"engine-{uuid.uuid4().hex[:8]}")
    host: str = "127.0.0.1"  # where the engine's sockets are (its pod IP)
    side_channel: tuple[str, int] | None = None  # NIXL: (host, port); default its HTTP server
    transport: httpx.AsyncBaseTransport | None = None  # how a decode side reaches peers
    seen: list[Seen] = field(default_factory=list)
    kv_sent: dict[str, str] = field(default_factory=dict)  # handle -> fingerprint (prefill)
    kv_received: list[tuple[str, str]] = field(default_factory=list)  # (source, fp) (decode)
    local_prefills: int = 0  # decode pod prefilled a plain request itself
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _client(self, timeout: float) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=timeout, transport=self.transport)

    def backend(self) -> dict[str, Any]:
        """This engine as a RouterConfig backend entry."""
        entry: dict[str, Any] = {"name": self.name, "url": self.url, "role": self.role}
        if self.role == "prefill" and self.protocol != "nixl":
            entry["bootstrap_port"] = self.bootstrap_port
        return entry

    def bodies(self) -> list[dict[str, Any]]:
        with self._lock:
            return [s.body for s in self.seen]

    # --- the engine API ---------------------------------------------------------------

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            body = await request.json()
            with self._lock:
                self.seen.append(
                    Seen(request.url.path, body, request.headers.get("x-request-id", ""))
                )
            if self.mode == "fail500":
                return JSONResponse({"error": {"message": "engine failed"}}, status_code=500)
            chat = request.url.path.endswith("chat/completions")
            try:
                if self.role == "prefill":
                    return await self._prefill(body, chat)
                return await self._decode(body, chat)
            except KVError as exc:
                return JSONResponse({"error": {"message": str(exc)}}, status_code=exc.status)

        async def side_channel(request: Request) -> Response:
            """NIXL side channel (a stand-in: the real one is ZMQ + RDMA reads)."""
            handle = request.path_params["handle"]
            with self._lock:
                fp = self.kv_sent.get(handle)
            if fp is None:
                return JSONResponse({"error": "unknown handle"}, status_code=404)
            return JSONResponse({"fingerprint": fp, "engine_id": self.engine_id})

        async def models(_: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        async def health(_: Request) -> Response:
            return Response(status_code=200)

        async def metrics(_: Request) -> Response:
            lbl = f'{{engine="0",model_name="{self.model}"}}'
            return PlainTextResponse(
                f"vllm:num_requests_waiting{lbl} 0.0\n"
                f"vllm:num_requests_running{lbl} {self.running}\n"
                f"vllm:kv_cache_usage_perc{lbl} {self.kv_usage}\n"
            )

        return Starlette(
            routes=[
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/nixl/{handle}", side_channel),
                Route("/v1/models", models),
                Route("/health", health),
                Route("/metrics", metrics),
            ]
        )

    def bootstrap_app(self) -> Starlette:
        """A prefill pod's bootstrap server (Mooncake, SGLang)."""

        async def query(_: Request) -> Response:
            # MooncakeBootstrapServer.query: {dp_rank: {engine_id, worker_addr}}
            worker = {"0": {"0": f"{self.host}:{self.bootstrap_port + 1}"}}
            return JSONResponse({"0": {"engine_id": self.engine_id, "worker_addr": worker}})

        async def kv(request: Request) -> Response:
            handle = request.path_params["handle"]
            with self._lock:
                fp = self.kv_sent.get(handle)
            if fp is None:
                return JSONResponse({"error": "not yet"}, status_code=404)
            return JSONResponse({"fingerprint": fp, "engine_id": self.engine_id})

        return Starlette(routes=[Route("/query", query), Route("/kv/{handle}", kv)])

    # --- prefill side -----------------------------------------------------------------

    async def _prefill(self, body: dict[str, Any], chat: bool) -> Response:
        fp = fingerprint(body)
        if self.protocol == "sglang":
            rooms = body.get("bootstrap_room")
            if body.get("bootstrap_host") is None or rooms is None:
                raise KVError(400, "prefill mode needs bootstrap_host/port/room")
            for room in rooms if isinstance(rooms, list) else [rooms]:
                with self._lock:
                    self.kv_sent[str(room)] = fp
            return self._answer(body, chat, "prefilled", None)
        params = body.get("kv_transfer_params") or {}
        if not params.get("do_remote_decode"):
            raise KVError(400, "this test prefill pod only takes do_remote_decode requests")
        if body.get("stream") is not False or body.get("max_tokens") != 1:
            raise KVError(400, "a prefill leg is one token, not streamed")
        if self.protocol == "mooncake":
            with self._lock:
                self.kv_sent[params["transfer_id"]] = fp
            return self._answer(body, chat, "prefilled", None)  # request_finished -> None
        if self.mode == "no_kv_params":
            return self._answer(body, chat, "prefilled", None)
        handle = f"cmpl-{uuid.uuid4().hex[:12]}-0"
        with self._lock:
            self.kv_sent[handle] = fp
        out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2, 3]],
            "remote_engine_id": self.engine_id,
            "remote_request_id": handle,
            "remote_host": self.side_channel[0] if self.side_channel else self.host,
            "remote_port": self.side_channel[1] if self.side_channel else self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": 1,
            "remote_blocks_expiry_time": None,
            "transfer_mode": "pull",
        }
        return self._answer(body, chat, "prefilled", out)

    # --- decode side ------------------------------------------------------------------

    async def _decode(self, body: dict[str, Any], chat: bool) -> Response:
        fp = fingerprint(body)
        if self.protocol == "sglang":
            host, port, room = (
                body.get(k) for k in ("bootstrap_host", "bootstrap_port", "bootstrap_room")
            )
            if host is None or port is None or room is None:
                raise KVError(400, "decode mode needs bootstrap_host/port/room")
            if isinstance(room, list):  # a batch: one entry per prompt
                host, port, room = host[0], port[0], room[0]
            got = await self._wait_kv(f"http://{host}:{port}/kv/{room}")
            return await self._after_kv(body, chat, fp, got)
        params = body.get("kv_transfer_params")
        if not params:
            self.local_prefills += 1
            return self._answer(body, chat, f"local:{self.name}", None)
        if self.protocol == "mooncake":
            addr = params["remote_bootstrap_addr"]
            async with self._client(5.0) as client:
                q = (await client.get(addr + "/query")).json()
            if params["remote_engine_id"] not in {e["engine_id"] for e in q.values()}:
                raise KVError(500, "remote engine id not found from bootstrap server")
            got = await self._wait_kv(f"{addr}/kv/{params['transfer_id']}")
            return await self._after_kv(body, chat, fp, got)
        for key in ("remote_engine_id", "remote_request_id", "remote_host", "remote_port"):
            if params.get(key) is None:
                raise KVError(400, f"kv_transfer_params lacks {key}")
        url = f"http://{params['remote_host']}:{params['remote_port']}/nixl/{params['remote_request_id']}"
        got = await self._wait_kv(url, wait=False)
        if got.get("engine_id") != params["remote_engine_id"]:
            raise KVError(500, "NIXL handshake: engine id mismatch")
        return await self._after_kv(body, chat, fp, got)

    async def _wait_kv(self, url: str, wait: bool = True) -> dict[str, Any]:
        deadline = time.monotonic() + WAIT_S
        async with self._client(2.0) as client:
            for _ in range(int(WAIT_S / 0.02) + 1):  # bounded
                try:
                    r = await client.get(url)
                except httpx.HTTPError as exc:
                    raise KVError(500, f"KV transfer failed: {exc}") from exc
                if r.status_code == 200:
                    got: dict[str, Any] = r.json()
                    return got
                if not wait or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.02)
        raise KVError(500, f"KV transfer failed: nothing at {url}")

    async def _after_kv(
        self, body: dict[str, Any], chat: bool, fp: str, got: dict[str, Any]
    ) -> Response:
        if got.get("fingerprint") != fp:
            raise KVError(500, "received KV of another prompt")
        with self._lock:
            self.kv_received.append((got.get("engine_id", ""), fp))
        return self._answer(body, chat, f"kv:{got.get('engine_id')}", None)

    # --- answers ----------------------------------------------------------------------

    def _answer(
        self, body: dict[str, Any], chat: bool, text: str, kv_params: dict[str, Any] | None
    ) -> Response:
        content = f"{self.name}|{text}"
        if body.get("stream"):
            return StreamingResponse(self._stream(chat, content), media_type="text/event-stream")
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": content}}
            if chat
            else {"index": 0, "text": content}
        )
        return JSONResponse(
            {
                "id": "cmpl-1",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [{**choice, "finish_reason": "length"}],
                "usage": {
                    "prompt_tokens": 1,
                    "completion_tokens": 1,
                    "total_tokens": 2,
                    "prompt_tokens_details": {"cached_tokens": 0},
                },
                "kv_transfer_params": kv_params,
            }
        )

    async def _stream(self, chat: bool, content: str) -> AsyncIterator[bytes]:
        for part in (content, "|t1", "|t2"):
            delta = {"delta": {"content": part}} if chat else {"text": part}
            chunk = {
                "id": "cmpl-1",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "choices": [{"index": 0, **delta}],
            }
            yield f"data: {json.dumps(chunk)}\n\n".encode()
            await asyncio.sleep(0.005)
        yield b"data: [DONE]\n\n"


class KVError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@contextlib.contextmanager
def serve_pd_engines(*engines: PDEngine) -> Iterator[list[PDEngine]]:
    """Serve every engine (and a prefill pod's bootstrap server) on loopback ports."""
    with contextlib.ExitStack() as stack:
        for eng in engines:
            if eng.role == "prefill" and eng.protocol != "nixl":
                eng.bootstrap_port = stack.enter_context(
                    serve_in_thread(eng.bootstrap_app(), eng.bootstrap_port or free_port())
                )
            eng.port = stack.enter_context(serve_in_thread(eng.app(), eng.port or None))
        yield list(engines)
