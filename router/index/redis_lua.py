"""The Redis index's Lua scripts (layout: ``redis_layout``), with the tier table filled in.

Every script declares no keys and is flagged ``allow-cross-slot-keys``: a node runs it
over every bucket it serves, whatever the slots (Redis 7 refuses a script whose
*declared* keys span slots, not one that touches local keys). Blocks come as two
blobs (8-byte keys, 4-byte bucket ids) and the scripts name the buckets themselves:
an argument per block, or a bucket name per block, costs the client more than the
script's work (bench/RESULTS.md, index). Redis' Lua turns numbers into strings slowly,
so window suffixes come ready-made.
"""

from __future__ import annotations

from typing import Final

from kvplane.router.index.redis_layout import HBM_BIT, SLOT_MUL
from kvplane.router.index.redis_nodes import Script


def _fill(source: str) -> str:
    return source.replace("__SLOT_MUL__", str(SLOT_MUL)).replace("__HBM__", str(HBM_BIT))


# Records: block i is the 8 bytes at 8i of a keys blob and the 4-byte bucket id at 4i of
# an ids blob. ``run`` takes the records from i that share a bucket: their fields, the
# bucket's name and the index after them.
_RECORDS = """
local function run(pre, ids, keys, i, stop)
  local id = string.sub(ids, 4 * i + 1, 4 * i + 4)
  local f = {}
  repeat
    f[#f + 1] = string.sub(keys, 8 * i + 1, 8 * i + 8)
    i = i + 1
  until i >= stop or string.sub(ids, 4 * i + 1, 4 * i + 4) ~= id
  return f, pre .. '{' .. string.sub(id, 1, 2) .. '}' .. string.sub(id, 3, 4), i
end
"""

# ARGV: the key prefix, this window's suffix, the last one's; the prompt's chunks on this
# node: their bucket ids (4 bytes each), their block counts (1 byte each), their blocks'
# keys; then the pods table, its version key and the version the caller knows ('', '',
# '' when another node holds the table). Returns per chunk {holders, this window's
# marks, the last window's}: the value of each field (nil where none), a window's 0
# when it has none; then, on the pods table's node, {version} or, if the caller's is
# older, {version, the whole table}.
LOOKUP: Final = Script(
    "#!lua flags=allow-cross-slot-keys,no-writes\n"
    + """
local pre, sfx1, sfx0, ids, per, keys = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local out = {}
local at = 1
for c = 1, #per do
  local id = string.sub(ids, 4 * c - 3, 4 * c)
  local name = pre .. '{' .. string.sub(id, 1, 2) .. '}' .. string.sub(id, 3, 4)
  local f = {}
  for j = 1, string.byte(per, c) do
    f[j] = string.sub(keys, at, at + 7)
    at = at + 8
  end
  local t1, t0 = name .. sfx1, name .. sfx0
  local m1, m0 = 0, 0
  if redis.call('EXISTS', t1, t0) > 0 then
    if redis.call('EXISTS', t1) == 1 then m1 = redis.call('HMGET', t1, unpack(f)) end
    if redis.call('EXISTS', t0) == 1 then m0 = redis.call('HMGET', t0, unpack(f)) end
  end
  out[c] = {redis.call('HMGET', name, unpack(f)), m1, m0}
end
if ARGV[7] ~= '' then
  local version = redis.call('GET', ARGV[8]) or '0'
  if version == ARGV[9] then
    out[#out + 1] = {version}
  else
    out[#out + 1] = {version, redis.call('HGETALL', ARGV[7])}
  end
end
return out
"""
)

# ARGV: the key prefix, this window's suffix, the last one's, the ops blob (6 bytes an
# op: the pod's slot (2), one tier bit (1), 1 to store or 0 to remove (1), its number
# of records (2)), the ids blob and the keys blob of the records, op after op. A write
# sets or clears the tier bit in the slot's entry; an entry left with no bit goes, and
# a field with no entry. An HBM write also ends the slot's tentative marks on those
# fields. Returns the number of records.
WRITE: Final = Script(
    _fill(
        "#!lua flags=allow-cross-slot-keys\n"
        + _RECORDS
        + """
local M, HBM = __SLOT_MUL__, __HBM__
local pre, ops, ids, keys = ARGV[1], ARGV[4], ARGV[5], ARGV[6]
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
local function apply(name, set, del)
  if #set > 0 then redis.call('HSET', name, unpack(set)) end
  if #del > 0 then redis.call('HDEL', name, unpack(del)) end
end
local function unmark(name, f, sb)
  if redis.call('EXISTS', name .. ARGV[2], name .. ARGV[3]) == 0 then return end
  for w = 2, 3 do
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
      apply(tn, set, del)
    end
  end
end
local i = 0
for o = 1, #ops, 6 do
  local sh, sl, tb, st, ch, cl = string.byte(ops, o, o + 5)
  local slot, store, stop = sh * 256 + sl, st == 1, i + ch * 256 + cl
  local sb = string.char(sh, sl)
  while i < stop do
    local f, name
    f, name, i = run(pre, ids, keys, i, stop)
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
    apply(name, set, del)
    if tb == HBM then unmark(name, f, sb) end
  end
end
return i
"""
    )
)

# ARGV: the key prefix, the window suffix, the window keys' lifetime in ms, the slot (2
# bytes), the expiry (6 bytes, ms), the ids blob and the keys blob. A mark keeps the
# later of its expiries.
TENTATIVE: Final = Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + _RECORDS
    + """
local function ms(s)
  local a, b, c, d, e, f = string.byte(s, 1, 6)
  return ((((a * 256 + b) * 256 + c) * 256 + d) * 256 + e) * 256 + f
end
local pre, sfx, life, sb, exp, ids, keys = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5],
  ARGV[6], ARGV[7]
local entry, until_ms = sb .. exp, ms(exp)
local i, stop = 0, #keys / 8
while i < stop do
  local f, name
  f, name, i = run(pre, ids, keys, i, stop)
  local tn = name .. sfx
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
    redis.call('PEXPIRE', tn, life, 'NX')
  end
end
return 1
"""
)

# ARGV: 'begin', 'drop' or 'mark'; the pods hash, the slots hash; the lease key and its
# owner ('' and '': no lease); the pod, its incarnation, now in ms, the slot count, and
# the pods table's version key (bumped on every change of the table).
# begin: the pod's slot for this incarnation, a new one if it changed (the old slot is
# dead from now on); drop: the pod's slot dies; mark: the pod's slot, a new one under
# the tentative incarnation if it has none. Returns the slot, -1 when another indexer
# holds the lease, -2 when every slot is taken, -3 when there is nothing to drop.
SLOT: Final = Script(
    "#!lua flags=allow-cross-slot-keys\n"
    + """
local op, pods, slots, lease, owner, pod, inc, now, max, version =
  ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9]),
  ARGV[10]
if lease ~= '' and redis.call('GET', lease) ~= owner then return -1 end
local cur = redis.call('HGET', pods, pod)
if cur then
  local sep = string.find(cur, '\\31', 1, true)
  local slot, held = string.sub(cur, 1, sep - 1), string.sub(cur, sep + 1)
  if op == 'mark' or (op == 'begin' and held == inc) then return tonumber(slot) end
  redis.call('HSET', slots, slot, '~' .. now)
  if op == 'drop' then
    redis.call('HDEL', pods, pod)
    redis.call('INCR', version)
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
    redis.call('INCR', version)
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
