"""The router's own Prometheus metrics, labelled by pool and model.

Names are ``kvplane_router_*``; Grafana dashboards and the drift alert read
``predicted`` vs ``reported`` cached tokens to show how far the index is from
what engines actually reuse. The predicted TTFT and the requested output lengths feed
the autoscaler and the P:D planner (docs/deploy.md, Operations); the tier series are
the cost model's prediction for the chosen pod (router/tiers.py).
"""

from __future__ import annotations

import copy
from typing import Any, Final

from kvplane.router.cost import CostTerms
from kvplane.router.tiers import TIER_ORDER, Tier
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

PEER_SOURCE: Final = "peer"  # the tier label of tokens pulled from another pod
_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_TOKENS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_TTFT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RouterMetrics:
    def for_pool(self, pool: str, model: str) -> RouterMetrics:
        """The same metrics (and registry) with another pool's labels: several pools in
        one process export one set of families."""
        view = copy.copy(self)
        view.labels = {"pool": pool, "model": model}
        return view

    def __init__(self, pool: str, model: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        lbl = ("pool", "model")
        self.labels = {"pool": pool, "model": model}
        self.decisions = Counter(
            "kvplane_router_decisions", "Routing decisions", (*lbl, "reason", "pod"), registry=r
        )
        self.requests = Counter(
            "kvplane_router_requests",
            "Requests by final status",
            (*lbl, "route", "status"),
            registry=r,
        )
        self.retries = Counter(
            "kvplane_router_retries", "Attempts moved to another pod", (*lbl, "pod"), registry=r
        )
        self.predicted_cached = Counter(
            "kvplane_router_predicted_cached_tokens",
            "Prompt tokens the router predicted the chosen pod holds",
            lbl,
            registry=r,
        )
        self.reported_cached = Counter(
            "kvplane_router_reported_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details)",
            lbl,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvplane_router_prompt_tokens", "Prompt tokens routed", lbl, registry=r
        )
        self.index_lookup = Histogram(
            "kvplane_router_index_lookup_seconds",
            "Residency index lookup",
            lbl,
            buckets=_FAST,
            registry=r,
        )
        self.index_errors = Counter(
            "kvplane_router_index_errors",
            "Index lookups that failed or timed out",
            lbl,
            registry=r,
        )
        self.tokenize = Histogram(
            "kvplane_router_tokenize_seconds",
            "Tokenization (and chat template)",
            lbl,
            buckets=_FAST,
            registry=r,
        )
        self.added = Histogram(
            "kvplane_router_added_latency_seconds",
            "Time from request receipt to the backend request being sent",
            lbl,
            buckets=_FAST,
            registry=r,
        )
        self.backend_ttft = Histogram(
            "kvplane_router_backend_ttft_seconds",
            "Backend time to first byte",
            (*lbl, "pod"),
            buckets=_TTFT,
            registry=r,
        )
        self.backend_healthy = Gauge(
            "kvplane_router_backend_healthy",
            "1 if the backend is routable",
            (*lbl, "pod"),
            registry=r,
        )
        self.inflight = Gauge(
            "kvplane_router_inflight_requests", "Requests in flight", (*lbl, "pod"), registry=r
        )
        # prefill/decode disaggregation (kvplane.router.pd)
        self.pd_decisions = Counter(
            "kvplane_router_pd_decisions",
            "P/D requests by how they were served (disaggregated or aggregated_*)",
            (*lbl, "reason"),
            registry=r,
        )
        self.pd_leg_failures = Counter(
            "kvplane_router_pd_leg_failures",
            "P/D legs that failed before the first byte, by what happened next",
            (*lbl, "leg", "outcome"),
            registry=r,
        )
        self.pd_transfer_bytes = Counter(
            "kvplane_router_pd_predicted_transfer_bytes",
            "KV bytes predicted to move from prefill to decode pods",
            (*lbl, "link"),
            registry=r,
        )
        self.pd_transfer_seconds = Histogram(
            "kvplane_router_pd_predicted_transfer_seconds",
            "Predicted KV transfer time per handoff",
            (*lbl, "link"),
            buckets=_FAST,
            registry=r,
        )
        self.pd_pairs = Counter(
            "kvplane_router_pd_pairs",
            "Disaggregated requests by their (prefill, decode) pair",
            (*lbl, "prefill", "decode"),
            registry=r,
        )
        # what the autoscaler and the P:D planner read
        self.predicted_ttft = Histogram(
            "kvplane_router_predicted_ttft_seconds",
            "The chosen pod's (or P/D option's) predicted time to first token",
            lbl,
            buckets=_TTFT,
            registry=r,
        )
        self.requested_output_tokens = Histogram(
            "kvplane_router_requested_output_tokens",
            "Output tokens requested (max_tokens or max_completion_tokens, when given)",
            lbl,
            buckets=_TOKENS,
            registry=r,
        )
        # KV cache tiers, as the cost model predicts them for the chosen pod; tier="peer":
        # pulled from another pod (peer_pull), tier="remote" includes shared stores
        self.tier_hit_tokens = Counter(
            "kvplane_router_tier_hit_tokens",
            "Prompt tokens the chosen pod is predicted to reuse, by the tier that holds them",
            (*lbl, "tier"),
            registry=r,
        )
        self.tier_loads = Counter(
            "kvplane_router_tier_loads",
            "Requests whose chosen pod is predicted to load KV from a slower tier",
            (*lbl, "tier"),
            registry=r,
        )
        self.tier_load_seconds = Histogram(
            "kvplane_router_tier_load_seconds",
            "Predicted transfer of one load into HBM, by the tier it comes from",
            (*lbl, "tier"),
            buckets=_FAST,
            registry=r,
        )
        self.demotions = Counter(
            "kvplane_router_backend_demotions",
            "Pods taken out of rotation for a back-off (stalled, 5xx, dropped requests)",
            (*lbl, "pod"),
            registry=r,
        )
        # metrics with a pod label, and their label names: a pod that leaves takes its
        # children with it (pods come and go with every rollout)
        self.per_pod: list[tuple[MetricWrapperBase, tuple[str, ...]]] = [
            (self.decisions, (*lbl, "reason", "pod")),
            (self.retries, (*lbl, "pod")),
            (self.backend_ttft, (*lbl, "pod")),
            (self.backend_healthy, (*lbl, "pod")),
            (self.inflight, (*lbl, "pod")),
            (self.demotions, (*lbl, "pod")),
            (self.pd_pairs, (*lbl, "prefill", "decode")),
        ]
        self._children: dict[tuple[Any, ...], Any] = {}

    def forget_pod(self, pod: str) -> None:
        """Remove every child labelled with ``pod``."""
        for metric, names in self.per_pod:
            seen: set[tuple[str, ...]] = set()
            for family in metric.collect():
                for sample in family.samples:
                    labels = sample.labels
                    if pod in (labels.get("pod"), labels.get("prefill"), labels.get("decode")):
                        seen.add(tuple(labels[n] for n in names))
            for values in seen:
                metric.remove(*values)

    def _child(self, metric: Any, *values: str) -> Any:
        """``metric.labels(pool, model, *values)``, cached: labels() costs microseconds."""
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*self.labels.values(), *values)
        return child

    def chose(
        self, terms: CostTerms | None, max_tokens: int | None, ttft_ms: float | None = None
    ) -> None:
        """One routing decision: the chosen pod's cost terms (None from a policy that
        does not cost), the requested output, and the predicted TTFT of what was chosen
        (by default the terms' own; a P/D option adds its transfer and decode)."""
        if max_tokens is not None:
            self._child(self.requested_output_tokens).observe(max_tokens)
        if ttft_ms is None and terms is not None:
            ttft_ms = terms.ttft_ms
        if ttft_ms is not None:
            self._child(self.predicted_ttft).observe(ttft_ms / 1000.0)
        if terms is None:
            return
        resident = terms.cached_tokens - sum(terms.loaded_from.values()) - terms.peer_tokens
        if resident > 0:
            self._child(self.tier_hit_tokens, TIER_ORDER[0].value).inc(resident)
        for tier, tokens in terms.loaded_from.items():
            name = Tier(tier).value
            self._child(self.tier_hit_tokens, name).inc(tokens)
            self._child(self.tier_loads, name).inc()
            self._child(self.tier_load_seconds, name).observe(terms.loaded_ms.get(tier, 0.0) / 1000)
        if terms.peer_tokens:  # a peer pull: its own source, beside the tiers
            self._child(self.tier_hit_tokens, PEER_SOURCE).inc(terms.peer_tokens)
            self._child(self.tier_loads, PEER_SOURCE).inc()
            self._child(self.tier_load_seconds, PEER_SOURCE).observe(terms.peer_ms / 1000)


def indexer_blocks(registry: CollectorRegistry) -> Counter:
    """The indexer's blocks written per event and tier (``CountedWrites``)."""
    return Counter(
        "kvplane_indexer_blocks",
        "Blocks the indexer stored or removed from KV events, by tier (removed: evicted)",
        ("event", "tier"),
        registry=registry,
    )
