"""The router's own Prometheus metrics, labelled by pool and model.

Names are ``kvplane_router_*``; Grafana dashboards and the drift alert read
``predicted`` vs ``reported`` cached tokens to show how far the index is from
what engines actually reuse.
"""

from __future__ import annotations

import copy

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_FAST = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
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
