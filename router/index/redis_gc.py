"""Garbage collection of the Redis index: entries of dead pod slots, and freeing slots.

A pod's new incarnation (or its removal) makes its old slot dead at once: lookups map
pods to their current slot only. The dead slot's entries stay in the chunk buckets
until a *sweep* walks every bucket of the generation (``SCAN`` on each node, one
script per batch of buckets) and drops them; the slot is then free for reuse. A slot
is freed only if it died at least ``grace_s`` before the sweep began: longer than
any writer may still write it (an indexer whose lease ran out stops within its
lease; a router marks with a slot at most a second old) and than its tentative marks
live (two windows). Expired tentative marks need no sweep: their window keys expire.

Memory is bounded by the live entries plus those of slots dead for at most one
grace period and one sweep; one indexer at a time sweeps (a lease).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from kvplane.router.index.redis_layout import FIELD
from kvplane.router.index.redis_lua import FREE, SWEEP

if TYPE_CHECKING:
    from kvplane.router.index.redis import RedisIndex

log = logging.getLogger(__name__)

SCAN_COUNT: Final = 256
SWEEP_BATCH: Final = 32  # buckets per script: a sweep must not block its node for long
DEFAULT_GRACE_S: Final = 60.0
DEFAULT_INTERVAL_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class Collected:
    swept_fields: int  # bucket fields rewritten
    freed: int  # slots freed


async def sweep(index: RedisIndex, drops: Mapping[int, int], pause_s: float = 0.0) -> int:
    """Clear tier bits (``drops``: slot -> bits) in every bucket of the generation;
    returns the number of fields rewritten. ``pause_s`` between scripts keeps a
    background sweep from crowding lookups out."""
    if not drops:
        return 0
    spec = b"".join(s.to_bytes(2, "big") + bytes([bits]) for s, bits in drops.items())
    nodes = index.nodes
    await nodes.connect()
    changed = 0
    for node in range(nodes.count):
        cursor: int | bytes = 0
        while True:
            cursor, names = await nodes.call(
                node, "SCAN", cursor, "MATCH", index.names.bucket_pattern, "COUNT", SCAN_COUNT
            )
            for i in range(0, len(names), SWEEP_BATCH):
                got = await nodes.eval_each(SWEEP, {node: [spec, *names[i : i + SWEEP_BATCH]]})
                changed += int(got[node])
                if pause_s:
                    await asyncio.sleep(pause_s)
            if int(cursor) == 0:
                break
    return changed


async def dead_slots(index: RedisIndex) -> dict[int, bytes]:
    """Dead slots -> their ``~<ms>`` value (the time they died)."""
    await index.nodes.connect()
    node = index.nodes.node_of(index.names.slots)
    raw = await index.nodes.call(node, "HGETALL", index.names.slots)
    return {int(raw[i]): raw[i + 1] for i in range(0, len(raw), 2) if raw[i + 1][:1] == b"~"}


async def collect(
    index: RedisIndex, grace_s: float = DEFAULT_GRACE_S, pause_s: float = 0.0
) -> Collected:
    """One sweep for the slots dead longer than ``grace_s``, then free them."""
    started_ms = index.now_ms()
    ready = {
        slot: died
        for slot, died in (await dead_slots(index)).items()
        if int(died[1:]) <= started_ms - grace_s * 1000
    }
    if not ready:
        return Collected(0, 0)
    swept = await sweep(index, dict.fromkeys(ready, FIELD), pause_s)
    args = [index.names.slots, *[x for slot, died in ready.items() for x in (slot, died)]]
    node = index.nodes.node_of(index.names.slots)
    freed = int((await index.nodes.eval_each(FREE, {node: args}))[node])
    log.info("index gc: %d slots freed, %d fields rewritten", freed, swept)
    return Collected(swept, freed)


async def run_collector(
    index: RedisIndex,
    owner: str,
    stop: asyncio.Event,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    grace_s: float = DEFAULT_GRACE_S,
    pause_s: float = 0.001,
) -> None:
    """Collect every ``interval_s`` while holding the GC lease (one collector a pool)."""
    lease_ms = int(max(interval_s * 3, 30.0) * 1000)
    node_of = index.nodes.node_of
    while not stop.is_set():
        try:
            await index.nodes.connect()
            node = node_of(index.names.gc)
            took = await index.nodes.call(node, "SET", index.names.gc, owner, "NX", "PX", lease_ms)
            mine = (
                took is not None
                or (await index.nodes.call(node, "GET", index.names.gc)) == owner.encode()
            )
            if mine:
                await index.nodes.call(node, "PEXPIRE", index.names.gc, lease_ms)
                await collect(index, grace_s, pause_s)
        except Exception as exc:
            log.warning("index gc failed (%s: %s); retrying later", type(exc).__name__, exc)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval_s)
