"""The buffer's Lua scripts: each multi-key update of a job's Redis state runs as one atomic script.

ARGV[1] is the job's key prefix (`physarum:{job}:`). A prompt slot is "epoch:index"; its group is stored under
`group:<job>:<epoch>:<index>`. The returned queue never holds a slot whose group is stored. Time is Redis's
own (TIME), so replicas with skewed clocks agree on lease deadlines. Every loop is bounded by the arguments' count or
by what is stored (never by a number a caller sends): a script that runs long blocks every job sharing the Redis.
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
# Fresh slots come from the cursor on, wrapping epochs; a slot whose group is already stored (written before a
# RESTORE_STATE moved the cursor back) is passed over. Nothing is written until every order needed exists.
LEASE = _COMMON + """
local p, job, count, timeout_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
if redis.call('EXISTS', p .. 'meta') == 0 then return {'missing'} end
local now = now_ms()
reclaim(p, job, now)
local meta = redis.call('HMGET', p .. 'meta', 'num_prompts', 'shuffle', 'epoch', 'cursor', 'generated')
local n, shuffle, epoch, cursor = tonumber(meta[1]), meta[2] == '1', tonumber(meta[3]), tonumber(meta[4])
local generated = meta[5] == '1'  -- a data source's own prompts: served once each, no second epoch
local from_returned = math.min(redis.call('LLEN', p .. 'returned'), count)
local fresh, e, c = {}, epoch, cursor
-- each pass either takes a slot or passes over a stored group, so the stored groups bound the passed-over ones
local passes_left = count + tonumber(redis.call('HGET', p .. 'meta', 'num_groups') or 0)
while #fresh < count - from_returned do
  if generated and c >= n then break end
  passes_left = passes_left - 1
  if passes_left < 0 then return redis.error_reply('ERR lease: passed over more stored groups than exist') end
  local index = c
  if shuffle then
    if redis.call('EXISTS', p .. 'order:' .. e) == 0 then
      local need = {'need'}
      for k = e, e + math.floor((c + count - from_returned - #fresh - 1) / n) do
        if redis.call('EXISTS', p .. 'order:' .. k) == 0 then table.insert(need, tostring(k)) end
      end
      return need
    end
    index = struct.unpack('<I4', redis.call('GETRANGE', p .. 'order:' .. e, 4 * c, 4 * c + 3))
  end
  local slot = e .. ':' .. index
  if redis.call('EXISTS', p .. 'group:' .. job .. ':' .. slot) == 0 then table.insert(fresh, slot) end
  c = c + 1
  if c == n and not generated then e, c = e + 1, 0 end
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
for _, slot in ipairs(fresh) do grant(slot) end
for k = epoch, e - 1 do redis.call('DEL', p .. 'order:' .. k) end
redis.call('HSET', p .. 'meta', 'epoch', e, 'cursor', c)
return out
"""

# ARGV: prefix, position, prompt payloads (their index position, position + 1, ...)
# -> {num_appended, num_prompts} | {-1, num_prompts} a file's dataset already served | {-2, num_prompts} a gap
# A payload whose index is stored already is passed over: the first copy of a position stays. A file's dataset
# (prompt_data, which slime requires even of a data source that makes its own prompts) is replaced while none of
# its prompts has been leased.
APPEND_PROMPTS = """
local p, position = ARGV[1], tonumber(ARGV[2])
local meta = redis.call('HMGET', p .. 'meta', 'num_prompts', 'generated', 'epoch', 'cursor', 'num_groups')
if meta[1] and meta[2] ~= '1' then
  local untouched = meta[3] == '0' and meta[4] == '0' and meta[5] == '0' and redis.call('EXISTS', p .. 'leases',
    p .. 'returned') == 0
  if not untouched then return {-1, tonumber(meta[1])} end
  if position > 0 then return {-2, 0} end
  redis.call('DEL', p .. 'prompts', p .. 'meta', p .. 'order:0')
  meta = {false}
end
local n = tonumber(meta[1] or 0)
if position > n then return {-2, n} end
if not meta[1] then
  redis.call('HSET', p .. 'meta', 'num_prompts', 0, 'shuffle', 0, 'seed', 0, 'num_skipped', 0, 'path', '',
             'epoch', 0, 'cursor', 0, 'num_groups', 0, 'generated', 1)
end
local appended = 0
for i = 3, #ARGV do
  if position + i - 3 == n then
    redis.call('HSET', p .. 'prompts', n, ARGV[i])
    n, appended = n + 1, appended + 1
  end
end
redis.call('HSET', p .. 'meta', 'num_prompts', n)
return {appended, n}
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

# ARGV: per group (prefix, group_id, rollout_id, lease_id, slot, "oldest newest" weight versions, num_tokens,
# payload) -> {1 written | 0 duplicate, ...} | {-1, position of a group of an unknown job}
PUT_GROUPS = """
for i = 1, #ARGV, 8 do
  if redis.call('EXISTS', ARGV[i] .. 'meta') == 0 then return {-1, (i - 1) / 8} end
end
local out = {}
for i = 1, #ARGV, 8 do
  local p, gid, rollout, lease, slot = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3], ARGV[i + 4]
  local new = redis.call('SET', p .. 'group:' .. gid, ARGV[i + 7], 'NX')
  if new then
    redis.call('RPUSH', p .. 'rollout:' .. rollout, gid)
    if tonumber(rollout) >= 0 then redis.call('ZADD', p .. 'rollouts', rollout, rollout) end
    redis.call('HSET', p .. 'versions', gid, ARGV[i + 5])
    redis.call('HSET', p .. 'tokens', gid, ARGV[i + 6])
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

# ARGV: prefix, rollout_id, num_groups, with_tokens (0/1) -> {have} while the rollout has fewer than num_groups
# groups, else {have, group_id...} (its first num_groups, in the order they were assigned), then under with_tokens
# each group's token count (0 for a group stored before counts were kept) | false unknown job.
# The payloads are read with MGET after it: copying them in and out of Lua took longer than that round trip.
READ_GROUP_IDS = """
local p, rollout, want = ARGV[1], ARGV[2], tonumber(ARGV[3])
if redis.call('EXISTS', p .. 'meta') == 0 then return false end
local have = redis.call('LLEN', p .. 'rollout:' .. rollout)
if have < want then return {have} end
local out = redis.call('LRANGE', p .. 'rollout:' .. rollout, 0, want - 1)
if ARGV[4] == '1' then
  for i = 1, want do table.insert(out, tonumber(redis.call('HGET', p .. 'tokens', out[i]) or 0)) end
end
table.insert(out, 1, have)
return out
"""

# ARGV: prefix, rollout_id, num_groups, min_weight_version, policy ('drop' | 'regenerate'), max_weight_version
# -> {num assigned to the rollout, stale dropped so far, stale regenerated so far} | false unknown job
# Moves stream groups (rollout -2) to the rollout in write order until it has num_groups. A stale group (its oldest
# token's version below the minimum, or its newest above a maximum >= 0) goes to the dropped list (rollout -1) or is
# deleted and its slot queued again.
TAKE = """
local p, rollout, want, min_version, policy = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local max_version = tonumber(ARGV[6])
local function stale(gid)
  local versions = redis.call('HGET', p .. 'versions', gid) or '-1 -1'
  local oldest, newest = string.match(versions, '^(%-?%d+) (%-?%d+)$')
  return tonumber(oldest) < min_version or (max_version >= 0 and tonumber(newest) > max_version)
end
if redis.call('EXISTS', p .. 'meta') == 0 then return false end
local have = redis.call('LLEN', p .. 'rollout:' .. rollout)
while have < want do
  local gid = redis.call('LPOP', p .. 'rollout:-2')
  if not gid then break end
  if stale(gid) then
    if policy == 'drop' then
      redis.call('RPUSH', p .. 'rollout:-1', gid)
      redis.call('HINCRBY', p .. 'meta', 'stale_dropped', 1)
    else
      redis.call('DEL', p .. 'group:' .. gid)
      redis.call('HDEL', p .. 'versions', gid)
      redis.call('HDEL', p .. 'tokens', gid)
      redis.call('RPUSH', p .. 'returned', string.match(gid, '(%d+:%d+)$'))
      redis.call('HINCRBY', p .. 'meta', 'stale_regenerated', 1)
      redis.call('HINCRBY', p .. 'meta', 'num_groups', -1)
    end
  else
    redis.call('RPUSH', p .. 'rollout:' .. rollout, gid)
    redis.call('ZADD', p .. 'rollouts', rollout, rollout)
    have = have + 1
  end
end
local m = redis.call('HMGET', p .. 'meta', 'stale_dropped', 'stale_regenerated')
return {have, tonumber(m[1] or 0), tonumber(m[2] or 0)}
"""

# ARGV: prefix, job_id -> {num_prompts, epoch, cursor, num_leased, num_returned, num_groups} | nil unknown job
STATS = _COMMON + """
local p = ARGV[1]
if redis.call('EXISTS', p .. 'meta') == 0 then return false end
reclaim(p, ARGV[2], now_ms())
local m = redis.call('HMGET', p .. 'meta', 'num_prompts', 'epoch', 'cursor', 'num_groups')
return {m[1], m[2], m[3], redis.call('HLEN', p .. 'leases'), redis.call('LLEN', p .. 'returned'), m[4]}
"""

# ARGV: prefix, rollout_id (the last one trained on)
# -> {num_prompts, shuffle, seed, epoch, cursor, #returned, returned..., #leased, leased..., pending..., generated}
# | nil
SAVE_STATE = """
local p, after = ARGV[1], tonumber(ARGV[2])
if redis.call('EXISTS', p .. 'meta') == 0 then return false end
local m = redis.call('HMGET', p .. 'meta', 'num_prompts', 'shuffle', 'seed', 'epoch', 'cursor')
local out = {m[1], m[2], m[3], m[4], m[5]}
local returned = redis.call('LRANGE', p .. 'returned', 0, -1)
table.insert(out, #returned)
for _, slot in ipairs(returned) do table.insert(out, slot) end
local leased = {}
for _, id in ipairs(redis.call('ZRANGE', p .. 'deadlines', 0, -1)) do  -- deadline order is lease order
  local slot = redis.call('HGET', p .. 'leases', id)
  if slot then table.insert(leased, slot) end
end
table.insert(out, #leased)
for _, slot in ipairs(leased) do table.insert(out, slot) end
-- the rollouts that hold groups (a sorted set), never every number up to the largest one written
for _, r in ipairs(redis.call('ZRANGEBYSCORE', p .. 'rollouts', '(' .. after, '+inf')) do
  for _, gid in ipairs(redis.call('LRANGE', p .. 'rollout:' .. r, 0, -1)) do
    table.insert(out, string.match(gid, '(%d+:%d+)$'))
  end
end
-- a fully_async stream's groups not yet taken: one that is refused as stale later is deleted, and a restore must
-- queue its prompt again
for _, gid in ipairs(redis.call('LRANGE', p .. 'rollout:-2', 0, -1)) do
  table.insert(out, string.match(gid, '(%d+:%d+)$'))
end
table.insert(out, redis.call('HGET', p .. 'meta', 'generated') or '0')
return out
"""

# ARGV: prefix, job_id, num_prompts, shuffle (0/1), seed, epoch, cursor, generated (0/1), slots to queue again
# (in order)... -> {num_requeued, num_leases_dropped} | {-1} unknown job | {-2, num_prompts, shuffle, seed} another
# dataset
# Outstanding leases end (a late write of theirs is still stored once); the cursor goes back to the saved one,
# and LEASE passes over the slots whose groups were stored since.
RESTORE_STATE = """
local p, job = ARGV[1], ARGV[2]
if redis.call('EXISTS', p .. 'meta') == 0 then return {-1} end
local m = redis.call('HMGET', p .. 'meta', 'num_prompts', 'shuffle', 'seed', 'generated')
-- a data source's own prompts only grow: the state's are a prefix of those stored, and its cursor may be at their end
local same_prompts = m[1] == ARGV[3]
if (m[4] or '0') ~= ARGV[8] then same_prompts = false
elseif m[4] == '1' then same_prompts = tonumber(ARGV[3]) <= tonumber(m[1]) end
if not same_prompts or m[2] ~= ARGV[4] or m[3] ~= ARGV[5] then return {-2, m[1], m[2], m[3]} end
local dropped = redis.call('HLEN', p .. 'leases')
redis.call('DEL', p .. 'leases', p .. 'deadlines', p .. 'returned')
local seen, num = {}, 0
for i = 9, #ARGV do
  local slot = ARGV[i]
  if not seen[slot] and redis.call('EXISTS', p .. 'group:' .. job .. ':' .. slot) == 0 then
    redis.call('RPUSH', p .. 'returned', slot)
    num = num + 1
  end
  seen[slot] = true
end
redis.call('HSET', p .. 'meta', 'epoch', ARGV[6], 'cursor', ARGV[7])
return {num, dropped}
"""
