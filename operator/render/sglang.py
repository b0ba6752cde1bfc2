"""SGLang engine command line and environment for one pod role.

Same contract with the router as vLLM: page size = block size, KV events on the
fixed ports with a per-pod topic, cached-token usage, metrics. P/D uses SGLang's
bootstrap protocol; KV tiers map onto HiCache (host pool, then one storage backend).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from kvplane.operator.api import (
    Connector,
    EnginePoolSpec,
    InferencePoolSpec,
    KVCacheTierSpec,
    KVTransfer,
    TierBackend,
)
from kvplane.operator.render import names
from kvplane.operator.render.names import Role
from kvplane.operator.render.tiers import (
    NVME_MOUNT,
    RenderError,
    TierPlan,
    mooncake_metadata_url,
    plan_tiers,
    quantity_bytes,
    store_address,
)
from kvplane.operator.render.vllm import (
    check_parallelism,
    compact_json,
    downward_env,
    effective_transfer,
    kv_events_config,
)

COMMAND: Final = ["python3", "-m", "sglang.launch_server"]

Json = dict[str, Any]


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
        extra = {
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


def sglang_args(
    ipool: InferencePoolSpec,
    role: Role,
    pool: EnginePoolSpec,
    tiers: Sequence[KVCacheTierSpec] = (),
    *,
    transfer: KVTransfer | None = None,
) -> list[str]:
    """Arguments after :data:`COMMAND`; ``transfer`` as for ``vllm_args``."""
    transfer = effective_transfer(role, transfer)
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
        compact_json(kv_events_config(model.served_name, vllm=False)),
    ]
    if model.max_model_len is not None:
        args += ["--context-length", str(model.max_model_len)]
    if transfer is not None:
        args += [
            "--disaggregation-mode",
            role.value,
            "--disaggregation-transfer-backend",
            transfer_backend(transfer),
        ]
        if role is Role.PREFILL:
            args += ["--disaggregation-bootstrap-port", str(transfer.bootstrap_port)]
    args += hicache_args(plan_tiers(tiers), pool.tensor_parallel_size)
    return args + list(ipool.engine.extra_args) + list(pool.extra_args)


def sglang_env(
    ipool: InferencePoolSpec,
    role: Role,
    pool: EnginePoolSpec,
    tiers: Sequence[KVCacheTierSpec] = (),
    *,
    transfer: KVTransfer | None = None,
) -> list[Json]:
    """POD_NAME for the event topic, the file backend's directory, then the spec's env."""
    del role, pool, transfer  # same env on both sides; kept for symmetry with vllm_env
    env = [
        *downward_env(),
        {"name": "PYTHONHASHSEED", "value": names.python_hash_seed(ipool.engine.hash_seed)},
    ]
    if plan_tiers(tiers).nvme is not None:
        env.append({"name": "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "value": NVME_MOUNT})
    return env + [dict(e) for e in ipool.engine.env]
