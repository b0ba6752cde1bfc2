"""KV cache tiers, ordered fastest first, and the engines' names for them."""

from enum import StrEnum


class Tier(StrEnum):
    HBM = "hbm"
    DRAM = "dram"
    NVME = "nvme"
    REMOTE = "remote"


TIER_ORDER: tuple[Tier, ...] = (Tier.HBM, Tier.DRAM, Tier.NVME, Tier.REMOTE)

# vLLM: GPU / CPU / STORAGE (+ locality); SGLang: GPU / CPU_PINNED / DISK / EXTERNAL.
_MEDIUM_TO_TIER: dict[str, Tier] = {
    "GPU": Tier.HBM,
    "CPU": Tier.DRAM,
    "CPU_PINNED": Tier.DRAM,
    "DISK": Tier.NVME,
    "STORAGE": Tier.NVME,
    "EXTERNAL": Tier.REMOTE,
}


def tier_of_medium(medium: str | None, locality: str | None = None) -> Tier:
    """Map an event's ``medium`` (and vLLM's ``locality``) to a tier; None means GPU."""
    if medium is None:
        return Tier.HBM
    upper = medium.upper()
    if upper == "STORAGE" and (locality or "").upper() == "REMOTE":
        return Tier.REMOTE
    return _MEDIUM_TO_TIER.get(upper, Tier.REMOTE)
