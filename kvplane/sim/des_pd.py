"""Prefill/decode disaggregation in virtual time: kvplane's P/D choice against simulated engines.

The discrete-event mode of :mod:`kvplane.sim.des` with roles. Every arrival goes
through the router's own P/D choice (``choose_pd``: every pair and every decode pod
alone, with the index, pool loads and pod labels the live router would see), and a
handoff plays out as vLLM's NixlConnector does it:

1. the prefill leg (``max_tokens: 1``) runs on the prefill pod, whose finished
   prompt blocks are then held (pinned) for the decode side;
2. the decode leg goes out at once; the decode engine pulls the blocks it lacks
   over the pair's link (latency + bytes / bandwidth of the link class the pods'
   labels give; transfers into one engine queue on each of its links, NIC and
   NVLink apart), caches them (``BlockStored`` events) and then decodes,
   recomputing only the prompt's last partial block;
3. the client's first token is the decode engine's first token.

The router-side accounting mirrors ``kvplane.router.pd.handoff``: the prefill leg's
``Attempt`` on the prefill pod, the decode pod booked from the choice until the
decode leg is sent, the decode leg's ``Attempt`` from the prefill's answer. With no
faults to inject, the only fallback is the one vLLM forces: a prompt under one block
has no KV to hand off and is prefilled on the decode pod (``aggregated_no_kv_params``).

What the HTTP benchmark cannot give, this does: runs that do not depend on the
machine's load (the same arguments give the same figures), fleets of any size, and
per-pair link classes (pods on nodes with NVLink inside and NICs between).
"""

from __future__ import annotations

import asyncio
import math
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from kvplane.router.blockkeys import block_keys
from kvplane.router.config import Backend, BackendRole, LinkClass, PDSpec
from kvplane.router.index.base import Blocks
from kvplane.router.load import Attempt, Booking
from kvplane.router.pd.choice import PDCandidates, PDReason, choose_pd
from kvplane.router.pd.cost import PDCostModel
from kvplane.router.pd.topology import link_class, link_cost, transfer_ms
from kvplane.router.tiers import Tier
from kvplane.sim import pd as simpd
from kvplane.sim.des import (
    DEFAULT_KV_EVENT_DELAY_S,
    DesOptions,
    Progress,
    _Engine,
    _Sim,
    profile_for,
)
from kvplane.sim.engine import SimRequest, StepOutput
from kvplane.sim.hashing import block_hashes
from kvplane.sim.profiles import EngineProfile
from kvplane.workload.results import (
    STALL_S,
    RequestResult,
    RunRecord,
    computed_prefill,
    percentile,
    summarize,
)
from kvplane.workload.traces import PromptBuilder, TraceRequest, Workload, synthetic_tokens

PREFILL_SUFFIX: Final = "/prefill"


@dataclass(frozen=True, slots=True)
class Topology:
    """Where the pods sit: ``gpus_per_node`` pods per node (0: placement unknown, every
    pair one zone apart), prefill and decode pods spread evenly over the nodes, as a
    scheduler spreading each pool would place them."""

    gpus_per_node: int = 0
    router_sees_nodes: bool = True  # False: a topology-blind router on the same fleet

    def nodes(self, roles: Sequence[str]) -> list[str | None]:
        """Each pod goes to a node with a free GPU holding the fewest of its pool (then
        the most free GPUs): every pool spreads evenly and no node hosts more pods than
        it has GPUs (22 prefill + 10 decode on 4 x 8: 6+2, 6+2, 5+3, 5+3)."""
        if self.gpus_per_node <= 0:
            return [None] * len(roles)
        n_nodes = max(1, math.ceil(len(roles) / self.gpus_per_node))
        free = [self.gpus_per_node] * n_nodes
        held: dict[str, list[int]] = {}
        out: list[str | None] = []
        for role in roles:
            count = held.setdefault(role, [0] * n_nodes)
            node = min(
                (n for n in range(n_nodes) if free[n] > 0), key=lambda n: (count[n], -free[n], n)
            )
            count[node] += 1
            free[node] -= 1
            out.append(f"node-{node}")
        return out


@dataclass(slots=True)
class _Handoff:
    """A request between its choice and its decode leg."""

    idx: int
    req: TraceRequest
    tokens: list[int]
    keys: list[int]
    matches: Mapping[str, Mapping[Tier, int]]
    prefill: str
    decode: str
    attempt: Attempt  # the prefill leg's
    booking: Booking  # the decode pod's, until the decode leg is sent


@dataclass(frozen=True, slots=True)
class _TransferEnd:
    handoff: _Handoff
    hashes: list[bytes]
    pinned: list[int]  # the prefill engine's blocks, held until pulled


class _PDSim(_Sim):
    """The DES fleet with roles, links and the router's P/D path."""

    def __init__(
        self,
        workload: Workload,
        roles: Sequence[str],
        pd: PDSpec | None,
        topology: Topology,
        profile: EngineProfile,
        tokens: PromptBuilder | None,
        seed: int,
        opts: DesOptions,
        progress: Progress | None,
    ) -> None:
        source = tokens.tokens if tokens is not None else synthetic_tokens(seed)
        super().__init__(workload, "kvplane", len(roles), profile, source, opts, progress)
        self.pd = pd
        self.pd_model = PDCostModel(self.model, pd) if pd is not None else None
        self.roles = dict(zip(self.engines, roles, strict=True))
        nodes = topology.nodes(roles)
        backends = []
        for (name, role), node in zip(self.roles.items(), nodes, strict=True):
            labels = {"node": node} if node is not None else {}
            backends.append(
                Backend(name=name, url=f"sim://{name}", role=BackendRole(role), labels=labels)
            )
        self.pool.set_backends(backends)
        self.placement = {b.name: b.labels for b in backends}  # where the pods really are
        # what the router is told of it (nothing: every pair looks one zone apart)
        self.labels = self.placement if topology.router_sees_nodes else {}
        self.handoffs: dict[str, _Handoff] = {}  # by the prefill leg's request id
        self.links: dict[tuple[str, LinkClass], simpd.Link] = {}
        self.gaps = array("d")  # every gap between two output tokens of a request, s
        self.transfers: dict[LinkClass, list[int]] = {}  # class -> [handoffs, tokens moved]
        self.busy_s = dict.fromkeys(self.engines, 0.0)
        self.decode_attempts: dict[str, Attempt] = {}  # decode legs waiting for their KV
        self.pending_marks: list[tuple[str, list[int], Mapping[str, Mapping[Tier, int]]]] = []

    # ----------------------------------------------------------------- the choice

    def _candidates(self) -> tuple[list[str], list[str]]:
        """As ``PDService.candidates`` with NIXL: ``both`` pods are in both pools."""
        prefill: list[str] = []
        decode: list[str] = []
        for name in self.pool.healthy():
            role = self.roles[name]
            if role != "decode":
                prefill.append(name)
            if role != "prefill":
                decode.append(name)
        return prefill, decode

    async def _arrive(self, idx: int, req: TraceRequest, t: float) -> None:
        if self.pd is None:
            await super()._arrive(idx, req, t)
            return
        tokens = self.tokens.token_ids(req)
        cpu0 = time.process_time()
        prefill, decode = self._candidates()
        for name in prefill + decode:
            self._snap(self.engines[name], t)
        keys = block_keys(tokens, self.block_size, self.root)
        matches = await self.index.lookup(keys, list(dict.fromkeys(prefill + decode)))
        states = self.pool.states
        cands = PDCandidates(
            prefill=self.pool.loads(prefill, now=t),
            decode=self.pool.loads(decode, now=t),
            labels=self.labels,
            alone=[p for p in prefill if self.roles[p] == "prefill"],  # NIXL: kv_both
        )
        assert self.pd_model is not None
        d = choose_pd(self.pd_model, len(tokens), matches, cands)
        self.pool.observe_prompt(len(tokens))
        uncached = len(tokens) - d.chosen.prefill_terms.cached_tokens
        self.pool.note_routed(d.prefill or d.decode, uncached, now=t)
        self.decisions[d.reason] += 1
        self.predicted_cached += d.chosen.prefill_terms.cached_tokens
        rid = f"r{idx}"
        if d.prefill is None:
            self.router_cpu += time.process_time() - cpu0
            await self._mark(d.decode, keys, matches)
            self._submit(rid, req, tokens, d.decode, uncached, t)
            return
        booking = Booking()
        booking.hold(states[d.decode], len(tokens))
        attempt = Attempt(states[d.prefill], uncached, t, len(tokens))
        attempt.begin()
        self.router_cpu += time.process_time() - cpu0
        eng = self.engines[d.prefill]
        self._snap(eng, t)
        leg = rid + PREFILL_SUFFIX
        try:
            eng.core.add_request(SimRequest(leg, tokens, max_tokens=1))
        except ValueError as exc:  # too long for the engine: vLLM answers 400
            attempt.end()
            booking.release()
            self._fail(req, len(tokens), eng.name, str(exc))
            return
        self.handoffs[leg] = _Handoff(
            idx, req, tokens, keys, matches, d.prefill, d.decode, attempt, booking
        )
        if not eng.busy:
            self._start_step(eng, t)

    async def _mark(
        self, pod: str, keys: list[int], matches: Mapping[str, Mapping[Tier, int]]
    ) -> None:
        """The pod will hold the prompt's blocks until its events say otherwise."""
        held = matches.get(pod, {}).get(Tier.HBM, 0)
        if len(keys) > held:
            await self.index.mark_tentative(
                pod, Blocks.of_prompt(keys, held), self.cost.tentative_ttl_s
            )

    # ----------------------------------------------------------------- the handoff

    def _step_done(self, eng: _Engine, out: StepOutput, t: float) -> None:
        self.busy_s[eng.name] += out.duration_s
        for rid, toks in out.new_tokens.items():
            lv = self.live.get(rid)
            if lv is not None and toks and lv.last is not None:
                self.gaps.append(t - lv.last)
        produced = [rid for rid in out.finished if rid in self.handoffs]
        super()._step_done(eng, out, t)
        for leg in produced:
            self._produced(self.handoffs.pop(leg), t)

    def _produced(self, h: _Handoff, t: float) -> None:
        """The prefill leg answered: pin its blocks; the decode leg goes out and the
        decode engine starts pulling what it lacks."""
        h.attempt.end()
        # the decode leg is sent now (to the decode pod, prefilling there or pulling the
        # KV): the router counts it there from here, and the booking that stood in ends
        h.booking.release()
        self.pending_marks.append((h.prefill, h.keys, h.matches))
        bs = self.block_size
        src = self.engines[h.prefill].core
        hashes = block_hashes(h.tokens, bs, self.opts.hash_algo)[: (len(h.tokens) - 1) // bs]
        pinned = simpd.pin_prefix(src, hashes)
        rid = f"r{h.idx}"
        if not pinned:  # not one full block: vLLM returns no params, the decode pod prefills
            self.decisions[PDReason.DISAGGREGATED] -= 1
            self.decisions[PDReason.NO_KV_PARAMS] += 1
            self._submit(rid, h.req, h.tokens, h.decode, len(h.tokens), t)
            return
        dst = self.engines[h.decode].core
        local = simpd.local_prefix_blocks(dst, hashes[: len(pinned)])
        moved = (len(pinned) - local) * bs
        cls = link_class(self.placement[h.prefill], self.placement[h.decode])
        assert self.pd is not None
        seconds = transfer_ms(moved, self.profile.kv_bytes_per_token, link_cost(cls, self.pd)) / 1e3
        stat = self.transfers.setdefault(cls, [0, 0])
        stat[0] += 1
        stat[1] += moved
        link = self.links.setdefault((h.decode, cls), simpd.Link())
        end = link.reserve(t, seconds)
        attempt = Attempt(self.pool.states[h.decode], 0, t, len(h.tokens))
        attempt.begin()
        self.decode_attempts[rid] = attempt
        self._push(end, _TransferEnd(h, hashes[: len(pinned)], pinned))

    def _received(self, x: _TransferEnd, t: float) -> None:
        """The KV arrived: cache it on the decode engine, free the prefill's blocks, decode."""
        h = x.handoff
        dst = self.engines[h.decode]
        self._snap(dst, t)
        local = simpd.local_prefix_blocks(dst.core, x.hashes)  # may have changed meanwhile
        simpd.insert_prefix(dst.core, x.hashes, h.tokens, local, len(x.hashes) - local)
        simpd.unpin(self.engines[h.prefill].core, x.pinned)
        rid = f"r{h.idx}"
        attempt = self.decode_attempts.pop(rid)
        self._submit(rid, h.req, h.tokens, h.decode, 0, t, attempt)
        self.pending_marks.append((h.decode, h.keys, h.matches))

    async def _handle(self, item: object, t: float) -> None:
        if isinstance(item, _TransferEnd):
            self._received(item, t)
        else:
            await super()._handle(item, t)
        # tentative marks of the legs that answered (the live router marks them then)
        while self.pending_marks:
            await self._mark(*self.pending_marks.pop())


@dataclass(slots=True)
class PDRun:
    """One run's row (``RunRecord`` with the P/D figures in ``extra``) and its results."""

    record: RunRecord
    results: list[RequestResult]
    gaps_s: array[float]  # every token gap of every request


def run_des_pd(
    workload: Workload,
    roles: Sequence[str],
    pd: PDSpec | None,
    *,
    name: str,
    topology: Topology | None = None,
    profile: str = "h100-llama-3.1-8b",
    block_size: int | None = None,
    builder: PromptBuilder | None = None,
    seed: int = 0,
    scrape_interval_s: float = 1.0,
    kv_event_delay_s: float = DEFAULT_KV_EVENT_DELAY_S,
    options: DesOptions | None = None,
    progress: Progress | None = None,
) -> PDRun:
    """Replay ``workload`` on pods of ``roles`` (``prefill`` / ``decode`` / ``both``).

    ``pd`` None routes with the aggregated cost policy (every pod ``both``); else
    through the P/D choice with that spec, whose ``links`` are also the physical links
    (an operator renders the fleet's real bandwidths). Deterministic."""
    if not roles:
        raise ValueError("roles must name at least one pod")
    if pd is None and any(r != "both" for r in roles):
        raise ValueError("without a pd spec every pod must be 'both'")
    opts = replace(
        options or DesOptions(),
        scrape_interval_s=scrape_interval_s,
        kv_event_delay_s=kv_event_delay_s,
    )
    prof = profile_for(profile, block_size)
    sim = _PDSim(workload, roles, pd, topology or Topology(), prof, builder, seed, opts, progress)
    end = asyncio.run(sim.run())
    left = {
        n: (s.inflight, s.inflight_tokens, s.pending_requests, s.pending_tokens)
        for n, s in sim.pool.states.items()
        if s.inflight or s.inflight_tokens or s.pending_requests or s.pending_tokens
    }
    if left:  # every booking and leg must be undone, as in the live router
        raise RuntimeError(f"router accounting left after the run: {left}")
    results = sorted(sim.results, key=lambda r: r.arrival_s)
    start = workload.requests[0].arrival_s if workload.requests else 0.0
    span = max(end - start, 1e-9)
    record = summarize(
        name,
        workload.name,
        results,
        oracle_hit_ratio=None,
        prefill_tokens_per_engine=computed_prefill(results, sim.engines),
        router_cpu_s=sim.router_cpu,
        duration_s=span,
        mode="des",
        engines=len(roles),
        profile=profile,
        offered_rps=workload.offered_rps,
        notes=f"block {prof.block_size}, scrape {scrape_interval_s:g}s, "
        f"kv events +{kv_event_delay_s:g}s",
    )
    gaps = sim.gaps
    x = record.extra
    x["token_gap_p99_ms"] = round(percentile(gaps, 99) * 1000.0, 1) if gaps else None
    x["stalled_token_share"] = (
        round(sum(1 for g in gaps if g > STALL_S) / len(gaps), 4) if gaps else None
    )
    decisions = {k: v for k, v in sorted(sim.decisions.items()) if v > 0}
    x["decisions"] = decisions if pd is not None else None
    total = sum(decisions.values())
    x["disaggregated_share"] = (
        round(decisions.get(PDReason.DISAGGREGATED, 0) / total, 4)
        if pd is not None and total
        else None
    )

    def busy(want: set[str]) -> float | None:
        xs = [sim.busy_s[n] / span for n, r in sim.roles.items() if r in want]
        return round(sum(xs) / len(xs), 3) if xs else None

    x["prefill_busy"] = busy({"prefill"})
    x["decode_busy"] = busy({"decode", "both"})
    x["transfers"] = {str(k): {"handoffs": v[0], "tokens": v[1]} for k, v in sim.transfers.items()}
    x["lag_resyncs"] = 0  # virtual time: the timeline cannot slip
    x["virtual_s"] = round(span, 3)
    return PDRun(record, results, gaps)
