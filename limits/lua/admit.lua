-- fleetgate limits: admit one request (one round trip, atomic).
-- The same algorithm, step for step, as MemoryStore.admit_now (limits/memory_store.py)
-- and limits/gcra.py check(); docs/limits.md describes the keys and fields.
--
-- KEYS[1]  hash  fleetgate:limits:{<tenant>}:s  buckets, counters, quotas, lease payloads
-- KEYS[2]  zset  fleetgate:limits:{<tenant>}:l  lease id -> expiry (seconds)
-- ARGV     now ("" = Redis TIME), lease id, lease ttl s, reserve, day limit ("" = none),
--          month limit ("" = none), ncaps, {cap field, cap}*, nbuckets,
--          {bucket field, kind r|t, interval s, tolerance s, cost}*
-- Returns  {allowed 0|1, failed field, retry s, req field, req remaining, req reset s,
--          tok field, tok remaining, tok reset s, now}

local SLACK = 1e-9          -- limits.gcra.SLACK_S
local RECLAIM_MAX = 512     -- expired leases reclaimed per call, to bound script time

local S, L = KEYS[1], KEYS[2]
local now = clock(ARGV[1])
local lease_id, ttl, reserve = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local day_limit, month_limit = tonumber(ARGV[5]), tonumber(ARGV[6])

local caps, buckets = {}, {}
local i = 7
for _ = 1, tonumber(ARGV[i]) do
  caps[#caps + 1] = {field = ARGV[i + 1], cap = tonumber(ARGV[i + 2])}; i = i + 2
end
i = i + 1
for _ = 1, tonumber(ARGV[i]) do
  buckets[#buckets + 1] = {field = ARGV[i + 1], kind = ARGV[i + 2],
                           interval = tonumber(ARGV[i + 3]), tol = tonumber(ARGV[i + 4]),
                           cost = tonumber(ARGV[i + 5])}
  i = i + 5
end

-- One read for everything this call looks at.
local names = {unpack(QUOTA_FIELDS)}
for _, c in ipairs(caps) do names[#names + 1] = c.field end
for _, b in ipairs(buckets) do
  names[#names + 1] = b.field .. '|d'; names[#names + 1] = b.field .. '|a'
end
names[#names + 1] = 'l|' .. lease_id
local vals = redis.call('HMGET', S, unpack(names))
if vals[#names] then
  -- This lease id was admitted already: a client retry after a lost reply. Admitting it
  -- again would take a second slot that no settle would ever return.
  return {1, '', '0', '', 0, '0', '', 0, '0', fmt(now)}
end
local q = read_quota(vals)
local counters = {}
for k, c in ipairs(caps) do counters[c.field] = tonumber(vals[6 + k]) or 0 end
local off = 6 + #caps
for k, b in ipairs(buckets) do
  b.debt = tonumber(vals[off + 2 * k - 1]) or 0
  b.at = tonumber(vals[off + 2 * k]) or 0
end

-- 1. Reclaim expired leases (a dead gateway's slots and reservations come back) and
--    expired tombstones of settled ones.
local qdirty = false
local expired = redis.call('ZRANGEBYSCORE', L, '-inf', fmt(now), 'LIMIT', 0, RECLAIM_MAX)
for _, id in ipairs(expired) do
  local payload = redis.call('HGET', S, 'l|' .. id)
  if payload and payload ~= SETTLED then qdirty = release(S, q, payload, counters) or qdirty end
  if payload then redis.call('HDEL', S, 'l|' .. id) end
  redis.call('ZREM', L, id)
end

-- 2. Roll the calendar windows (UTC).
local w = nil
if day_limit ~= nil or month_limit ~= nil then
  w = windows(now)
  qdirty = roll(q, w) or qdirty
end

-- 3. Evaluate every bucket (GCRA, limits/gcra.py check()).
local req, tok
for _, b in ipairs(buckets) do
  local debt = math.max(b.debt - math.max(now - b.at, 0), 0)
  b.new_at = math.max(now, b.at)
  local new = debt + b.cost * b.interval
  if new <= b.tol + SLACK then
    b.ok, b.retry, b.new_debt, b.reset = true, 0, new, new
    b.remaining = math.max(math.floor((b.tol - new + SLACK) / b.interval), 0)
  else
    b.ok, b.new_debt, b.reset = false, debt, debt
    b.retry = (b.cost * b.interval <= b.tol + SLACK) and (new - b.tol) or -1
    b.remaining = math.max(math.floor((b.tol - debt + SLACK) / b.interval), 0)
  end
  if b.kind == 'r' then
    if req == nil or b.remaining < req.remaining then req = b end
  elseif tok == nil or b.remaining < tok.remaining then
    tok = b
  end
end

-- 4. First failure: caps, then quotas, then rates (the longest wait wins).
local failed, retry = '', 0
for _, c in ipairs(caps) do
  if counters[c.field] >= c.cap then failed = c.field; break end
end
if failed == '' and day_limit ~= nil and q.du + q.dr + reserve > day_limit then
  failed, retry = 'q|d', w.day_reset - now
end
if failed == '' and month_limit ~= nil and q.mu + q.mr + reserve > month_limit then
  failed, retry = 'q|m', w.month_reset - now
end
if failed == '' then
  for _, b in ipairs(buckets) do
    if not b.ok then
      if b.retry < 0 then failed, retry = b.field, -1; break end
      if failed == '' or b.retry > retry then failed, retry = b.field, b.retry end
    end
  end
end

local function view(b)
  if b == nil then return '', 0, '0' end
  return b.field, b.remaining, fmt(b.reset)
end
local rf, rr, rs = view(req)
local tf, tr, ts = view(tok)

if failed ~= '' then
  if qdirty then
    redis.call('HSET', S, unpack(quota_writes(q, {})))
    -- A first request may be rejected (quota) yet have written the window fields.
    if w ~= nil then
      local until_reset = month_limit ~= nil and w.month_reset - now or w.day_reset - now
      extend(S, math.ceil(until_reset * 1000) + GRACE_MS)
    end
  end
  return {0, failed, fmt(retry), rf, rr, rs, tf, tr, ts, fmt(now)}
end

-- 5. Commit: buckets, counters, quota reservation, the lease.
local writes, keep = {}, 0
for _, b in ipairs(buckets) do
  writes[#writes + 1] = b.field .. '|d'; writes[#writes + 1] = fmt(b.new_debt)
  writes[#writes + 1] = b.field .. '|a'; writes[#writes + 1] = fmt(b.new_at)
  keep = math.max(keep, b.new_debt)
end
local cap_fields = {}
if #caps > 0 then keep = math.max(keep, ttl) end
for _, c in ipairs(caps) do
  redis.call('HINCRBY', S, c.field, 1)
  cap_fields[#cap_fields + 1] = c.field
end
local lease_day, lease_month = '', ''
if day_limit ~= nil then
  q.dr = q.dr + reserve; qdirty = true; lease_day = q.d
  keep = math.max(keep, ttl, w.day_reset - now)
end
if month_limit ~= nil then
  q.mr = q.mr + reserve; qdirty = true; lease_month = q.m
  keep = math.max(keep, ttl, w.month_reset - now)
end
if qdirty then quota_writes(q, writes) end
-- A lease is recorded only when expiry has something to give back (slots or quota).
local held = #caps > 0 or day_limit ~= nil or month_limit ~= nil
if held then
  writes[#writes + 1] = 'l|' .. lease_id
  writes[#writes + 1] = reserve .. ';' .. lease_day .. ';' .. lease_month .. ';'
                        .. table.concat(cap_fields, ',')
end
if #writes > 0 then
  redis.call('HSET', S, unpack(writes))
  extend(S, math.ceil(keep * 1000) + GRACE_MS)
end
if held then
  redis.call('ZADD', L, fmt(now + ttl), lease_id)
  extend(L, math.ceil(ttl * 1000) + GRACE_MS)
end

return {1, '', '0', rf, rr, rs, tf, tr, ts, fmt(now)}
