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

Dynamo's frontend tokenizes in Rust (with a prefix cache) before routing. The proxy
looks the prompt's token ids up in a table the benchmark wrote before the run (the ids
of every prompt it will send, which are what the engines' tokenizer makes of the text:
:class:`kvplane.workload.traces.PromptBuilder`'s contract, tested), and tokenizes any
other prompt in a worker thread (``encode_batch`` releases the GIL, so other requests
keep streaming). The time either took is reported in ``x-bench-overhead-ms``, which the
benchmark's client subtracts from the request's time to first token; the table keeps a
Python tokenizer from eating the CPU the simulated fleet runs on. The chosen engine is
named in ``x-bench-backend``.

Run: ``python -m kvplane.bench.peers.dynamo_proxy --config FILE`` where FILE is JSON:
``{"selector": URL, "tokenizer": DIR, "model": NAME, "host": H, "port": P,
"engines": [{"worker_id": 1, "name": "e0", "url": URL}, ...], "token_table": PATH}``
(``token_table`` optional, see :func:`write_token_table`).
Hand-written on the simulator's HTTP server (``kvplane.sim.httpd``) rather than a
framework: the proxy shares a 2-core machine with the fleet it measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import struct
import time
import uuid
from array import array
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import xxhash

from kvplane.bench.peers import BACKEND_HEADER, OVERHEAD_HEADER
from kvplane.bench.pool_limits import client_limits, fd_budget
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
    token_table: Path | None = None

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
            token_table=Path(raw["token_table"]) if raw.get("token_table") else None,
        )


_ENTRY = struct.Struct("<QI")  # xxh3-64 of the prompt's UTF-8 text, number of ids


def write_token_table(path: Path, prompts: Iterable[tuple[str, Sequence[int]]]) -> Path:
    """The token ids of prompts the benchmark will send, keyed by their text's hash:
    ``(xxh3-64, n)`` then ``n`` little-endian uint32 ids, per prompt."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        for text, ids in prompts:
            fh.write(_ENTRY.pack(xxhash.xxh3_64_intdigest(text.encode()), len(ids)))
            fh.write(array("I", ids).tobytes())
    tmp.replace(path)
    return path


def read_token_table(path: Path) -> dict[int, memoryview]:
    data = memoryview(path.read_bytes())
    out: dict[int, memoryview] = {}
    pos = 0
    while pos < len(data):
        key, n = _ENTRY.unpack_from(data, pos)
        pos += _ENTRY.size
        out[key] = data[pos : pos + 4 * n].cast("I")
        pos += 4 * n
    return out


class Tokenizer:
    """The engines' tokenizer, encoding off the event loop; prompts of the token table
    (if any) are looked up instead."""

    def __init__(self, directory: Path, table: Path | None = None) -> None:
        from transformers import AutoTokenizer

        tok: Any = AutoTokenizer.from_pretrained(str(directory))
        self._backend: Any = tok.backend_tokenizer
        self._pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        self._table = read_token_table(table) if table is not None else {}

    def encode_sync(self, text: str) -> list[int]:
        # encode_batch releases the GIL (encode does not): the loop keeps serving
        return list(self._backend.encode_batch([text], add_special_tokens=True)[0].ids)

    async def encode(self, text: str) -> list[int]:
        known = self._table.get(xxhash.xxh3_64_intdigest(text.encode()))
        if known is not None:
            return known.tolist()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.encode_sync, text)


class DynamoProxy:
    def __init__(self, cfg: ProxyConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.by_worker = {e.worker_id: e for e in cfg.engines}
        limits = client_limits(1024, fd_budget())  # pool_limits.client_limits says why
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
        try:
            resp = await self._send(engine, req.body)
        except httpx.HTTPError as exc:
            self._background(self._free(sid))
            return openai_error(502, f"engine {engine.name}: {exc!r}", "bad_gateway")
        if resp.status_code != 200 or not stream:
            try:
                data = await resp.aread()
            finally:
                await resp.aclose()
                self._background(self._prefill_then_free(sid))
            return Response(resp.status_code, data, headers=headers)
        return StreamingResponse(self._relay(resp, sid), headers=headers)

    async def _send(self, engine: Engine, body: bytes) -> httpx.Response:
        """POST to the engine; once more on a fresh connection if a kept-alive one was
        closed under us before any answer (nothing was processed, as a router retries)."""
        for attempt in range(2):
            upstream = self.engines.build_request(
                "POST", engine.url + "/v1/completions", content=body
            )
            try:
                return await self.engines.send(upstream, stream=True)
            except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
                if attempt:
                    raise
        raise AssertionError("unreachable")

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
    proxy = DynamoProxy(cfg, Tokenizer(cfg.tokenizer, cfg.token_table))
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
