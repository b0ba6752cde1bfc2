"""Discrete-event mode: kvplane's own routing code against simulated engines, in virtual time.

No HTTP and no wall clock: a heap of timestamped events drives one ``EngineCore``
per pod, each stepped at its own step boundaries (a step lasts its modeled
``duration_s``; the tokens it produced are stamped at its end). Arrivals go
through the router's real code path at their arrival time:

- block keys (``blockkeys``), the in-memory residency index (``MemoryIndex``) fed by
  the engines' KV events through the real ingest planner (``Ingestor``), after a
  configurable delivery delay;
- the router's policies by name (``kvplane.router.policies``: the cost model and
  choice, or a baseline), through the same ``route`` function the live router calls;
- load as the live router sees it: ``Pool``/``BackendState`` with the proxy's
  ``Attempt`` accounting (pending prefill tokens until the first token, in-flight
  until the end) plus engine stats sampled every ``scrape_interval_s``;
- tentative marks on the chosen pod, as the live request path sets them;
- optionally a fleet that shares KV (``SharedKV``): one store every engine writes to and
  loads from, whose events reach the index on their writers' streams, and peer pulls,
  with the router configured for both (``shared_stores``, ``peer_pull``).

Only engines with work are stepped, so 200 mostly idle pods cost little. Stats are
sampled lazily but exactly: an engine's snapshot for a scrape tick is taken just
before its first change after that tick (or when read), which is its state at the
tick. Engine stats read mid-step show the step's outcome (the step is computed
when it starts); the live scraper would see the state before it.
"""

from __future__ import annotations

import asyncio
import heapq
import math
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Final

from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.config import (
    Backend,
    CostParams,
    LinkClass,
    LinkCost,
    PeerPullSpec,
    SharedStoreSpec,
    TierCost,
    UnreportedTierSpec,
)
from kvplane.router.cost import CostModel
from kvplane.router.engine_stats import EngineStats as ScrapedStats
from kvplane.router.index.base import Blocks, ResidencyIndex
from kvplane.router.index.memory import MemoryIndex
from kvplane.router.index.redis import RedisIndex, forget_generation
from kvplane.router.index.shared import with_shared_stores
from kvplane.router.kvevents import model as rk
from kvplane.router.kvevents.ingest import Ingestor
from kvplane.router.load import Attempt
from kvplane.router.policies import RoutingInput, labelled, make_policy, route
from kvplane.router.policies.sticky import index_down
from kvplane.router.pool import Pool
from kvplane.router.shared import SharedStores
from kvplane.router.tiers import Tier
from kvplane.sim import events as se
from kvplane.sim.engine import EngineCore, Fabric, SimRequest, StepOutput
from kvplane.sim.kvcache import SIM_STORE, Link, PeerFabric, SharedStore
from kvplane.sim.profiles import PROFILES, EngineProfile
from kvplane.sim.store_bound import REPLAY_POLICIES, replay
from kvplane.workload.results import (
    RequestResult,
    RunRecord,
    computed_prefill,
    mean_itl,
    oracle_hit_ratio,
    summarize,
)
from kvplane.workload.traces import (
    PromptBuilder,
    SegmentTokens,
    TraceRequest,
    Workload,
    synthetic_tokens,
)

ROUTERS: Final[dict[str, str]] = labelled()  # label -> policy name
GENERATION: Final = "kvplane-des"
DEFAULT_KV_EVENT_DELAY_S: Final = 0.05
IDLE_RETRY_S: Final = 0.001  # an engine with work that could not schedule anything
MAX_IDLE_RETRIES: Final = 100_000  # per run: a stuck engine ends the run, not the machine

Progress = Callable[[int, int], None]


def profile_for(name: str, block_size: int | None) -> EngineProfile:
    """A named profile, with another block size at the same token capacity."""
    try:
        prof = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r} (known: {', '.join(PROFILES)})") from None
    if block_size is None or block_size == prof.block_size:
        return prof
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    return replace(
        prof,
        block_size=block_size,
        num_gpu_blocks=max(2, prof.num_gpu_blocks * prof.block_size // block_size),
        cpu_offload_blocks=prof.cpu_offload_blocks * prof.block_size // block_size,
    )


def cost_params_for(profile: EngineProfile) -> CostParams:
    """Cost parameters as an operator would calibrate them for this engine: its prefill
    rate and attention, decode step and CPU link; the rest at the router's defaults (the same
    calibration the HTTP benchmark renders into the router's config)."""
    base = CostParams()
    tiers = dict(base.tiers)
    tiers[Tier.DRAM] = TierCost(bandwidth_gbps=profile.cpu_bandwidth_gbps, latency_ms=0.05)
    return base.model_copy(
        update={
            "prefill_tokens_per_s": profile.prefill_tokens_per_s,
            "prefill_attention_ms_per_mpair": profile.attn_coeff * 1e6,
            "decode_step_ms": profile.decode_base_ms,
            "tiers": tiers,
        }
    )


def router_events(events: Sequence[se.KVEvent]) -> list[rk.KVEvent]:
    """The simulator's events as the router's decoder would produce them.

    vLLM sends one ``BlockRemoved`` per evicted block; consecutive ones of a tier are
    merged here into one list (the ingest applies them hash by hash all the same).
    """
    out: list[rk.KVEvent] = []
    for ev in events:
        if isinstance(ev, se.BlockStored):
            out.append(
                rk.BlockStored(
                    block_hashes=ev.block_hashes,
                    parent_block_hash=ev.parent_block_hash,
                    token_ids=ev.token_ids,
                    block_size=ev.block_size,
                    medium=ev.medium,
                    locality=ev.locality,
                )
            )
        elif isinstance(ev, se.BlockRemoved):
            last = out[-1] if out else None
            if (
                isinstance(last, rk.BlockRemoved)
                and last.medium == ev.medium
                and last.locality == ev.locality
            ):
                last.block_hashes.extend(ev.block_hashes)
            else:
                removed = rk.BlockRemoved(list(ev.block_hashes), ev.medium, locality=ev.locality)
                out.append(removed)
        else:
            out.append(rk.AllBlocksCleared())
    return out


@dataclass(slots=True)
class _Engine:
    name: str
    core: EngineCore
    busy: bool = False  # a step is in flight
    snap_tick: int = -1  # scrape tick of the pool's current stats of this engine


@dataclass(frozen=True, slots=True)
class _StepEnd:
    engine: _Engine
    out: StepOutput


@dataclass(frozen=True, slots=True)
class _Delivery:
    pod: str
    events: list[se.KVEvent]


@dataclass(slots=True)
class _Live:
    req: TraceRequest
    engine: _Engine
    attempt: Attempt
    prompt_tokens: int
    first: float | None = None
    last: float | None = None
    n_out: int = 0


@dataclass(slots=True)
class _Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class DramEvents(StrEnum):
    """What the router learns of the pods' DRAM tiers: their KV events (vLLM's CPU
    offload reports them), nothing (Dynamo's mocker), or nothing but their size
    (``RouterConfig.unreported_tier``)."""

    REPORTED = "reported"
    SILENT = "silent"
    INFERRED = "inferred"


@dataclass(slots=True)
class DesOptions:
    scrape_interval_s: float = 0.5
    kv_event_delay_s: float = DEFAULT_KV_EVENT_DELAY_S
    max_drain_s: float = 7200.0  # virtual time allowed after the last arrival
    cost: CostParams | None = None
    hash_algo: str = "xxhash"  # vLLM's fast option; the router never sees engine hashes
    oracle: float | None = None  # precomputed oracle hit ratio (else computed here)
    notes: list[str] = field(default_factory=list)
    # the residency index: in memory (None), or a Redis at this URL, on the same virtual
    # clock (its decisions must equal the memory index's)
    index_url: str | None = None
    shared_kv: SharedKV | None = None  # a fleet sharing KV (None: every pod on its own)
    cpu_offload_blocks: int | None = None  # each pod's DRAM tier (None: the profile's)
    dram_events: DramEvents = DramEvents.REPORTED


@dataclass(frozen=True, slots=True)
class SharedKV:
    """A fleet that shares KV: a store of ``store_blocks`` every engine writes to and
    loads from (0: none), and peer pulls over ``peer_link`` (None: none). With
    ``pods_per_node``, pods sit that many to a node (e0.. on node-0, and so on) and two
    pods of one node pull over ``peer_node_link``. The router is configured as a real
    one would be: the store is every pod's shared store at its link, peer pulls at
    theirs, per link class from the pods' node labels (with ``router_sees_nodes``
    False, a router told one link for every pair and no nodes)."""

    store_blocks: int = 0
    store_link: Link = field(default_factory=lambda: Link(25.0, 1.0))
    peer_link: Link | None = None
    write_through: bool = False  # engines store blocks as computed, not as HBM evicts them
    store_policy: str = "lru"  # the store's eviction: lru or slru (kvcache.SharedStore)
    store_bound: bool = False  # replay the store's accesses under other policies (store_bound)
    pods_per_node: int = 0  # 0: placement unknown, every pair over peer_link
    peer_node_link: Link | None = None  # between two pods of one node (None: peer_link)
    router_sees_nodes: bool = True

    def nodes(self, names: Sequence[str]) -> dict[str, str]:
        """Each pod's node (none when placement is unknown)."""
        if self.pods_per_node <= 0:
            return {}
        return {n: f"node-{i // self.pods_per_node}" for i, n in enumerate(names)}

    def fabric(self, names: Sequence[str]) -> PeerFabric | None:
        """The engines' side of peer pulls (None: none)."""
        if self.peer_link is None:
            return None
        return PeerFabric(self.peer_link, node_link=self.peer_node_link, nodes=self.nodes(names))

    def router_side(self) -> tuple[SharedStores, PeerPullSpec | None]:
        """What the router's config says of this fleet."""
        stores = SharedStores()
        if self.store_blocks:
            link = TierCost(
                bandwidth_gbps=self.store_link.bandwidth_gbps,
                latency_ms=self.store_link.latency_ms,
            )
            stores = SharedStores.of([SharedStoreSpec(name=SIM_STORE, link=link)])
        if self.peer_link is None:
            return stores, None
        links = {}
        if self.router_sees_nodes and self.peer_node_link is not None and self.pods_per_node:
            links[LinkClass.SAME_NODE] = _link_cost(self.peer_node_link)
        return stores, PeerPullSpec(link=_link_cost(self.peer_link), links=links)


def _link_cost(link: Link) -> LinkCost:
    return LinkCost(bandwidth_gbps=link.bandwidth_gbps, latency_ms=link.latency_ms)


class _Sim:
    """One run: the fleet, the router state and the event heap."""

    def __init__(
        self,
        workload: Workload,
        router: str,
        engines: int,
        profile: EngineProfile,
        tokens: SegmentTokens,
        opts: DesOptions,
        progress: Progress | None,
    ) -> None:
        if router not in ROUTERS:
            raise ValueError(f"unknown router {router!r} (known: {', '.join(ROUTERS)})")
        if engines < 1:
            raise ValueError("engines must be at least 1")
        self.workload = workload
        self.router = router
        self.profile = profile
        self.block_size = profile.block_size
        self.tokens = tokens
        self.opts = opts
        self.progress = progress
        self.cost = opts.cost or cost_params_for(profile)
        kv = opts.shared_kv or SharedKV()
        stores, peer_pull = kv.router_side()
        kvb = profile.kv_bytes_per_token
        self.model = CostModel(self.cost, self.block_size, kvb, stores, peer_pull)
        self.policy = make_policy(ROUTERS[router], self.model)
        self.clock = _Clock()
        self.backend: MemoryIndex | RedisIndex = MemoryIndex(clock=self.clock)
        if opts.index_url is not None:
            self.backend = RedisIndex(
                opts.index_url,
                f"{GENERATION}-{uuid.uuid4().hex[:8]}",
                timeout_s=30.0,
                clock=self.clock,
                window_s=self.cost.tentative_ttl_s,
                mark_keys_ttl_s=24 * 3600.0,  # virtual time may run slower than the wall's
            )
        self.index: ResidencyIndex = with_shared_stores(self.backend, stores)
        unreported = (
            UnreportedTierSpec(tier=Tier.DRAM, blocks=profile.cpu_offload_blocks)
            if opts.dram_events is DramEvents.INFERRED and profile.cpu_offload_blocks
            else None
        )
        self.ingestor = Ingestor(
            self.index, generation=GENERATION, block_size=self.block_size, unreported=unreported
        )
        self.dram_reported = opts.dram_events is DramEvents.REPORTED
        self.root = generation_root(GENERATION)
        width = len(str(engines - 1))
        names = [f"e{i:0{width}d}" for i in range(engines)]
        bs = self.block_size
        self.store = (
            SharedStore(kv.store_blocks, bs, kv.store_link, kv.store_policy, trace=kv.store_bound)
            if kv.store_blocks
            else None
        )
        peers = kv.fabric(names)
        shares = self.store is not None or peers is not None
        self.engines = {
            n: _Engine(
                n,
                EngineCore(
                    profile,
                    hash_algo=opts.hash_algo,
                    fabric=Fabric(n, self.store, peers, kv.write_through) if shares else None,
                ),
            )
            for n in names
        }
        self.pool = Pool(clock=self.clock)
        nodes = kv.nodes(names) if kv.router_sees_nodes else {}
        self.pool.set_backends(
            [
                Backend(name=n, url=f"sim://{n}", labels={"node": nodes[n]} if n in nodes else {})
                for n in names
            ]
        )
        self.live: dict[str, _Live] = {}
        self.results: list[RequestResult] = []
        self.heap: list[tuple[float, int, object]] = []
        self.seq = 0
        self.router_cpu = 0.0
        self.decisions: Counter[str] = Counter()  # by reason, as the router's metric
        self.predicted_cached = 0  # cached tokens the chosen pods' terms predicted
        self.peer_pulls: Counter[str] = Counter()  # chosen pulls by the pair's link class
        self.idle_retries = 0
        self.uses_index = self.policy.uses_index

    # ----------------------------------------------------------------- plumbing

    def _push(self, t: float, item: object) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, item))

    def _snap(self, eng: _Engine, t: float) -> None:
        """Sample the engine's stats for the current scrape tick, once per tick."""
        tick = int(t // self.opts.scrape_interval_s)
        if eng.snap_tick >= tick:
            return
        st = eng.core.stats()
        self.pool.states[eng.name].observe(
            ScrapedStats(
                waiting=float(st.num_waiting),
                running=float(st.num_running),
                kv_usage=st.kv_cache_usage,
                kv_capacity_tokens=float(eng.core.profile.capacity_tokens),
            )
        )
        eng.snap_tick = tick

    def _start_step(self, eng: _Engine, t: float) -> None:
        self._snap(eng, t)
        out = eng.core.step()
        if out.duration_s > 0 or out.new_tokens or out.finished or out.events:
            eng.busy = True
            self._push(t + max(out.duration_s, 0.0), _StepEnd(eng, out))
        elif eng.core.has_work():
            # nothing could run (no KV left and nothing to preempt): try again shortly
            self.idle_retries += 1
            if self.idle_retries > MAX_IDLE_RETRIES:
                raise RuntimeError(f"engine {eng.name} has work it can never schedule")
            eng.busy = True
            self._push(t + IDLE_RETRY_S, _StepEnd(eng, out))
        else:
            eng.busy = False

    # ----------------------------------------------------------------- events

    async def _arrive(self, idx: int, req: TraceRequest, t: float) -> None:
        tokens = self.tokens.token_ids(req)
        cpu0 = time.process_time()
        pods = self.pool.healthy()
        for name in pods:
            self._snap(self.engines[name], t)
        loads = self.pool.loads(pods, now=t)
        keys = block_keys(tokens, self.block_size, self.root)
        labels = None
        if self.model.peer_pull is not None:  # as the live router: pairs placed by labels
            labels = {p: self.pool.states[p].backend.labels for p in pods}
        inp = RoutingInput(len(tokens), tokens, keys, loads, labels=labels)
        decision, matches = await route(
            self.policy, self.index, inp, lambda i: index_down(self.model, i)
        )
        if matches is not None:
            held = matches.get(decision.pod, {}).get(Tier.HBM, 0)
            if len(keys) > held:
                await self.index.mark_tentative(
                    decision.pod, Blocks.of_prompt(keys, held), self.cost.tentative_ttl_s
                )
        self.pool.observe_prompt(len(tokens))
        terms = decision.terms.get(decision.pod)
        self.decisions[decision.reason] += 1
        self.predicted_cached += terms.cached_tokens if terms is not None else 0
        if terms is not None and terms.peer_link is not None:
            self.peer_pulls[terms.peer_link.value] += 1
        uncached = len(tokens) - (terms.cached_tokens if terms is not None else 0)
        self.pool.note_routed(decision.pod, uncached, now=t)
        self.router_cpu += time.process_time() - cpu0
        self._submit(f"r{idx}", req, tokens, decision.pod, uncached, t)

    def _submit(
        self,
        rid: str,
        req: TraceRequest,
        tokens: list[int],
        pod: str,
        uncached: int,
        t: float,
        attempt: Attempt | None = None,
    ) -> None:
        """Send the request to ``pod`` as the proxy does (its ``Attempt`` accounting);
        ``attempt``: one the router began earlier (a decode leg sent before its KV came)."""
        if attempt is None:
            attempt = Attempt(self.pool.states[pod], uncached, t, len(tokens))
            attempt.begin()
        eng = self.engines[pod]
        self._snap(eng, t)
        try:
            eng.core.add_request(SimRequest(rid, tokens, max_tokens=req.output_tokens))
        except ValueError as exc:  # too long for the engine: vLLM answers 400
            attempt.end()
            self._fail(req, len(tokens), eng.name, str(exc))
            return
        self.live[rid] = _Live(req, eng, attempt, len(tokens))
        if not eng.busy:
            self._start_step(eng, t)

    def _step_done(self, eng: _Engine, out: StepOutput, t: float) -> None:
        for rid, toks in out.new_tokens.items():
            lv = self.live.get(rid)
            if lv is None or not toks:
                continue
            if lv.first is None:
                lv.first = t
                lv.attempt.first()
            lv.last = t
            lv.n_out += len(toks)
        for rid in out.finished:
            lv = self.live.pop(rid, None)
            if lv is None:
                continue
            lv.attempt.end()
            self._finish(rid, lv, t)
        if out.events and self.uses_index:
            self._push(t + self.opts.kv_event_delay_s, _Delivery(eng.name, out.events))
        if self.store is not None:  # the store's events, on their writers' streams
            for writer, events in self.store.take_events().items():
                if self.uses_index:
                    self._push(t + self.opts.kv_event_delay_s, _Delivery(writer, events))
        if eng.core.has_work():
            self._start_step(eng, t)
        else:
            eng.busy = False

    def _finish(self, rid: str, lv: _Live, t: float) -> None:
        arrival = lv.req.arrival_s
        first = lv.first if lv.first is not None else t
        last = lv.last if lv.last is not None else t
        self.results.append(
            RequestResult(
                router=self.router,
                ok=True,
                ttft_s=first - arrival,
                itl_s=mean_itl(first, last, lv.n_out),
                e2e_s=t - arrival,
                prompt_tokens=lv.prompt_tokens,
                cached_tokens=lv.engine.core.cached_tokens(rid),
                backend=lv.engine.name,
                arrival_s=arrival,
                output_tokens=lv.n_out,
            )
        )
        self._progressed()

    def _fail(self, req: TraceRequest, prompt_tokens: int, pod: str, error: str) -> None:
        self.results.append(
            RequestResult(
                router=self.router,
                ok=False,
                prompt_tokens=prompt_tokens,
                backend=pod,
                arrival_s=req.arrival_s,
                error=error,
            )
        )
        self._progressed()

    def _progressed(self) -> None:
        if self.progress is not None:
            self.progress(len(self.results), len(self.workload.requests))

    async def _deliver(self, pod: str, events: Sequence[se.KVEvent], t: float) -> None:
        if not self.dram_reported:
            events = [ev for ev in events if getattr(ev, "medium", None) != se.MEDIUM_CPU]
        batch = rk.EventBatch(ts=t, events=router_events(events))
        cpu0 = time.process_time()
        await self.ingestor.apply(pod, "sim", batch)
        self.router_cpu += time.process_time() - cpu0

    # ----------------------------------------------------------------- loop

    async def _handle(self, item: object, t: float) -> None:
        """One event off the heap (subclasses add kinds of their own)."""
        if isinstance(item, _StepEnd):
            self._step_done(item.engine, item.out, t)
        elif isinstance(item, _Delivery):
            await self._deliver(item.pod, item.events, t)
        else:
            raise TypeError(f"unknown event {item!r}")

    async def run_and_close(self) -> float:
        try:
            return await self.run()
        finally:
            if isinstance(self.backend, RedisIndex):
                await self.backend.close()
                await forget_generation(self.backend.url, self.backend.names.generation)

    async def run(self) -> float:
        """Play every event; returns the virtual time of the last one."""
        for name in self.engines:
            await self.index.begin_incarnation(name, "sim")
        reqs = sorted(self.workload.requests, key=lambda r: r.arrival_s)
        horizon = (reqs[-1].arrival_s if reqs else 0.0) + self.opts.max_drain_s
        i, n, t = 0, len(reqs), 0.0
        heap = self.heap
        while True:
            next_arrival = reqs[i].arrival_s if i < n else math.inf
            if heap and heap[0][0] <= next_arrival:
                t, _, item = heapq.heappop(heap)
                if t > horizon:
                    break
                self.clock.now = t
                await self._handle(item, t)
            elif i < n:
                t = next_arrival
                self.clock.now = t
                await self._arrive(i, reqs[i], t)
                i += 1
            else:
                break
        for rid, lv in sorted(self.live.items()):
            late = f"{rid} unfinished {self.opts.max_drain_s:g} s after the last arrival"
            self._fail(lv.req, lv.prompt_tokens, lv.engine.name, late)
        return t


def run_des(
    workload: Workload,
    router: str,
    *,
    engines: int = 8,
    profile: str = "h100-llama-3.1-8b",
    block_size: int | None = None,
    builder: PromptBuilder | None = None,
    scrape_interval_s: float = 0.5,
    seed: int = 0,
    progress: Progress | None = None,
    kv_event_delay_s: float = DEFAULT_KV_EVENT_DELAY_S,
    options: DesOptions | None = None,
) -> tuple[RunRecord, list[RequestResult]]:
    """Replay ``workload`` through ``router`` on ``engines`` simulated pods.

    Prompts come from ``builder`` if given, else from a tokenizer-free synthetic
    vocabulary seeded by ``seed`` (the simulator only needs ids). Deterministic:
    the same arguments give the same results.
    """
    opts = options or DesOptions()
    opts = replace(opts, scrape_interval_s=scrape_interval_s, kv_event_delay_s=kv_event_delay_s)
    if opts.scrape_interval_s <= 0:
        raise ValueError("scrape_interval_s must be positive")
    prof = profile_for(profile, block_size)
    if opts.cpu_offload_blocks is not None:
        prof = replace(prof, cpu_offload_blocks=opts.cpu_offload_blocks)
    tokens = builder.tokens if builder is not None else synthetic_tokens(seed)
    sim = _Sim(workload, router, engines, prof, tokens, opts, progress)
    end = asyncio.run(sim.run_and_close())
    results = sorted(sim.results, key=lambda r: r.arrival_s)
    oracle = opts.oracle if opts.oracle is not None else oracle_hit_ratio(workload, prof.block_size)
    start = workload.requests[0].arrival_s if workload.requests else 0.0
    notes = [
        f"block {prof.block_size}",
        f"scrape {opts.scrape_interval_s:g}s",
        f"kv events +{opts.kv_event_delay_s:g}s",
        *opts.notes,
    ]
    record = summarize(
        router,
        workload.name,
        results,
        oracle_hit_ratio=oracle,
        prefill_tokens_per_engine=computed_prefill(results, sim.engines),
        router_cpu_s=sim.router_cpu,
        duration_s=end - start,
        mode="des",
        engines=engines,
        profile=profile,
        offered_rps=workload.offered_rps,
        notes=", ".join(notes),
    )
    record.extra["block_size"] = prof.block_size
    record.extra["virtual_s"] = round(end - start, 3)
    # Where reuse goes: decisions by reason, and the chosen pods' predicted cached tokens
    # next to what the engines reported (equal: nothing lost to eviction or index lag).
    record.extra["decisions"] = dict(sim.decisions)
    record.extra["predicted_cached_tokens"] = sim.predicted_cached
    if sim.peer_pulls:  # peer pulls chosen, by the class of the pair's link
        record.extra["peer_pulls"] = dict(sim.peer_pulls)
    record.extra["reported_cached_tokens"] = sum(r.cached_tokens or 0 for r in results)
    # recompute preemptions: a prompt sent where its KV did not fit (cost: KV room)
    record.extra["preemptions"] = sum(e.core.stats().num_preemptions for e in sim.engines.values())
    # BlockStored events the router could not key (a parent it no longer knew): index drift
    record.extra["events_stored"] = sim.ingestor.stats.stored
    record.extra["events_unmapped"] = sim.ingestor.stats.unmapped
    if sim.store is not None:
        record.extra["shared_store_blocks"] = len(sim.store)
        record.extra["shared_store_capacity"] = sim.store.capacity
        record.extra["shared_store_found_blocks"] = sim.store.found
        if sim.store.trace is not None:  # the same stream under every policy, Belady's too
            record.extra["store_bound_blocks"] = {
                p: replay(sim.store.trace, sim.store.capacity, p) for p in REPLAY_POLICIES
            }
            sim.store.trace = None
    if opts.shared_kv is not None:  # tokens the engines loaded from CPU, store or peers
        stats = [e.core.stats() for e in sim.engines.values()]
        record.extra["external_hit_tokens"] = sum(st.external_prefix_cache_hits for st in stats)
    return record, results
