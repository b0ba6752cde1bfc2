"""Several indexers per pool: each pod's stream is owned by exactly one of them, and an
indexer's pods move to the others when it dies.

First the leases alone (two ``Ownership`` views on a real Redis), then the real thing:
two ``kvplane indexer`` processes over a simulated fleet's KV events, one of them
killed with SIGKILL, and the pods it owned indexed by the other from then on.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import redis
import yaml
from kvplane.router.blockkeys import block_keys, generation_root
from kvplane.router.index.base import NotOwner
from kvplane.router.index.redis import RedisIndex
from kvplane.router.kvevents.ownership import Ownership, rank_first
from kvplane.router.tiers import Tier
from support.router_server import deepseek_tokenizer_dir

from kvplane.local import redis as local_redis
from kvplane.local.ports import free_ports
from kvplane.sim.fleet import FleetConfig, SimFleet, running_fleet

GEN = "owners"
PODS = [f"pod-{i}" for i in range(12)]


@pytest.fixture
def server() -> Iterator[local_redis.LocalRedis]:
    with local_redis.running() as local:
        yield local


async def settle(*views: Ownership, pods: list[str] = PODS, rounds: int = 3) -> None:
    """A few rounds of every view: announce, let go of what is not its own, take the rest."""
    for _ in range(rounds):
        for view in views:
            wanted = set(view.wanted(pods))
            await view.round(sorted(wanted), sorted(view.held - wanted))


async def wait_for(check: Callable[[], object], what: str, bound_s: float = 60.0) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {bound_s}s: {what}")
        await asyncio.sleep(0.1)


async def test_each_pod_has_exactly_one_owner_and_moves_when_it_dies(
    server: local_redis.LocalRedis,
) -> None:
    a_index = RedisIndex(server.url, GEN, owner="ix-a")
    b_index = RedisIndex(server.url, GEN, owner="ix-b")
    a, b = Ownership(a_index, "ix-a", lease_s=1.0), Ownership(b_index, "ix-b", lease_s=1.0)
    try:
        await settle(a, b)
        assert a.live == b.live == ["ix-a", "ix-b"]
        assert a.held and b.held and a.held | b.held == set(PODS) and not a.held & b.held
        assert a.held == {p for p in PODS if rank_first(p, a.live) == "ix-a"}
        # the leases fence incarnations: b cannot start (or drop) a pod a owns
        mine, theirs = sorted(b.held)[0], sorted(a.held)[0]
        await b_index.begin_incarnation(mine, "1")
        with pytest.raises(NotOwner):
            await b_index.begin_incarnation(theirs, "1")
        with pytest.raises(NotOwner):
            await b_index.drop_pod(theirs)
        # a dies (renews nothing): once its entry and leases run out, b owns every pod
        deadline = time.monotonic() + 60
        while (await b.round(b.wanted(PODS))).held != set(PODS):
            assert time.monotonic() < deadline, "b never took a's pods over"
            await asyncio.sleep(0.2)
        assert b.live == ["ix-b"]
        await b_index.begin_incarnation(theirs, "2")  # now it may
        # a clean exit hands over at once: a comes back, takes its share, then leaves
        await settle(a, b)
        assert a.held and not a.held & b.held
        await a.leave()
        await settle(b)
        assert b.held == set(PODS)
    finally:
        await a_index.close()
        await b_index.close()


# ------------------------------------------------------------------ two indexer processes


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimFleet]:
    tok = deepseek_tokenizer_dir(tmp_path_factory.mktemp("tok"))
    cfg = FleetConfig(tokenizer=str(tok), engines=6, model="tiny", profile="cpu-tiny")
    with running_fleet(cfg) as f:
        yield f


def _indexer(
    exe: Path, config: Path, ident: str, metrics_port: int, log: Path
) -> subprocess.Popen[bytes]:
    argv = [str(exe), "indexer", "--config", str(config), "--metrics-port", str(metrics_port)]
    with log.open("wb") as sink:
        return subprocess.Popen(
            [*argv, "--id", ident, "--lease-s", "2"], stdout=subprocess.DEVNULL, stderr=sink
        )


def _metric(port: int, name: str) -> float | None:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def _owners(r: redis.Redis, names: list[str]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in names:
        v = r.get(f"kvp:{{{GEN}}}:own:{name}")
        out[name] = v.decode() if isinstance(v, bytes) else v
    return out


async def test_two_indexer_processes_share_a_fleet_and_survive_a_kill(
    fleet: SimFleet, server: local_redis.LocalRedis, tmp_path: Path
) -> None:
    backends = fleet.backends()
    names = [b["name"] for b in backends]
    tok = fleet.cfg.tokenizer
    config = {
        "model": {"name": "tiny", "tokenizer": tok, "block_size": 32, "generation": GEN},
        "backends": backends,
        "index": {"backend": "redis", "url": server.url, "lookup_timeout_ms": 2000},
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    exe = Path(sys.executable).parent / "kvplane"
    logs = {i: tmp_path / f"indexer-{i}.log" for i in ("ix-a", "ix-b")}
    ports = dict(zip(logs, free_ports(2), strict=True))
    procs = {i: _indexer(exe, path, i, ports[i], logs[i]) for i in logs}
    r = redis.Redis(port=server.port)
    index = RedisIndex(server.url, GEN)
    try:
        split = {n: rank_first(n, ["ix-a", "ix-b"]) for n in names}
        assert set(split.values()) == {"ix-a", "ix-b"}, split  # fixed ids: a fixed split
        await wait_for(lambda: _owners(r, names) == split, "each pod leased to its indexer")
        await wait_for(lambda: len(r.hkeys(f"kvp:{{{GEN}}}:pods")) == len(names), "streams up")

        async def indexed(text: str) -> None:
            """Send ``text`` to every engine; wait until the index has each one's blocks."""
            prompts = {b["name"]: f"{b['name']} {text}" for b in backends}
            async with httpx.AsyncClient(timeout=60) as http:
                for b in backends:
                    body = {"model": "tiny", "prompt": prompts[b["name"]], "max_tokens": 1}
                    reply = await http.post(f"{b['url']}/v1/completions", json=body)
                    assert reply.status_code == 200
            keys = {name: _keys_of(fleet, p) for name, p in prompts.items()}
            deadline = time.monotonic() + 60
            while True:
                held = {n: (await index.lookup(keys[n], [n]))[n][Tier.HBM] for n in names}
                if all(held[n] == len(keys[n]) for n in names):
                    return
                assert time.monotonic() < deadline, f"not indexed: {held}"
                await asyncio.sleep(0.2)

        await indexed("before the kill " * 40)
        procs["ix-a"].send_signal(signal.SIGKILL)
        procs["ix-a"].wait(10)
        survivors = dict.fromkeys(names, "ix-b")
        await wait_for(lambda: _owners(r, names) == survivors, "ix-b holds every lease")
        await indexed("after the kill " * 40)  # ix-a's pods are indexed again, by ix-b
        port_b = ports["ix-b"]
        await wait_for(
            lambda: _metric(port_b, "kvplane_indexer_owned_pods") == len(names), "ix-b's metrics"
        )
        assert _metric(port_b, "kvplane_indexer_live_indexers") == 1
        assert _metric(port_b, "kvplane_indexer_pending_blocks") is not None
    except AssertionError as exc:
        tails = "\n".join(f"{i}:\n{p.read_text()[-2000:]}" for i, p in logs.items())
        raise AssertionError(f"{exc}\n{tails}") from exc
    finally:
        await index.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(20)
    assert procs["ix-b"].returncode == 0, logs["ix-b"].read_text()[-3000:]
    # its clean exit let every lease go
    assert _owners(r, names) == dict.fromkeys(names)


def _keys_of(fleet: SimFleet, prompt: str) -> list[int]:
    ids = fleet.tokenizer.encode(prompt, add_special_tokens=True)
    return block_keys(ids, 32, generation_root(GEN))
