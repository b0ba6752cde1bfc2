"""The Redis index's Lua scripts (layout: ``redis_layout``), with the tier table filled in.

Every script takes its key names as arguments, declares none, and is flagged
``allow-cross-slot-keys``: a node runs it over every bucket it serves, whatever the
slots (Redis 7 refuses a script whose *declared* keys span slots, not one that
touches local keys). Redis' Lua turns numbers into strings slowly, so names and
window suffixes come ready-made from the client.
"""

from __future__ import annotations

from typing import Final

from kvplane.router.index.redis_layout import HBM_BIT, SLOT_MUL
from kvplane.router.index.redis_nodes import Script


def _fill(source: str) -> str:
    return source.replace("__SLOT_MUL__", str(SLOT_MUL)).replace("__HBM__", str(HBM_BIT))


_FIELDS = """
local function fields(blob, from, n)
  local f = {}
  for j = 1, n do f[j] = string.sub(blob, from + 8 * j - 8, from + 8 * j - 1) end
  return f
end
"""

# ARGV: this window's suffix, the last one's, the fields blob (8-byte keys, bucket after
# bucket), one byte per bucket (its number of fields), the pods hash ('' when another
# node holds it), the bucket names, then the candidate pods.
# Returns {holders, this window's marks, the last window's, pods}: a value or nil per
# field (a window's list is empty when no bucket here has that window), and
# ``slot␟incarnation`` or nil per pod.
LOOKUP: Final = Script(
    "#!lua flags=allow-cross-slot-keys,no-writes\n"
    + _FIELDS
    + """
local per = ARGV[4]
local nb = #per
local held, w1, w0 = {}, {}, {}
local any1, any0 = false, false
local at = 1
for b = 1, nb do
  local name = ARGV[5 + b]
  local n = string.byte(per, b)
  local f = fields(ARGV[3], at, n)
  at = at + 8 * n
  local base = #held
  local v = redis.call('HMGET', name, unpack(f))
  for j = 1, n do held[base + j] = v[j] end
  local t1, t0 = name .. ARGV[1], name .. ARGV[2]
  if redis.call('EXISTS', t1) == 1 then
    any1 = true
    v = redis.call('HMGET', t1, unpack(f))
    for j = 1, n do w1[base + j] = v[j] end
  else
    for j = 1, n do w1[base + j] = false end
  end
  if redis.call('EXISTS', t0) == 1 then
    any0 = true
    v = redis.call('HMGET', t0, unpack(f))
    for j = 1, n do w0[base + j] = v[j] end
  else
    for j = 1, n do w0[base + j] = false end
  end
end
if not any1 then w1 = {} end
if not any0 then w0 = {} end
local pods = {}
if ARGV[5] ~= '' and #ARGV > 5 + nb then
  pods = redis.call('HMGET', ARGV[5], unpack(ARGV, 6 + nb))
end
return {held, w1, w0, pods}
"""
)

# ARGV: this window's suffix, the last one's; then per segment five: a bucket, 's' (store)
# or 'r' (remove), the pod's slot, one tier bit, the fields blob. A write sets or clears
# the tier bit in the slot's entry; an entry left with no bit goes, and a field with no
# entry. An HBM write also ends the slot's tentative marks on those fields.
WRITE: Final = Script(
    _fill(
        "#!lua flags=allow-cross-slot-keys\n"
        + _FIELDS
        + """
local M, HBM = __SLOT_MUL__, __HBM__
local function put(x, slot, tb, store)
  for k = 1, #x, 2 do
    local a, b = string.byte(x, k, k + 1)
    local e = a * 256 + b
    if math.floor(e / M) == slot then
      local m = e % M
      local nm
      if store then nm = bit.bor(m, tb) else nm = bit.band(m, bit.bnot(tb)) end
      if nm == m then return x end
      if nm == 0 then return string.sub(x, 1, k - 1) .. string.sub(x, k + 2) end
      e = slot * M + nm
      return string.sub(x, 1, k - 1) .. string.char(math.floor(e / 256), e % 256)
        .. string.sub(x, k + 2)
    end
  end
  if not store then return x end
  local e = slot * M + tb
  return x .. string.char(math.floor(e / 256), e % 256)
end
local function apply(name, f, set, del)
  if #set > 0 then redis.call('HSET', name, unpack(set)) end
  if #del > 0 then redis.call('HDEL', name, unpack(del)) end
end
local function unmark(name, f, sb)
  for w = 1, 2 do
    local tn = name .. ARGV[w]
    if redis.call('EXISTS', tn) == 1 then
      local v = redis.call('HMGET', tn, unpack(f))
      local set, del = {}, {}
      for j = 1, #f do
        local x = v[j]
        if x then
          local keep = {}
          for k = 1, #x, 8 do
            if string.sub(x, k, k + 1) ~= sb then keep[#keep + 1] = string.sub(x, k, k + 7) end
          end
          if #keep == 0 then del[#del + 1] = f[j]
          elseif #keep * 8 < #x then
            set[#set + 1] = f[j]
            set[#set + 1] = table.concat(keep)
          end
        end
      end
      apply(tn, f, set, del)
    end
  end
end
local i, written = 3, 0
while i <= #ARGV do
  local name, store = ARGV[i], ARGV[i + 1] == 's'
  local slot, tb, blob = tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3]), ARGV[i + 4]
  i = i + 5
  local f = fields(blob, 1, #blob / 8)
  local v = redis.call('HMGET', name, unpack(f))
  local set, del = {}, {}
  for j = 1, #f do
    local x = v[j] or ''
    local y = put(x, slot, tb, store)
    if y ~= x then
      if y == '' then del[#del + 1] = f[j] else
        set[#set + 1] = f[j]
        set[#set + 1] = y
      end
    end
  end
  apply(name, f, set, del)
  if tb == HBM then unmark(name, f, string.char(math.floor(slot / 256), slot % 256)) end
  written = written + #f
end
return written
"""
    )
)

# ARGV: the window suffix, the window keys' lifetime in ms, the slot (2 bytes), the
# expiry (6 bytes, ms); then pairs: a bucket, the fields blob. A mark keeps the later
# of its expiries.
TENTATIVE: Final = Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + _FIELDS
    + """
local function ms(s)
  local a, b, c, d, e, f = string.byte(s, 1, 6)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end
local sb, exp = ARGV[3], ARGV[4]
local entry, until_ms = sb .. exp, ms(exp)
for i = 5, #ARGV, 2 do
  local tn, blob = ARGV[i] .. ARGV[1], ARGV[i + 1]
  local f = fields(blob, 1, #blob / 8)
  local v = redis.call('HMGET', tn, unpack(f))
  local set = {}
  for j = 1, #f do
    local x = v[j]
    local y = entry
    if x then
      y = x .. entry
      for k = 1, #x, 8 do
        if string.sub(x, k, k + 1) == sb then
          if ms(string.sub(x, k + 2, k + 7)) < until_ms then
            y = string.sub(x, 1, k - 1) .. entry .. string.sub(x, k + 8)
          else
            y = x
          end
          break
        end
      end
    end
    if y ~= x then
      set[#set + 1] = f[j]
      set[#set + 1] = y
    end
  end
  if #set > 0 then
    redis.call('HSET', tn, unpack(set))
    redis.call('PEXPIRE', tn, ARGV[2], 'NX')
  end
end
return 1
"""
)

# ARGV: 'begin', 'drop' or 'mark'; the pods hash, the slots hash; the lease key and its
# owner ('' and '': no lease); the pod, its incarnation, now in ms, the slot count.
# begin: the pod's slot for this incarnation, a new one if it changed (the old slot is
# dead from now on); drop: the pod's slot dies; mark: the pod's slot, a new one under
# the tentative incarnation if it has none. Returns the slot, -1 when another indexer
# holds the lease, -2 when every slot is taken, -3 when there is nothing to drop.
SLOT: Final = Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + """
local op, pods, slots, lease, owner, pod, inc, now, max =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9])
if lease ~= '' and redis.call('GET', lease) ~= owner then return -1 end
local cur = redis.call('HGET', pods, pod)
if cur then
  local sep = string.find(cur, '\\31', 1, true)
  local slot, held = string.sub(cur, 1, sep - 1), string.sub(cur, sep + 1)
  if op == 'mark' or (op == 'begin' and held == inc) then return tonumber(slot) end
  redis.call('HSET', slots, slot, '~' .. now)
  if op == 'drop' then
    redis.call('HDEL', pods, pod)
    return tonumber(slot)
  end
elseif op == 'drop' then
  return -3
end
local taken = {}
for _, s in ipairs(redis.call('HKEYS', slots)) do taken[tonumber(s)] = true end
for s = 0, max - 1 do
  if not taken[s] then
    redis.call('HSET', slots, s, pod)
    redis.call('HSET', pods, pod, s .. '\\31' .. inc)
    return s
  end
end
return -2
"""
)

# ARGV: what to drop, 3 bytes per slot (the slot, 2 bytes, then the tier bits to clear),
# then bucket names. Returns the number of fields rewritten.
SWEEP: Final = Script(
    _fill(
        "#!lua flags=allow-cross-slot-keys\n"
        + """
local M = __SLOT_MUL__
local drop = {}
for k = 1, #ARGV[1], 3 do
  local a, b, m = string.byte(ARGV[1], k, k + 2)
  drop[a * 256 + b] = m
end
local changed = 0
for i = 2, #ARGV do
  local name = ARGV[i]
  local h = redis.call('HGETALL', name)
  local set, del = {}, {}
  for k = 1, #h, 2 do
    local x = h[k + 1]
    local keep, dirty = {}, false
    for e = 1, #x, 2 do
      local a, b = string.byte(x, e, e + 1)
      local v = a * 256 + b
      local s = math.floor(v / M)
      local dm = drop[s]
      if dm then
        dirty = true
        local m = bit.band(v % M, bit.bnot(dm))
        if m ~= 0 then
          v = s * M + m
          keep[#keep + 1] = string.char(math.floor(v / 256), v % 256)
        end
      else
        keep[#keep + 1] = string.sub(x, e, e + 1)
      end
    end
    if dirty then
      changed = changed + 1
      if #keep == 0 then del[#del + 1] = h[k] else
        set[#set + 1] = h[k]
        set[#set + 1] = table.concat(keep)
      end
    end
  end
  if #set > 0 then redis.call('HSET', name, unpack(set)) end
  if #del > 0 then redis.call('HDEL', name, unpack(del)) end
end
return changed
"""
    )
)

# ARGV: the slots hash, then pairs: a slot, the value it must still have. Frees the
# slots whose value is unchanged; returns how many.
FREE: Final = Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + """
local n = 0
for i = 2, #ARGV, 2 do
  if redis.call('HGET', ARGV[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', ARGV[1], ARGV[i])
    n = n + 1
  end
end
return n
"""
)
