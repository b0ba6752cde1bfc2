"""vLLM engine command line and environment for one pod role.

The flags are what the router depends on: a fixed block size and a seeded,
cross-language prefix hash (so block hashes agree across pods), KV events on fixed
ports with a per-pod topic (so the indexer can attribute blocks), and cached-token
usage (so the router can measure its own predictions). KV connectors come from the
pool's P/D transfer and the InferencePool's KVCacheTiers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

from kvplane.operator.api import (
    Connector,
    Engine,
    Eviction,
    KVCacheTierSpec,
    KVTransfer,
    ScaleSignal,
    TierBackend,
)
from kvplane.operator.render import names
from kvplane.operator.render.engines.base import (
    ConfigMount,
    EnginePod,
    check_parallelism,
    compact_json,
    identity_env,
    kv_events_config,
)
from kvplane.operator.render.lmcache import LMCACHE_CONFIG_KEY, lmcache_config
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    GIB,
    LMCACHE_CONFIG_DIR,
    LMCACHE_CONFIG_FILE,
    RenderError,
    TierPlan,
    format_number,
    mooncake_metadata_url,
    plan_tiers,
    quantity_bytes,
    store_address,
)

from kvplane.types import Json

# Works in any vLLM image whatever its ENTRYPOINT. vLLM 0.32 marks the module
# deprecated in favour of `vllm serve`, which parses the same flags (make_arg_parser),
# so switching is this one line.
COMMAND: Final = ["python3", "-m", "vllm.entrypoints.openai.api_server"]


def _pd_connector(role: Role, transfer: KVTransfer) -> Json:
    if transfer.connector is Connector.NIXL:
        # NixlConnector takes its side per request from kv_transfer_params, not from
        # kv_role, and vLLM's NIXL docs and tests run both sides as kv_both. kv_both
        # also keeps the consumer-only scheduler safety on (deferred block frees, the
        # kv_fetch metrics) and lets either pod serve a plain request in full, e.g.
        # the decode leg when the prefill pod returned no kv_transfer_params.
        return {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    if transfer.connector is Connector.MOONCAKE:
        # MooncakeConnector asserts its side: the producer runs the bootstrap server.
        return {
            "kv_connector": "MooncakeConnector",
            "kv_role": "kv_producer" if role is Role.PREFILL else "kv_consumer",
            "kv_connector_extra_config": {"mooncake_protocol": transfer.protocol},
        }
    raise RenderError(
        "LMCache P/D (enable_pd) needs a proxy protocol the router does not speak; "
        "use the nixl or mooncake connector for kvTransfer"
    )


def _offloading_connector(tier: KVCacheTierSpec) -> Json:
    if tier.eviction_policy not in (Eviction.LRU, Eviction.ARC):  # CEL refuses it too
        raise RenderError(
            f"vLLM's CPU offload cannot honour evictionPolicy {tier.eviction_policy.value}: "
            "use lru or arc"
        )
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "cpu_bytes_to_use": quantity_bytes(tier.capacity_per_pod),
            "eviction_policy": tier.eviction_policy.value,
        },
    }


def lmcache_pod_overrides(plan: TierPlan) -> Json:
    """LMCache keys that differ per pod, passed as ``lmcache.<key>`` connector extras.

    LMCache ignores its ``LMCACHE_*`` env once a config file is set, and Mooncake
    Store needs this pod's address (``local_hostname``) in ``extra_config``; the
    connector's ``lmcache.*`` extras are the one per-pod override LMCache honours,
    and the kubelet expands ``$(POD_IP)`` in them.
    """
    remote = plan.remote
    if remote is None or remote.backend is not TierBackend.MOONCAKE:
        return {}
    address = store_address(remote)
    return {
        "lmcache.extra_config": {
            "local_hostname": "$(POD_IP)",
            "master_server_address": address.hostport,
            "metadata_server": mooncake_metadata_url(address),
            "global_segment_size": quantity_bytes(remote.capacity_per_pod),
            "local_buffer_size": 1 << 30,
            "protocol": "tcp",
            "device_name": "",
        }
    }


def _lmcache_connector(plan: TierPlan) -> Json:
    connector: Json = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    overrides = lmcache_pod_overrides(plan)
    if overrides:
        connector["kv_connector_extra_config"] = overrides
    return connector


def _native_flags_suffice(plan: TierPlan, transfer: KVTransfer | None) -> bool:
    """``--kv-offloading-size`` builds the OffloadingConnector itself, but it replaces
    any --kv-transfer-config connector (VllmConfig._post_init_kv_transfer_config) and
    has no eviction knob; otherwise the connector is spelled out."""
    dram = plan.native_dram
    return (
        dram is not None
        and transfer is None
        and not plan.uses_lmcache
        and dram.eviction_policy is Eviction.LRU
    )


def kv_transfer_config(e: EnginePod) -> Json | None:
    """The --kv-transfer-config, or None when the flags (or nothing) cover it.

    Several connectors go into a MultiConnector, P/D first: MultiConnector loads from
    the first child reporting a hit, and a decode pod's remote prefill must win over
    a partial local hit. The offload tiers follow, fastest first; all children save.
    """
    plan, transfer = e.plan, e.transfer
    children: list[Json] = []
    if transfer is not None:
        children.append(_pd_connector(e.role, transfer))
    dram = plan.native_dram
    if dram is not None and not _native_flags_suffice(plan, transfer):
        children.append(_offloading_connector(dram))
    if plan.uses_lmcache:
        children.append(_lmcache_connector(plan))
    if not children:
        return None
    if len(children) == 1:
        return children[0]
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": children},
    }


def vllm_args(e: EnginePod) -> list[str]:
    """Arguments after :data:`COMMAND`."""
    ipool, pool, transfer = e.ipool, e.pool, e.transfer
    model = ipool.model
    check_parallelism(pool)
    args = [
        "--model",
        model.source,
        "--served-model-name",
        model.served_name,
        "--revision",
        model.revision,
        "--tokenizer",
        model.tokenizer or model.source,
        "--tensor-parallel-size",
        str(pool.tensor_parallel_size),
        "--block-size",
        str(ipool.engine.block_size),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        names.HASH_ALGO,
        "--kv-events-config",
        compact_json({"enable_kv_cache_events": True, **kv_events_config(model.served_name)}),
        "--port",
        str(names.ENGINE_HTTP_PORT),
        "--enable-prompt-tokens-details",
    ]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if model.lora_adapters:
        args += ["--enable-lora", "--lora-modules"]
        args += [f"{a.name}={a.source}" for a in model.lora_adapters]
        if model.max_loras is not None:
            args += ["--max-loras", str(model.max_loras)]
    plan = e.plan
    dram = plan.native_dram
    if dram is not None and _native_flags_suffice(plan, transfer):
        size = quantity_bytes(dram.capacity_per_pod) / GIB  # total over TP ranks
        args += ["--kv-offloading-size", format_number(size), "--kv-offloading-backend", "native"]
    connector = kv_transfer_config(e)
    if connector is not None:
        args += ["--kv-transfer-config", compact_json(connector)]
    traces = ipool.tracing
    if traces is not None and traces.engines:
        # vLLM's OTLP/HTTP exporter takes the full URL (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
        # in vllm_env); it joins the router's trace by the traceparent header
        args += ["--otlp-traces-endpoint", traces.endpoint.rstrip("/") + "/v1/traces"]
    return args + list(ipool.engine.extra_args) + list(pool.extra_args)


def vllm_env(e: EnginePod) -> list[Json]:
    """Container env: identity for hashing, connector addresses, then the spec's own."""
    transfer, role = e.transfer, e.role
    env = identity_env(e.ipool)
    if transfer is not None and transfer.connector is Connector.NIXL:
        env += [
            {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
            {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(transfer.side_channel_port)},
        ]
    elif transfer is not None and transfer.connector is Connector.MOONCAKE:
        # the address the transfer engine advertises to its peer
        env.append({"name": "VLLM_HOST_IP", "value": "$(POD_IP)"})
        if role is Role.PREFILL:
            env.append(
                {"name": "VLLM_MOONCAKE_BOOTSTRAP_PORT", "value": str(transfer.bootstrap_port)}
            )
    if e.plan.uses_lmcache:
        env.append({"name": "LMCACHE_CONFIG_FILE", "value": LMCACHE_CONFIG_FILE})
    if e.ipool.tracing is not None and e.ipool.tracing.engines:
        env += [
            {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"},
            {"name": "OTEL_SERVICE_NAME", "value": f"vllm-{e.role.value}"},
        ]
    return env + [dict(v) for v in e.ipool.engine.env]


class VllmAdapter:
    kind: ClassVar[Engine] = Engine.VLLM
    command: ClassVar[list[str]] = COMMAND
    scale_metrics: ClassVar[Mapping[ScaleSignal, str]] = {
        ScaleSignal.KV_CACHE_PRESSURE: "vllm:kv_cache_usage_perc",
        ScaleSignal.QUEUE_DEPTH: "vllm:num_requests_waiting",
    }

    def args(self, pod: EnginePod) -> list[str]:
        return vllm_args(pod)

    def env(self, pod: EnginePod) -> list[Json]:
        return vllm_env(pod)

    def transfer_ports(self, pod: EnginePod) -> list[tuple[str, int]]:
        t = pod.transfer
        if t is None:
            return []
        if t.connector is Connector.NIXL:  # every NIXL pod serves the side channel
            return [(names.PORT_NIXL, t.side_channel_port)]
        # Mooncake: the producer runs the bootstrap server
        return [(names.PORT_BOOTSTRAP, t.bootstrap_port)] if pod.role is Role.PREFILL else []

    def router_pd(self, transfer: KVTransfer) -> Json:
        if transfer.connector is Connector.MOONCAKE:
            return {"connector": "mooncake", "bootstrap_port": transfer.bootstrap_port}
        # the NIXL side channel travels inside the prefill pod's answer: no port
        return {"connector": "nixl"}

    def config_mounts(self, ipool_name: str, tiers: Sequence[KVCacheTierSpec]) -> list[ConfigMount]:
        if not plan_tiers(tiers).uses_lmcache:
            return []
        return [
            ConfigMount(
                volume="lmcache-config",
                config_map=names.lmcache_config_name(ipool_name),
                mount_path=LMCACHE_CONFIG_DIR,
                key=LMCACHE_CONFIG_KEY,
                content=lmcache_config(tiers),
                component="lmcache",
            )
        ]
