"""The buffer's Lua scripts: each multi-key update of a job's Redis state runs as one atomic script.

ARGV[1] is the job's key prefix (`physarum:{job}:`). A prompt slot is "epoch:index"; its group is stored under
`group:<job>:<epoch>:<index>`. The returned queue never holds a slot whose group is stored. Time is Redis's
own (TIME), so replicas with skewed clocks agree on lease deadlines.
"""

_COMMON = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function give_back(p, job, id)  -- a lease ends unanswered: its prompt is served again
  local slot = redis.call('HGET', p .. 'leases', id)
  redis.call('HDEL', p .. 'leases', id)
  redis.call('ZREM', p .. 'deadlines', id)
  if not slot then return 0 end
  if redis.call('EXISTS', p .. 'group:' .. job .. ':' .. slot) == 0 then redis.call('RPUSH', p .. 'returned', slot) end
  return 1
end
local function reclaim(p, job, now)  -- expired leases go back to the returned queue
  local expired = redis.call('ZRANGEBYSCORE', p .. 'deadlines', '-inf', now)
  for _, id in ipairs(expired) do give_back(p, job, id) end
end
"""

# ARGV: prefix, tmp key, num_prompts, shuffle (0/1), seed, num_skipped, path -> 1 stored, 0 already there
FINISH_LOAD = """
local p, tmp = ARGV[1], ARGV[2]
if redis.call('EXISTS', p .. 'meta') == 1 then
  redis.call('DEL', tmp)
  return 0
end
redis.call('RENAME', tmp, p .. 'prompts')
redis.call('PERSIST', p .. 'prompts')
redis.call('HSET', p .. 'meta', 'num_prompts', ARGV[3], 'shuffle', ARGV[4], 'seed', ARGV[5],
           'num_skipped', ARGV[6], 'path', ARGV[7], 'epoch', 0, 'cursor', 0, 'num_groups', 0)
return 1
"""

# ARGV: prefix, job_id, count, timeout_ms, count lease ids.
# -> {'ok', slot, lease_id, prompt, ...} | {'missing'} | {'need', epoch...} (shuffle orders to create first)
LEASE = _COMMON + """
local p, job, count, timeout_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('EXISTS', p .. 'meta') == 0 then return {'missing'} end
local now = now_ms()
reclaim(p, job, now)
local meta = redis.call('HMGET', p .. 'meta', 'num_prompts', 'shuffle', 'epoch', 'cursor')
local n, shuffle, epoch, cursor = tonumber(meta[1]), meta[2] == '1', tonumber(meta[3]), tonumber(meta[4])
local from_returned = math.min(redis.call('LLEN', p .. 'returned'), count)
local fresh = count - from_returned
if shuffle and fresh > 0 then
  local need = {'need'}
  for e = epoch, epoch + math.floor((cursor + fresh - 1) / n) do
    if redis.call('EXISTS', p .. 'order:' .. e) == 0 then table.insert(need, tostring(e)) end
  end
  if #need > 1 then return need end
end
local out, next_id = {'ok'}, 5
local function grant(slot)
  local id = ARGV[next_id]
  next_id = next_id + 1
  redis.call('HSET', p .. 'leases', id, slot)
  redis.call('ZADD', p .. 'deadlines', now + timeout_ms, id)
  table.insert(out, slot)
  table.insert(out, id)
  table.insert(out, redis.call('HGET', p .. 'prompts', string.match(slot, ':(%d+)$')))
end
for _ = 1, from_returned do grant(redis.call('LPOP', p .. 'returned')) end
while fresh > 0 do
  local take = math.min(fresh, n - cursor)
  if shuffle then
    local raw = redis.call('GETRANGE', p .. 'order:' .. epoch, 4 * cursor, 4 * (cursor + take) - 1)
    for j = 0, take - 1 do grant(epoch .. ':' .. struct.unpack('<I4', raw, 4 * j + 1)) end
  else
    for j = 0, take - 1 do grant(epoch .. ':' .. (cursor + j)) end
  end
  cursor, fresh = cursor + take, fresh - take
  if cursor == n then
    redis.call('DEL', p .. 'order:' .. epoch)
    epoch, cursor = epoch + 1, 0
  end
end
redis.call('HSET', p .. 'meta', 'epoch', epoch, 'cursor', cursor)
return out
"""

# ARGV: prefix, epoch, packed order; an epoch already passed is not written again.
SET_ORDER = """
local p, e = ARGV[1], tonumber(ARGV[2])
local epoch = redis.call('HGET', ARGV[1] .. 'meta', 'epoch')
if epoch and tonumber(epoch) <= e then redis.call('SET', p .. 'order:' .. e, ARGV[3], 'NX') end
return 1
"""

# ARGV: prefix, job_id, lease ids -> number returned (unknown ids ignored) | -1 unknown job
RETURN = _COMMON + """
local p, job = ARGV[1], ARGV[2]
if redis.call('EXISTS', p .. 'meta') == 0 then return -1 end
local num = 0
for i = 3, #ARGV do num = num + give_back(p, job, ARGV[i]) end
return num
"""

# ARGV: per group (prefix, group_id, rollout_id, lease_id, slot, payload)
# -> {1 written | 0 duplicate, ...} | {-1, position of a group of an unknown job}
PUT_GROUPS = """
for i = 1, #ARGV, 6 do
  if redis.call('EXISTS', ARGV[i] .. 'meta') == 0 then return {-1, (i - 1) / 6} end
end
local out = {}
for i = 1, #ARGV, 6 do
  local p, gid, rollout, lease, slot = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local new = redis.call('SET', p .. 'group:' .. gid, ARGV[i + 5], 'NX')
  if new then
    redis.call('RPUSH', p .. 'rollout:' .. rollout, gid)
    redis.call('HINCRBY', p .. 'meta', 'num_groups', 1)
  end
  if lease ~= '' and redis.call('HGET', p .. 'leases', lease) == slot then
    redis.call('HDEL', p .. 'leases', lease)
    redis.call('ZREM', p .. 'deadlines', lease)
  end
  redis.call('LREM', p .. 'returned', 0, slot)  -- written meanwhile: never generate it twice
  table.insert(out, new and 1 or 0)
end
return out
"""

# ARGV: prefix, job_id -> {num_prompts, epoch, cursor, num_leased, num_returned, num_groups} | nil unknown job
STATS = _COMMON + """
local p = ARGV[1]
if redis.call('EXISTS', p .. 'meta') == 0 then return false end
reclaim(p, ARGV[2], now_ms())
local m = redis.call('HMGET', p .. 'meta', 'num_prompts', 'epoch', 'cursor', 'num_groups')
return {m[1], m[2], m[3], redis.call('HLEN', p .. 'leases'), redis.call('LLEN', p .. 'returned'), m[4]}
"""
