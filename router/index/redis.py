"""Redis residency index: shared by every router replica and the indexer.

Layout, all under one hash tag so a Redis Cluster keeps a generation in one
slot and the Lua scripts may touch any of its keys:

- ``kvp:{gen}:inc``            HASH pod -> current incarnation
- ``kvp:{gen}:b:<key>``        HASH ``pod␟inc␟tier`` -> "0" (confirmed) or expiry in ms
- ``kvp:{gen}:p:<pod>:<inc>``  SET of block keys, for garbage collection

A lookup is one EVALSHA: the script reads the candidates' incarnations and walks
the prompt's blocks in order, stopping as soon as no pod can extend a prefix.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import redis.asyncio as aioredis
from kvplane.router.index.base import PrefixMatches
from kvplane.router.tiers import TIER_ORDER, Tier, lua_tier_index, lua_tier_names

SEP = "\x1f"
_TENTATIVE_INC = "-"  # incarnation of marks on a pod the index has no stream for yet


def _lua(script: str) -> str:
    """A script with the tier table (``router/tiers.py``) filled in."""
    return (
        script.replace("__TIER_INDEX__", lua_tier_index())
        .replace("__TIER_NAMES__", lua_tier_names())
        .replace("__NTIERS__", str(len(TIER_ORDER)))
        .replace("__HBM__", TIER_ORDER[0].value)
    )


_LOOKUP = """
local n = #KEYS - 1
local npods = #ARGV
local cur = redis.call('HMGET', KEYS[n + 1], unpack(ARGV))
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tier_idx = __TIER_INDEX__
local ntiers = __NTIERS__
local pod_idx, runs, alive = {}, {}, {}
for p = 1, npods do
  pod_idx[ARGV[p]] = p
  if not cur[p] then cur[p] = '-' end
  runs[p], alive[p] = {}, {}
  for ti = 1, ntiers do runs[p][ti], alive[p][ti] = 0, true end
end
local active = npods * ntiers
for i = 1, n do
  if active == 0 then break end
  local h = redis.call('HGETALL', KEYS[i])
  local best = {}
  for j = 1, #h, 2 do
    local pod, inc, tier = string.match(h[j], '^(.*)\\31(.*)\\31(.*)$')
    local p = pod_idx[pod]
    if p and inc == cur[p] then
      local exp = tonumber(h[j + 1])
      local ti = tier_idx[tier]
      if ti and (exp == 0 or exp > now) and (best[p] == nil or ti < best[p]) then
        best[p] = ti
      end
    end
  end
  for p = 1, npods do
    local b = best[p]
    for ti = 1, ntiers do
      if alive[p][ti] then
        if b ~= nil and b <= ti then
          runs[p][ti] = runs[p][ti] + 1
        else
          alive[p][ti] = false
          active = active - 1
        end
      end
    end
  end
end
local out = {}
for p = 1, npods do
  for ti = 1, ntiers do out[#out + 1] = runs[p][ti] end
end
return out
"""

# KEYS[1] inc hash, KEYS[2] pod set, KEYS[3..] block hashes; ARGV pod, inc, tier, prefix
_STORE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
local field = ARGV[1] .. '\\31' .. ARGV[2] .. '\\31' .. ARGV[3]
for i = 3, #KEYS do
  redis.call('HSET', KEYS[i], field, '0')
  redis.call('SADD', KEYS[2], string.sub(KEYS[i], #ARGV[4] + 1))
end
return #KEYS - 2
"""

_REMOVE = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
local field = ARGV[1] .. '\\31' .. ARGV[2] .. '\\31' .. ARGV[3]
for i = 3, #KEYS do redis.call('HDEL', KEYS[i], field) end
return #KEYS - 2
"""

# KEYS[1] inc hash, KEYS[2..] block hashes; ARGV pod, expiry_ms_from_now, set prefix, key prefix
_TENTATIVE = """
local inc = redis.call('HGET', KEYS[1], ARGV[1]) or '-'
local t = redis.call('TIME')
local exp = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
local field = ARGV[1] .. '\\31' .. inc .. '\\31__HBM__'
local set = ARGV[3] .. ARGV[1] .. ':' .. inc
for i = 2, #KEYS do
  local v = redis.call('HGET', KEYS[i], field)
  if v ~= '0' then
    redis.call('HSET', KEYS[i], field, tostring(exp))
    redis.call('SADD', set, string.sub(KEYS[i], #ARGV[4] + 1))
  end
end
return 1
"""

# Pops up to ARGV[3] keys of a pod set and deletes their fields; returns what is left.
# KEYS[1] pod set; ARGV pod, inc, count, key prefix, [tier]
_GC = """
local keys = redis.call('SPOP', KEYS[1], tonumber(ARGV[3]))
local tiers = __TIER_NAMES__
if ARGV[5] then tiers = {ARGV[5]} end
local kept = {}
for _, k in ipairs(keys) do
  local bk = ARGV[4] .. k
  for _, tier in ipairs(tiers) do
    redis.call('HDEL', bk, ARGV[1] .. '\\31' .. ARGV[2] .. '\\31' .. tier)
  end
  if ARGV[5] and redis.call('EXISTS', bk) == 1 then kept[#kept + 1] = k end
end
return {redis.call('SCARD', KEYS[1]), kept}
"""


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


class RedisIndex:
    """ResidencyIndex on Redis (redis-py asyncio, hiredis parser when installed)."""

    in_process = False

    def __init__(
        self, url: str, generation: str, timeout_s: float = 0.5, password: str | None = None
    ) -> None:
        self._r: aioredis.Redis = aioredis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            decode_responses=False,
            password=password,
        )
        base = f"kvp:{{{generation}}}"
        self._inc = f"{base}:inc"
        self._bpre = f"{base}:b:"
        self._ppre = f"{base}:p:"
        self._lookup = self._r.register_script(_lua(_LOOKUP))
        self._store = self._r.register_script(_STORE)
        self._remove = self._r.register_script(_REMOVE)
        self._tentative = self._r.register_script(_lua(_TENTATIVE))
        self._gc = self._r.register_script(_lua(_GC))

    def _bkeys(self, keys: Sequence[int]) -> list[str]:
        pre = self._bpre
        return [f"{pre}{k:x}" for k in keys]

    async def begin_incarnation(self, pod: str, incarnation: str) -> None:
        old = await self._r.hget(self._inc, pod)
        await self._r.hset(self._inc, pod, incarnation)
        await self._collect(pod, _text(old))
        await self._collect(pod, _TENTATIVE_INC)

    async def drop_pod(self, pod: str) -> None:
        old = await self._r.hget(self._inc, pod)
        await self._r.hdel(self._inc, pod)
        await self._collect(pod, _text(old))
        await self._collect(pod, _TENTATIVE_INC)

    async def _collect(self, pod: str, incarnation: str | None, tier: Tier | None = None) -> None:
        """Delete a pod incarnation's fields in bounded batches (never one huge script)."""
        if incarnation is None:
            return
        pod_set = f"{self._ppre}{pod}:{incarnation}"
        extra = [tier.value] if tier else []
        kept: list[bytes] = []
        for _ in range(100_000):
            left, batch_kept = await self._gc(
                keys=[pod_set], args=[pod, incarnation, 1000, self._bpre, *extra]
            )
            kept.extend(batch_kept)
            if int(left) == 0:
                break
        if kept:  # blocks still held in other tiers stay collectable later
            await self._r.sadd(pod_set, *kept)

    async def store(self, pod: str, incarnation: str, keys: Sequence[int], tier: Tier) -> None:
        if keys:
            await self._store(
                keys=[self._inc, f"{self._ppre}{pod}:{incarnation}", *self._bkeys(keys)],
                args=[pod, incarnation, tier.value, self._bpre],
            )

    async def remove(self, pod: str, incarnation: str, keys: Sequence[int], tier: Tier) -> None:
        if keys:
            await self._remove(
                keys=[self._inc, f"{self._ppre}{pod}:{incarnation}", *self._bkeys(keys)],
                args=[pod, incarnation, tier.value],
            )

    async def clear(self, pod: str, incarnation: str, tier: Tier) -> None:
        current = await self._r.hget(self._inc, pod)
        if current is not None and _text(current) == incarnation:
            await self._collect(pod, incarnation, tier)

    async def mark_tentative(self, pod: str, keys: Sequence[int], ttl_s: float) -> None:
        if keys:
            await self._tentative(
                keys=[self._inc, *self._bkeys(keys)],
                args=[pod, int(ttl_s * 1000), self._ppre, self._bpre],
            )

    async def lookup(self, keys: Sequence[int], pods: Sequence[str]) -> PrefixMatches:
        if not pods:
            return {}
        if not keys:
            return {p: dict.fromkeys(TIER_ORDER, 0) for p in pods}
        flat = await self._lookup(keys=[*self._bkeys(keys), self._inc], args=list(pods))
        n = len(TIER_ORDER)
        return {
            pod: {tier: int(flat[n * i + j]) for j, tier in enumerate(TIER_ORDER)}
            for i, pod in enumerate(pods)
        }

    async def incarnations(self) -> Mapping[str, str]:
        raw = await self._r.hgetall(self._inc)
        return {_text(k) or "": _text(v) or "" for k, v in raw.items()}

    async def ping(self) -> None:
        await self._r.ping()

    async def close(self) -> None:
        await self._r.aclose()


async def forget_generation(url: str, generation: str, password: str | None = None) -> int:
    """Delete every key of one generation (its pool is gone); returns how many."""
    client: aioredis.Redis = aioredis.Redis.from_url(url, password=password)
    removed = 0
    try:
        batch: list[bytes] = []
        async for key in client.scan_iter(match=f"kvp:{{{generation}}}:*", count=1000):
            batch.append(key)
            if len(batch) >= 1000:
                removed += await client.unlink(*batch)
                batch = []
        if batch:
            removed += await client.unlink(*batch)
    finally:
        await client.aclose()
    return removed
