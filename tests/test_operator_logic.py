"""The operator's pure decisions: is a live object up to date (compare.py), is this
replica the active one (peering.py, kopf's rule), and the per-key work queue
(coalescing, back-off that never delays another key)."""

from __future__ import annotations

import asyncio
import datetime as dt

from kvplane.operator.compare import covers, quantity
from kvplane.operator.peering import Peering, active, pauses
from kvplane.operator.reconcile import PRUNABLE
from kvplane.operator.workqueue import RETRY, Result, WorkQueue
from kvplane.router.kube import kind_key

from kvplane.types import Json

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)


def test_quantities_compare_by_value() -> None:
    assert quantity("1Gi") == quantity("1024Mi") == 2**30
    assert quantity("500m") == quantity("0.5")
    assert quantity("ghcr.io/x:1") is None and quantity("") is None and quantity("Mi") is None


def test_a_live_object_covers_what_we_apply() -> None:
    desired: Json = {
        "metadata": {"name": "x", "labels": {"a": "1"}, "annotations": None},
        "spec": {
            "replicas": 1,
            "env": [],
            "readOnly": False,
            "resources": {"limits": {"memory": "1024Mi"}},
            "ports": [{"name": "http", "port": 8000}],
        },
    }
    live: Json = {
        "metadata": {"name": "x", "labels": {"a": "1", "other": "x"}, "uid": "u"},
        "spec": {
            "replicas": 1,
            "resources": {"limits": {"memory": "1Gi"}},  # canonicalised by the API server
            "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],  # defaulted
        },
        "status": {"ready": 1},
    }
    assert covers(live, desired)
    changes: list[Json] = [
        {"replicas": 2},
        {"resources": {"limits": {"memory": "2Gi"}}},
        {"ports": [{"name": "http", "port": 8001}]},
        {"ports": []},
        {"image": "new"},
    ]
    for change in changes:
        assert not covers(live, {**desired, "spec": {**desired["spec"], **change}}), change
    assert not covers(
        {**live, "metadata": {**live["metadata"], "annotations": {"k": "v"}}}, desired
    )


def peering_object(**peers: tuple[int, dt.datetime]) -> Json:
    return {
        "metadata": {"name": "p"},
        "status": {
            ident: {"priority": prio, "lifetime": 60, "lastseen": seen.isoformat()}
            for ident, (prio, seen) in peers.items()
        },
    }


def test_kopf_peering_decides_who_writes() -> None:
    me = Peering("p", priority=10, identity="me")
    alone = peering_object(me=(10, NOW))
    assert not pauses(me, alone, NOW)
    assert pauses(me, peering_object(me=(10, NOW), other=(20, NOW)), NOW), "higher priority"
    assert pauses(me, peering_object(me=(10, NOW), other=(10, NOW)), NOW), "same priority"
    assert not pauses(me, peering_object(me=(10, NOW), other=(5, NOW)), NOW)
    dead = NOW - dt.timedelta(seconds=61)
    assert not pauses(me, peering_object(me=(10, NOW), other=(20, dead)), NOW), "a dead peer"
    assert pauses(me, peering_object(other=(5, NOW)), NOW), "not registered (or removed)"
    unknown = Peering("p", priority=10)  # identity not known: our priority, once
    assert not pauses(unknown, alone, NOW)
    assert pauses(unknown, peering_object(a=(10, NOW), b=(10, NOW)), NOW)
    assert active(Peering(None), [], NOW), "standalone"
    assert not active(me, [], NOW), "no peering object: kopf stays paused"
    assert active(me, [alone], NOW)


def test_the_work_queue_coalesces_and_backs_off_per_key() -> None:
    async def scenario() -> None:
        runs: list[str] = []
        release = asyncio.Event()

        async def work(key: str) -> Result:
            runs.append(key)
            if key == "slow":
                await release.wait()
            return RETRY if key == "bad" else None

        queue: WorkQueue[str] = WorkQueue(work, limit=4, backoff_s=(3600.0, 3600.0))
        queue.add("slow")
        await asyncio.sleep(0)
        for _ in range(5):
            queue.add("slow")  # while it runs: one more run, not five
        queue.add("bad")
        queue.add("good")
        release.set()
        await queue.drain()
        assert runs.count("slow") == 2 and runs.count("good") == 1
        assert queue.failing("bad") and runs.count("bad") == 1
        queue.add("bad")  # a repair waits for the back-off ...
        queue.add("good")  # ... and never delays another key
        await queue.drain()
        assert runs.count("bad") == 1 and runs.count("good") == 2
        queue.add("bad", urgent=True)  # a spec change does not wait
        await queue.drain()
        assert runs.count("bad") == 2
        await queue.stop()

    asyncio.run(scenario())


def test_every_rendered_kind_is_watched_and_pruned() -> None:
    """The operator compares what it renders with its watch cache and prunes by owner:
    a kind rendered but not in PRUNABLE (and the chart's RBAC) would be re-applied on
    every pass and never pruned."""
    from test_render import SCENARIOS

    rendered = {kind_key(o) for s in SCENARIOS for o in s.render()}
    assert rendered <= set(PRUNABLE), rendered - set(PRUNABLE)
