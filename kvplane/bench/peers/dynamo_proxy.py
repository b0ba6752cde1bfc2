"""Dynamo's KV-router decision loop in front of vLLM-compatible engines, for benchmarks.

Dynamo's frontend routes a request in four steps around its selection core; this proxy
takes the same steps against the runtime-free selection service (``python -m
dynamo.select_service``, in the Dynamo virtualenv), which indexes the engines' own
vLLM ZMQ KV events and keeps Dynamo's load accounting:

1. tokenize the prompt as the engines do (the same Hugging Face tokenizer, special
   tokens as a vLLM completion adds them);
2. ``POST /select_and_reserve`` with the token ids: the chosen worker and its load booked;
3. forward the request to that engine and stream its answer back; at the first token
   ``POST /reservations/{id}/prefill_complete`` (the prompt's load moves to decode);
4. at the end (or on any failure or client disconnect) ``DELETE /reservations/{id}``.

Dynamo's frontend tokenizes in Rust before routing; this proxy tokenizes in a worker
thread (``encode_batch`` releases the GIL, so other requests keep streaming) and reports
the time it took in ``x-bench-overhead-ms``, which the benchmark's client subtracts from
the request's time to first token. The chosen engine is named in ``x-bench-backend``.

Run: ``python -m kvplane.bench.peers.dynamo_proxy --config FILE`` where FILE is JSON:
``{"selector": URL, "tokenizer": DIR, "model": NAME, "host": H, "port": P,
"engines": [{"worker_id": 1, "name": "e0", "url": URL}, ...]}``.
Hand-written on the simulator's HTTP server (``kvplane.sim.httpd``) rather than a
framework: the proxy shares a 2-core machine with the fleet it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec

from kvplane.bench.peers import BACKEND_HEADER, OVERHEAD_HEADER
from kvplane.sim.httpd import HttpServer, Request, Response, StreamingResponse

_encode = msgspec.json.Encoder().encode
TOKENIZER_THREADS = 2
_TOKEN_TEXT = re.compile(rb'"text":"[^"]')  # an SSE chunk that carries generated text


def openai_error(status: int, message: str, kind: str = "invalid_request_error") -> Response:
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return Response(status, _encode(body))


@dataclass(frozen=True, slots=True)
class Engine:
    worker_id: int
    name: str
    url: str


@dataclass(frozen=True, slots=True)
class ProxyConfig:
    selector: str
    tokenizer: Path
    model: str
    engines: tuple[Engine, ...]
    host: str = "127.0.0.1"
    port: int = 0

    @classmethod
    def load(cls, path: Path) -> ProxyConfig:
        raw = json.loads(path.read_text())
        engines = tuple(Engine(int(e["worker_id"]), e["name"], e["url"]) for e in raw["engines"])
        return cls(
            selector=raw["selector"].rstrip("/"),
            tokenizer=Path(raw["tokenizer"]),
            model=raw["model"],
            engines=engines,
            host=raw.get("host", "127.0.0.1"),
            port=int(raw.get("port", 0)),
        )


class Tokenizer:
    """The engines' tokenizer, encoding off the event loop."""

    def __init__(self, directory: Path) -> None:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(str(directory))
        self._backend: Any = tok.backend_tokenizer
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")

    def encode_sync(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): the loop keeps serving
        return list(self._backend.encode_batch([text], add_special_tokens=True)[0].ids)

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.encode_sync, text)


class DynamoProxy:
    def __init__(self, cfg: ProxyConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.by_worker = {e.worker_id: e for e in cfg.engines}
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        self.engines = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None))
        self.selector = httpx.AsyncClient(
            base_url=cfg.selector, limits=limits, timeout=httpx.Timeout(60.0)
        )
        self.tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await self.engines.aclose()
        await self.selector.aclose()

    # ----------------------------------------------------------------- selector calls

    async def _select(self, selection_id: str, tokens: list[int]) -> dict[str, Any]:
        body = {"selection_id": selection_id, "model_name": self.cfg.model, "token_ids": tokens}
        r = await self.selector.post("/select_and_reserve", json=body)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def _background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _prefill_complete(self, selection_id: str) -> None:
        await self.selector.post(f"/reservations/{selection_id}/prefill_complete")

    async def _free(self, selection_id: str) -> None:
        await self.selector.delete(f"/reservations/{selection_id}")

    # ----------------------------------------------------------------- HTTP

    async def handle(self, req: Request) -> Response | StreamingResponse:
        if req.method == "GET" and req.path in ("/health", "/ready"):
            r = await self.selector.get("/ready")
            ok = r.status_code == 200 and bool(r.json().get("ready"))
            return Response(200 if ok else 503, b"{}")
        if req.method == "GET" and req.path == "/v1/models":
            return Response(200, _encode({"object": "list", "data": [{"id": self.cfg.model}]}))
        if req.path != "/v1/completions":
            return openai_error(404, f"{req.path} is not served (completions only)")
        if req.method != "POST":
            return openai_error(405, "use POST")
        try:
            body = msgspec.json.decode(req.body)
        except msgspec.DecodeError:
            return openai_error(400, "the body is not JSON")
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, str):
            return openai_error(400, "prompt must be a string")
        return await self._complete(req, body, prompt)

    async def _complete(
        self, req: Request, body: dict[str, Any], prompt: str
    ) -> Response | StreamingResponse:
        t0 = time.perf_counter()
        tokens = await self.tokenizer.encode(prompt)
        overhead_ms = (time.perf_counter() - t0) * 1000.0
        sid = uuid.uuid4().hex
        try:
            choice = await self._select(sid, tokens)
        except (httpx.HTTPError, ValueError) as exc:
            return openai_error(503, f"selection failed: {exc}", "service_unavailable")
        engine = self.by_worker.get(int(choice.get("worker_id", -1)))
        if engine is None:
            self._background(self._free(sid))
            return openai_error(503, f"selector chose an unknown worker: {choice}")
        headers = ((BACKEND_HEADER, engine.name), (OVERHEAD_HEADER, f"{overhead_ms:.3f}"))
        stream = bool(body.get("stream"))
        upstream = self.engines.build_request(
            "POST", engine.url + "/v1/completions", content=req.body
        )
        try:
            resp = await self.engines.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            self._background(self._free(sid))
            return openai_error(502, f"engine {engine.name}: {exc}", "bad_gateway")
        if resp.status_code != 200 or not stream:
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
                self._background(self._prefill_then_free(sid))
            return Response(resp.status_code, data, headers=headers)
        return StreamingResponse(self._relay(resp, sid), headers=headers)

    async def _prefill_then_free(self, sid: str) -> None:
        await self._prefill_complete(sid)
        await self._free(sid)

    async def _relay(self, resp: httpx.Response, sid: str) -> AsyncIterator[bytes]:
        first = True
        try:
            async for chunk in resp.aiter_raw():
                if first and _TOKEN_TEXT.search(chunk):
                    first = False
                    self._background(self._prefill_complete(sid))
                yield chunk
        finally:
            await resp.aclose()
            self._background(self._free(sid))


async def serve(cfg: ProxyConfig) -> None:
    proxy = DynamoProxy(cfg, Tokenizer(cfg.tokenizer))
    server = HttpServer(proxy.handle, cfg.host, cfg.port)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(f"dynamo proxy on http://{cfg.host}:{server.port}", flush=True)
    try:
        await stop.wait()
    finally:
        await server.close()
        await proxy.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvplane.bench.peers.dynamo_proxy")
    p.add_argument("--config", type=Path, required=True)
    args = p.parse_args(argv)
    cfg = ProxyConfig.load(args.config)
    try:
        import uvloop
    except ImportError:
        asyncio.run(serve(cfg))
    else:
        uvloop.run(serve(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
