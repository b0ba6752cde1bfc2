"""A no-op, OpenAI-compatible "engine" that answers at once, for router benchmarks.

Router overhead is the latency a router adds on top of the engine, so the engine
must cost (almost) nothing and, above all, cost the same every time: it runs on the
simulator's lean HTTP server (``kvplane.sim.httpd``: httptools, no framework, one
``write`` per response; uvloop when present), and builds every response at once.
Responses have the shape vLLM's OpenAI server gives (completions and chat, stream
and non-stream, ``n`` choices, usage). It also serves what routers probe:
``/v1/models``, ``/health``, ``/version``, ``/metrics`` (vLLM metric names, zero
values), ``/server_info?config_format=json``, and what vllm-router 0.1.17's
``kv_aware`` and ``cache_aware`` policies need from a worker: ``/get_server_info``
(model id, KV block size), ``/kv_event_sources`` (a ZMQ PUB socket per port with
``--kv-events-port``, bound and silent: a no-op engine stores no block) and, with
``--tokenizer``, ``/v1/completions/render``, ``/v1/chat/completions/render`` and
``/tokenize`` (both policies tokenize each request by calling render on every
worker). ``GET /bench/stats`` counts requests per path.

``prompt_tokens`` in ``usage`` is an estimate (characters / 4) unless
``--exact-usage`` is given: generation never tokenizes, so a direct request costs
the same whatever the prompt's content.

Run: ``python -m kvplane.bench.noop_backend --port 8101 [--port 8102 ...]``.
Several ports share one event loop; the benchmark runs one process per backend
instead, since a tokenizing ``/render`` blocks its loop, as it would an engine's.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec

from kvplane.sim.httpd import HttpServer, Request, Response

MAX_OUTPUT_TOKENS = 256
DEFAULT_OUTPUT_TOKENS = 16
TOKEN_TEXT = " ok"


class _GenRequest(msgspec.Struct, omit_defaults=True):
    """The only request fields the answer depends on; the rest is skipped unparsed."""

    model: str | None = None
    prompt: Any = None
    messages: Any = None
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = None
    stream_options: dict[str, Any] | None = None


class _TokenizeRequest(msgspec.Struct):
    prompt: Any = None
    messages: Any = None
    add_special_tokens: bool = True


class _RenderRequest(msgspec.Struct):
    prompt: Any = None
    messages: Any = None
    model: str | None = None


_render_decoder = msgspec.json.Decoder(_RenderRequest)
_gen_decoder = msgspec.json.Decoder(_GenRequest)
_tok_decoder = msgspec.json.Decoder(_TokenizeRequest)
_encode = msgspec.json.Encoder().encode


@dataclass
class EngineSpec:
    """What the fake engine claims to be (model, block size, KV events endpoint)."""

    model: str = "noop"
    max_model_len: int = 131072
    block_size: int = 16
    tokenizer: str | None = None
    kv_events_endpoint: str | None = None
    instance_id: str = "noop-0"
    version: str = "0.11.0"
    exact_usage: bool = False


@dataclass
class _Stats:
    by_path: dict[str, int] = field(default_factory=dict)
    unknown_paths: set[str] = field(default_factory=set)


class NoopEngine:
    """Builds the response bytes; shared by every port and connection."""

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.stats = _Stats()
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex()
        self._created = int(time.time())
        self._static = self._build_static()

    # -- helpers ------------------------------------------------------------

    def _tok(self) -> Any:
        """The tokenizer, loaded on first use so that a pure no-op run never pays for it."""
        return _load_tokenizer(self.spec.tokenizer) if self.spec.tokenizer else None

    def _count_prompt(self, prompt: Any, messages: Any) -> int:
        text = _prompt_text(prompt, messages)
        if isinstance(text, int):
            return text
        if self.spec.exact_usage and self._tok() is not None:
            return len(self._tok().encode(text, add_special_tokens=False).ids)
        return max(1, len(text) // 4)

    def _build_static(self) -> dict[str, bytes]:
        s = self.spec
        model_path = s.tokenizer or s.model
        models = {
            "object": "list",
            "data": [
                {
                    "id": s.model,
                    "object": "model",
                    "created": self._created,
                    "owned_by": "vllm",
                    "root": model_path,
                    "parent": None,
                    "max_model_len": s.max_model_len,
                    "permission": [],
                }
            ],
        }
        kv_events: dict[str, Any] | None = None
        if s.kv_events_endpoint:
            kv_events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": s.kv_events_endpoint,
                "replay_endpoint": None,
                "topic": "",
                "buffer_steps": 10000,
                "hwm": 100000,
                "max_queue_size": 100000,
            }
        server_info = {
            "vllm_config": {
                "model_config": {
                    "model": model_path,
                    "tokenizer": model_path,
                    "served_model_name": s.model,
                    "max_model_len": s.max_model_len,
                    "tokenizer_mode": "auto",
                    "skip_tokenizer_init": False,
                    "trust_remote_code": False,
                },
                "cache_config": {"block_size": s.block_size, "enable_prefix_caching": True},
                "kv_events_config": kv_events,
                "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1},
            }
        }
        get_server_info = {
            "model_id": s.model,
            "model_path": model_path,
            "tokenizer_path": model_path,
            "served_model_name": s.model,
            "instance_id": s.instance_id,
            "worker_type": "regular",
            "max_model_len": s.max_model_len,
            "kv_block_size": s.block_size,
            "effective_attention_block_size": s.block_size,
        }
        # keyed by data-parallel rank, the shape vllm-router 0.1.17 parses
        sources = (
            {"0": {"endpoint": s.kv_events_endpoint, "replay_endpoint": None, "topic": ""}}
            if s.kv_events_endpoint
            else {}
        )
        labels = f'engine="0",model_name="{s.model}"'
        metrics = "".join(
            f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name}{{{labels}}} 0.0\n"
            for name, kind, help_ in (
                ("vllm:num_requests_running", "gauge", "Number of requests in model execution."),
                ("vllm:num_requests_waiting", "gauge", "Number of requests waiting."),
                ("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent."),
                ("vllm:prefix_cache_queries_total", "counter", "Prefix cache queries (tokens)."),
                ("vllm:prefix_cache_hits_total", "counter", "Prefix cache hits (tokens)."),
            )
        )
        return {
            "models": _encode(models),
            "server_info": _encode(server_info),
            "get_server_info": _encode(get_server_info),
            "metrics": metrics.encode(),
            "version": _encode({"version": s.version}),
            "kv_event_sources": _encode(sources),
        }

    # -- dispatch -----------------------------------------------------------

    async def serve(self, req: Request) -> Response:
        """The HTTP server's handler (HEAD answers as GET; the server sends no body)."""
        return self.handle(req.method, req.path, req.body)

    def handle(self, method: str, path: str, body: bytes) -> Response:
        by_path = self.stats.by_path
        by_path[path] = by_path.get(path, 0) + 1
        if method == "POST":
            if path == "/v1/completions":
                return self._generate(body, chat=False)
            if path == "/v1/chat/completions":
                return self._generate(body, chat=True)
            if path == "/tokenize":
                return self._tokenize(body)
            if path == "/v1/completions/render":
                return self._render(body, chat=False)
            if path == "/v1/chat/completions/render":
                return self._render(body, chat=True)
        elif method in ("GET", "HEAD"):
            st = self._static
            if path in ("/health", "/ping"):
                return Response(200, b"", "text/plain")
            if path == "/v1/models":
                return Response(200, st["models"])
            if path == "/metrics":
                return Response(200, st["metrics"], "text/plain; version=0.0.4")
            if path == "/version":
                return Response(200, st["version"])
            if path == "/server_info":
                return Response(200, st["server_info"])
            if path in ("/get_server_info", "/get_model_info"):
                return Response(200, st["get_server_info"])
            if path == "/kv_event_sources":
                return Response(200, st["kv_event_sources"])
            if path == "/bench/stats":
                # request counts per path: lets a test see what a router sent
                return Response(200, _encode(self.stats.by_path))
        if path not in self.stats.unknown_paths:
            self.stats.unknown_paths.add(path)
            print(f"noop_backend: 404 {method} {path}", file=sys.stderr, flush=True)
        return _error(404, f"no route {method} {path}")

    def _generate(self, body: bytes, *, chat: bool) -> Response:
        try:
            req = _gen_decoder.decode(body)
        except msgspec.DecodeError as exc:
            return _error(400, f"invalid request body: {exc}")
        if chat and not isinstance(req.messages, list):
            return _error(400, "`messages` must be a list")
        if not chat and req.prompt is None:
            return _error(400, "`prompt` is required")
        wanted = req.max_completion_tokens if chat else None
        wanted = wanted or req.max_tokens or DEFAULT_OUTPUT_TOKENS
        n_out = max(1, min(wanted, MAX_OUTPUT_TOKENS))
        n_choices = max(1, min(req.n or 1, 16))
        prompt_tokens = self._count_prompt(req.prompt, req.messages)
        usage = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + n_out * n_choices,
            "completion_tokens": n_out * n_choices,
            "prompt_tokens_details": None,
        }
        model = req.model or self.spec.model
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self._id_prefix}{next(self._ids):024x}"
        created = int(time.time())
        if req.stream:
            opts = req.stream_options or {}
            return _stream(
                rid,
                created,
                model,
                chat,
                n_out,
                n_choices,
                usage if opts.get("include_usage") else None,
            )
        text = TOKEN_TEXT * n_out
        choices: list[dict[str, Any]]
        if chat:
            choices = [
                {
                    "index": i,
                    "message": {
                        "role": "assistant",
                        "content": text,
                        "refusal": None,
                        "annotations": None,
                        "audio": None,
                        "function_call": None,
                        "tool_calls": [],
                        "reasoning_content": None,
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                }
                for i in range(n_choices)
            ]
        else:
            choices = [
                {
                    "index": i,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": "length",
                    "stop_reason": None,
                    "prompt_logprobs": None,
                }
                for i in range(n_choices)
            ]
        payload = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "service_tier": None,
            "system_fingerprint": None,
            "usage": usage,
            "prompt_logprobs": None,
            "kv_transfer_params": None,
        }
        return Response(200, _encode(payload))

    def _render(self, body: bytes, *, chat: bool) -> Response:
        """vLLM's render endpoints: the prompt's token ids, as vllm-router's kv_aware asks.

        Chat messages are rendered with a plain ``role: content`` template (the
        bench tokenizer ships no chat template); the benchmark sends completions.
        """
        tok = self._tok()
        if tok is None:
            return _error(404, "this no-op backend was started without --tokenizer")
        try:
            req = _render_decoder.decode(body)
        except msgspec.DecodeError as exc:
            return _error(400, f"invalid request body: {exc}")
        if chat:
            msgs = req.messages if isinstance(req.messages, list) else []
            text = "".join(
                f"{m.get('role', 'user')}: {m.get('content', '')}\n"
                for m in msgs
                if isinstance(m, dict)
            )
            ids = tok.encode(text, add_special_tokens=True).ids
            return Response(200, _encode({"token_ids": ids}))
        prompts = req.prompt if isinstance(req.prompt, list) else [req.prompt]
        if prompts and all(isinstance(x, int) for x in prompts):
            prompts = [prompts]
        out = []
        for p in prompts:
            ids = p if isinstance(p, list) else tok.encode(str(p), add_special_tokens=True).ids
            out.append({"token_ids": ids, "model": req.model or self.spec.model})
        return Response(200, _encode(out))

    def _tokenize(self, body: bytes) -> Response:
        tok = self._tok()
        if tok is None:
            return _error(404, "this no-op backend was started without --tokenizer")
        try:
            req = _tok_decoder.decode(body)
        except msgspec.DecodeError as exc:
            return _error(400, f"invalid request body: {exc}")
        text = _prompt_text(req.prompt, req.messages)
        if isinstance(text, int):
            return _error(400, "prompt must be text")
        ids = tok.encode(text, add_special_tokens=req.add_special_tokens).ids
        out = {
            "count": len(ids),
            "max_model_len": self.spec.max_model_len,
            "tokens": ids,
            "token_strs": None,
        }
        return Response(200, _encode(out))


_TOKENIZERS: dict[str, Any] = {}


def _load_tokenizer(path: str) -> Any:
    """One tokenizer per directory and process, shared by every port's engine."""
    tok = _TOKENIZERS.get(path)
    if tok is None:
        from tokenizers import Tokenizer

        tok = _TOKENIZERS[path] = Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return tok


def _prompt_text(prompt: Any, messages: Any) -> str | int:
    """The prompt's text, or its length when it is already token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], int):
            return len(prompt)
        if prompt and isinstance(prompt[0], list):
            return len(prompt[0])
        return "".join(p for p in prompt if isinstance(p, str))
    parts: list[str] = []
    if isinstance(messages, list):
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(
                    c.get("text", "") for c in content if isinstance(c, dict) and "text" in c
                )
    return "\n".join(parts)


def _error(status: int, message: str) -> Response:
    body = {"object": "error", "message": message, "type": "BadRequestError", "code": status}
    return Response(status, _encode(body))


def _stream(
    rid: str,
    created: int,
    model: str,
    chat: bool,
    n_out: int,
    n_choices: int,
    usage: dict[str, Any] | None,
) -> Response:
    """The whole SSE stream as one response (the engine is instant)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    events: list[bytes] = []

    def emit(choices: list[dict[str, Any]], with_usage: bool = False) -> None:
        payload: dict[str, Any] = {
            "id": rid,
            "object": obj,
            "created": created,
            "model": model,
            "choices": choices,
        }
        if with_usage:
            payload["usage"] = usage
        events.append(b"data: " + _encode(payload) + b"\n\n")

    for i in range(n_choices):
        if chat:
            emit(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        for t in range(n_out):
            last = t == n_out - 1
            choice: dict[str, Any] = {"index": i, "logprobs": None}
            if chat:
                choice["delta"] = {"content": TOKEN_TEXT}
            else:
                choice["text"] = TOKEN_TEXT
            choice["finish_reason"] = "length" if last else None
            choice["stop_reason"] = None
            emit([choice])
    if usage is not None:
        emit([], with_usage=True)
    events.append(b"data: [DONE]\n\n")
    return Response(
        200, b"".join(events), "text/event-stream; charset=utf-8", (("cache-control", "no-cache"),)
    )


async def _serve(
    spec: EngineSpec, host: str, ports: Sequence[int], kv_events_ports: Sequence[int]
) -> None:
    if spec.tokenizer:
        _load_tokenizer(spec.tokenizer)  # now, not on the first /render
    publishers: list[Any] = []
    servers = []
    for i, port in enumerate(ports):
        endpoint = spec.kv_events_endpoint
        if i < len(kv_events_ports):
            # a silent PUB socket: gives vllm-router's kv_aware a live event source
            # to subscribe to; a no-op engine never stores a block, so it never publishes
            import zmq

            sock: Any = zmq.Context.instance().socket(zmq.PUB)
            endpoint = f"tcp://{host}:{kv_events_ports[i]}"
            sock.bind(endpoint)
            publishers.append(sock)
        engine = NoopEngine(replace(spec, instance_id=f"noop-{port}", kv_events_endpoint=endpoint))
        server = HttpServer(engine.serve, host, port)
        await server.start()
        servers.append(server)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"noop_backend: serving {spec.model} on {host}:{list(ports)}", file=sys.stderr, flush=True
    )
    await stop.wait()
    for server in servers:
        await server.close()
    for sock in publishers:
        sock.close(linger=0)


def _run(coro: Any) -> None:
    """Runs on uvloop when installed: lower and steadier per-request latency."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, action="append", required=True, help="repeatable")
    p.add_argument("--model", default="noop", help="served model name")
    p.add_argument("--tokenizer", default=None, help="tokenizer dir (for /tokenize)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=131072)
    p.add_argument(
        "--kv-events-port",
        type=int,
        action="append",
        default=[],
        help="bind a silent ZMQ PUB socket per --port (in order) and advertise it",
    )
    p.add_argument("--exact-usage", action="store_true", help="tokenize to fill usage")
    a = p.parse_args(argv)
    spec = EngineSpec(
        model=a.model,
        max_model_len=a.max_model_len,
        block_size=a.block_size,
        tokenizer=a.tokenizer,
        exact_usage=a.exact_usage,
    )
    _run(_serve(spec, a.host, a.port, a.kv_events_port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
