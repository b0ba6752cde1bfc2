"""KV cache tiers: the one table of them, fastest first.

Everything that knows tiers follows from ``TIERS``: their order (the cost model loads
a contiguous prefix through them in this order), the bit each has in the indexes'
per-block masks, the tier tables inside the Redis index's Lua scripts, the engines'
names for them (KV event ``medium``), the router's default transfer costs, and the
operator's ``KVCacheTier.spec.tier`` kinds. Adding a tier is a row here plus the
renderer of whatever backend serves it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Final


class Tier(StrEnum):
    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    REMOTE = "remote"


@dataclass(frozen=True, slots=True)
class TierInfo:
    tier: Tier
    media: tuple[str, ...]  # KV event ``medium`` values (vLLM, SGLang) that mean this tier
    bandwidth_gbps: float  # default transfer into HBM, GB/s (the router's cost.tiers)
    latency_ms: float


# vLLM: GPU / CPU / STORAGE (+ locality); SGLang: GPU / CPU_PINNED / DISK / EXTERNAL.
TIERS: Final[tuple[TierInfo, ...]] = (
    TierInfo(Tier.HBM, ("GPU",), bandwidth_gbps=0.0, latency_ms=0.0),  # resident: no transfer
    TierInfo(Tier.DRAM, ("CPU", "CPU_PINNED"), bandwidth_gbps=50.0, latency_ms=0.05),
    TierInfo(Tier.NVME, ("DISK", "STORAGE"), bandwidth_gbps=6.0, latency_ms=0.1),
    TierInfo(Tier.REMOTE, ("EXTERNAL",), bandwidth_gbps=25.0, latency_ms=1.0),
)
TIER_ORDER: Final[tuple[Tier, ...]] = tuple(t.tier for t in TIERS)
TIER_BIT: Final[dict[Tier, int]] = {tier: 1 << i for i, tier in enumerate(TIER_ORDER)}
_MEDIUM_TO_TIER: Final[dict[str, Tier]] = {m: t.tier for t in TIERS for m in t.media}


def tier_of_medium(medium: str | None, locality: str | None = None) -> Tier:
    """Map an event's ``medium`` (and vLLM's ``locality``) to a tier; None means GPU.
    vLLM's ``STORAGE`` with ``locality`` REMOTE is a remote store; an unknown medium is
    taken for the slowest tier (never credited as faster than it may be)."""
    if medium is None:
        return TIER_ORDER[0]
    upper = medium.upper()
    if upper == "STORAGE" and (locality or "").upper() == "REMOTE":
        return Tier.REMOTE
    return _MEDIUM_TO_TIER.get(upper, TIER_ORDER[-1])


def lua_tier_index() -> str:
    """``{hbm = 1, dram = 2, ...}``: tier name -> 1-based position, for Lua scripts."""
    return "{" + ", ".join(f"{t.value} = {i}" for i, t in enumerate(TIER_ORDER, 1)) + "}"


def lua_tier_names() -> str:
    """``{'hbm', 'dram', ...}``: the tiers in order, for Lua scripts."""
    return "{" + ", ".join(f"'{t.value}'" for t in TIER_ORDER) + "}"
