"""Router configuration: one YAML/JSON file, validated by pydantic.

Every number the cost model uses lives here, so that an operator (or the
kvplane operator's ConfigMap) can calibrate a fleet without a code change.
"""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Final

import yaml
from kvplane.router.tiers import TIERS, Tier
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSpec(_Strict):
    name: str = Field(description="served model name clients send as `model`")
    tokenizer: str = Field(description="local directory with the tokenizer files")
    revision: str = "main"
    block_size: Annotated[int, Field(gt=0)] = 16
    max_model_len: Annotated[int, Field(gt=0)] = 8192
    chat_template: str | None = Field(
        default=None, description="overrides the tokenizer's template, as vLLM's --chat-template"
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="accept a request's own chat_template (vLLM's --trust-request-chat-template); "
        "it is rendered in a separate process, cut at request_template_timeout_s",
    )
    request_template_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=2.0, description="a request-supplied chat template rendering longer is a 400"
    )
    kv_bytes_per_token: Annotated[int, Field(gt=0)] = 131072
    tokenizer_cache_tokens: Annotated[int, Field(ge=0)] = Field(
        default=4_000_000,
        description="token ids of recent prompts kept for exact prefix reuse (4 bytes each, "
        "plus their block keys); 0 turns reuse off",
    )
    lora_adapters: list[str] = Field(
        default_factory=list,
        description="names of the LoRA adapters the engines serve (vLLM --lora-modules); a "
        "request whose model is one of them is routed in this pool, keyed in its own namespace",
    )
    generation: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9._-]{1,64}$",  # a part of the index's key names
        description="the pool's generation tag (the operator sets it); by default derived "
        "from name, revision, the tokenizer files and block size",
    )


class BackendRole(StrEnum):
    """What a backend serves: whole requests (``both``), or one side of P/D."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


class TokenForwarding(StrEnum):
    """How the pool's backends take the prompt's token ids the router computed
    (kvplane.router.token_forward): not at all, or as Dynamo's frontend does."""

    OFF = "off"
    DYNAMO = "dynamo"


class Backend(_Strict):
    name: str
    url: str
    kv_events: str | None = Field(default=None, description="engine ZMQ PUB endpoint")
    replay: str | None = Field(default=None, description="engine ZMQ ROUTER replay endpoint")
    topic: str = ""
    labels: dict[str, str] = Field(
        default_factory=dict, description="node and zone labels place the pod for P/D links"
    )
    role: BackendRole = BackendRole.BOTH
    bootstrap_port: Annotated[int, Field(gt=0, lt=65536)] | None = Field(
        default=None, description="a prefill pod's bootstrap server; default pd.bootstrap_port"
    )
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="request headers the router adds to everything it sends this backend; "
        "clients cannot send these names. For engines behind one shared endpoint that "
        "picks the engine by a header, e.g. Dynamo's frontend in --router-mode direct "
        "(x-worker-instance-id: <instance id>)",
    )

    @field_validator("headers")
    @classmethod
    def _wire_safe(cls, headers: dict[str, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in headers.items():
            if not _TOKEN.fullmatch(name):
                raise ValueError(f"not a header field name: {name!r}")
            if any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name} has a line break or NUL in its value")
            if name.lower() in RESERVED_BACKEND_HEADERS:
                raise ValueError(f"header {name} is the router's to set")
            out[name.lower()] = value.strip()
        return out


# RFC 9110 5.6.2 token
_TOKEN: Final = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
# set by the router or the connection; a backend's own headers may not replace them
RESERVED_BACKEND_HEADERS: Final = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "x-request-id"}
)


class KubernetesDiscoverySpec(_Strict):
    """Backends are the Ready pods matching ``selector`` in ``namespace``."""

    namespace: str
    selector: str = Field(description="label selector, e.g. kvplane.io/pool=llama,kvplane.io/role")
    http_port: Annotated[int, Field(gt=0, lt=65536)] = 8000
    kv_events_port: Annotated[int, Field(gt=0, lt=65536)] | None = 5557
    replay_port: Annotated[int, Field(gt=0, lt=65536)] | None = 5558
    topic: str = ""
    watch_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=300.0,
        description="the pod watch reconnects at least this often, from its last "
        "resourceVersion (no re-list), so credentials are re-checked regularly",
    )


class TierCost(_Strict):
    bandwidth_gbps: Annotated[float, Field(gt=0)] = Field(description="GB/s into HBM")
    latency_ms: Annotated[float, Field(ge=0)] = 0.0


def _default_tiers() -> dict[Tier, TierCost]:
    """Every tier below HBM at its default cost (``router/tiers.py``)."""
    return {
        t.tier: TierCost(bandwidth_gbps=t.bandwidth_gbps, latency_ms=t.latency_ms)
        for t in TIERS[1:]
    }


class UnreportedTierSpec(_Strict):
    """A tier below HBM that the engines fill without publishing KV events for it."""

    tier: Tier = Field(description="the tier (not hbm)")
    blocks: Annotated[int, Field(gt=0)] = Field(
        description="its capacity per pod, in blocks of model.block_size"
    )

    @field_validator("tier")
    @classmethod
    def _below_hbm(cls, tier: Tier) -> Tier:
        if tier is Tier.HBM:
            raise ValueError("the unreported tier must be below hbm")
        return tier


class CostParams(_Strict):
    prefill_tokens_per_s: Annotated[float, Field(gt=0)] = 30000.0
    prefill_attention_ms_per_mpair: Annotated[float, Field(ge=0)] = Field(
        default=1.09,
        description="prefill attention on top of the linear rate: ms per million "
        "(new token x context token) pairs; n new tokens after c cached ones cost "
        "n x (c + n/2) pairs, so a long prompt's prefill grows faster than its length. "
        "The default is Llama-3.1-8B on an H100 (the default rate's model): "
        "(1000 / rate) x 2 x layers x hidden / parameters; 0 keeps prefill linear",
    )
    decode_step_ms: Annotated[float, Field(ge=0)] = 6.0
    running_step_ms_per_request: Annotated[float, Field(ge=0)] = 0.05
    kv_pressure_threshold: Annotated[float, Field(ge=0, le=1)] = 0.9
    kv_pressure_penalty_ms: Annotated[float, Field(ge=0)] = 200.0
    kv_overflow_penalty_ms: Annotated[float, Field(ge=0)] = Field(
        default=2000.0,
        description="a prompt whose new tokens do not fit in the KV its pod has free "
        "(capacity from vllm:cache_config_info or sglang:max_total_num_tokens, less the "
        "usage and the prefill the router has pending there) waits for running requests "
        "to finish: vLLM preempts the newest request, usually that prompt, until blocks "
        "free up. The penalty stands for that wait",
    )
    tiers: dict[Tier, TierCost] = Field(default_factory=_default_tiers)
    recompute_weight: Annotated[float, Field(ge=1)] = Field(
        default=6.0,
        description="ranking weight of recompute against waiting: every token a pod "
        "recomputes also delays the requests queued behind it, so under load a pod that "
        "holds the prefix is worth a longer queue than one predicted TTFT shows "
        "(docs/router.md: how 6 was chosen)",
    )
    balance_band: Annotated[float, Field(ge=0)] = Field(
        default=0.05,
        description="pods ranked within this fraction of the best score count as equally "
        "good; among them the one sent the least prefill work lately wins, so new prefixes "
        "land where little work has gone and long-run load stays even while queues are "
        "momentarily equal",
    )
    tail_guard: Annotated[float, Field(ge=1)] | None = Field(
        default=None,
        description="off by default. When set, recompute_weight may trade a request's own "
        "TTFT for reuse only so far: while some pod has no prefill queued, a pod "
        "predicted slower than tail_guard x that pod's TTFT (and by more than "
        "tail_guard_slack_ms) is not chosen for what it holds. Helps where a tier below "
        "HBM holds the working set; with HBM alone the prefill it adds evicts more than "
        "it saves (docs/router.md: the tail guard)",
    )
    tail_guard_slack_ms: Annotated[float, Field(ge=0)] = 2000.0
    queue_progress: bool = Field(
        default=False,
        description="off by default. When set, the queue term takes off the time a pod "
        "has been on its oldest pending prefill (at most that prefill's work): a pod half "
        "through a long prompt is predicted to wait half of it. Closer to the waits the "
        "engines show, but recompute_weight was chosen against the undrained queue, and "
        "with it saturated fleets queue more behind prefix holders (docs/router.md: the "
        "queue term)",
    )
    pending_evicts_cached: bool = Field(
        default=True,
        description="a pod's HBM prefix of the prompt counts only as far as the room its "
        "pending prefill leaves: what the router has sent there and not yet seen start "
        "takes free blocks first, and the engine reuses free blocks, cached ones "
        "included, least recently used first, a request's last blocks before its first; "
        "what it takes of the prefix is recomputed or loaded from a slower tier "
        "(docs/router.md: KV room)",
    )
    new_prefix_share: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.25,
        description="a prompt no pod holds this share of is a new prefix: it goes to the "
        "pod sent the least prefill work lately among those predicted within this share "
        "of the fastest TTFT, so a short common head (a system prompt) does not pull every "
        "new conversation onto the pod that holds it (0: off; docs/router.md)",
    )
    shared_head_share: Annotated[float, Field(ge=0, lt=1)] = Field(
        default=0.5,
        description="a prompt whose cached part ends where other prompts went on "
        "differently (a shared head: a system prompt, not its own conversation) is a new "
        "prefix while no pod holds this share of it: its own part, as long as the head "
        "or longer, is what its follow-ups will reuse (0: off; docs/router.md)",
    )
    load_cap: Annotated[float, Field(ge=1)] = Field(
        default=2.0,
        description="a pod with more than load_cap x the mean in-flight requests (+ slack) is "
        "skipped, so a universally shared prefix cannot herd all traffic onto one pod",
    )
    load_cap_slack: Annotated[int, Field(ge=0)] = 4
    tentative_ttl_s: Annotated[float, Field(gt=0)] = 10.0
    sticky_tokens: Annotated[int, Field(gt=0)] = Field(
        default=2048, description="sticky hashing anchors on the key of this many leading tokens"
    )
    adapter_load_ms: Annotated[float, Field(ge=0)] = Field(
        default=25.0,
        description="a LoRA request on a pod where its adapter has no request running: "
        "loading the adapter's weights into a free slot first (from the engine's CPU cache "
        "of adapters, --max-cpu-loras, or from disk)",
    )
    adapter_slot_wait_ms: Annotated[float, Field(ge=0)] = Field(
        default=500.0,
        description="added when every one of the pod's --max-loras slots is taken by other "
        "adapters' running or waiting requests: the request waits for one of them to drain",
    )


class PDConnector(StrEnum):
    """The engines' P/D handoff protocol (see kvplane.router.pd.protocols)."""

    NIXL = "nixl"  # vLLM NixlConnector: prefill leg, then decode with its kv_transfer_params
    MOONCAKE = "mooncake"  # vLLM MooncakeConnector: concurrent legs matched by transfer_id
    SGLANG = "sglang"  # SGLang: bootstrap_host/port/room in the body sent to both


class LinkClass(StrEnum):
    """Where a prefill pod sits relative to a decode pod."""

    SAME_NODE = "same_node"
    SAME_ZONE = "same_zone"
    CROSS_ZONE = "cross_zone"


class LinkCost(_Strict):
    bandwidth_gbps: Annotated[float, Field(gt=0)] = Field(description="GB/s prefill -> decode")
    latency_ms: Annotated[float, Field(ge=0)] = 0.0


def _default_links() -> dict[LinkClass, LinkCost]:
    return {
        LinkClass.SAME_NODE: LinkCost(bandwidth_gbps=100.0, latency_ms=0.05),
        LinkClass.SAME_ZONE: LinkCost(bandwidth_gbps=40.0, latency_ms=0.2),
        LinkClass.CROSS_ZONE: LinkCost(bandwidth_gbps=5.0, latency_ms=2.0),
    }


class PDSpec(_Strict):
    """Prefill/decode disaggregation: backends with role ``prefill`` form the prefill
    pool, ``decode`` (and ``both``) the decode pool."""

    connector: PDConnector = PDConnector.NIXL
    bootstrap_port: Annotated[int, Field(gt=0, lt=65536)] = Field(
        default=8998, description="prefill pods' bootstrap server (mooncake, sglang)"
    )
    links: dict[LinkClass, LinkCost] = Field(default_factory=_default_links)
    aggregate_max_uncached_tokens: Annotated[int, Field(ge=0)] = Field(
        default=512,
        description="a decode pod may prefill a request itself when it lacks at most this "
        "many of its tokens (short prompts, prompts mostly resident there); 0 = never",
    )
    interference_weight: Annotated[float, Field(ge=0)] = Field(
        default=1.0,
        description="prefilling on a decode pod stalls its running requests by what does "
        "not fit in the compute their memory-bound decode step leaves idle: max(0, recompute "
        "ms - idle ms) x running requests x this weight is added to that option",
    )
    exposure_weight: Annotated[float, Field(ge=0)] = Field(
        default=0.0,
        description="decode choice: the stall a request can expect from prefills routed to "
        "its decode pod while it decodes (the pod's share of recent prefill x the fleet's "
        "requests in flight x mean prompt tokens, at the prefill rate) x this weight; "
        "with both pods it keeps decodes away from the pods that prefill; 0 = off",
    )
    decode_running_ms: Annotated[float, Field(ge=0)] = Field(
        default=1.0, description="decode choice: penalty per running request"
    )
    decode_context_ms_per_ktok: Annotated[float, Field(ge=0)] = Field(
        default=0.5,
        description="decode choice: penalty per thousand prompt tokens in flight on the pod "
        "(router-tracked, so fresh between scrapes): a decode step reads every running "
        "request's KV, so long contexts slow a pod more than many short ones",
    )
    balance_decides_handoff: bool = Field(
        default=False,
        description="balance counts in the choice between the best pair and the best decode "
        "pod prefilling alone; false: only in ranking pairs among pairs and lone pods among "
        "themselves (shared-prefix loads: no handoff of a cache hit for a less busy pod)",
    )
    decode_kv_weight_ms: Annotated[float, Field(ge=0)] = Field(
        default=20.0, description="decode choice: penalty x KV cache usage (0..1)"
    )
    prefill_serves_resident: bool = Field(
        default=True,
        description="NIXL (kv_both): an idle prefill pod may serve a request alone, as a "
        "decode pod does, when it holds most of the prompt and lacks at most "
        "aggregate_max_uncached_tokens; it never takes a handoff's decode leg",
    )
    prefill_pool_busy_max: Annotated[float, Field(ge=0, le=1)] = Field(
        default=0.25,
        description="prefill_serves_resident: only while at most this share of the prefill "
        "pods have prefill in flight (and never on one that has)",
    )
    max_prefill_attempts: Annotated[int, Field(ge=1)] = Field(
        default=2, description="prefill pods tried before prefilling on the decode pod"
    )
    prefill_timeout_s: Annotated[float, Field(gt=0)] = 120.0
    bootstrap_cache_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0, description="how long a Mooncake prefill pod's engine ids are reused"
    )


class SharedStoreSpec(_Strict):
    """A KV store every listed pod writes its remote tier to and loads from (Mooncake
    Store, an LMCache remote server, SGLang HiCache on Mooncake): a block one pod wrote
    there is resident for all of them, and outlives its writer."""

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]{0,62}$", description="the store's id")
    pods: list[str] | None = Field(
        default=None,
        description="backends that write to and read from it (their remote-tier KV "
        "events are the store's); absent: every pod of the pool",
    )
    link: TierCost = Field(
        default_factory=lambda: TierCost(bandwidth_gbps=25.0, latency_ms=1.0),
        description="loading from the store into a reader's HBM (the remote tier's cost "
        "for its readers)",
    )
    pod_links: dict[str, TierCost] = Field(
        default_factory=dict,
        description="readers whose path to the store differs from `link` (a pod on the "
        "store's node, or across a slower network), by backend name",
    )
    capacity_blocks: Annotated[int, Field(gt=0)] | None = Field(
        default=None,
        description="for a store that publishes no evictions: its size in blocks; the "
        "index then drops the least recently written blocks beyond it (each indexer "
        "models the blocks it wrote); absent: blocks leave with the store's events only",
    )


class PeerPullSpec(_Strict):
    """The engines can pull KV from each other (vLLM's NIXL connector, LMCache P2P,
    Mooncake's transfer engine): a prefix in another pod's HBM or DRAM is an option,
    over the link between the two pods (its class from their node and zone labels, as
    for P/D handoffs)."""

    link: LinkCost = Field(
        default_factory=lambda: LinkCost(bandwidth_gbps=40.0, latency_ms=0.2),
        description="pod to pod, into the puller's HBM: every pair whose link class is "
        "not in `links`",
    )
    links: dict[LinkClass, LinkCost] = Field(
        default_factory=dict,
        description="per link class of the pair (same_node, same_zone, cross_zone, from "
        "the pods' node and zone labels); a class left out uses `link`",
    )

    def link_for(self, cls: LinkClass) -> LinkCost:
        return self.links.get(cls, self.link)


class TracingConfig(_Strict):
    """OpenTelemetry traces of requests (router/tracing.py), exported over OTLP/HTTP."""

    endpoint: Annotated[str, Field(pattern=r"^https?://")] = Field(
        description="the collector's OTLP/HTTP base URL (spans go to <endpoint>/v1/traces)"
    )
    sampling_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    service_name: str = "kvplane-router"


class IndexSpec(_Strict):
    backend: str = Field(default="memory", pattern="^(memory|redis)$")
    url: str = Field(
        default="redis://127.0.0.1:6379/0",
        description="one Redis or any node of a Redis Cluster (asked of the server); "
        "rediss:// for TLS. The password comes from KVPLANE_INDEX_PASSWORD",
    )
    tls_ca_file: str | None = Field(
        default=None,
        description="CA bundle that a rediss:// index's certificate chains to "
        "(default: the system's)",
    )
    lookup_timeout_ms: Annotated[float, Field(gt=0)] = Field(
        default=50.0, description="a routing lookup slower than this routes without the index"
    )
    io_timeout_ms: Annotated[float, Field(gt=0)] = Field(
        default=5000.0,
        description="socket timeout of every Redis command: event writes are not on a "
        "request's path, and a write cut short costs the pod a resync",
    )


class MetricsAccess(StrEnum):
    """Who may read ``/metrics``."""

    OPEN = "open"  # anyone who reaches the port (kubelet probes, Prometheus)
    API_KEY = "api_key"  # any accepted API key (or an admin key)
    ADMIN = "admin"  # an admin key


class AuthSpec(_Strict):
    """Who may call the router, and what each caller is told (docs/security.md).

    A key source is a file (one key per line) or a directory (a mounted Kubernetes
    Secret: every file in it, one key per line); it is re-read when it changes."""

    api_keys: str | None = Field(
        default=None,
        description="accepted bearer tokens for the OpenAI routes; none: those routes are open",
    )
    admin_keys: str | None = Field(
        default=None,
        description="bearer tokens of admins: /kvplane/explain, /docs, /openapi.json and the "
        "residency headers; none: admin endpoints are off",
    )
    open_admin: bool = Field(
        default=False,
        description="every caller is an admin: a router on loopback for development and "
        "benchmarks only (explain and the headers reveal what other clients' prompts hold)",
    )
    metrics: MetricsAccess = MetricsAccess.OPEN
    route_headers: bool = Field(
        default=False,
        description="every response names its pod and reason (x-kvplane-pod, -reason, "
        "-attempts, -prompt-tokens); a cache_hit reason tells a caller that its prefix was "
        "resident, so only for tenants that may know that of each other",
    )
    forward_authorization: bool = Field(
        default=False, description="send the client's Authorization header on to the engines"
    )
    forward_cookie: bool = Field(
        default=False, description="send the client's Cookie header on to the engines"
    )
    reload_interval_s: Annotated[float, Field(gt=0)] = Field(
        default=2.0, description="how often the key sources are checked for changes"
    )


class ServerSpec(_Strict):
    """Bounds on what one client can hold of the router (router/serving.py)."""

    max_connections: Annotated[int, Field(ge=8)] = Field(
        default=4096,
        description="open client connections; at the cap a new one closes the longest idle "
        "connection (none: it is refused); lowered to half the file-descriptor limit",
    )
    header_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=10.0,
        description="a request head (line and headers) must arrive within this long of the "
        "connection opening or the previous response ending",
    )
    body_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=60.0, description="a request body must arrive within this long of its head"
    )
    keep_alive_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0, description="an idle keep-alive connection is closed after this long"
    )
    max_body_bytes: Annotated[int, Field(gt=0)] = Field(
        default=32 * 1024 * 1024, description="a longer request body is a 413"
    )
    max_headers: Annotated[int, Field(gt=0)] = Field(
        default=100, description="more request header fields are a 431"
    )
    max_header_bytes: Annotated[int, Field(ge=1024)] = Field(
        default=32 * 1024, description="a longer request head (line and headers) is a 431"
    )


class ResponsesSpec(_Strict):
    """Where ``previous_response_id`` goes: vLLM keeps a stored response in the process
    that made it, so the router remembers which pod answered each response id."""

    max_entries: Annotated[int, Field(ge=1)] = Field(
        default=100_000,
        description="response ids remembered (in memory: least recently used go first)",
    )
    ttl_s: Annotated[float, Field(gt=0)] = Field(
        default=3600.0, description="a response id is forgotten this long after its answer"
    )


class RouterConfig(_Strict):
    model: ModelSpec
    backends: list[Backend] = Field(default_factory=list)
    discovery: KubernetesDiscoverySpec | None = Field(
        default=None, description="discover backends in Kubernetes instead of `backends`"
    )
    policy: str = Field(
        default="cost",
        description="a routing policy by name (kvplane.router.policies): cost (kvplane's), "
        "or a baseline: round_robin, least_loaded, sticky, prefix_affinity",
    )
    policy_options: dict[str, Any] = Field(
        default_factory=dict, description="the policy's own settings (docs/router.md)"
    )
    cost: CostParams = Field(default_factory=CostParams)
    index: IndexSpec = Field(default_factory=IndexSpec)
    scrape_interval_s: Annotated[float, Field(gt=0)] = 1.0
    connect_timeout_s: Annotated[float, Field(gt=0)] = 2.0
    read_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=600.0,
        description="longest wait for a backend's response head (a non-streamed answer "
        "comes whole) or for any next piece of a body",
    )
    first_byte_timeout_s: Annotated[float, Field(gt=0)] = Field(
        default=30.0,
        description="a stream's first chunk must come within this plus 4x the pod's "
        "predicted TTFT, and a non-streamed request's engine must compute something "
        "(its token counters move) within as long, else the pod is stalled: it is "
        "demoted and the request retried",
    )
    demote_first_s: Annotated[float, Field(gt=0)] = Field(
        default=2.0,
        description="a pod that stalls, answers 5xx or drops requests other pods serve is "
        "out of rotation this long, doubling on each repeat up to demote_max_s",
    )
    demote_max_s: Annotated[float, Field(gt=0)] = 60.0
    max_attempts: Annotated[int, Field(ge=1)] = 3
    forward_tokens: TokenForwarding = Field(
        default=TokenForwarding.OFF,
        description="hand the backends the prompt's token ids so that they skip their own "
        "chat template and encode: off, or dynamo (nvext.token_data, for backends that are "
        "Dynamo frontends). On, a short new tail is encoded before the request goes, and a "
        "long prompt no pod holds still goes as text (docs/router.md)",
    )
    unreported_tier: UnreportedTierSpec | None = Field(
        default=None,
        description="an offload tier the engines publish no usable KV events for "
        "(Dynamo's mocker's host offload; LMCache's CPU tier, reported in chunks of its "
        "own size and, in-process, without removals): the index takes each pod to hold "
        "there its `blocks` most recently stored blocks, as a write-through tier does, "
        "once they leave HBM (docs/router.md). Leave it out where the engines report "
        "the tier",
    )
    pool: str = "default"
    pd: PDSpec | None = Field(
        default=None, description="prefill/decode disaggregation over backends' roles"
    )
    shared_stores: list[SharedStoreSpec] = Field(
        default_factory=list,
        description="pool-wide KV stores: their blocks count for every reader (docs/router.md)",
    )
    peer_pull: PeerPullSpec | None = Field(
        default=None, description="pods may pull a prefix from another pod's HBM or DRAM"
    )
    auth: AuthSpec = Field(default_factory=AuthSpec)
    server: ServerSpec = Field(default_factory=ServerSpec)
    tracing: TracingConfig | None = Field(default=None, description="off when absent")
    responses: ResponsesSpec = Field(default_factory=ResponsesSpec)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from kvplane.router.policies import registry  # the policies import this module

        return registry.check_policy(name)

    @model_validator(mode="after")
    def _policy_options(self) -> RouterConfig:
        from kvplane.router.policies import registry

        registry.check_options(self.policy, self.policy_options)
        return self

    @model_validator(mode="after")
    def _unique_backends(self) -> RouterConfig:
        names = [b.name for b in self.backends]
        if len(names) != len(set(names)):
            raise ValueError(f"backend names must be unique: {names}")
        targets = [(b.url.rstrip("/"), sorted(b.headers.items())) for b in self.backends]
        for i, t in enumerate(targets):
            if t in targets[:i]:
                raise ValueError(
                    f"backend {self.backends[i].name} is another backend again (same url, "
                    "same headers): engines sharing a url must differ by their headers"
                )
        if self.pd is None and any(b.role is BackendRole.PREFILL for b in self.backends):
            raise ValueError("backends with role 'prefill' need a 'pd' section")
        return self

    @model_validator(mode="after")
    def _unique_stores(self) -> RouterConfig:
        names = [s.name for s in self.shared_stores]
        if len(names) != len(set(names)):
            raise ValueError(f"shared store names must be unique: {names}")
        return self


def load_config(path: str | Path) -> RouterConfig:
    data: Any = yaml.safe_load(Path(path).read_text())
    return RouterConfig.model_validate(data)
