"""The Lua scripts of the Redis Streams buffer (`redis_stream.RedisBuffer`), one per atomic step.

Payloads never pass through these scripts on the hot path (put and get): on Redis 7.0 moving a
16 KiB value through Lua costs several times a plain XADD or XREADGROUP. Only the rare paths
(quarantine of an entry a consumer found bad, accounting snapshots) read payloads here.
"""

# Shared Lua prelude: the group's pending count, creating stream and group when missing (a stream
# that vanished is recreated at id 0, so every entry still in it counts as undelivered).
PENDING = """
local function pending_count(stream, group)
  local summary = redis.pcall('XPENDING', stream, group)
  if type(summary) == 'table' and summary.err then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
    return 0
  end
  return summary[1]
end
"""

# KEYS: stream, reservations. ARGV: group, 'put'|'get', limit, n, token, ttl_ms.
# Returns {granted, server ms, last delivered id when a get found nothing undelivered}.
RESERVE = PENDING + """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local reserved, mine = 0, ARGV[5] .. ':'
for _, m in ipairs(redis.call('ZRANGE', KEYS[2], 0, -1)) do
  if string.sub(m, 1, #mine) == mine then
    redis.call('ZREM', KEYS[2], m)  -- this call's own, from an attempt whose reply was lost
  else
    reserved = reserved + tonumber(string.match(m, ':(%d+)$'))
  end
end
local pending = pending_count(KEYS[1], ARGV[1])
local depth = redis.call('XLEN', KEYS[1]) - pending
local limit, n, granted = tonumber(ARGV[3]), tonumber(ARGV[4]), 0
if ARGV[2] == 'put' then
  if depth + reserved + n <= math.max(limit, n) then granted = n end
else
  granted = math.max(0, math.min(n, limit - pending - reserved, depth))
end
if granted > 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), mine .. granted)
  return {granted, now, false}
end
if ARGV[2] == 'get' and depth == 0 then
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local fields = {}
    for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
    if fields['name'] == ARGV[1] then return {0, now, fields['last-delivered-id']} end
  end
end
return {0, now, false}
"""

# KEYS: stream. ARGV: group, id... Acknowledges and deletes; ids not pending are left alone.
ACK = """
local n = 0
for i = 2, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    n = n + 1
  end
end
return n
"""

# KEYS: stream, quarantine, reasons. ARGV: group, id, reason, message, consumer, group id (or
# ''), [data].
# Moves a pending entry to the quarantine stream (its bytes: `data`, or read from the stream when
# not given, for an entry a consumer found bad after decoding it) and counts its reason; the
# XACK guard makes a retry after a lost reply a no-op.
QUARANTINE = """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  local data = ARGV[7]
  if data == nil then
    data = ''
    local found = redis.call('XRANGE', KEYS[1], ARGV[2], ARGV[2])
    if #found == 1 then
      local fields = found[1][2]
      for i = 1, #fields, 2 do if fields[i] == 'group' then data = fields[i + 1] end end
    end
  end
  redis.call('XADD', KEYS[2], '*', 'id', ARGV[2], 'group', data, 'reason', ARGV[4],
             'kind', ARGV[3], 'consumer', ARGV[5], 'group_id', ARGV[6])
  redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
  redis.call('XDEL', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

# KEYS: stream, quarantine, added, reasons. ARGV: group.
# Returns {xlen, pending, quarantined, added, {reason, count, ...}}.
COUNTS = """
local pending = 0
local summary = redis.pcall('XPENDING', KEYS[1], ARGV[1])
if not (type(summary) == 'table' and summary.err) then pending = summary[1] end
return {redis.call('XLEN', KEYS[1]), pending, redis.call('XLEN', KEYS[2]),
        tonumber(redis.call('GET', KEYS[3]) or '0'), redis.call('HGETALL', KEYS[4])}
"""

# KEYS: stream, quarantine. ARGV: group. Every id in the stream, the pending list, the quarantine
# (for tests and audits: it moves every payload through Lua, so it is slow on a full buffer).
ALL_IDS = """
local function scan(key, field)
  local out, start = {}, '-'
  while true do
    local page = redis.call('XRANGE', key, start, '+', 'COUNT', 1000)
    if #page == 0 then return out end
    for _, e in ipairs(page) do
      local value = e[1]
      for i = 1, #e[2], 2 do if field and e[2][i] == field then value = e[2][i + 1] end end
      out[#out + 1] = value
    end
    start = '(' .. page[#page][1]
  end
end
local pending, start = {}, '-'
while redis.call('EXISTS', KEYS[1]) == 1 do
  local page = redis.pcall('XPENDING', KEYS[1], ARGV[1], start, '+', 1000)
  if (type(page) == 'table' and page.err) or #page == 0 then break end
  for _, p in ipairs(page) do pending[#pending + 1] = p[1] end
  start = '(' .. page[#page][1]
end
return {scan(KEYS[1], nil), pending, scan(KEYS[2], 'id')}
"""
