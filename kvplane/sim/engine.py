"""The simulated engine core: vLLM v1's scheduler over a paged prefix cache, in virtual
time (synchronous, no I/O; the HTTP server and the discrete-event mode both drive it).

One :meth:`EngineCore.step` is one vLLM ``schedule()`` + forward + ``update_from_output``:

1. running requests first, in order: each gets ``min(remaining tokens, budget)`` (a
   decode gets 1, a prefill in progress its next chunk); when its blocks cannot be
   allocated, the last running request is preempted (blocks freed, recomputed later)
   until they can, or it was itself the one preempted;
2. if nothing was preempted, waiting requests in FCFS order while the token budget and
   ``max_num_seqs`` allow: prefix-cache lookup (at most ``n - 1`` prompt tokens, whole
   blocks), then CPU-tier lookup, then blocks for the first chunk; the first request that
   does not fit stops admission;
3. every request whose computed tokens reach its length samples one token (generation
   runs to ``max_tokens``: ``ignore_eos``), finished requests free their blocks.

Blocks are hashed and announced (``BlockStored``) when scheduled, as vLLM does: a
request admitted later in the same step already hits them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from kvplane.sim.events import AllBlocksCleared, BlockStored, KVEvent
from kvplane.sim.hashing import chain, external_hash, hash_function, none_hash
from kvplane.sim.kvcache import BlockMeta, BlockPool, CpuTier, PeerFabric, SharedStore
from kvplane.sim.lora import LoraConfig, LoraRequest
from kvplane.sim.profiles import EngineProfile
from kvplane.sim.timing import load_ms, step_ms

FINISH_LENGTH: Final = "length"
# cached_tokens() stays answerable this many requests after they finish or are aborted
FINISHED_MEMORY: Final = 65536


@dataclass(slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    min_tokens: int = 0  # generation always runs to max_tokens (ignore_eos): deterministic
    kv_transfer_params: dict[str, Any] | None = None  # P/D roles (later)
    lora: LoraRequest | None = None  # the request's adapter (its blocks hash apart)


@dataclass(slots=True)
class StepOutput:
    duration_s: float  # modeled duration of this step (0.0 if nothing ran)
    new_tokens: dict[str, list[int]]  # request_id -> tokens generated this step
    first_token: list[str]  # requests whose first output token came out in this step
    finished: dict[str, str]  # request_id -> finish_reason ("length")
    events: list[KVEvent]  # KV events of this step: GPU pool first, then CPU tier


@dataclass(frozen=True, slots=True)
class Fabric:
    """An engine's place in a fleet that shares KV: its name there, the shared store it
    writes to and loads from, the peers it pulls from (None: not this fleet's)."""

    name: str
    store: SharedStore | None = None
    peers: PeerFabric | None = None
    write_through: bool = False  # store blocks as computed (else as HBM evicts them)


@dataclass(slots=True)
class EngineStats:
    """Everything /metrics needs, counted as vLLM counts it."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, referenced blocks (cached free blocks count as free)
    prefix_cache_queries: int  # prompt tokens of requests at first admission
    prefix_cache_hits: int  # of which found in the GPU prefix cache
    prompt_tokens: int  # prompts of requests that produced their first token
    generation_tokens: int
    num_preemptions: int
    request_success: dict[str, int]  # finish_reason -> count
    external_prefix_cache_queries: int = 0  # tokens not hit on GPU, looked up in CPU
    external_prefix_cache_hits: int = 0  # of which loaded from the CPU tier
    prompt_tokens_cached: int = 0  # cached (GPU + CPU) prompt tokens, at first token
    cpu_cache_usage: float = 0.0  # CPU tier occupancy, 0..1
    running_loras: dict[str, int] = field(default_factory=dict)  # adapter -> requests
    waiting_loras: dict[str, int] = field(default_factory=dict)


class _Req:
    """Scheduler state of one request (vLLM's ``Request``)."""

    __slots__ = (
        "blocks",
        "cached_tokens",
        "ext",
        "hashes",
        "lora",
        "max_tokens",
        "num_cached_blocks",
        "num_computed",
        "num_output",
        "preemptions",
        "prompt",
        "prompt_len",
        "request_id",
        "running",
        "toks",
    )

    def __init__(self, req: SimRequest, keep_tokens: bool) -> None:
        self.request_id = req.request_id
        self.prompt = req.prompt_token_ids
        self.prompt_len = len(req.prompt_token_ids)
        self.max_tokens = req.max_tokens
        self.lora = req.lora
        self.num_output = 0
        self.num_computed = 0  # tokens whose KV is computed (or scheduled this step)
        self.blocks: list[int] = []
        self.num_cached_blocks = 0  # leading blocks already in the prefix cache
        self.hashes: list[bytes] = []  # chained hashes of full blocks, computed once
        self.ext: list[int] = []  # their event values
        self.toks: list[tuple[int, ...]] | None = [] if keep_tokens else None
        self.cached_tokens: int | None = None
        self.preemptions = 0
        self.running = False

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.num_output


def _adapter_counts(reqs: Iterable[_Req]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in reqs:
        if r.lora is not None:
            counts[r.lora.name] = counts.get(r.lora.name, 0) + 1
    return counts


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class EngineCore:
    """A vLLM v1 engine core in virtual time."""

    def __init__(
        self,
        profile: EngineProfile,
        *,
        hash_algo: str = "sha256",
        hash_seed: str | None = None,
        output_token_id: int = 0,
        enable_prefix_caching: bool = True,
        lora: LoraConfig | None = None,
        fabric: Fabric | None = None,
    ) -> None:
        """``fabric``: the fleet's shared store and peer pulls this engine takes part in."""
        self._profile = profile
        self._lora = lora
        self._gpu_loras: OrderedDict[str, None] = OrderedDict()  # adapters in GPU slots, LRU
        self._bs = profile.block_size
        self._hash_fn = hash_function(hash_algo)
        self._none_hash = none_hash(hash_algo, hash_seed)
        self._out_tok = output_token_id
        self._caching = enable_prefix_caching
        cpu = None
        if enable_prefix_caching and profile.cpu_offload_blocks > 0:
            cpu = CpuTier(profile.cpu_offload_blocks, profile.block_size)
        self._cpu = cpu
        self._pool = BlockPool(
            profile.num_gpu_blocks, enable_caching=enable_prefix_caching, cpu=cpu
        )
        self._fabric = fabric if enable_prefix_caching else None
        if self._fabric is not None and self._fabric.peers is not None:
            self._fabric.peers.join(self._fabric.name, self._pool)
        shared = self._fabric.store if self._fabric is not None else None
        if shared is not None and self._fabric is not None and not self._fabric.write_through:
            self._pool.remote = shared.writer(self._fabric.name)
        self._fabric_ms = 0.0  # this step's loads from the shared store and peers
        self._max_len = min(profile.max_model_len, profile.capacity_tokens)
        self._waiting: deque[_Req] = deque()
        self._running: list[_Req] = []
        self._requests: dict[str, _Req] = {}
        self._finished_cached: OrderedDict[str, int | None] = OrderedDict()
        self._pending_events: list[KVEvent] = []
        self._queries = 0
        self._hits = 0
        self._ext_queries = 0
        self._ext_hits = 0
        self._prompt_tokens = 0
        self._prompt_tokens_cached = 0
        self._generation_tokens = 0
        self._preemptions = 0
        self._success: dict[str, int] = {}

    @property
    def profile(self) -> EngineProfile:
        return self._profile

    # ---- requests -------------------------------------------------------------------

    def add_request(self, req: SimRequest) -> None:
        """Queue a request (FCFS). Raises ValueError for a duplicate id, an empty prompt,
        ``max_tokens < 1`` or a sequence that could never fit (``max_model_len`` or the
        whole KV pool), which vLLM's frontend rejects before the engine sees it."""
        if req.request_id in self._requests:
            raise ValueError(f"request {req.request_id!r} already exists")
        if not req.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if req.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        total = len(req.prompt_token_ids) + req.max_tokens
        if total > self._max_len:
            raise ValueError(
                f"prompt ({len(req.prompt_token_ids)} tokens) + max_tokens ({req.max_tokens}) "
                f"exceeds this engine's maximum sequence length of {self._max_len}"
            )
        keep = self._cpu is not None or (
            self._fabric is not None and self._fabric.store is not None
        )
        r = _Req(req, keep_tokens=keep)
        self._requests[req.request_id] = r
        self._waiting.append(r)

    def cached_tokens(self, request_id: str) -> int | None:
        """Prompt tokens served from cache (GPU or CPU) when first scheduled; None before."""
        r = self._requests.get(request_id)
        if r is not None:
            return r.cached_tokens
        return self._finished_cached.get(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request wherever it is and free its blocks (unknown ids are ignored)."""
        r = self._requests.get(request_id)
        if r is None:
            return
        if r.running:
            self._running.remove(r)
        else:
            self._waiting.remove(r)
        self._retire(r)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def reset_prefix_cache(self) -> bool:
        """Forget the GPU prefix cache (the CPU tier stays); refused while requests hold
        blocks. ``AllBlocksCleared`` goes out with the next step's events, as in vLLM."""
        if not self._pool.reset_prefix_cache():
            return False
        self._pending_events.append(AllBlocksCleared())
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage=self._pool.usage(),
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            num_preemptions=self._preemptions,
            request_success=dict(self._success),
            external_prefix_cache_queries=self._ext_queries,
            external_prefix_cache_hits=self._ext_hits,
            prompt_tokens_cached=self._prompt_tokens_cached,
            cpu_cache_usage=self._cpu.usage() if self._cpu is not None else 0.0,
            running_loras=_adapter_counts(self._running),
            waiting_loras=_adapter_counts(self._waiting),
        )

    # ---- one step -------------------------------------------------------------------

    def step(self) -> StepOutput:
        """One scheduler iteration and its forward; see the module docstring."""
        running = self._running
        budget = self._profile.max_num_batched_tokens
        scheduled: list[tuple[_Req, int]] = []
        load_tokens = 0
        preempted = False

        bs = self._bs
        pool = self._pool
        caching = self._caching
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            num_new = r.prompt_len + r.num_output - r.num_computed
            if num_new > budget:
                num_new = budget
            end = r.num_computed + num_new
            need = -(-end // bs) - len(r.blocks)
            if need > 0:
                if need > pool.num_free:  # preempt from the back until it fits
                    victim = running.pop()
                    self._preempt(victim)
                    while victim is not r and need > pool.num_free:
                        victim = running.pop()
                        self._preempt(victim)
                    preempted = True
                    if victim is r:
                        break
                r.blocks.extend(pool.allocate(need))
            if caching and end // bs > r.num_cached_blocks:
                self._cache(r, end)
            scheduled.append((r, num_new))
            budget -= num_new
            i += 1

        if not preempted:
            waiting = self._waiting
            max_seqs = self._profile.max_num_seqs
            lora = self._lora
            loras = {x.lora.name for x in running if x.lora is not None}
            skipped: list[_Req] = []
            while waiting and budget > 0 and len(running) < max_seqs:
                r = waiting[0]
                if (
                    lora is not None
                    and r.lora is not None
                    and r.lora.name not in loras
                    and len(loras) >= lora.max_loras
                ):  # as vLLM: another adapter would exceed max_loras in the batch, skip it
                    skipped.append(waiting.popleft())
                    continue
                admitted = self._admit(r, budget)
                if admitted is None:
                    break
                num_new, loaded = admitted
                waiting.popleft()
                r.running = True
                running.append(r)
                scheduled.append((r, num_new))
                budget -= num_new
                load_tokens += loaded
                if r.lora is not None:
                    loras.add(r.lora.name)
            waiting.extendleft(reversed(skipped))

        return self._execute(scheduled, load_tokens)

    def _execute(self, scheduled: list[tuple[_Req, int]], load_tokens: int) -> StepOutput:
        chunks: list[tuple[int, int]] = []
        decodes: list[int] = []
        new_tokens: dict[str, list[int]] = {}
        first: list[str] = []
        finished: dict[str, str] = {}
        out = self._out_tok
        for r, n in scheduled:
            before = r.num_computed
            total = r.num_tokens
            if n == 1 and r.num_output and before == total - 1:
                decodes.append(total)
            else:
                chunks.append((n, before))
            r.num_computed = before + n
            if r.num_computed < total:
                continue  # a prefill chunk short of the end samples nothing
            r.num_output += 1
            new_tokens[r.request_id] = [out]
            if r.num_output == 1:
                first.append(r.request_id)
                self._prompt_tokens += r.prompt_len
                self._prompt_tokens_cached += r.cached_tokens or 0
            if r.num_output >= r.max_tokens:
                finished[r.request_id] = FINISH_LENGTH
        self._generation_tokens += len(new_tokens)
        if finished:
            self._running = [r for r in self._running if r.request_id not in finished]
            for rid in finished:
                self._retire(self._requests[rid])
                self._success[FINISH_LENGTH] = self._success.get(FINISH_LENGTH, 0) + 1
        events = self._pending_events
        self._pending_events = []
        events.extend(self._pool.take_events())
        ms = step_ms(self._profile, chunks, decodes) + load_ms(self._profile, load_tokens)
        ms += self._load_adapters(r for r, _ in scheduled)
        ms += self._fabric_ms
        self._fabric_ms = 0.0
        return StepOutput(ms / 1000.0, new_tokens, first, finished, events)

    # ---- scheduling helpers ---------------------------------------------------------

    def _load_adapters(self, reqs: Iterable[_Req]) -> float:
        """Milliseconds spent loading the step's adapters not already in a GPU slot."""
        lora = self._lora
        if lora is None:
            return 0.0
        slots = self._gpu_loras
        ms = 0.0
        for r in reqs:
            if r.lora is None:
                continue
            name = r.lora.name
            if name in slots:
                slots.move_to_end(name)
                continue
            ms += lora.load_ms
            slots[name] = None
            if len(slots) > lora.max_loras:
                slots.popitem(last=False)
        return ms

    def _admit(self, r: _Req, budget: int) -> tuple[int, int] | None:
        """Prefix lookup and first blocks of a waiting request: (tokens scheduled, tokens
        loaded from the CPU tier), or None when its blocks do not fit."""
        pool = self._pool
        bs = self._bs
        num_tokens = r.num_tokens
        hits: list[int] = []
        n_cpu = n_far = 0
        far_ms = 0.0
        if self._caching:
            max_blocks = (num_tokens - 1) // bs  # the last token is always recomputed
            self._ensure_hashes(r, max_blocks)
            hashes = r.hashes
            lookup = pool.lookup
            for k in range(max_blocks):
                b = lookup(hashes[k])
                if b is None:
                    break
                hits.append(b)
            if self._cpu is not None:
                n_cpu = self._cpu.match(hashes, len(hits), max_blocks)
            if self._fabric is not None:
                n_far, far_ms = self._fabric_match(hashes, len(hits) + n_cpu, max_blocks)
        n_hit = len(hits)
        local = n_hit * bs
        loaded = n_cpu * bs
        computed = local + loaded + n_far * bs
        num_new = min(num_tokens - computed, budget)
        end = computed + num_new
        new_blocks = _cdiv(end, bs) - n_hit
        if new_blocks + pool.evictable(hits) > pool.num_free:
            return None
        pool.touch(hits)
        hits.extend(pool.allocate(new_blocks))
        self._fabric_ms += far_ms
        r.blocks = hits
        r.num_cached_blocks = n_hit
        r.num_computed = computed
        if self._caching and r.preemptions == 0:
            self._queries += num_tokens
            self._hits += local
            if self._cpu is not None or self._fabric is not None:
                self._ext_queries += num_tokens - local
                self._ext_hits += loaded + n_far * bs
        if r.cached_tokens is None:
            r.cached_tokens = computed
        self._cache(r, min(end, num_tokens))
        return num_new, loaded

    def _fabric_match(self, hashes: list[bytes], start: int, end: int) -> tuple[int, float]:
        """Blocks of ``hashes[start:end]`` loaded from the shared store, then pulled from
        a peer, as one contiguous run, and their transfer in ms."""
        fabric = self._fabric
        assert fabric is not None
        kvb = self._profile.kv_bytes_per_token
        n_store = n_peer = 0
        ms = 0.0
        if fabric.store is not None:
            n_store = fabric.store.match(hashes, start, end)
            ms += fabric.store.link.load_ms(n_store * self._bs, kvb)
        if fabric.peers is not None:
            n_peer, peer_ms = fabric.peers.match(
                fabric.name,
                hashes,
                start + n_store,
                end,
                self._bs,
                kvb,
                1000.0 / self._profile.prefill_tokens_per_s,
            )
            ms += peer_ms
        return n_store + n_peer, ms

    def _preempt(self, r: _Req) -> None:
        """Recompute preemption: free everything, back to the head of the queue."""
        self._pool.release(r.blocks)
        r.blocks = []
        r.num_computed = 0
        r.num_cached_blocks = 0
        r.preemptions += 1
        r.running = False
        self._preemptions += 1
        self._waiting.appendleft(r)

    def _retire(self, r: _Req) -> None:
        self._pool.release(r.blocks)
        r.blocks = []
        r.running = False
        del self._requests[r.request_id]
        memory = self._finished_cached
        memory[r.request_id] = r.cached_tokens
        if len(memory) > FINISHED_MEMORY:
            memory.popitem(last=False)

    # ---- prefix caching -------------------------------------------------------------

    def _tokens(self, r: _Req, start: int, end: int) -> list[int]:
        """Token ids ``start:end`` of prompt + output (every output token is the same)."""
        plen = r.prompt_len
        if end <= plen:
            return r.prompt[start:end]
        head = r.prompt[start:plen] if start < plen else []
        return head + [self._out_tok] * (end - max(start, plen))

    def _ensure_hashes(self, r: _Req, n_blocks: int) -> None:
        """Hash full blocks up to ``n_blocks`` (each block of a request hashed once)."""
        have = len(r.hashes)
        if have >= n_blocks:
            return
        bs = self._bs
        fn = self._hash_fn
        parent = r.hashes[-1] if have else self._none_hash
        extra = None if r.lora is None else r.lora.extra_keys()
        in_prompt = min(n_blocks, r.prompt_len // bs)
        if have < in_prompt:
            parent = chain(fn, parent, r.prompt, bs, have, in_prompt, r.hashes, r.toks, extra)
            have = in_prompt
        if have < n_blocks:  # blocks reaching into the output
            tokens = self._tokens(r, have * bs, n_blocks * bs)
            chain(fn, parent, tokens, bs, 0, n_blocks - have, r.hashes, r.toks, extra)
        r.ext.extend(external_hash(h) for h in r.hashes[len(r.ext) :])

    def _cache(self, r: _Req, num_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_tokens`` and announce them."""
        if not self._caching:
            return
        bs = self._bs
        n_full = num_tokens // bs
        start = r.num_cached_blocks
        if n_full <= start:
            return
        self._ensure_hashes(r, n_full)
        pool = self._pool
        hashes = r.hashes
        blocks = r.blocks
        ext = r.ext
        toks = r.toks
        parent = ext[start - 1] if start else None
        insert = pool.insert
        written: list[tuple[bytes, BlockMeta]] = []
        if toks is None:
            for k in range(start, n_full):
                insert(blocks[k], hashes[k], ext[k])
        else:
            prev = parent
            lora_id, lora_name = (None, None) if r.lora is None else (r.lora.lora_id, r.lora.name)
            for k in range(start, n_full):
                e = ext[k]
                meta = BlockMeta(e, prev, toks[k], lora_id, lora_name)
                insert(blocks[k], hashes[k], e, meta)
                written.append((hashes[k], meta))
                prev = e
        adapter = r.lora
        pool.events.append(
            BlockStored(
                ext[start:n_full],
                parent,
                self._tokens(r, start * bs, n_full * bs),
                bs,
                lora_id=None if adapter is None else adapter.lora_id,
                lora_name=None if adapter is None else adapter.name,
            )
        )
        fabric = self._fabric
        if fabric is not None and fabric.store is not None and fabric.write_through and written:
            fabric.store.write(fabric.name, written)  # after the GPU's event
        r.num_cached_blocks = n_full
