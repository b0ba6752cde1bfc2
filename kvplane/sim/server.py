"""One simulated engine: the virtual-time core driven in scaled real time, behind vLLM's
HTTP API, metrics and KV-event publisher.

Time: a step of modeled duration ``d`` takes ``d * time_scale`` wall seconds; its tokens
and KV events come out at its end, as a real engine's do after the forward. Requests
that arrive meanwhile join the next step (continuous batching). While the engine stays
busy, each step starts at the previous one's scheduled end, not at the moment the
event loop got round to it, so small loop delays do not accumulate into the modeled
timeline; a lag beyond :data:`MAX_CATCH_UP_S` is given up (the loop is overloaded and
the figures would be fiction either way). Latencies reported here (``/metrics``,
``/sim/stats``) are simulated seconds: wall time divided by ``time_scale``.

Streaming follows vLLM's ``--stream-interval N``: a chunk at the first token, then
every ``N`` tokens, and at the end; a client that disconnects aborts its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvplane.router.tokens import ChatFormatError, ChatOptions, PromptTokenizer
from kvplane.sim import openai_api as api
from kvplane.sim import pd, surface
from kvplane.sim.engine import EngineCore, EngineStats, Fabric, SimRequest, StepOutput
from kvplane.sim.hashing import block_hashes
from kvplane.sim.httpd import HttpServer, Request, Response, StreamingResponse
from kvplane.sim.lora import LoraConfig, LoraRequest, info_labels
from kvplane.sim.metrics import RequestHistograms, TransferCounters, render_metrics
from kvplane.sim.profiles import EngineProfile
from kvplane.sim.publisher import KVEventPublisher

log = logging.getLogger(__name__)

VLLM_VERSION: Final = "0.33.0"
MAX_CATCH_UP_S: Final = 0.1  # wall seconds a busy engine may run behind its timeline
LATE_S: Final = 0.002  # a step starting later than this counts as late (timers are ~1 ms)
OUTPUT_TEXT: Final = " ok"  # every generated token is this word's token


@dataclass(frozen=True, slots=True)
class OutputToken:
    """The one token every simulated generation repeats (deterministic text)."""

    token_id: int
    text: str

    @classmethod
    def for_tokenizer(cls, tok: PromptTokenizer) -> OutputToken:
        ids = tok.encode(OUTPUT_TEXT, add_special_tokens=False)
        tid = ids[-1] if ids else 0
        return cls(tid, str(tok.hf.decode([tid])))


@dataclass(slots=True)
class SimEngineConfig:
    """One engine's identity, interfaces and model."""

    profile: EngineProfile
    name: str = "e0"
    model: str = "sim"  # served model name
    tokenizer_path: str = ""  # reported as the model root
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    kv_events: bool = True
    kv_events_port: int = 0
    replay_port: int | None = 0  # None: no replay socket
    topic: str = ""
    time_scale: float = 1.0  # wall seconds per simulated second
    stream_interval: int = 1
    hash_algo: str = "sha256"
    hash_seed: str | None = None
    enable_prefix_caching: bool = True
    kv_role: str = "both"  # both | prefill | decode (P/D)
    kv_connector: str = "nixl"  # nixl | mooncake | sglang
    engine_id: str = ""  # NIXL/Mooncake engine identity; default: a uuid
    pd_link_gbps: float = 50.0  # GB/s between engines for P/D KV transfers
    bootstrap_port: int | None = None  # Mooncake/SGLang bootstrap (prefill engines)
    lora: LoraConfig | None = None  # LoRA adapters served (vLLM --enable-lora)
    # serve /v1/embeddings, /v1/score, /v1/rerank too (vLLM serves them for a pooling
    # model, --runner pooling; a generative one answers them 404)
    pooling: bool = False
    fabric: Fabric | None = None  # the fleet's shared store and peer pulls (SimFleet)

    @property
    def max_model_len(self) -> int:
        return min(self.profile.max_model_len, self.profile.capacity_tokens)


@dataclass(slots=True)
class _Sub:
    """One engine request: a (prompt, sample) pair of an HTTP request."""

    rid: str
    index: int
    prompt_len: int
    max_tokens: int
    gen: _Gen
    t_arrival: float
    t_sched: float | None = None
    t_first: float | None = None
    t_last: float = 0.0
    n_out: int = 0
    n_sent: int = 0
    finish: str | None = None
    cached: int = 0
    transferred: int = 0  # P/D: prompt tokens whose KV came from a prefill engine


@dataclass(slots=True)
class _Gen:
    """One HTTP generation request and the waiter its handler sleeps on."""

    n: int = 1  # samples per prompt (subs are numbered prompt-major: i * n + j)
    subs: list[_Sub] = field(default_factory=list)
    waiter: asyncio.Future[None] | None = None
    open_subs: int = 0
    plan: pd.Plan | None = None  # this request's side of a P/D handoff
    prompt: list[int] = field(default_factory=list)  # kept for a P/D prefill's blocks
    kv_transfer_params: dict[str, Any] | None = None  # a NIXL prefill's answer

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter


@dataclass(slots=True)
class SimCounters:
    """``/sim/stats``: what the benchmark's load-imbalance figures need."""

    requests: int = 0  # engine requests admitted
    finished: int = 0
    aborted: int = 0
    rejected: int = 0  # 4xx answers to generation requests
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (GPU or CPU)
    prefill_tokens_computed: int = 0  # prompt tokens computed here (not cached/sent)
    transferred_tokens: int = 0  # P/D: prompt tokens whose KV was received
    generation_tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0  # simulated seconds spent in steps
    # event-loop health (wall seconds): a step that began after its modeled start
    late_steps: int = 0
    max_lag_s: float = 0.0
    lag_resyncs: int = 0  # lags beyond MAX_CATCH_UP_S: the modeled timeline slipped


class SimEngine:
    """A simulated vLLM engine with its HTTP server and KV-event publisher."""

    def __init__(
        self,
        cfg: SimEngineConfig,
        tokenizer: PromptTokenizer,
        output: OutputToken | None = None,
        registry: EngineRegistry | None = None,
    ) -> None:
        self.cfg = cfg
        self.tok = tokenizer
        self.out = output or OutputToken.for_tokenizer(tokenizer)
        self.registry = registry
        if not cfg.engine_id:
            cfg.engine_id = str(uuid.uuid4())
        profile = cfg.profile
        if profile.max_model_len > profile.capacity_tokens:
            profile = replace(profile, max_model_len=profile.capacity_tokens)
        self.core = EngineCore(
            profile,
            hash_algo=cfg.hash_algo,
            hash_seed=cfg.hash_seed,
            output_token_id=self.out.token_id,
            enable_prefix_caching=cfg.enable_prefix_caching,
            lora=cfg.lora,
            fabric=cfg.fabric,
        )
        self.loras = cfg.lora.by_name() if cfg.lora is not None else {}
        # vllm:lora_requests_info: label set -> when it was last set (vLLM keeps them all)
        self._lora_series: OrderedDict[tuple[str, str], float] = OrderedDict()
        self.max_model_len = cfg.max_model_len
        self.vocab_size = len(tokenizer.hf)
        self.http = HttpServer(self.handle, cfg.host, cfg.port)
        self.publisher: KVEventPublisher | None = None
        self.hists = RequestHistograms(self.max_model_len)
        self.counters = SimCounters()
        self.transfers = TransferCounters()
        self._aborts = 0
        self.dead: str | None = None  # why the engine loop died (then /health is 503)
        self._xfer_hits = 0  # prompt tokens received from prefill engines (P/D)
        self._xfer_queries = 0
        self.pins: dict[str, pd.Pin] = {}  # request id -> blocks held for a decode side
        self.link = pd.Link()  # inbound KV transfers queue here
        self.bootstrap: HttpServer | None = None
        self._subs: dict[str, _Sub] = {}
        self._unscheduled: dict[str, _Sub] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._t0 = time.monotonic()
        self._created = int(time.time())
        self._created_f = time.time()
        self._ids = 0
        digest = hashlib.sha256(f"{cfg.model}:{profile.name}".encode()).hexdigest()[:8]
        self.fingerprint = f"vllm-{VLLM_VERSION}-{digest}"
        self.routes: dict[tuple[str, str], Callable[[Request], Any]] = {}
        self.http_requests: dict[str, int] = {}  # "METHOD /path" -> count (what probed us)
        self._register_routes()
        self.extra_routes: dict[tuple[str, str], Callable[[Request], Any]] = {}

    # ---- lifecycle ----------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.cfg.host}:{self.http.port}"

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def bootstrap_port(self) -> int | None:
        """Mooncake/SGLang bootstrap server port (prefill engines with those connectors)."""
        return self.bootstrap.port if self.bootstrap is not None else None

    @property
    def events_endpoint(self) -> str | None:
        return self.publisher.endpoint if self.publisher is not None else None

    @property
    def replay_endpoint(self) -> str | None:
        return self.publisher.replay_endpoint if self.publisher is not None else None

    def backend(self) -> dict[str, str]:
        """This engine as a kvplane router backend entry."""
        entry = {"name": self.cfg.name, "url": self.url, "topic": self.cfg.topic}
        if self.events_endpoint:
            entry["kv_events"] = self.events_endpoint
        if self.replay_endpoint:
            entry["replay"] = self.replay_endpoint
        return entry

    def router_backend(self) -> dict[str, Any]:
        """The kvplane router backend entry, with the P/D role and bootstrap port."""
        entry: dict[str, Any] = dict(self.backend())
        if self.cfg.kv_role != "both":
            entry["role"] = self.cfg.kv_role
        if self.bootstrap_port is not None:
            entry["bootstrap_port"] = self.bootstrap_port
        return entry

    async def start(self) -> None:
        cfg = self.cfg
        if cfg.kv_events:
            replay = None if cfg.replay_port is None else f"tcp://{cfg.host}:{cfg.replay_port}"
            self.publisher = KVEventPublisher(
                f"tcp://{cfg.host}:{cfg.kv_events_port}",
                replay,
                topic=cfg.topic,
                bind=True,
            )
            self.publisher.start()
        await self.http.start()
        if cfg.kv_role == "prefill" and cfg.kv_connector in ("mooncake", "sglang"):
            self.bootstrap = HttpServer(self._bootstrap_handle, cfg.host, cfg.bootstrap_port or 0)
            await self.bootstrap.start()
        self._task = asyncio.get_running_loop().create_task(self._drive())
        if self.registry is not None:
            self.registry.add(self)

    async def stop(self) -> None:
        if self.registry is not None:
            self.registry.remove(self)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.http.close()
        if self.bootstrap is not None:
            await self.bootstrap.close()
            self.bootstrap = None
        for pin in list(self.pins.values()):
            pin.release()
        if self.publisher is not None:
            await self.publisher.aclose()
            self.publisher = None

    # ---- the engine loop ----------------------------------------------------------------

    def sim_time(self, wall: float | None = None) -> float:
        """Simulated seconds since start."""
        t = time.monotonic() if wall is None else wall
        return (t - self._t0) / self.cfg.time_scale

    async def _drive(self) -> None:
        try:
            await self._run_steps()
        except Exception as exc:  # a broken core is vLLM's EngineDeadError: fail loudly
            log.exception("engine %s died", self.cfg.name)
            self.dead = f"{type(exc).__name__}: {exc}"
            for sub in list(self._subs.values()):
                del self._subs[sub.rid]
                sub.finish = "error"
                sub.gen.open_subs -= 1
                sub.gen.wake()

    async def _run_steps(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.cfg.time_scale
        next_start: float | None = None
        while True:
            if not self.core.has_work():
                self._wake.clear()
                await self._wake.wait()
                next_start = None
            now = loop.time()
            start = now if next_start is None or now - next_start > MAX_CATCH_UP_S else next_start
            if next_start is not None and now - next_start > LATE_S:
                lag = now - next_start  # the loop got here late: how far behind the model
                self.counters.late_steps += 1
                self.counters.max_lag_s = max(self.counters.max_lag_s, lag)
                if lag > MAX_CATCH_UP_S:
                    self.counters.lag_resyncs += 1
            wall_start = time.monotonic() - (now - start)
            out = self.core.step()
            self._note_scheduled(wall_start)
            end = start + out.duration_s * scale
            delay = end - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                await asyncio.sleep(0)  # let HTTP handlers run between back-to-back steps
            self._deliver(out, wall_start + out.duration_s * scale)
            next_start = end

    def _publish_store_events(self) -> None:
        """The shared store's events since the last step of any engine, each on the
        stream of the engine that wrote the block (an eviction included), as the
        discrete-event mode delivers them."""
        fabric = self.cfg.fabric
        if fabric is None or fabric.store is None:
            return
        for writer, events in fabric.store.take_events().items():
            engine = self.registry.by_name.get(writer) if self.registry is not None else None
            if engine is not None and engine.publisher is not None:
                engine.publisher.publish(events)

    def _note_scheduled(self, wall: float) -> None:
        if not self._unscheduled:
            return
        for rid, sub in list(self._unscheduled.items()):
            cached = self.core.cached_tokens(rid)
            if cached is not None:
                sub.t_sched = wall
                sub.cached = cached
                del self._unscheduled[rid]

    def _deliver(self, out: StepOutput, wall: float) -> None:
        c = self.counters
        c.steps += 1
        c.busy_s += out.duration_s
        if out.events and self.publisher is not None:
            self.publisher.publish(out.events)
        self._publish_store_events()
        scale = self.cfg.time_scale
        interval = self.cfg.stream_interval
        h = self.hists
        finished = out.finished
        for rid, toks in out.new_tokens.items():
            sub = self._subs.get(rid)
            if sub is None:
                continue
            k = len(toks)
            c.generation_tokens += k
            if sub.n_out == 0:
                sub.t_first = wall
                if sub.t_sched is None:
                    sub.t_sched = wall
                    sub.cached = self.core.cached_tokens(rid) or 0
                    self._unscheduled.pop(rid, None)
                h.ttft.observe((wall - sub.t_arrival) / scale)
                computed = max(0, sub.prompt_len - sub.cached)
                xfer = min(sub.transferred, sub.cached)  # received blocks hit as cached
                c.prompt_tokens += sub.prompt_len
                c.cached_tokens += sub.cached - xfer
                c.transferred_tokens += xfer
                c.prefill_tokens_computed += computed
                self._xfer_hits += xfer
                h.prefill_kv_computed.observe(computed)
            else:
                h.itl.observe((wall - sub.t_last) / scale)
            sub.t_last = wall
            sub.n_out += k
            reason = finished.get(rid)
            if reason is not None:
                self._finish(sub, reason, wall)
            elif sub.n_sent == 0 or sub.n_out - sub.n_sent >= interval:
                sub.gen.wake()
        for rid, reason in finished.items():
            sub = self._subs.get(rid)
            if sub is not None:
                self._finish(sub, reason, wall)

    def _finish(self, sub: _Sub, reason: str, wall: float) -> None:
        del self._subs[sub.rid]
        self._unscheduled.pop(sub.rid, None)
        sub.finish = reason
        self.counters.finished += 1
        scale = self.cfg.time_scale
        h = self.hists
        t_sched = sub.t_sched if sub.t_sched is not None else sub.t_arrival
        t_first = sub.t_first if sub.t_first is not None else wall
        h.e2e.observe((wall - sub.t_arrival) / scale)
        h.queue.observe((t_sched - sub.t_arrival) / scale)
        h.prefill.observe((t_first - t_sched) / scale)
        h.decode.observe((wall - t_first) / scale)
        h.inference.observe((wall - t_sched) / scale)
        if sub.n_out > 1:
            h.tpot.observe((wall - t_first) / scale / (sub.n_out - 1))
        h.prompt_tokens.observe(sub.prompt_len)
        h.generation_tokens.observe(sub.n_out)
        h.max_num_generation_tokens.observe(sub.max_tokens)
        h.max_tokens.observe(sub.max_tokens)
        h.params_n.observe(1)
        gen = sub.gen
        if gen.plan is not None and gen.plan.role == pd.PRODUCE:
            self._produced(gen, sub)
        gen.open_subs -= 1
        gen.wake()

    def submit(
        self,
        gen: _Gen,
        sub: _Sub,
        prompt: list[int],
        ktp: dict[str, Any] | None,
        lora: LoraRequest | None = None,
    ) -> None:
        """Queue one engine request (raises ValueError as the core does)."""
        req = SimRequest(sub.rid, prompt, sub.max_tokens, kv_transfer_params=ktp, lora=lora)
        self.core.add_request(req)
        self._subs[sub.rid] = sub
        self._unscheduled[sub.rid] = sub
        gen.subs.append(sub)
        gen.open_subs += 1
        self.counters.requests += 1
        self._wake.set()

    def start_generation(self, ids: list[int], max_tokens: int, public_id: str) -> _Gen:
        """One sequence generated for a request of another endpoint (``surface``)."""
        gen = _Gen()
        rid = f"{public_id}-0-{self.next_id()}"
        sub = _Sub(rid, 0, len(ids), max_tokens, gen, time.monotonic())
        try:
            self.submit(gen, sub, ids, None)
        except ValueError as exc:
            self.abort(gen)
            raise api.ApiError(400, str(exc)) from exc
        return gen

    def abort(self, gen: _Gen) -> None:
        plan = gen.plan
        unfinished = any(s.finish is None for s in gen.subs)
        if unfinished and plan and plan.role == pd.PRODUCE and plan.key and self.registry:
            self.registry.board.fail(plan.key, "the prefill request was aborted")
        for sub in gen.subs:
            if sub.finish is None and sub.rid in self._subs:
                self.core.abort(sub.rid)
                del self._subs[sub.rid]
                self._unscheduled.pop(sub.rid, None)
                sub.finish = "abort"
                self._aborts += 1
                self.counters.aborted += 1

    def stats(self) -> EngineStats:
        """The core's counters as vLLM reports them: KV received from a prefill engine is
        an external (connector) hit, not a local prefix-cache hit."""
        s = self.core.stats()
        if self._aborts:
            s.request_success = {**s.request_success, "abort": self._aborts}
        if self._xfer_hits:
            s.prefix_cache_hits = max(0, s.prefix_cache_hits - self._xfer_hits)
            s.prompt_tokens_cached = max(0, s.prompt_tokens_cached - self._xfer_hits)
        self.transfers = TransferCounters(self._xfer_queries, self._xfer_hits)
        return s

    # ---- P/D ----------------------------------------------------------------------------

    def _prompt_hashes(self, prompt: list[int]) -> list[bytes]:
        bs = self.core.profile.block_size
        return block_hashes(prompt, bs, self.cfg.hash_algo, self.cfg.hash_seed)

    def _produced(self, gen: _Gen, sub: _Sub) -> None:
        """A prefill for a remote decode finished: hold its blocks for the lease and
        leave the handle where the decode side looks (NIXL: in the answer)."""
        plan = gen.plan
        assert plan is not None
        scale = self.cfg.time_scale
        hashes = self._prompt_hashes(gen.prompt)
        blocks = pd.pin_prefix(self.core, hashes)
        if not blocks:  # not one full block: nothing to hand off (vLLM returns no params)
            if plan.key and self.registry is not None:
                self.registry.board.fail(plan.key, "the prompt is shorter than one block")
            return
        pin = pd.Pin(
            self.cfg.engine_id,
            sub.rid,
            sub.prompt_len,
            hashes[: len(blocks)],
            blocks,
            self._release_pin,
            key=plan.key,
        )
        self.pins[sub.rid] = pin
        pin.timer = asyncio.get_running_loop().call_later(pd.LEASE_S * scale, pin.release)
        if plan.connector == "nixl":
            gen.kv_transfer_params = pd.nixl_params(
                pin, self.cfg.host, self.port, time.time() + pd.LEASE_S * scale, sub.prompt_len
            )
        elif plan.key and self.registry is not None:
            self.registry.board.offer(plan.key, pin)

    def _release_pin(self, pin: pd.Pin) -> None:
        pd.unpin(self.core, pin.blocks)
        self.pins.pop(pin.request_id, None)
        if pin.key and self.registry is not None:
            self.registry.board.drop(pin.key)

    async def _receive(self, plan: pd.Plan, prompt: list[int]) -> int:
        """The decode side: find the prefill's blocks, wait for the transfer of what this
        engine lacks, cache them here. Returns the prompt tokens received."""
        registry = self.registry
        if registry is None:
            raise pd.transfer_failed("no engine registry (a lone engine has no peers)")
        scale = self.cfg.time_scale
        if plan.connector == "nixl":
            params = plan.params
            addr = f"{params.get('remote_host')}:{params.get('remote_port')}"
            source = registry.find(str(params.get("remote_engine_id")), addr)
            if source is None:
                raise pd.transfer_failed(f"unknown remote engine {params.get('remote_engine_id')}")
            pin = source.pins.get(str(params.get("remote_request_id")))
            if pin is None:
                raise pd.transfer_failed(
                    f"{source.cfg.name} no longer holds {params.get('remote_request_id')} "
                    "(lease over or unknown request)"
                )
        else:
            assert plan.key is not None
            if plan.connector == "mooncake":
                if registry.find(str(plan.params.get("remote_engine_id"))) is None:
                    raise pd.transfer_failed(
                        f"unknown remote engine {plan.params.get('remote_engine_id')}"
                    )
            elif f"{plan.params.get('host')}:{plan.params.get('port')}" not in (
                registry.by_bootstrap
            ):
                raise pd.transfer_failed(
                    f"no prefill server bootstraps at {plan.params.get('host')}:"
                    f"{plan.params.get('port')}"
                )
            try:
                pin = await registry.board.take(plan.key, pd.HANDOFF_TIMEOUT_S * scale)
            except pd.HandoffFailed as exc:
                raise pd.transfer_failed(str(exc)) from exc
            if pin.released:
                raise pd.transfer_failed("the prefill's lease ended before the transfer")
        bs = self.core.profile.block_size
        hashes = self._prompt_hashes(prompt)[: (len(prompt) - 1) // bs]
        common = 0
        for mine, theirs in zip(hashes, pin.hashes, strict=False):
            if mine != theirs:
                break
            common += 1
        local = pd.local_prefix_blocks(self.core, hashes[:common])
        seconds = pd.transfer_seconds(
            (common - local) * bs, self.core.profile.kv_bytes_per_token, self.cfg.pd_link_gbps
        )
        loop = asyncio.get_running_loop()
        end = self.link.reserve(loop.time(), seconds * scale)
        try:
            if end > loop.time():
                await asyncio.sleep(end - loop.time())
            local = pd.local_prefix_blocks(self.core, hashes[:common])  # may have changed
            inserted = pd.insert_prefix(self.core, hashes, prompt, local, common - local)
        finally:
            pin.release()  # pulled (or given up): the prefill engine frees its blocks
        self._xfer_queries += len(prompt) - local * bs
        return inserted

    async def _bootstrap_handle(self, req: Request) -> Response:
        """A Mooncake bootstrap server's ``GET /query`` (engine id per DP rank)."""
        if req.method == "GET" and req.path == "/query":
            entry = {"engine_id": self.cfg.engine_id, "dp_rank": 0, "host": self.cfg.host}
            return api.json_response({"0": entry})
        if req.method == "GET" and req.path == "/health":
            return Response(200, b"", "")
        return api.not_found()

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    # ---- HTTP ---------------------------------------------------------------------------

    def _register_routes(self) -> None:
        r = self.routes
        r["POST", "/v1/completions"] = lambda q: self._generate(q, chat=False)
        r["POST", "/v1/chat/completions"] = lambda q: self._generate(q, chat=True)
        r["POST", "/tokenize"] = self._tokenize
        r["POST", "/detokenize"] = self._detokenize
        r["POST", "/v1/completions/render"] = lambda q: self._render(q, chat=False)
        r["POST", "/v1/chat/completions/render"] = lambda q: self._render(q, chat=True)
        r["POST", "/reset_prefix_cache"] = self._reset_prefix_cache
        for path in ("/health", "/ping"):
            r["GET", path] = self._health
        r["GET", "/v1/models"] = self._models
        r["GET", "/version"] = self._version
        r["GET", "/metrics"] = self._metrics
        r["GET", "/load"] = self._load
        r["GET", "/kv_event_sources"] = self._kv_event_sources
        # SGLang's names (sglang-router probes /server_info, then /get_server_info, ...)
        r["GET", "/get_server_info"] = r["GET", "/server_info"] = self._server_info
        r["GET", "/get_model_info"] = r["GET", "/model_info"] = self._model_info
        r["GET", "/sim/stats"] = self._sim_stats
        surface.register(self, r)  # embeddings, score, rerank, responses

    async def handle(self, req: Request) -> Response | StreamingResponse:
        method = "GET" if req.method == "HEAD" else req.method
        key = f"{req.method} {req.path}"
        self.http_requests[key] = self.http_requests.get(key, 0) + 1
        fn = self.routes.get((method, req.path)) or self.extra_routes.get((method, req.path))
        if fn is None and method == "GET" and req.path.startswith(surface.RESPONSE_PREFIX):
            fn = self.routes.get((method, surface.RESPONSE_PREFIX + "{id}"))
        if fn is None:
            if any(path == req.path for _, path in (*self.routes, *self.extra_routes)):
                return api.method_not_allowed()
            return api.not_found()
        try:
            result: Response | StreamingResponse = await fn(req)
        except api.ApiError as exc:
            return exc.response()
        return result

    async def _health(self, _req: Request) -> Response:
        return Response(503 if self.dead else 200, b"", "")

    async def _models(self, _req: Request) -> Response:
        root = self.cfg.tokenizer_path or self.cfg.model
        adapters = [(a.name, a.path) for a in self.loras.values()]
        return api.json_response(
            api.models_list(self.cfg.model, root, self.max_model_len, self._created, adapters)
        )

    async def _version(self, _req: Request) -> Response:
        return api.json_response({"version": VLLM_VERSION})

    async def _load(self, _req: Request) -> Response:
        return api.json_response({"server_load": len(self._subs)})

    async def _metrics(self, _req: Request) -> Response:
        p = self.core.profile
        text = render_metrics(
            model_name=self.cfg.model,
            engine="0",
            stats=self.stats(),
            hists=self.hists,
            cache_config={
                "block_size": str(p.block_size),
                "enable_prefix_caching": str(self.cfg.enable_prefix_caching),
                "num_gpu_blocks": str(p.num_gpu_blocks),
                "prefix_caching_hash_algo": self.cfg.hash_algo,
                "kv_cache_size_tokens": str(p.capacity_tokens),
            },
            created=self._created_f,
            transfers=self.transfers,
            lora_series=self._lora_info(),
        )
        return Response(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _lora_info(self) -> list[tuple[dict[str, str], float]]:
        """vllm:lora_requests_info: the current label set stamped now, with every set
        seen before at its own time (as vLLM's gauge keeps them; the last 64 here)."""
        if self.cfg.lora is None:
            return []
        stats = self.core.stats()
        key = (",".join(stats.running_loras), ",".join(stats.waiting_loras))
        series = self._lora_series
        series[key] = time.time()
        series.move_to_end(key)
        while len(series) > 64:
            series.popitem(last=False)
        max_loras = self.cfg.lora.max_loras
        return [
            (info_labels(max_loras, running.split(",") if running else [],
                         waiting.split(",") if waiting else []), at)
            for (running, waiting), at in series.items()
        ]  # fmt: skip

    async def _kv_event_sources(self, _req: Request) -> Response:
        pub = self.publisher
        return api.json_response({"0": pub.config()} if pub is not None else {})

    def _server_info_dict(self) -> dict[str, Any]:
        p = self.core.profile
        root = self.cfg.tokenizer_path or self.cfg.model
        return {
            "model_id": self.cfg.model,
            "model_path": root,
            "tokenizer_path": root,
            "served_model_name": self.cfg.model,
            "instance_id": self.cfg.name,
            "engine_id": self.cfg.engine_id,
            "worker_type": {"both": "regular"}.get(self.cfg.kv_role, self.cfg.kv_role),
            "max_model_len": self.max_model_len,
            "context_length": self.max_model_len,
            "kv_block_size": p.block_size,
            "page_size": p.block_size,
            "effective_attention_block_size": p.block_size,
            "disaggregation_mode": {"both": "null"}.get(self.cfg.kv_role, self.cfg.kv_role),
            "version": VLLM_VERSION,
        }

    async def _server_info(self, _req: Request) -> Response:
        return api.json_response(self._server_info_dict())

    async def _model_info(self, _req: Request) -> Response:
        root = self.cfg.tokenizer_path or self.cfg.model
        return api.json_response(
            {
                "model_path": root,
                "tokenizer_path": root,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "has_image_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def _sim_stats(self, _req: Request) -> Response:
        c = self.counters
        s = self.core.stats()
        return api.json_response(
            {
                "name": self.cfg.name,
                "engine_id": self.cfg.engine_id,
                "kv_role": self.cfg.kv_role,
                "profile": self.core.profile.name,
                "time_scale": self.cfg.time_scale,
                "sim_time_s": self.sim_time(),
                "requests": c.requests,
                "finished": c.finished,
                "aborted": c.aborted,
                "rejected": c.rejected,
                "prompt_tokens": c.prompt_tokens,
                "cached_tokens": c.cached_tokens,
                "prefill_tokens_computed": c.prefill_tokens_computed,
                "transferred_tokens": c.transferred_tokens,
                "generation_tokens": c.generation_tokens,
                "steps": c.steps,
                "busy_s": c.busy_s,
                "late_steps": c.late_steps,
                "max_lag_s": c.max_lag_s,
                "lag_resyncs": c.lag_resyncs,
                "num_running": s.num_running,
                "num_waiting": s.num_waiting,
                "kv_cache_usage": s.kv_cache_usage,
                "num_preemptions": s.num_preemptions,
                "events_published": self.publisher.published if self.publisher else 0,
                "http_requests": self.http_requests,
                "pinned_requests": len(self.pins),
                "bootstrap_port": self.bootstrap_port,
            }
        )

    async def _reset_prefix_cache(self, _req: Request) -> Response:
        ok = self.core.reset_prefix_cache()
        self._wake.set()  # AllBlocksCleared leaves with the next step
        return Response(200 if ok else 400, b"", "")

    # ---- tokenization -------------------------------------------------------------------

    async def encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.tok.encode_async(text, add_special_tokens)

    async def encode_chat(self, messages: list[Any], opts: dict[str, Any]) -> list[int]:
        options = _chat_options(opts)
        size = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
        try:
            return await self.tok.call(size, self.tok.encode_chat, messages, options)
        except ChatFormatError as exc:
            raise api.ApiError(400, str(exc), "BadRequestError", "messages") from exc

    def check_ids(self, ids: list[int]) -> None:
        if not ids:
            return
        vocab = self.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            bad = next(t for t in ids if t < 0 or t >= vocab)
            raise api.ApiError(400, f"Token id {bad} is out of vocabulary")

    async def prompt_ids(self, p: api.GenParams) -> list[list[int]]:
        if p.chat:
            assert p.messages is not None
            return [await self.encode_chat(p.messages, p.chat_options)]
        out: list[list[int]] = []
        for prompt in p.prompts:
            if isinstance(prompt, str):
                out.append(await self.encode_text(prompt, p.add_special_tokens))
            else:
                self.check_ids(prompt)
                out.append(prompt)
        return out

    async def _tokenize(self, req: Request) -> Response:
        obj = api.parse_json_object(req.body)
        api.check_model(obj, self.cfg.model, self.loras)
        if "messages" in obj:
            messages = obj["messages"]
            if not isinstance(messages, list):
                raise api.ApiError(400, "'messages' must be a list", param="messages")
            opts = {k: v for k, v in obj.items() if k in _CHAT_KEYS and v is not None}
            ids = await self.encode_chat(messages, opts)
        else:
            prompt = obj.get("prompt")
            if isinstance(prompt, str):
                add = obj.get("add_special_tokens")
                ids = await self.encode_text(prompt, True if add is None else bool(add))
            elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
                ids = list(prompt)
            else:
                raise api.ApiError(400, "'prompt' must be a string", param="prompt")
        strs = self.tok.hf.convert_ids_to_tokens(ids) if obj.get("return_token_strs") else None
        return api.json_response(
            {
                "count": len(ids),
                "max_model_len": self.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def _detokenize(self, req: Request) -> Response:
        obj = api.parse_json_object(req.body)
        api.check_model(obj, self.cfg.model, self.loras)
        tokens = obj.get("tokens")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise api.ApiError(400, "'tokens' must be a list of token ids", param="tokens")
        self.check_ids(tokens)
        return api.json_response({"prompt": self.tok.hf.decode(tokens)})

    async def _render(self, req: Request, *, chat: bool) -> Response:
        """vLLM's scale-out render endpoints (token ids, no generation), which
        vllm-router's kv_aware and cache_aware policies call on every worker."""
        obj = api.parse_json_object(req.body)
        api.check_model(obj, self.cfg.model, self.loras)
        p = api.parse_generate(obj, chat=chat)
        prompts = await self.prompt_ids(p)
        items = [
            {
                "request_id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}",
                "token_ids": ids,
                "token_offsets": None,
                "features": None,
                "content_parts": None,
                "sampling_params": {
                    "max_tokens": api.effective_max_tokens(
                        p.max_tokens, len(ids), self.max_model_len, chat=chat
                    ),
                    "n": p.n,
                },
                "model": self.cfg.model,
                "stream": p.stream,
                "kv_transfer_params": p.kv_transfer_params,
            }
            for ids in prompts
        ]
        return api.json_response(items[0] if chat else items)

    # ---- generation ---------------------------------------------------------------------

    async def _generate(self, req: Request, *, chat: bool) -> Response | StreamingResponse:
        if self.dead:
            raise api.ApiError(500, f"engine is dead: {self.dead}", "InternalServerError")
        try:
            obj = api.parse_json_object(req.body)
            api.check_model(obj, self.cfg.model, self.loras)
            p = api.parse_generate(obj, chat=chat)
            prompts = await self.prompt_ids(p)
            limits = [
                api.effective_max_tokens(p.max_tokens, len(ids), self.max_model_len, chat=chat)
                for ids in prompts
            ]
        except api.ApiError:
            self.counters.rejected += 1
            raise
        plan = pd.plan(self.cfg.kv_role, self.cfg.kv_connector, obj, p.kv_transfer_params)
        transferred = 0
        if plan is not None:
            if len(prompts) != 1 or p.n != 1:
                self.counters.rejected += 1
                raise api.ApiError(
                    400, "a P/D handoff carries one sequence (n=1, one prompt)", param="n"
                )
            if plan.role == pd.PRODUCE and plan.connector == "sglang":
                limits = [1]  # an SGLang prefill server only prefills
            if plan.role == pd.CONSUME:
                transferred = await self._receive(plan, prompts[0])
        base = req.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        public_id = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        lora = self.loras.get(obj.get("model") or "")  # the request names an adapter
        gen = _Gen(n=p.n, plan=plan)
        if plan is not None:
            gen.prompt = prompts[0]
        now = time.monotonic()
        serial = self.next_id()
        try:
            for i, (ids, max_tokens) in enumerate(zip(prompts, limits, strict=True)):
                for j in range(p.n):
                    index = i * p.n + j
                    sub = _Sub(
                        f"{public_id}-{index}-{serial}", index, len(ids), max_tokens, gen, now
                    )
                    sub.transferred = transferred
                    self.submit(gen, sub, ids, p.kv_transfer_params, lora)
        except ValueError as exc:
            self.abort(gen)
            self.counters.rejected += 1
            raise api.ApiError(400, str(exc)) from exc
        model = self.cfg.model if lora is None else lora.name  # vLLM answers as asked
        writer = api.ChunkWriter(public_id, int(time.time()), model, chat, self.fingerprint)
        if p.stream:
            return StreamingResponse(self._stream(gen, p, writer))
        try:
            while gen.open_subs > 0:
                await gen.wait()
        except asyncio.CancelledError:
            self.abort(gen)
            raise
        return api.json_response(self._final(gen, p, writer))

    def _created_cache(self, sub: _Sub, chat: bool) -> int | None:
        """vLLM reports, for chat only, the prompt tokens newly written to the cache."""
        if not chat:
            return None
        bs = self.core.profile.block_size
        return max(0, (sub.prompt_len // bs) * bs - sub.cached)

    def _usage(self, gen: _Gen, chat: bool, *, stream: bool) -> dict[str, Any]:
        # n samples of one prompt count the prompt once, as vLLM does
        firsts = [s for s in gen.subs if s.index % gen.n == 0]
        prompt = sum(s.prompt_len for s in firsts)
        cached = sum(s.cached for s in firsts)
        created = None
        if chat:
            created = sum(self._created_cache(s, chat) or 0 for s in firsts)
        completion = sum(s.n_out for s in gen.subs)
        fn = api.stream_usage if stream else api.usage
        return fn(prompt, completion, cached, created_cache_tokens=created)

    def _final(self, gen: _Gen, p: api.GenParams, w: api.ChunkWriter) -> dict[str, Any]:
        text = self.out.text
        choices = [api.Choice(s.index, text * s.n_out, s.finish) for s in gen.subs]
        build = api.chat_response if p.chat else api.completion_response
        return build(
            w.rid,
            w.created,
            w.model,
            choices,
            self._usage(gen, p.chat, stream=False),
            self.fingerprint,
            gen.kv_transfer_params,
        )

    async def _stream(
        self, gen: _Gen, p: api.GenParams, w: api.ChunkWriter
    ) -> AsyncIterator[bytes]:
        text = self.out.text
        role_sent: set[int] = set()
        done: set[int] = set()
        try:
            while True:
                if gen.open_subs > 0 and all(s.n_out == s.n_sent for s in gen.subs):
                    await gen.wait()
                parts: list[bytes] = []
                for s in gen.subs:
                    if s.index in done:
                        continue
                    pending = s.n_out - s.n_sent
                    if pending <= 0 and s.finish is None:
                        continue
                    cont = (
                        api.continuous_usage(s.prompt_len, s.n_out) if p.continuous_usage else None
                    )
                    if p.chat and s.index not in role_sent:
                        role_sent.add(s.index)
                        role_usage = api.continuous_usage(s.prompt_len, 0) if cont else None
                        parts.append(w.role(s.index, role_usage))
                    s.n_sent = s.n_out
                    finish = s.finish if s.finish is not None and s.finish != "abort" else None
                    if finish is not None:
                        done.add(s.index)
                    last = finish is not None and not p.include_usage
                    parts.append(
                        w.delta(
                            s.index,
                            text * pending,
                            finish,
                            usage_=cont,
                            fingerprint=last,
                            kv_transfer_params=gen.kv_transfer_params if last else None,
                        )
                    )
                if parts:
                    yield b"".join(parts)
                if gen.open_subs <= 0 and all(s.n_out == s.n_sent for s in gen.subs):
                    break
            usage = self._usage(gen, p.chat, stream=True)
            tail = [w.usage_chunk(usage, gen.kv_transfer_params)] if p.include_usage else []
            yield b"".join([*tail, w.done()])
        finally:
            self.abort(gen)


_CHAT_KEYS: Final = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
)


def _chat_options(opts: dict[str, Any]) -> ChatOptions:
    kwargs = opts.get("chat_template_kwargs")
    return ChatOptions(
        add_generation_prompt=bool(opts.get("add_generation_prompt", True)),
        continue_final_message=bool(opts.get("continue_final_message", False)),
        add_special_tokens=bool(opts.get("add_special_tokens", False)),
        chat_template=opts.get("chat_template"),
        tools=opts.get("tools"),
        chat_template_kwargs=kwargs if isinstance(kwargs, dict) else {},
    )


class EngineRegistry:
    """The engines of one process, found by engine id or ``host:port`` (P/D peers)."""

    def __init__(self) -> None:
        self.by_id: dict[str, SimEngine] = {}
        self.by_addr: dict[str, SimEngine] = {}
        self.by_bootstrap: dict[str, SimEngine] = {}
        self.by_name: dict[str, SimEngine] = {}  # a shared store's writers
        self.board = pd.HandoffBoard()  # concurrent P/D legs meet here

    def add(self, engine: SimEngine) -> None:
        self.by_id[engine.cfg.engine_id] = engine
        self.by_name[engine.cfg.name] = engine
        self.by_addr[f"{engine.cfg.host}:{engine.port}"] = engine
        if engine.bootstrap_port is not None:
            self.by_bootstrap[f"{engine.cfg.host}:{engine.bootstrap_port}"] = engine

    def remove(self, engine: SimEngine) -> None:
        self.by_id.pop(engine.cfg.engine_id, None)
        if self.by_name.get(engine.cfg.name) is engine:
            del self.by_name[engine.cfg.name]
        self.by_addr.pop(f"{engine.cfg.host}:{engine.port}", None)
        if engine.bootstrap_port is not None:
            self.by_bootstrap.pop(f"{engine.cfg.host}:{engine.bootstrap_port}", None)

    def find(self, engine_id: str | None = None, addr: str | None = None) -> SimEngine | None:
        if engine_id and engine_id in self.by_id:
            return self.by_id[engine_id]
        if addr:
            return self.by_addr.get(addr)
        return None
