"""Predicted time to first token of a prompt on one pod: the whole cost model.

    ttft = queue + transfer + recompute

- queue: prefill work waiting on the pod: the tokens the router has sent and not yet
  seen a first token for, plus requests the engine reported waiting beyond those the
  router had pending when it scraped (at the mean prompt), costed as their prefill
  (rate plus attention); with ``queue_progress``, less the time the pod has been on the
  oldest of the router's (at most that one's work); plus decode interference from
  running requests; plus a penalty when the KV cache is nearly full (preemptions
  ahead), and a larger one when the prompt does not fit in what is free (it waits for
  running requests to finish: ``kv_pressure_ms``).
- transfer: blocks held only in a slower tier are loaded (tier latency + bytes
  over tier bandwidth).
- recompute: every token not resident (or not worth loading) is prefilled: at the
  prefill rate, plus attention to the context before it (quadratic in length, so a
  long prompt costs more than its tokens at the rate).
- adapter (LoRA requests only, ``adapter_load_ms``): nothing when the pod has a request
  of that adapter running; else the load of the adapter, plus ``adapter_slot_wait_ms``
  when the pod's ``max_loras`` slots are all taken by other adapters with requests
  running or waiting (vLLM's ``vllm:lora_requests_info``; the order of GIE's LoRA
  affinity: active, then room to load, then full). A pod that reports no LoRA state
  pays the load.

A connector can only load a contiguous prefix, so the choice is one cut: load
tiers up to some boundary, recompute everything after it. Every cut is costed
and the cheapest kept, which is "recompute when transfer is slower". A pool's
shared store is the remote tier of the pods that read it, at the store's link
(``router.shared``). Where pods can pull KV from each other (``peer_pull``), one
more option is costed: pull the prefix another pod holds in HBM or DRAM (a
``PeerOffer``) over the link between the two pods (its class from their node and zone
labels, ``router.pd.topology``), beyond what is resident here; of the holders, the one
whose pull plus recompute of the rest is cheapest.
Pure functions only: the router, the explain endpoint and the discrete-event
simulator share them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvplane.router.config import CostParams, LinkClass, PeerPullSpec, RouterConfig, TierCost
from kvplane.router.engine_stats import LoraState
from kvplane.router.pd.topology import Place, place_class, place_of
from kvplane.router.pd.topology import transfer_ms as link_ms
from kvplane.router.shared import SharedStores
from kvplane.router.tiers import TIER_ORDER, Tier


@dataclass(frozen=True, slots=True)
class PodLoad:
    """What is known of a pod's load right now."""

    pending_prefill_tokens: int = 0  # router-tracked, sent and awaiting first token
    pending_prefill_pairs: float = 0.0  # their attention work: sum of n x (cached + n/2)
    pending_requests: int = 0  # router-tracked count of the above
    head_prefill: tuple[int, float] = (0, 0.0)  # the oldest of them: tokens, pairs
    prefill_busy_s: float = 0.0  # how long the pod has been on that one (LoadCounters)
    inflight: int = 0  # router-tracked requests not finished
    inflight_tokens: int = 0  # their prompt tokens: the KV a decode step reads there
    engine_waiting: float = 0.0  # vllm:num_requests_waiting (scraped)
    scraped_pending_requests: int = 0  # pending_requests when that scrape was taken
    engine_running: float = 0.0  # vllm:num_requests_running (scraped)
    kv_usage: float = 0.0  # vllm:kv_cache_usage_perc, 0..1 (scraped)
    kv_capacity_tokens: float = 0.0  # KV the pod can hold (scraped; 0: unknown)
    recent_prefill_tokens: float = 0.0  # router-sent uncached tokens, decayed (half-life)
    mean_request_tokens: float = 1024.0  # the fleet's mean prompt: size of an unseen request
    lora: LoraState | None = None  # vllm:lora_requests_info (scraped), None if not reported


@dataclass(frozen=True, slots=True)
class CostTerms:
    pod: str
    queue_ms: float
    transfer_ms: float
    recompute_ms: float
    cached_tokens: int  # tokens reused: resident in HBM or loaded from a slower tier
    loaded_from: dict[Tier, int] = field(default_factory=dict)  # tokens loaded per tier
    loaded_ms: dict[Tier, float] = field(default_factory=dict)  # their transfer, per tier
    adapter_ms: float = 0.0  # loading the request's LoRA adapter (adapter_load_ms)
    store: str | None = None  # the shared store the remote tier's tokens come from
    peer: str | None = None  # the pod a prefix is pulled from (peer_pull)
    peer_tokens: int = 0  # tokens pulled from it (part of cached_tokens)
    peer_ms: float = 0.0  # their transfer (part of transfer_ms)
    peer_link: LinkClass | None = None  # the class of the link it comes over

    @property
    def ttft_ms(self) -> float:
        return self.queue_ms + self.transfer_ms + self.recompute_ms + self.adapter_ms


def attention_pairs(new_tokens: float, cached_tokens: float) -> float:
    """Attention work of prefilling ``new_tokens`` after ``cached_tokens``: every new
    token attends to the cached context and, causally, to half of the new ones."""
    return new_tokens * (cached_tokens + new_tokens / 2.0) if new_tokens > 0 else 0.0


def prefill_compute_ms(tokens: float, pairs: float, params: CostParams) -> float:
    """Time to prefill ``tokens`` new tokens whose attention work is ``pairs``."""
    return (
        tokens / params.prefill_tokens_per_s * 1000.0
        + pairs * params.prefill_attention_ms_per_mpair / 1e6
    )


def pending_prefill_ms(load: PodLoad, params: CostParams) -> float:
    """Prefill still queued on the pod: its tokens at the prefill rate plus their
    attention, so a pod with one long prompt pending is known to be busier than one
    with several short ones of the same total. With ``queue_progress``, less the time
    the pod has been on the oldest of them (it runs them in order), at most that one's
    own work: until its first token comes it is not done. A pod half through its only
    pending prefill then waits half."""
    # Requests waiting that the router did not send (another replica's, a direct
    # client's), counted against the router's pending at the scrape's instant: a scrape
    # is up to an interval old, and its waiting requests may have started since.
    unseen_waiting = max(0.0, load.engine_waiting - load.scraped_pending_requests)
    mean = load.mean_request_tokens
    tokens = load.pending_prefill_tokens + unseen_waiting * mean
    pairs = load.pending_prefill_pairs + unseen_waiting * attention_pairs(mean, 0.0)
    queued = prefill_compute_ms(tokens, pairs, params)
    if not params.queue_progress or load.prefill_busy_s <= 0.0:
        return queued
    head = prefill_compute_ms(*load.head_prefill, params)
    return max(0.0, queued - min(head, load.prefill_busy_s * 1000.0))


def kv_pressure_ms(load: PodLoad, new_tokens: int, params: CostParams) -> float:
    """Waiting for KV on the pod. ``kv_pressure_penalty_ms`` when its cache is past
    ``kv_pressure_threshold`` (preemptions ahead). ``kv_overflow_penalty_ms`` instead when
    the prompt's ``new_tokens`` (not resident there) do not fit beside what its requests
    hold (the usage as scraped) and what the router has sent there and not yet seen
    start (its pending prefill): vLLM allocates a prompt's blocks chunk by chunk and,
    when none are free, preempts the newest running request, most often that prompt
    itself, which then waits for running requests to finish. A pod that does not report
    its capacity is judged by its usage alone."""
    capacity = load.kv_capacity_tokens
    if capacity > 0:
        held = load.kv_usage * capacity + load.pending_prefill_tokens
        if held + new_tokens > capacity:
            return params.kv_overflow_penalty_ms
    full = load.kv_usage >= params.kv_pressure_threshold
    return params.kv_pressure_penalty_ms if full else 0.0


def surviving_hbm_tokens(load: PodLoad, resident: int) -> int:
    """How much of a ``resident`` HBM prefix is still there when a prompt queued behind
    the pod's pending prefill starts: what the router has sent there and not yet seen
    start allocates first, and it takes free blocks (the capacity less the usage as
    scraped), cached ones included, least recently used first. The prefix counts as the
    most recently freed (vLLM frees a request's blocks last ones first, so what is
    taken of it is its end); as much of it as the free blocks cannot hold is held by a
    running request and stays. A pod that does not report its capacity keeps it all."""
    capacity, pending = load.kv_capacity_tokens, load.pending_prefill_tokens
    if capacity <= 0 or pending <= 0 or resident <= 0:
        return resident
    free = max(0.0, capacity * (1.0 - load.kv_usage))
    free_part = min(float(resident), free)
    taken = min(free_part, max(0.0, pending - (free - free_part)))
    return resident - math.ceil(taken)


def queue_ms(load: PodLoad, params: CostParams, new_tokens: int = 0) -> float:
    """Waiting before a prompt whose ``new_tokens`` are not resident on the pod starts:
    prefill ahead of it, its running requests' steps, and room in its KV cache."""
    running = max(load.engine_running, float(load.inflight - load.pending_requests))
    wait = pending_prefill_ms(load, params)
    wait += running * params.running_step_ms_per_request
    return wait + kv_pressure_ms(load, new_tokens, params)


def transfer_ms(tokens: int, tier: Tier, params: CostParams, kv_bytes_per_token: int) -> float:
    return _load_ms(tokens, params.tiers.get(tier), kv_bytes_per_token)


def _load_ms(tokens: int, t: TierCost | None, kv_bytes_per_token: int) -> float:
    if tokens <= 0:
        return 0.0
    if t is None:  # a tier without a configured path cannot be loaded from
        return float("inf")
    return t.latency_ms + tokens * kv_bytes_per_token / (t.bandwidth_gbps * 1e9) * 1000.0


def adapter_load_ms(adapter: str | None, lora: LoraState | None, params: CostParams) -> float:
    """Time before ``adapter``'s request can run on a pod with LoRA state ``lora``."""
    if adapter is None or (lora is not None and adapter in lora.running):
        return 0.0
    ms = params.adapter_load_ms
    if lora is not None and len((lora.running | lora.waiting) - {adapter}) >= lora.max_loras:
        ms += params.adapter_slot_wait_ms
    return ms


@dataclass(frozen=True, slots=True)
class PeerOffer:
    """Another pod's resident prefix of the prompt: blocks it holds in HBM or DRAM, and
    the class of the link between it and the pod that would pull them."""

    pod: str
    blocks: int
    link: LinkClass = LinkClass.SAME_ZONE


def peer_offers(
    matches: Mapping[str, Mapping[Tier, int]],
    pods: Sequence[str],
    labels: Mapping[str, Mapping[str, str]] | None = None,
    spec: PeerPullSpec | None = None,
) -> dict[str, list[PeerOffer]]:
    """Per pod, the holders worth costing: for each class of link from it, the other pod
    holding the longest prefix in HBM or DRAM over a link of that class (ties: by name).
    Over one link a pull's cost is concave in the blocks pulled (each one costs the same
    transfer and saves more recompute than the one before, its attention reaching
    further back), so a shorter holder of the same class is never cheaper than both the
    longest one and pulling nothing; ``CostModel.predict`` compares the classes.
    ``labels``: the pods' node and zone labels (absent: one zone, different nodes).
    ``spec``: the links; with it, an offer no longer than one over a link at least as
    fast is left out, and when every class has the same link (no ``links``) only the
    longest holder is offered (its link class named all the same)."""
    labels = labels or {}
    if spec is not None and not spec.links:
        return _longest_offers(matches, pods, labels)
    places = {p: place_of(labels.get(p, {})) for p in pods}
    # the two longest holders per place (one of them may be the puller itself), and the
    # pullers per place: pods of one place see the same holders, less themselves
    tops: dict[Place, list[tuple[int, str]]] = {}
    pullers: dict[Place, list[str]] = {}
    for p in pods:
        pullers.setdefault(places[p], []).append(p)
        blocks = matches.get(p, {}).get(Tier.DRAM, 0)
        if blocks > 0:
            tops.setdefault(places[p], []).append((-blocks, p))
    for held in tops.values():
        held.sort()
        del held[2:]
    out: dict[str, list[PeerOffer]] = {}
    for here, group in pullers.items():
        by_class: dict[LinkClass, list[tuple[int, str]]] = {}
        for place, held in tops.items():
            best = by_class.setdefault(place_class(here, place), [])
            best.extend(held)
            best.sort()
            del best[2:]
        for pod in group:
            offers = []
            for cls, best in sorted(by_class.items()):
                for neg, other in best:
                    if other != pod:
                        offers.append(PeerOffer(other, -neg, cls))
                        break
            if offers:
                out[pod] = offers if spec is None else _undominated(offers, spec)
    return out


def _undominated(offers: list[PeerOffer], spec: PeerPullSpec) -> list[PeerOffer]:
    """The offers not beaten outright by another: one with at least as many blocks over
    a link at least as fast (bandwidth and latency) is never the costlier pull."""
    links = {o.link: spec.link_for(o.link) for o in offers}

    def beats(a: PeerOffer, b: PeerOffer) -> bool:
        la, lb = links[a.link], links[b.link]
        return (
            a.blocks >= b.blocks
            and la.bandwidth_gbps >= lb.bandwidth_gbps
            and la.latency_ms <= lb.latency_ms
            and (a.blocks, la.bandwidth_gbps, -la.latency_ms, b.link)
            > (b.blocks, lb.bandwidth_gbps, -lb.latency_ms, a.link)
        )

    return [b for b in offers if not any(beats(a, b) for a in offers if a is not b)]


def _longest_offers(
    matches: Mapping[str, Mapping[Tier, int]],
    pods: Sequence[str],
    labels: Mapping[str, Mapping[str, str]],
) -> dict[str, list[PeerOffer]]:
    """Per pod, the other pod holding the longest prefix in HBM or DRAM (ties by name)."""
    best = sorted((-matches.get(p, {}).get(Tier.DRAM, 0), p) for p in pods)[:2]
    out: dict[str, list[PeerOffer]] = {}
    for pod in pods:
        for neg, other in best:
            if other != pod:
                if neg < 0:
                    cls = place_class(
                        place_of(labels.get(pod, {})), place_of(labels.get(other, {}))
                    )
                    out[pod] = [PeerOffer(other, -neg, cls)]
                break
    return out


@dataclass(frozen=True, slots=True)
class CostModel:
    """The cost parameters with the facts of the model they apply to: everything the
    prediction needs besides the request and the pod."""

    params: CostParams
    block_size: int
    kv_bytes_per_token: int
    # the pool's shared stores: each reader's remote tier is its store, at its link
    shared: SharedStores = field(default_factory=SharedStores)
    # pods pull KV from each other over the link of each pair's class (None: never)
    peer_pull: PeerPullSpec | None = None

    @classmethod
    def of(cls, config: RouterConfig) -> CostModel:
        m = config.model
        shared = SharedStores.of(config.shared_stores)
        return cls(config.cost, m.block_size, m.kv_bytes_per_token, shared, config.peer_pull)

    def predict(
        self,
        pod: str,
        prompt_tokens: int,
        match: Mapping[Tier, int],
        load: PodLoad,
        adapter: str | None = None,
        *,
        peers: Sequence[PeerOffer] = (),
    ) -> CostTerms:
        """Cost terms of serving ``prompt_tokens`` on ``pod`` given its resident prefix
        (``match``: leading blocks held per tier or a faster one); ``adapter``: the
        request's LoRA adapter, None for the base model; ``peers``: with peer pulls, the
        prefixes other pods could send it (``peer_offers``), each over its pair's link."""
        params, block_size = self.params, self.block_size
        tiers = self.shared.tier_costs(pod, params.tiers) if self.shared else params.tiers
        # The engine always computes the last prompt token, so at most n-1 are reusable.
        reusable = max(0, prompt_tokens - 1)
        resident = min(match.get(Tier.HBM, 0) * block_size, reusable)
        if params.pending_evicts_cached:
            kept = surviving_hbm_tokens(load, resident)
            if kept < resident:  # whole blocks, from the prefix's first
                resident = kept // block_size * block_size

        def recompute(covered: int) -> float:
            rest = prompt_tokens - covered
            return prefill_compute_ms(rest, attention_pairs(rest, covered), params)

        best_loaded: dict[Tier, int] = {}
        best_loaded_ms: dict[Tier, float] = {}
        best_transfer, best_covered = 0.0, resident
        best_total = recompute(resident)
        loaded: dict[Tier, int] = {}
        loaded_ms: dict[Tier, float] = {}
        covered, transfer = resident, 0.0
        for tier in TIER_ORDER[1:]:
            upto = min(match.get(tier, 0) * block_size, reusable)
            extra = upto - covered
            if extra <= 0:
                continue
            ms = _load_ms(extra, tiers.get(tier), self.kv_bytes_per_token)
            transfer += ms
            covered = upto
            loaded, loaded_ms = {**loaded, tier: extra}, {**loaded_ms, tier: ms}
            total = transfer + recompute(covered)
            if total < best_total:
                best_total, best_transfer, best_covered = total, transfer, covered
                best_loaded, best_loaded_ms = loaded, loaded_ms
        pulled, pull_ms, source, via = 0, 0.0, None, None
        pull = self.peer_pull
        for peer in peers if pull is not None else ():
            # the peer sends what is not resident here; the rest is recomputed
            extra = min(peer.blocks * block_size, reusable) - resident
            if extra <= 0 or pull is None:
                continue
            ms = link_ms(extra, self.kv_bytes_per_token, pull.link_for(peer.link))
            total = ms + recompute(resident + extra)
            if total < best_total:
                best_total = total
                pulled, pull_ms, source, via = extra, ms, peer.pod, peer.link
                best_transfer, best_covered = ms, resident + extra
                best_loaded, best_loaded_ms = {}, {}
        store = None
        if Tier.REMOTE in best_loaded and self.shared:
            store = self.shared.store_of(pod)
        return CostTerms(
            pod=pod,
            queue_ms=queue_ms(load, params, prompt_tokens - resident),
            transfer_ms=best_transfer,
            recompute_ms=recompute(best_covered),
            cached_tokens=best_covered,
            loaded_from=best_loaded,
            loaded_ms=best_loaded_ms,
            adapter_ms=adapter_load_ms(adapter, load.lora, params),
            store=store,
            peer=source,
            peer_tokens=pulled,
            peer_ms=pull_ms,
            peer_link=via,
        )
