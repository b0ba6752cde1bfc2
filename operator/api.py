"""The kvplane.io/v1alpha1 custom resources, as typed models.

These models are the single source of truth: ``crdgen.py`` turns them into the
CRD manifests in ``crds/`` (a test fails when those are stale), and the operator
parses every object it reconciles with them. Cross-field rules live here as CEL
(``x-kubernetes-validations``) so the API server rejects bad objects before the
operator ever sees them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from kvplane.router.config import CostParams
from kvplane.router.policies import policy_names
from kvplane.router.policies.registry import check_options, check_policy
from kvplane.router.tiers import Tier
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict, JsonValue

from kvplane.sim.profiles import PROFILES

GROUP = "kvplane.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"

QUANTITY = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def cel(rule: str, message: str) -> JsonDict:
    return {"rule": rule, "message": message}


def validated(*rules: JsonDict) -> ConfigDict:
    """Model config carrying CEL rules (``x-kubernetes-validations``) for the schema."""
    listed: list[JsonValue] = list(rules)
    return ConfigDict(json_schema_extra={"x-kubernetes-validations": listed})


class Model(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


FreeForm = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}),
]


class LocalObjectRef(Model):
    name: Annotated[str, Field(min_length=1, max_length=253)]


class SecretKeyRef(Model):
    name: Annotated[str, Field(min_length=1, max_length=253)]
    key: Annotated[str, Field(min_length=1)]


# --- InferencePool ---------------------------------------------------------------


class Engine(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


class ModelShape(Model):
    """Enough of the model's config to size its KV cache per token."""

    layers: Annotated[int, Field(ge=1, le=1024)]
    kv_heads: Annotated[int, Field(ge=1, le=1024)]
    head_dim: Annotated[int, Field(ge=1, le=4096)]
    dtype_bytes: Annotated[int, Field(ge=1, le=8)] = 2

    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


LORA_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$"  # no '=', ',' or quotes: flags, labels


class LoraAdapter(Model):
    """A LoRA adapter the engines load at start (vLLM ``--lora-modules name=path``,
    SGLang ``--lora-paths name=path``); requests name it as their ``model``."""

    name: Annotated[
        str,
        Field(
            max_length=128,
            pattern=LORA_NAME,
            description="the `model` clients send for this adapter",
        ),
    ]
    source: Annotated[
        str,
        Field(
            min_length=1,
            max_length=1024,
            pattern=r"^[^\s,]+$",
            description="the adapter's weights: a path in the image/volume, or a hub id",
        ),
    ]


class ModelIdentity(Model):
    model_config = validated(
        cel(
            "has(self.shape) != has(self.kvBytesPerToken)",
            "set exactly one of shape and kvBytesPerToken",
        ),
        cel(
            "!has(self.loraAdapters) || !self.loraAdapters.exists(a, a.name == self.servedName)",
            "an adapter's name differs from servedName",
        ),
        cel(
            "!has(self.maxLoras) || (has(self.loraAdapters) && size(self.loraAdapters) > 0)",
            "maxLoras needs loraAdapters",
        ),
    )

    served_name: Annotated[str, Field(min_length=1, description="the `model` clients send")]
    source: Annotated[
        str, Field(min_length=1, description="weights: a hub id, or a path in the image/volume")
    ]
    revision: str = "main"
    tokenizer: str | None = Field(default=None, description="defaults to source")
    shape: ModelShape | None = None
    kv_bytes_per_token: Annotated[int, Field(ge=1)] | None = None
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    lora_adapters: Annotated[
        list[LoraAdapter],
        Field(  # names unique: the API server checks a map-type list's keys
            max_length=64,
            json_schema_extra={
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["name"],
            },
        ),
    ] = Field(
        default_factory=list,
        description="LoRA adapters served on the same pods; a request names one as its model",
    )
    max_loras: Annotated[int, Field(ge=1, le=64)] | None = Field(
        default=None,
        description="adapters in one batch (vLLM --max-loras, SGLang --max-loras-per-batch); "
        "default the engine's",
    )

    @model_validator(mode="after")
    def _unique_adapters(self) -> ModelIdentity:
        names = [a.name for a in self.lora_adapters]
        if len(set(names)) != len(names) or self.served_name in names:
            raise ValueError("adapter names are unique and differ from servedName")
        if self.max_loras is not None and not names:
            raise ValueError("maxLoras needs loraAdapters")
        return self

    def kv_bytes(self) -> int:
        if self.kv_bytes_per_token is not None:
            return self.kv_bytes_per_token
        assert self.shape is not None
        return self.shape.kv_bytes_per_token()


class EngineSpec(Model):
    kind: Engine = Engine.VLLM
    image: Annotated[str, Field(min_length=1)] = "vllm/vllm-openai:v0.33.0"
    block_size: Annotated[int, Field(ge=1, le=1024)] = 16
    hash_seed: str = Field(
        default="kvplane",
        description="PYTHONHASHSEED on every engine: identical block hashes across pods",
    )
    extra_args: list[str] = Field(default_factory=list)
    env: list[FreeForm] = Field(default_factory=list, description="extra container env vars")


class ServiceType(StrEnum):
    CLUSTER_IP = "ClusterIP"
    NODE_PORT = "NodePort"
    LOAD_BALANCER = "LoadBalancer"


def _router_default(name: str) -> Any:
    """A cost parameter's default as the router defines it (one place for every default)."""
    return CostParams.model_fields[name].default


class RouterCost(Model):
    prefill_tokens_per_s: Annotated[float, Field(gt=0)] = _router_default("prefill_tokens_per_s")
    running_step_ms_per_request: Annotated[float, Field(ge=0)] = _router_default(
        "running_step_ms_per_request"
    )
    prefill_attention_ms_per_mpair: Annotated[float, Field(ge=0)] = Field(
        default=_router_default("prefill_attention_ms_per_mpair"),
        description="prefill attention, ms per million (new x context) token pairs: "
        "(1000 / prefillTokensPerS) x 2 x layers x hidden / parameters for the model",
    )
    tail_guard: Annotated[float, Field(ge=1)] | None = Field(
        default=None,
        description="bound on what reuse may cost a request's own TTFT while a pod is "
        "idle (off when unset; 2 suits pools with a DRAM tier, docs/router.md)",
    )
    load_cap: Annotated[float, Field(ge=1)] = _router_default("load_cap")
    tentative_ttl_s: Annotated[float, Field(gt=0)] = _router_default("tentative_ttl_s")


class RouterSpec(Model):
    replicas: Annotated[int, Field(ge=0, le=100)] = 2
    image: str | None = Field(default=None, description="defaults to the operator's image")
    policy: str = Field(
        default="cost",
        description="routing policy: cost (kvplane's), or a baseline",
        json_schema_extra={"enum": list(policy_names())},
    )
    policy_options: FreeForm = Field(
        default_factory=dict, description="the policy's own settings (docs/router.md)"
    )
    cost: RouterCost = Field(default_factory=RouterCost)
    service_type: ServiceType = ServiceType.CLUSTER_IP
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    api_keys_secret_ref: LocalObjectRef | None = Field(
        default=None, description="Secret whose values are accepted bearer tokens"
    )

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        return check_policy(name)

    @model_validator(mode="after")
    def _policy_options(self) -> RouterSpec:
        check_options(self.policy, self.policy_options)
        return self


class ManagedRedis(Model):
    image: str = "redis:7.4-alpine"
    memory: Annotated[str, Field(pattern=QUANTITY)] = "1Gi"


class ExternalRedis(Model):
    url: Annotated[str, Field(pattern=r"^rediss?://")]
    password_secret_ref: SecretKeyRef | None = None


class IndexSpec(Model):
    model_config = validated(
        cel(
            "!(has(self.managed) && has(self.external))",
            "managed and external exclude each other",
        )
    )

    managed: ManagedRedis | None = Field(
        default=None, description="a Redis the operator runs (the default)"
    )
    external: ExternalRedis | None = None


class NetworkPolicySpec(Model):
    enabled: bool = Field(
        default=True,
        description="NetworkPolicies: only the router and indexer reach the engines' KV "
        "event and replay ports, only the router their HTTP port, only they the Redis",
    )
    metrics_from: list[FreeForm] = Field(
        default_factory=list,
        description="NetworkPolicy peers (e.g. Prometheus) that may also reach the engines' "
        "HTTP port, which serves /metrics",
    )


class PoolRefs(Model):
    prefill: LocalObjectRef | None = None
    decode: list[LocalObjectRef] = Field(default_factory=list)


class FailureMode(StrEnum):
    """What a gateway does when the endpoint picker does not answer (GIE's names)."""

    FAIL_OPEN = "FailOpen"
    FAIL_CLOSE = "FailClose"


class GatewaySpec(Model):
    """Serve the pool through the Gateway API Inference Extension: a GIE
    ``InferencePool`` (inference.networking.k8s.io/v1) selecting the engine pods, with
    kvplane's endpoint picker (``kvplane epp``) as its ``endpointPickerRef``."""

    failure_mode: FailureMode = Field(
        default=FailureMode.FAIL_CLOSE,
        description="FailOpen: the gateway routes by its own policy while the picker is down",
    )
    replicas: Annotated[int, Field(ge=1, le=100)] = 1
    port: Annotated[int, Field(ge=1, le=65535)] = Field(
        default=9002, description="the picker's gRPC port (GIE's default)"
    )


class ServiceLevel(Model):
    """The pool's latency targets: the predictedTTFT autoscaling signal and the P:D
    planner aim at them."""

    ttft_ms: Annotated[float, Field(gt=0, description="time to first token, p90")]
    itl_ms: Annotated[float, Field(gt=0)] | None = Field(
        default=None, description="inter-token latency, p99"
    )


class PlannerMode(StrEnum):
    RECOMMEND = "recommend"  # publish the plan in status and as a metric
    APPLY = "apply"  # and size the prefill and decode Deployments by it


class PlannerSpec(Model):
    """The P:D planner (docs/deploy.md, Operations): from the router's observed workload,
    the prefill and decode replicas that meet ``slo``, found in the P/D simulation."""

    model_config = validated(
        cel("self.maxReplicas >= self.minReplicas", "maxReplicas must be >= minReplicas")
    )

    mode: PlannerMode = PlannerMode.RECOMMEND
    interval_seconds: Annotated[int, Field(ge=10, le=86400)] = 120
    min_replicas: Annotated[int, Field(ge=2, le=1000)] = 2
    max_replicas: Annotated[int, Field(ge=2, le=1000)] = 16
    profile: str = Field(
        default="h100-llama-3.1-8b",
        description="the simulator's engine profile the plan is made with (kvplane sim)",
        json_schema_extra={"enum": list[JsonValue](sorted(PROFILES))},
    )
    gpus_per_node: Annotated[int, Field(ge=0, le=64)] = 8


class TracingSpec(Model):
    """OpenTelemetry traces: the router's spans per request, exported over OTLP, and the
    engines' own (vLLM ``--otlp-traces-endpoint``), joined by W3C trace context."""

    endpoint: Annotated[
        str, Field(pattern=r"^https?://", description="OTLP/HTTP collector, e.g. http://otel:4318")
    ]
    sampling_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0
    engines: bool = Field(default=True, description="the engines export their spans too")


class InferencePoolSpec(Model):
    """One served model: engine, model identity, router and residency index."""

    model_config = validated(cel("!has(self.planner) || has(self.slo)", "the planner needs slo"))

    model: ModelIdentity
    engine: EngineSpec = Field(default_factory=EngineSpec)
    pools: PoolRefs | None = Field(
        default=None,
        description="optional: pools also point here with poolRef; both must agree",
    )
    kv_cache_tiers: list[LocalObjectRef] = Field(default_factory=list)
    router: RouterSpec = Field(default_factory=RouterSpec)
    index: IndexSpec = Field(default_factory=IndexSpec)
    gateway: GatewaySpec | None = Field(
        default=None,
        description="also render a GIE InferencePool whose endpoint picker is kvplane's",
    )
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    slo: ServiceLevel | None = None
    planner: PlannerSpec | None = Field(default=None, description="needs slo")
    tracing: TracingSpec | None = None


class Condition(Model):
    type: str
    status: str = Field(json_schema_extra={"enum": ["True", "False", "Unknown"]})
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None
    observed_generation: int | None = None


class PoolStatusEntry(Model):
    name: str
    role: str
    replicas: int = 0
    ready_replicas: int = 0


class PlanStatus(Model):
    """The P:D planner's last recommendation."""

    prefill_replicas: int
    decode_replicas: int
    meets_targets: bool
    predicted_ttft_p90_ms: float | None = None
    predicted_itl_p99_ms: float | None = None
    observed: str = Field(default="", description="the workload it was planned for")
    applied: bool = False
    planned_at: str | None = None


class InferencePoolStatus(Model):
    observed_generation: int | None = None
    generation_tag: str | None = None
    router_endpoint: str | None = None
    mode: str | None = Field(default=None, description="aggregated or disaggregated")
    pools: list[PoolStatusEntry] = Field(default_factory=list)
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanStatus | None = None


# --- PrefillPool / DecodePool ----------------------------------------------------


class ScaleSignal(StrEnum):
    KV_CACHE_PRESSURE = "kvCachePressure"
    QUEUE_DEPTH = "queueDepth"
    PREDICTED_TTFT = "predictedTTFT"  # the router's predicted TTFT p90 against the pool's SLO


class Autoscaling(Model):
    model_config = validated(
        cel("self.maxReplicas >= self.minReplicas", "maxReplicas must be >= minReplicas")
    )

    min_replicas: Annotated[int, Field(ge=0, le=1000)] = 1
    max_replicas: Annotated[int, Field(ge=1, le=1000)]
    signal: ScaleSignal = ScaleSignal.KV_CACHE_PRESSURE
    target: Annotated[float, Field(gt=0)] = Field(
        default=0.8,
        description="kv cache usage (0..1), waiting requests per replica, or (predictedTTFT) "
        "the router's predicted TTFT p90 in seconds; predictedTTFT defaults to the "
        "InferencePool's slo.ttftMs",
    )


class Connector(StrEnum):
    NIXL = "nixl"
    MOONCAKE = "mooncake"
    LMCACHE = "lmcache"


class KVTransfer(Model):
    connector: Connector = Connector.NIXL
    side_channel_port: Annotated[int, Field(ge=1, le=65535)] = 5600
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] = 8998
    protocol: str = Field(default="rdma", json_schema_extra={"enum": ["rdma", "tcp"]})


class EnginePoolSpec(Model):
    """Engine pods of one role (prefill or decode) for an InferencePool."""

    model_config = validated(
        cel(
            "!(has(self.replicas) && has(self.autoscaling))",
            "set replicas or autoscaling, not both",
        ),
        cel(
            "self.gpusPerReplica == self.tensorParallelSize",
            "gpusPerReplica must equal tensorParallelSize: one engine per pod (data-parallel "
            "ranks would publish KV events on ports that discovery does not follow)",
        ),
    )

    pool_ref: LocalObjectRef = Field(description="the InferencePool this pool serves")
    replicas: Annotated[int, Field(ge=0, le=1000)] | None = None
    autoscaling: Autoscaling | None = None
    gpus_per_replica: Annotated[int, Field(ge=1, le=64)] = 1
    tensor_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[FreeForm] = Field(default_factory=list)
    affinity: FreeForm | None = None
    topology_spread_constraints: list[FreeForm] = Field(default_factory=list)
    kv_transfer: KVTransfer | None = Field(
        default=None, description="P/D transfer; defaults to NIXL when both pools exist"
    )
    extra_args: list[str] = Field(default_factory=list)
    resources: FreeForm | None = Field(default=None, description="overrides; GPUs are added")

    def desired_replicas(self) -> int:
        if self.replicas is not None:
            return self.replicas
        return self.autoscaling.min_replicas if self.autoscaling else 1


class EnginePoolStatus(Model):
    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    generation_tag: str | None = None
    conditions: list[Condition] = Field(default_factory=list)


# --- KVCacheTier -----------------------------------------------------------------


TierKind = Tier  # the router's tier table (router/tiers.py) is the one list of tier kinds


class TierBackend(StrEnum):
    NATIVE = "native"  # vLLM's own GPU pool / OffloadingConnector, SGLang HiCache host pool
    LMCACHE = "lmcache"
    MOONCAKE = "mooncake"  # Mooncake Store
    LMCACHE_SERVER = "lmcacheServer"
    REDIS = "redis"
    S3 = "s3"


class Eviction(StrEnum):
    LRU = "lru"
    ARC = "arc"  # recency and frequency: vLLM's OffloadingConnector
    LFU = "lfu"  # frequency: LMCache's cache_policy for its local tiers


class Compression(StrEnum):
    NONE = "none"
    CACHEGEN = "cachegen"
    KIVI = "kivi"


class TierVolume(Model):
    storage_class_name: str | None = None
    host_path: str | None = None
    size: Annotated[str, Field(pattern=QUANTITY)] = "100Gi"


class KVCacheTierSpec(Model):
    """One KV cache tier: where blocks live, how fast they come back to HBM."""

    model_config = validated(
        cel(
            "self.tier != 'hbm' || self.backend == 'native'",
            "the hbm tier is the engine's own pool: backend must be native",
        ),
        cel(
            "self.tier != 'dram' || self.backend in ['native', 'lmcache']",
            "dram tiers use vLLM native CPU offload or LMCache",
        ),
        cel(
            "self.tier != 'nvme' || (self.backend == 'lmcache' && has(self.volume))",
            "nvme tiers use LMCache local disk and need a volume",
        ),
        cel(
            "self.tier != 'remote' || "
            "(self.backend in ['mooncake', 'lmcacheServer', 'redis', 's3'] && has(self.url))",
            "remote tiers use mooncake, lmcacheServer, redis or s3 and need a url",
        ),
        cel(
            "self.backend != 's3' || has(self.region)",
            "s3 tiers need a region (LMCache's S3 connector requires s3_region)",
        ),
        cel(
            "self.evictionPolicy == 'lru'"
            " || (self.evictionPolicy == 'arc' && self.tier == 'dram' && self.backend == 'native')"
            " || (self.evictionPolicy == 'lfu' && self.backend == 'lmcache')",
            "evictionPolicy arc is honoured only by vLLM's native CPU offload (dram, native) "
            "and lfu only by LMCache's local tiers (backend lmcache): the remote stores and "
            "the engines' own pools evict by their own policy",
        ),
        cel(
            "self.compression == 'none' || self.tier == 'remote'",
            "compression applies only to remote tiers (LMCache's remote_serde); "
            "dram, nvme and hbm tiers store blocks uncompressed",
        ),
    )

    tier: TierKind
    backend: TierBackend = TierBackend.NATIVE
    capacity_per_pod: Annotated[str, Field(pattern=QUANTITY)] = Field(
        default="0", description="bytes per engine pod (hbm: informational)"
    )
    bandwidth_gbps: Annotated[float, Field(gt=0)] = Field(description="GB/s into HBM")
    latency_ms: Annotated[float, Field(ge=0)] = 0.0
    chunk_size: Annotated[int, Field(ge=1, le=65536)] = 256
    compression: Compression = Compression.NONE
    eviction_policy: Eviction = Eviction.LRU
    volume: TierVolume | None = None
    url: str | None = Field(default=None, description="remote store address")
    region: str | None = Field(
        default=None, min_length=1, max_length=64, description="s3: the bucket's region"
    )
    credentials_secret_ref: LocalObjectRef | None = None
    master_image: str | None = Field(
        default=None,
        min_length=1,
        description="mooncake: image with mooncake_master for the managed master "
        "(default: the engine image for SGLang pools; required for vLLM pools)",
    )


class KVCacheTierStatus(Model):
    observed_generation: int | None = None
    ready: bool = Field(default=False, description="the tier is valid for every pool using it")
    endpoints: list[str] = Field(default_factory=list, description="a remote store's host:port")
    pools: list[str] = Field(default_factory=list, description="InferencePools that use it")
    conditions: list[Condition] = Field(default_factory=list)


# An InferencePool's name begins the names of its Services, which are DNS-1035 labels:
# a letter first, no dots (longer names are shortened with a hash, so any length works).
POOL_NAME_RULE: JsonDict = cel(
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
    "an InferencePool name must start with a letter and hold only lowercase letters, "
    "digits and '-': it begins the names of the pool's Services (DNS-1035 labels)",
)
