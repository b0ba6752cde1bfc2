"""Fleet shapes: one fleet's KV cache beyond HBM held in different places.

``hbm`` has none; ``hbm+dram`` gives each pod its own DRAM tier, whose KV events the
router reads (``hbm+dram-silent``: the engines publish none for it, as Dynamo's mocker;
``hbm+dram-inferred``: none either, but the router is told the tier's size,
``RouterConfig.unreported_tier``); ``hbm+shared`` puts
the same total in one store every pod writes to and loads from; ``hbm+shared+peer``
also lets pods pull a prefix from each other's HBM or DRAM. The links are the router's
defaults for them: the remote tier's (``router/tiers.py``) for the store, the P/D
same-zone link (``router/config.py``) for peer pulls. With ``gpus_per_node``, pods sit
that many to a node and two pods of one node pull over ``node_link`` (NVLink); the
router is told the pods' nodes and both links unless ``placement_blind``.

``hbm+oracle`` is no fleet anyone can build: one store without a bound, every block
written to it as it is computed and loaded from it at no cost, by every pod. Every pod
then reuses whatever any pod has computed (the ideal floor's reuse, less the blocks still
being computed when a request arrives), so a router's TTFT on it is what the load costs at
that reuse: the gap to the ideal floor that is left once the cache is perfect (queueing,
its balancing's share), against which a real shape's loss of reuse can be told apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from kvplane.sim.des import DramEvents, SharedKV
from kvplane.sim.kvcache import Link, router_kv_settings

FLEET_SHAPES: Final = (
    "hbm",
    "hbm+dram",
    "hbm+dram-silent",
    "hbm+dram-inferred",
    "hbm+shared",
    "hbm+shared+peer",
    "hbm+oracle",
)
STORE_LINK: Final = Link(bandwidth_gbps=25.0, latency_ms=1.0)
PEER_LINK: Final = Link(bandwidth_gbps=40.0, latency_ms=0.2)
NVLINK_LATENCY_MS: Final = 0.05  # the P/D same-node default's
# hbm+oracle: a store that never evicts within any run, and loads that take no time
ORACLE_STORE_BLOCKS: Final = 1 << 40
ORACLE_LINK: Final = Link(bandwidth_gbps=1e9, latency_ms=0.0)


@dataclass(frozen=True, slots=True)
class FleetShape:
    name: str
    cpu_offload_blocks: int  # each pod's own DRAM tier
    shared_kv: SharedKV | None  # the store and peer pulls
    dram_events: DramEvents = DramEvents.REPORTED  # what the router learns of the DRAM tier

    def sim_flags(self) -> list[str]:
        """The shape as ``kvplane sim`` flags: the HTTP fleet has the same DRAM tier,
        store and peer pulls. Its engines always publish their DRAM tier's events, and
        it does not place pods on nodes, so those shapes are the discrete-event mode's."""
        kv = self.shared_kv
        if self.dram_events is not DramEvents.REPORTED or (kv is not None and kv.pods_per_node):
            raise ValueError(f"fleet shape {self.name!r} runs in the discrete-event mode only")
        argv = ["--cpu-offload-blocks", str(self.cpu_offload_blocks)]
        if kv is None:
            return argv
        if kv.store_blocks:
            link = kv.store_link
            argv += ["--store-blocks", str(kv.store_blocks), "--store-policy", kv.store_policy]
            argv += ["--store-gbps", repr(link.bandwidth_gbps)]
            argv += ["--store-latency-ms", repr(link.latency_ms)]
            argv += ["--store-write-through"] if kv.write_through else []
        if kv.peer_link is not None:
            argv += ["--peer-gbps", repr(kv.peer_link.bandwidth_gbps)]
            argv += ["--peer-latency-ms", repr(kv.peer_link.latency_ms)]
        return argv

    def router_settings(self) -> dict[str, Any]:
        """What kvplane's router config says of the shape's store and peer pulls."""
        kv = self.shared_kv
        if kv is None:
            return {}
        return router_kv_settings(kv.store_link if kv.store_blocks else None, kv.peer_link)


def fleet_shape(
    name: str,
    engines: int,
    dram_blocks: int,
    store_policy: str = "lru",
    *,
    gpus_per_node: int = 0,
    node_link: Link | None = None,
    placement_blind: bool = False,
) -> FleetShape:
    """The shape ``name`` of ``engines`` pods with ``dram_blocks`` of DRAM each (or
    their total in the shared store, evicting by ``store_policy``); peer pulls between
    pods of one node over ``node_link`` when ``gpus_per_node`` places them."""
    store = engines * dram_blocks
    if name == "hbm":
        return FleetShape(name, 0, None)
    if name == "hbm+dram":
        return FleetShape(name, dram_blocks, None)
    if name == "hbm+dram-silent":
        return FleetShape(name, dram_blocks, None, DramEvents.SILENT)
    if name == "hbm+dram-inferred":
        return FleetShape(name, dram_blocks, None, DramEvents.INFERRED)
    if name == "hbm+shared":
        return FleetShape(name, 0, SharedKV(store, STORE_LINK, store_policy=store_policy))
    if name == "hbm+shared+peer":
        kv = SharedKV(
            store,
            STORE_LINK,
            PEER_LINK,
            store_policy=store_policy,
            pods_per_node=gpus_per_node,
            peer_node_link=node_link if gpus_per_node > 0 else None,
            router_sees_nodes=not placement_blind,
        )
        return FleetShape(name, 0, kv)
    if name == "hbm+oracle":
        kv = SharedKV(ORACLE_STORE_BLOCKS, ORACLE_LINK, write_through=True)
        return FleetShape(name, 0, kv)
    raise ValueError(f"unknown fleet shape {name!r} (known: {', '.join(FLEET_SHAPES)})")
