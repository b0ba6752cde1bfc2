"""LMCache's configuration file for the pool's vLLM engines (LMCacheConnectorV1 reads it
from ``LMCACHE_CONFIG_FILE``): the settings every pod shares. Per-pod ones travel as the
connector's ``lmcache.*`` extras (``engines/vllm.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import yaml
from kvplane.operator.api import Compression, Eviction, KVCacheTierSpec, TierBackend
from kvplane.operator.render.tiers import (
    NVME_MOUNT,
    RenderError,
    TierPlan,
    gib,
    plan_tiers,
    quantity_bytes,
    store_address,
)

from kvplane.types import Json

LMCACHE_CONFIG_KEY: Final = "lmcache.yaml"

_SERDE: Final = {
    Compression.NONE: "naive",
    Compression.CACHEGEN: "cachegen",
    Compression.KIVI: "kivi",
}


def _remote_url(tier: KVCacheTierSpec) -> str:
    """LMCache's ``remote_url`` scheme for each remote backend."""
    if tier.backend is TierBackend.S3:
        assert tier.url is not None  # CEL: remote tiers have a url
        return tier.url
    if tier.backend is TierBackend.REDIS and tier.url and tier.url.startswith("rediss://"):
        return tier.url
    scheme = {
        TierBackend.MOONCAKE: "mooncakestore",
        TierBackend.REDIS: "redis",
        TierBackend.LMCACHE_SERVER: "lm",
    }.get(tier.backend)
    if scheme is None:
        raise RenderError(f"LMCache has no remote backend {tier.backend.value}")
    suffix = "/" if tier.backend is TierBackend.MOONCAKE else ""
    return f"{scheme}://{store_address(tier).hostport}{suffix}"


def lmcache_config_dict(plan: TierPlan) -> Json:
    """LMCache settings shared by every pod of the pool (per-pod ones: vllm.py)."""
    lm_tiers = plan.lmcache_tiers
    if not lm_tiers:
        raise RenderError("no tier uses LMCache")
    chunks = {t.chunk_size for t in lm_tiers}
    if len(chunks) != 1:
        raise RenderError(f"LMCache tiers disagree on chunkSize: {sorted(chunks)}")
    config: Json = {"chunk_size": chunks.pop()}
    dram = plan.dram if plan.dram and plan.dram.backend is TierBackend.LMCACHE else None
    config["local_cpu"] = dram is not None
    if dram is not None:
        config["max_local_cpu_size"] = round(gib(dram.capacity_per_pod), 3)
    if plan.nvme is not None:
        nvme = plan.nvme
        size = nvme.capacity_per_pod
        if quantity_bytes(size) == 0 and nvme.volume is not None:
            size = nvme.volume.size
        config["local_disk"] = f"file://{NVME_MOUNT}/"
        config["max_local_disk_size"] = round(gib(size), 3)
    policies = {t.eviction_policy for t in lm_tiers if t.backend is TierBackend.LMCACHE}
    if len(policies) > 1:
        raise RenderError(
            "LMCache has one cache_policy for its local tiers: they disagree on "
            f"evictionPolicy ({', '.join(sorted(p.value for p in policies))})"
        )
    if policies == {Eviction.LFU}:
        # prefixes many requests reuse outlive one-off tails (LMCache's LFUCachePolicy)
        config["cache_policy"] = "LFU"
    if plan.remote is not None:
        config["remote_url"] = _remote_url(plan.remote)
        config["remote_serde"] = _SERDE[plan.remote.compression]
        if plan.remote.backend is TierBackend.S3:
            # LMCache's S3 connector asserts extra_config.s3_region (CEL: s3 has a region)
            config["extra_config"] = {"s3_region": plan.remote.region}
    # same chunk hashes on every pod, so a shared remote store deduplicates across them
    config["pre_caching_hash_algorithm"] = "sha256_cbor_64bit"
    # forward LMCache's stores into vLLM's KV event stream: the router indexes them
    config["enable_kv_events"] = True
    return config


def lmcache_config(tiers: Sequence[KVCacheTierSpec]) -> str:
    """The YAML file at LMCACHE_CONFIG_FILE (sorted keys: stable ConfigMap content)."""
    return yaml.safe_dump(lmcache_config_dict(plan_tiers(tiers)), sort_keys=True)
