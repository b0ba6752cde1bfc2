"""KVCacheTier specs sorted into what each engine needs, plus quantity arithmetic.

Both engine renderers and the store renderers ask the same questions (is there a
DRAM tier, which backend holds the NVMe tier, where is the remote store), so the
answers are computed once here and cannot disagree.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Final
from urllib.parse import urlsplit

from kvplane.operator.api import KVCacheTierSpec, TierBackend, TierKind
from kvplane.operator.render import names

GIB: Final = 1 << 30

_SUFFIX: Final[dict[str, int]] = {
    "": 1,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 1 << 10,
    "Mi": 1 << 20,
    "Gi": 1 << 30,
    "Ti": 1 << 40,
    "Pi": 1 << 50,
}
_QUANTITY: Final = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|K|M|G|T|P)?$")

NVME_MOUNT: Final = "/kvcache/nvme"
LMCACHE_CONFIG_DIR: Final = "/etc/lmcache"
LMCACHE_CONFIG_FILE: Final = f"{LMCACHE_CONFIG_DIR}/lmcache.yaml"


class RenderError(ValueError):
    """A spec the CRD schema accepts but no engine can run; the message says why."""


def quantity_bytes(quantity: str) -> int:
    """Bytes in a Kubernetes quantity of the API's pattern (``100Gi``, ``1.5G``, ``0``)."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise RenderError(f"not a quantity: {quantity!r}")
    return int(Decimal(match.group(1)) * _SUFFIX[match.group(2) or ""])


def gib(quantity: str) -> float:
    return quantity_bytes(quantity) / GIB


def format_number(value: float) -> str:
    """``4`` rather than ``4.0``: flags and YAML stay readable and stable in goldens."""
    return str(int(value)) if float(value).is_integer() else repr(round(value, 6))


@dataclass(frozen=True)
class StoreAddress:
    """A remote store's host and port as the engines dial them."""

    host: str
    port: int

    @property
    def hostport(self) -> str:
        return f"{self.host}:{self.port}"


_DEFAULT_PORTS: Final[dict[TierBackend, int]] = {
    TierBackend.MOONCAKE: names.MOONCAKE_RPC_PORT,
    TierBackend.REDIS: names.REDIS_PORT,
    TierBackend.LMCACHE_SERVER: 65432,
}


def store_address(tier: KVCacheTierSpec) -> StoreAddress:
    """Host and port of a remote tier's ``url`` (``scheme://host:port``, or ``host:port``)."""
    if tier.url is None:
        raise RenderError(f"{tier.backend.value} tier needs a url")
    parts = urlsplit(tier.url if "//" in tier.url else f"//{tier.url}")
    if not parts.hostname:
        raise RenderError(f"no host in {tier.backend.value} tier url {tier.url!r}")
    port = parts.port or _DEFAULT_PORTS.get(tier.backend)
    if port is None:
        raise RenderError(f"no port in {tier.backend.value} tier url {tier.url!r}")
    return StoreAddress(parts.hostname, port)


def mooncake_metadata_url(address: StoreAddress) -> str:
    """The master's embedded HTTP metadata server (``-enable_http_metadata_server``)."""
    return f"http://{address.host}:{names.MOONCAKE_METADATA_PORT}/metadata"


def is_managed_mooncake(tier: KVCacheTierSpec, pool: str, namespace: str) -> bool:
    """The tier's url names the master this operator runs for ``pool``.

    The url stays the single source of truth: pointing it at ``<pool>-mooncake``
    asks for a managed master, any other host is an external one.
    """
    if tier.tier is not TierKind.REMOTE or tier.backend is not TierBackend.MOONCAKE:
        return False
    managed = names.mooncake_name(pool)
    fqdn = names.service_host(managed, namespace)
    return store_address(tier).host in (
        managed,
        f"{managed}.{namespace}",
        fqdn,
        f"{fqdn}.cluster.local",
    )


@dataclass(frozen=True)
class TierPlan:
    """The tiers of one InferencePool below HBM, at most one per kind."""

    by_kind: Mapping[TierKind, KVCacheTierSpec]

    @property
    def dram(self) -> KVCacheTierSpec | None:
        return self.by_kind.get(TierKind.DRAM)

    @property
    def nvme(self) -> KVCacheTierSpec | None:
        return self.by_kind.get(TierKind.NVME)

    @property
    def remote(self) -> KVCacheTierSpec | None:
        return self.by_kind.get(TierKind.REMOTE)

    @property
    def native_dram(self) -> KVCacheTierSpec | None:
        """vLLM's OffloadingConnector / SGLang's HiCache host pool."""
        if self.dram is not None and self.dram.backend is TierBackend.NATIVE:
            return self.dram
        return None

    @property
    def lmcache_tiers(self) -> list[KVCacheTierSpec]:
        """Tiers vLLM serves through LMCacheConnectorV1 (every nvme and remote tier)."""
        tiers = [self.dram] if self.dram and self.dram.backend is TierBackend.LMCACHE else []
        return tiers + [t for t in (self.nvme, self.remote) if t is not None]

    @property
    def uses_lmcache(self) -> bool:
        return bool(self.lmcache_tiers)


def plan_tiers(tiers: Sequence[KVCacheTierSpec]) -> TierPlan:
    """Sort tiers by kind; the hbm tier is the engine's own pool and needs nothing.

    One tier per kind: engines have one host pool, one local disk and one remote
    store, so a second tier of a kind has no meaning to render.
    """
    by_kind: dict[TierKind, KVCacheTierSpec] = {}
    for tier in tiers:
        if tier.tier is TierKind.HBM:
            continue
        if tier.tier in by_kind:
            raise RenderError(f"more than one {tier.tier.value} tier: engines have one of each")
        by_kind[tier.tier] = tier
    return TierPlan(by_kind)
