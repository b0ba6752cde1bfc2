"""SGLang engine command line and environment for one pod role.

Same contract with the router as vLLM: page size = block size, KV events on the
fixed ports with a per-pod topic, cached-token usage, metrics. P/D uses SGLang's
bootstrap protocol; KV tiers map onto HiCache (host pool, then one storage backend).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar, Final

from kvplane.operator.api import (
    Compression,
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
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    NVME_MOUNT,
    RenderError,
    TierPlan,
    mooncake_metadata_url,
    quantity_bytes,
    store_address,
)

from kvplane.types import Json

COMMAND: Final = ["python3", "-m", "sglang.launch_server"]


def transfer_backend(transfer: KVTransfer) -> str:
    if transfer.connector is Connector.NIXL:
        return "nixl"
    if transfer.connector is Connector.MOONCAKE:
        # mooncake_tcp = mooncake with MC_FORCE_TCP set by SGLang itself
        return "mooncake_tcp" if transfer.protocol == "tcp" else "mooncake"
    raise RenderError("SGLang P/D transfers with nixl or mooncake, not lmcache")


def hicache_args(plan: TierPlan, tensor_parallel_size: int) -> list[str]:
    """HiCache: the DRAM tier is the host pool, NVMe or remote the storage backend.

    ``--hicache-size`` is whole GB (1e9 bytes) per TP rank (each rank allocates its
    own host pool), so the per-pod capacity is divided by TP; capacity 0 keeps
    SGLang's default host/GPU ratio. HiCache has a single storage backend, so an
    NVMe and a remote tier cannot both be used.
    """
    if plan.dram is None and plan.nvme is None and plan.remote is None:
        return []
    for tier in (plan.dram, plan.nvme, plan.remote):
        if tier is not None and tier.eviction_policy is not Eviction.LRU:
            raise RenderError(
                f"SGLang HiCache cannot honour evictionPolicy {tier.eviction_policy.value} "
                f"on the {tier.tier.value} tier: use lru"
            )
        if tier is not None and tier.compression is not Compression.NONE:
            raise RenderError(
                f"SGLang HiCache cannot compress the {tier.tier.value} tier "
                f"({tier.compression.value}): use compression none"
            )
    if plan.dram is not None and plan.dram.backend is not TierBackend.NATIVE:
        raise RenderError("SGLang's host pool is HiCache's own: the dram tier's backend is native")
    args = ["--enable-hierarchical-cache"]
    if plan.dram is not None:
        per_rank = quantity_bytes(plan.dram.capacity_per_pod) // tensor_parallel_size
        if per_rank:
            size_gb = per_rank // 10**9
            if size_gb < 1:
                raise RenderError(
                    "SGLang sizes its host pool in whole GB per TP rank: the dram tier's "
                    f"capacityPerPod {plan.dram.capacity_per_pod} is below 1 GB per rank"
                )
            args += ["--hicache-size", str(size_gb)]
    if plan.nvme is not None and plan.remote is not None:
        raise RenderError("SGLang HiCache has one storage backend: use an nvme or a remote tier")
    if plan.nvme is not None:
        args += ["--hicache-storage-backend", "file"]  # directory set by env, see sglang_env
    if plan.remote is not None:
        remote = plan.remote
        if remote.backend is not TierBackend.MOONCAKE:
            raise RenderError(
                f"SGLang HiCache has no {remote.backend.value} storage backend; use mooncake"
            )
        address = store_address(remote)
        # SGLang's MooncakeStoreConfig.load_from_extra_config defaults local_hostname to
        # "localhost", which other pods cannot reach: advertise the pod IP (the kubelet
        # expands $(POD_IP) in container args), as the vLLM path does.
        extra = {
            "local_hostname": "$(POD_IP)",
            "master_server_address": address.hostport,
            "metadata_server": mooncake_metadata_url(address),
            "global_segment_size": quantity_bytes(remote.capacity_per_pod),
            "protocol": "tcp",
            "device_name": "",
        }
        args += [
            "--hicache-storage-backend",
            "mooncake",
            "--hicache-storage-backend-extra-config",
            compact_json(extra),
        ]
    return args


def sglang_args(e: EnginePod) -> list[str]:
    """Arguments after :data:`COMMAND`."""
    ipool, role, pool, transfer = e.ipool, e.role, e.pool, e.transfer
    check_parallelism(pool)
    model = ipool.model
    args = [
        "--model-path",
        model.source,
        "--served-model-name",
        model.served_name,
        "--revision",
        model.revision,
        "--tokenizer-path",
        model.tokenizer or model.source,
        "--tp-size",
        str(pool.tensor_parallel_size),
        "--page-size",
        str(ipool.engine.block_size),
        "--host",
        "0.0.0.0",  # SGLang binds 127.0.0.1 by default
        "--port",
        str(names.ENGINE_HTTP_PORT),
        "--enable-metrics",
        "--enable-cache-report",  # usage.prompt_tokens_details.cached_tokens
        "--kv-events-config",
        compact_json(kv_events_config(model.served_name)),
    ]
    if model.max_model_len is not None:
        args += ["--context-length", str(model.max_model_len)]
    if model.lora_adapters:
        args += ["--enable-lora", "--lora-paths"]
        args += [f"{a.name}={a.source}" for a in model.lora_adapters]
        if model.max_loras is not None:
            args += ["--max-loras-per-batch", str(model.max_loras)]
    if transfer is not None:
        args += [
            "--disaggregation-mode",
            role.value,
            "--disaggregation-transfer-backend",
            transfer_backend(transfer),
        ]
        if role is Role.PREFILL:
            args += ["--disaggregation-bootstrap-port", str(transfer.bootstrap_port)]
    args += hicache_args(e.plan, pool.tensor_parallel_size)
    return args + list(ipool.engine.extra_args) + list(pool.extra_args)


def sglang_env(e: EnginePod) -> list[Json]:
    """POD_NAME for the event topic, the file backend's directory, then the spec's env
    (the same on both sides of P/D)."""
    env = identity_env(e.ipool)
    if e.plan.nvme is not None:
        env.append({"name": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "value": NVME_MOUNT})
    return env + [dict(v) for v in e.ipool.engine.env]


class SglangAdapter:
    kind: ClassVar[Engine] = Engine.SGLANG
    command: ClassVar[list[str]] = COMMAND
    scale_metrics: ClassVar[Mapping[ScaleSignal, str]] = {
        ScaleSignal.KV_CACHE_PRESSURE: "sglang:token_usage",
        ScaleSignal.QUEUE_DEPTH: "sglang:num_queue_reqs",
    }

    def args(self, pod: EnginePod) -> list[str]:
        return sglang_args(pod)

    def env(self, pod: EnginePod) -> list[Json]:
        return sglang_env(pod)

    def transfer_ports(self, pod: EnginePod) -> list[tuple[str, int]]:
        t = pod.transfer
        # every SGLang P/D backend: the prefill server runs the bootstrap server
        if t is None or pod.role is not Role.PREFILL:
            return []
        return [(names.PORT_BOOTSTRAP, t.bootstrap_port)]

    def router_pd(self, transfer: KVTransfer) -> Json:
        return {"connector": "sglang", "bootstrap_port": transfer.bootstrap_port}

    def config_mounts(self, ipool_name: str, tiers: Sequence[KVCacheTierSpec]) -> list[ConfigMount]:
        return []
