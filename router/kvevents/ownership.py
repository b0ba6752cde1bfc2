"""Several indexers for one pool: each pod's KV-event stream is owned by exactly one.

Every indexer announces itself in the index (``kvp:{g}:indexers``, id -> expiry),
renewed several times a lease. A pod belongs to the live indexer that rendezvous
hashing ranks first for it, so adding or losing an indexer moves only the pods it
gains or held. An indexer takes a pod only by acquiring the pod's lease (``SET NX
PX``), renews the leases it holds on every round, and releases a pod it no longer
ranks first for after stopping its stream; the new owner takes it on a later round.
An indexer that dies stops renewing: its leases run out within ``lease_s`` and the
next-ranked indexers take its pods over, each starting a new incarnation that the
engine's replay buffer fills. Starting and dropping an incarnation check the lease
in the same script (``RedisIndex(owner=...)``), so an indexer that lost a lease
(stalled past it) cannot retire its successor's slot; its late writes land in the
old, dead slot, which nobody reads.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import xxhash
from kvplane.router.index.redis import RedisIndex
from kvplane.router.index.redis_nodes import Script

log = logging.getLogger(__name__)

DEFAULT_LEASE_S: Final = 10.0

# ARGV: the indexers ZSET, this indexer, now ms, lease ms, then pairs: a pod's lease key,
# '1' to take or keep it, '0' to let it go. Returns the live indexers, then one 1 or 0
# per pod: whether this indexer holds the pod's lease now.
_ROUND: Final = Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + """
local set, me, now, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
redis.call('ZADD', set, now + tonumber(lease), me)
redis.call('ZREMRANGEBYSCORE', set, '-inf', now)
local live = redis.call('ZRANGE', set, 0, -1)
local held = {}
for i = 5, #ARGV, 2 do
  local key, want = ARGV[i], ARGV[i + 1] == '1'
  local owner = redis.call('GET', key)
  if want then
    if owner == me then
      redis.call('PEXPIRE', key, lease)
      held[#held + 1] = 1
    elseif not owner then
      redis.call('SET', key, me, 'PX', lease)
      held[#held + 1] = 1
    else
      held[#held + 1] = 0
    end
  else
    if owner == me then redis.call('DEL', key) end
    held[#held + 1] = 0
  end
end
return {live, held}
"""
)


def new_owner_id() -> str:
    """This process, recognisably: host, pid and a random part."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def rank_first(pod: str, indexers: Iterable[str]) -> str | None:
    """The indexer rendezvous hashing ranks first for ``pod``."""
    best, best_score = None, -1
    for ix in indexers:
        score = xxhash.xxh3_64_intdigest(f"{pod}\x1f{ix}".encode())
        if score > best_score:
            best, best_score = ix, score
    return best


@dataclass(frozen=True, slots=True)
class Round:
    live: list[str]  # live indexers, this one included
    held: set[str]  # pods whose lease this indexer holds now


class Ownership:
    """One indexer's view of who owns which pod, through leases in the index."""

    def __init__(self, index: RedisIndex, owner: str, lease_s: float = DEFAULT_LEASE_S) -> None:
        self.index = index
        self.owner = owner
        self.lease_s = lease_s
        self.held: set[str] = set()
        self.live: list[str] = [owner]

    def wanted(self, pods: Sequence[str]) -> list[str]:
        """The pods this indexer should own, given the live indexers last seen."""
        live = self.live or [self.owner]
        return [p for p in pods if rank_first(p, live) == self.owner]

    async def round(self, take: Sequence[str], release: Sequence[str] = ()) -> Round:
        """Announce this indexer, take or keep the leases of ``take``, let ``release`` go."""
        names = self.index.names
        args: list[bytes | str | int] = [names.indexers, self.owner, self.index.now_ms()]
        args.append(int(self.lease_s * 1000))
        for pod in take:
            args += [names.lease(pod), "1"]
        for pod in release:
            args += [names.lease(pod), "0"]
        nodes = self.index.nodes
        await nodes.connect()
        node = nodes.node_of(names.indexers)
        live, held = (await nodes.eval_each(_ROUND, {node: args}))[node]
        self.live = sorted(x.decode() for x in live)
        self.held = {pod for pod, h in zip(take, held, strict=False) if int(h)}
        return Round(self.live, set(self.held))

    async def leave(self) -> None:
        """Let every lease go and leave the live set (a clean shutdown hands over at once)."""
        await self.round((), sorted(self.held))
        nodes = self.index.nodes
        node = nodes.node_of(self.index.names.indexers)
        await nodes.call(node, "ZREM", self.index.names.indexers, self.owner)
        self.held = set()
