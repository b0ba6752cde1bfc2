"""The simulator's shared KV: a store every engine writes to and loads from, and peer
pulls, with the events a real deployment publishes and the router configured for them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from kvplane.router.config import LinkClass, PeerPullSpec
from kvplane.router.tiers import Tier, tier_of_medium

from kvplane.local import redis as local_redis
from kvplane.sim import des
from kvplane.sim.engine import EngineCore, Fabric, SimRequest
from kvplane.sim.events import BlockRemoved, BlockStored, KVEvent
from kvplane.sim.kvcache import BlockMeta, Link, PeerFabric, SharedStore
from kvplane.sim.profiles import PROFILES, EngineProfile
from kvplane.sim.shapes import FLEET_SHAPES, fleet_shape
from kvplane.workload import traces as workloads

MAX_STEPS = 10_000


def small(num_gpu_blocks: int = 64, block_size: int = 4) -> EngineProfile:
    return dataclasses.replace(
        PROFILES["cpu-tiny"],
        num_gpu_blocks=num_gpu_blocks,
        block_size=block_size,
        max_num_batched_tokens=64,
        max_num_seqs=16,
        cpu_offload_blocks=0,
    )


def serve(engine: EngineCore, rid: str, prompt: Sequence[int]) -> int | None:
    """One request to the end (bounded); the prompt tokens it found cached."""
    engine.add_request(SimRequest(rid, list(prompt), max_tokens=1))
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            return engine.cached_tokens(rid)
        engine.step()
    raise AssertionError("the engine never went idle")


def meta(i: int) -> tuple[bytes, BlockMeta]:
    return bytes([i]), BlockMeta(i, i - 1 if i else None, (i, i))


def test_slru_keeps_a_reused_prefix_through_a_flood_of_one_off_blocks() -> None:
    """LRU loses a prefix that later requests reuse once enough fresh one-off blocks are
    written after its last use; segmented LRU keeps it: loaded once, it is protected,
    and the flood evicts the probation segment (its own oldest blocks) instead."""
    prefix = [meta(i) for i in range(4)]
    hashes = [h for h, _ in prefix]
    kept = {}
    for policy in ("lru", "slru"):
        store = SharedStore(10, 2, Link(10.0), policy)
        store.write("a", prefix)
        assert store.match(hashes, 0, 4) == 4  # a second request loads the prefix
        store.write("b", [meta(i) for i in range(10, 20)])  # one-off tails, more recent
        store.take_events()
        kept[policy] = store.match(hashes, 0, 4)
        assert len(store) == 10
    assert kept == {"lru": 0, "slru": 4}


def test_slru_protects_at_most_its_share_and_demotes_to_probation() -> None:
    store = SharedStore(5, 2, Link(10.0), "slru")  # protected: at most 4 blocks
    blocks = [meta(i) for i in range(5)]
    store.write("a", blocks)
    hashes = [h for h, _ in blocks]
    # all loaded, tail first: the tail is protected first, so it is the one demoted
    assert store.match(hashes, 0, 5) == 5
    assert len(store.protected) == 4 and list(store.entries) == [hashes[4]]
    store.write("b", [meta(9)])  # full: the probation block goes, the prefix's head stays
    assert hashes[4] not in store and all(h in store for h in hashes[:4])
    assert store.take_events()["a"][-1] == BlockRemoved([4], "STORAGE", "REMOTE")
    with pytest.raises(ValueError, match="unknown store policy"):
        SharedStore(5, 2, Link(10.0), "lfu")


def test_the_store_announces_runs_and_tells_evictions_on_the_writers_stream() -> None:
    store = SharedStore(3, 2, Link(10.0))
    store.write("a", [meta(0), meta(1)])
    store.write("b", [meta(1), meta(2), meta(3)])  # 1 is known: refreshed, not stored again
    events = store.take_events()
    remote = ("STORAGE", "REMOTE")
    assert events["a"] == [
        BlockStored([0, 1], None, [0, 0, 1, 1], 2, "STORAGE", locality="REMOTE"),
        BlockRemoved([0], *remote),  # evicted by b's write, told by its writer
    ]
    assert events["b"] == [BlockStored([2, 3], 1, [2, 2, 3, 3], 2, "STORAGE", locality="REMOTE")]
    assert tier_of_medium(*remote) is Tier.REMOTE
    assert store.match([bytes([1]), bytes([2]), bytes([9])], 0, 3) == 2
    assert store.take_events() == {}


def test_a_block_stored_and_evicted_in_one_write_is_never_announced() -> None:
    store = SharedStore(1, 2, Link(10.0))
    store.write("a", [meta(0), meta(1)])
    stored = BlockStored([1], 0, [1, 1], 2, "STORAGE", locality="REMOTE")
    assert store.take_events() == {"a": [stored]}


def test_an_engine_loads_what_another_evicted_into_the_store() -> None:
    """e0's HBM holds 8 blocks: a second prompt evicts the first one's blocks into the
    store, where e1 finds them (at the store's link, in its step time)."""
    store = SharedStore(64, 4, Link(1.0, latency_ms=50.0))
    e0 = EngineCore(small(num_gpu_blocks=9), fabric=Fabric("e0", store))
    e1 = EngineCore(small(), fabric=Fabric("e1", store))
    first, second = list(range(1, 30)), list(range(100, 129))
    assert serve(e0, "a", first) == 0
    assert serve(e0, "b", second) == 0
    assert len(store) >= 7
    e1.add_request(SimRequest("c", first, max_tokens=1))
    out = e1.step()
    assert e1.cached_tokens("c") == 28  # the last token is always computed
    assert out.duration_s > 0.05  # the store's latency is in the step
    stats = e1.stats()
    assert stats.external_prefix_cache_hits == 28 and stats.prefix_cache_hits == 0
    stored: list[KVEvent] = store.take_events()["e0"]
    assert {type(e) for e in stored} == {BlockStored}


def test_write_through_stores_blocks_as_they_are_computed() -> None:
    store = SharedStore(64, 4, Link(10.0))
    e0 = EngineCore(small(), fabric=Fabric("e0", store, write_through=True))
    serve(e0, "a", list(range(1, 30)))
    assert len(store) == 7  # every full block, with no eviction from HBM
    e1 = EngineCore(small(), fabric=Fabric("e1", store, write_through=True))
    assert serve(e1, "b", list(range(1, 30))) == 28


def test_an_engine_pulls_a_prefix_from_a_peers_hbm() -> None:
    peers = PeerFabric(Link(10.0))
    e0 = EngineCore(small(), fabric=Fabric("e0", peers=peers))
    e1 = EngineCore(small(), fabric=Fabric("e1", peers=peers))
    prompt = list(range(1, 30))
    serve(e0, "a", prompt)
    assert serve(e1, "b", [*prompt[:20], 7, 7, 7]) == 20
    assert serve(e1, "c", list(range(200, 230))) == 0  # nobody holds it


def test_an_engine_pulls_from_the_peer_whose_link_makes_it_quickest() -> None:
    """e2 holds 28 tokens of the prompt and e0 20; e1 shares e0's node. Over NVLink from
    e0 and 50 ms of latency from e2, e1 pulls e0's 20 (recomputing 8 is quicker than the
    wait); with one link for every pair it pulls the longest run, e2's 28."""
    prompt = list(range(1, 30))
    for nodes, cached in (({"e0": "n0", "e1": "n0", "e2": "n1"}, 20), ({}, 28)):
        peers = PeerFabric(Link(10.0, latency_ms=50.0), node_link=Link(100.0), nodes=nodes)
        e0, e1, e2 = (EngineCore(small(), fabric=Fabric(f"e{i}", peers=peers)) for i in range(3))
        serve(e2, "a", prompt)
        serve(e0, "b", prompt[:21])
        e1.add_request(SimRequest("c", prompt, max_tokens=1))
        out = e1.step()
        assert e1.cached_tokens("c") == cached
        assert (out.duration_s < 0.05) == bool(nodes)
        assert peers.link_between("e1", "e0") == (Link(100.0) if nodes else Link(10.0, 50.0))


def test_fleet_shapes_hold_the_same_cache_beyond_hbm() -> None:
    shapes = {name: fleet_shape(name, 8, 1000) for name in FLEET_SHAPES}
    assert shapes["hbm"].cpu_offload_blocks == 0 and shapes["hbm"].shared_kv is None
    assert shapes["hbm+dram"].cpu_offload_blocks == 1000
    for name, events in (("hbm+dram-silent", "silent"), ("hbm+dram-inferred", "inferred")):
        assert shapes[name].cpu_offload_blocks == 1000 and shapes[name].dram_events == events
    shared = shapes["hbm+shared"].shared_kv
    assert shared is not None and shared.store_blocks == 8000 and shared.peer_link is None
    peer = shapes["hbm+shared+peer"].shared_kv
    assert peer is not None and peer.peer_link is not None
    _, spec = peer.router_side()
    assert spec is not None and spec.links == {} and peer.nodes(["e0", "e1"]) == {}
    nvlink = Link(450.0, 0.05)
    placed = fleet_shape("hbm+shared+peer", 8, 1000, gpus_per_node=4, node_link=nvlink).shared_kv
    assert placed is not None and placed.peer_node_link == nvlink
    names = [f"e{i}" for i in range(8)]
    assert placed.nodes(names)["e3"] == "node-0" and placed.nodes(names)["e4"] == "node-1"
    _, spec = placed.router_side()
    assert spec is not None and spec.link.bandwidth_gbps == 40.0  # the shapes' PEER_LINK
    assert spec.link_for(LinkClass.SAME_NODE).bandwidth_gbps == 450.0
    blind = fleet_shape(
        "hbm+shared+peer", 8, 1000, gpus_per_node=4, node_link=nvlink, placement_blind=True
    ).shared_kv
    assert blind is not None and blind.router_side()[1] == PeerPullSpec(link=spec.link)
    oracle = shapes["hbm+oracle"].shared_kv
    assert oracle is not None and oracle.write_through and oracle.peer_link is None
    assert shapes["hbm+oracle"].cpu_offload_blocks == 0
    assert oracle.store_link.load_ms(100_000, 131_072) < 1e-3  # loads take no time
    with pytest.raises(ValueError, match="unknown fleet shape"):
        fleet_shape("hbm+nvme", 8, 1000)


def _small_hbm(monkeypatch: pytest.MonkeyPatch) -> str:
    """The 8B pod with HBM for 32K tokens: conversations outgrow it at once."""
    prof = dataclasses.replace(PROFILES["h100-llama-3.1-8b"], name="tiny-hbm", num_gpu_blocks=2000)
    monkeypatch.setitem(PROFILES, "tiny-hbm", prof)
    return "tiny-hbm"


def chats() -> workloads.Workload:
    """More conversation than the three small pods' HBM holds even spread over them."""
    return workloads.multi_round_qa(users=24, rounds=4, history_len=4000, qps=4.0)


def test_des_routes_on_the_shared_store_and_keys_every_event(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pods with a small HBM and one store: the router indexes the store's blocks for
    every pod (its events, from the writers' streams, all keyed) and routes on them;
    the fleet then reuses what HBM alone loses. With peer pulls some requests pull."""
    profile = _small_hbm(monkeypatch)
    wl = chats()
    alone = des.run_des(wl, "kvplane", engines=3, profile=profile, block_size=64)[0].hit_ratio
    assert alone is not None
    for name in ("hbm+shared", "hbm+shared+peer"):
        shape = fleet_shape(name, 3, 2000)
        opts = des.DesOptions(cpu_offload_blocks=0, shared_kv=shape.shared_kv)
        rec, results = des.run_des(
            wl, "kvplane", engines=3, profile=profile, block_size=64, options=opts
        )
        assert rec.errors == 0 and len(results) == len(wl.requests)
        assert rec.extra["events_unmapped"] == 0
        assert rec.hit_ratio is not None and rec.hit_ratio > 2 * alone, (name, rec.hit_ratio)
        reason = "shared_store" if name == "hbm+shared" else "peer_pull"
        assert rec.extra["decisions"].get(reason, 0) > 0, rec.extra["decisions"]
        if name == "hbm+shared":  # (with peers, conversations stay where they are)
            assert rec.extra["shared_store_blocks"] > 0
    # two pods to a node, NVLink inside: most pulls come from the puller's node, and the
    # engines pull what the router predicted (the same holders, the same tokens)
    shape = fleet_shape("hbm+shared+peer", 4, 2000, gpus_per_node=2, node_link=Link(450.0, 0.05))
    opts = des.DesOptions(cpu_offload_blocks=0, shared_kv=shape.shared_kv)
    rec, _ = des.run_des(wl, "kvplane", engines=4, profile=profile, block_size=64, options=opts)
    assert rec.errors == 0 and rec.extra["events_unmapped"] == 0
    pulls = rec.extra["peer_pulls"]
    assert pulls["same_node"] > pulls.get("same_zone", 0), pulls
    assert rec.extra["predicted_cached_tokens"] == rec.extra["reported_cached_tokens"]


def test_the_oracle_shape_reuses_what_any_pod_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pods whose HBM the conversations outgrow, over the unbounded store loaded at no
    cost: every router reuses about what the oracle does (the blocks still being
    computed when a request arrives are not there yet), and least-loaded, blind to
    residency, reuses as much as kvplane."""
    profile = _small_hbm(monkeypatch)
    wl = chats()
    opts = des.DesOptions(cpu_offload_blocks=0, shared_kv=fleet_shape("hbm+oracle", 3, 0).shared_kv)
    hits = {}
    for router in ("kvplane", "kvplane-least_loaded"):
        rec, results = des.run_des(
            wl, router, engines=3, profile=profile, block_size=64, options=opts
        )
        assert rec.errors == 0 and len(results) == len(wl.requests)
        assert rec.hit_ratio is not None and rec.oracle_hit_ratio is not None
        hits[router] = rec.hit_ratio
        assert rec.hit_ratio >= 0.95 * rec.oracle_hit_ratio, (router, rec.hit_ratio)
    alone = des.run_des(wl, "kvplane", engines=3, profile=profile, block_size=64)[0].hit_ratio
    assert alone is not None and alone < 0.9 * hits["kvplane"]


def test_des_infers_a_dram_tier_its_engines_do_not_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pods with a small HBM and their own DRAM tier, conversations that outgrow HBM:
    with the tier's events the router sends each user's next turn back to the DRAM that
    holds its history. With no events for the tier (Dynamo's mocker, to any router) it
    sees only the system prompt everywhere and spreads the turns by load; told only the
    tier's size (``unreported_tier``) it routes as with the events."""
    profile = _small_hbm(monkeypatch)
    # a user comes back after 20 s, when the router's own marks have expired; ten users
    # on three pods, so that a turn spread by load lands on another pod than the last
    wl = workloads.multi_round_qa(users=10, rounds=3, history_len=16000, qps=0.5)
    recs, hits = {}, {}
    for name in ("hbm+dram", "hbm+dram-silent", "hbm+dram-inferred"):
        shape = fleet_shape(name, 3, 8000)
        opts = des.DesOptions(
            cpu_offload_blocks=shape.cpu_offload_blocks, dram_events=shape.dram_events
        )
        rec, results = des.run_des(
            wl, "kvplane", engines=3, profile=profile, block_size=64, options=opts
        )
        assert rec.errors == 0 and len(results) == len(wl.requests)
        assert rec.hit_ratio is not None
        recs[name], hits[name] = rec, rec.hit_ratio
    assert hits["hbm+dram-inferred"] > 0.9 * hits["hbm+dram"] > 2 * hits["hbm+dram-silent"]
    predicted = {n: r.extra["predicted_cached_tokens"] for n, r in recs.items()}
    assert predicted["hbm+dram-inferred"] > 0.9 * predicted["hbm+dram"]
    assert predicted["hbm+dram-silent"] < 0.5 * predicted["hbm+dram"]


def test_the_redis_index_decides_as_the_memory_index_with_a_shared_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    profile = _small_hbm(monkeypatch)
    wl = chats()
    shared = fleet_shape("hbm+shared", 2, 2000).shared_kv
    opts = des.DesOptions(cpu_offload_blocks=0, shared_kv=shared)
    ref = des.run_des(wl, "kvplane", engines=2, profile=profile, block_size=64, options=opts)
    with local_redis.running() as server:
        opts = dataclasses.replace(opts, index_url=server.url)
        got = des.run_des(wl, "kvplane", engines=2, profile=profile, block_size=64, options=opts)
    assert got[1] == ref[1]
    assert got[0].extra["decisions"] == ref[0].extra["decisions"]
    assert ref[0].extra["decisions"].get("shared_store", 0) > 0
