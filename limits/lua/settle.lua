-- fleetgate limits: settle one lease (one round trip, atomic).
-- Mirrors MemoryStore.settle_now (limits/memory_store.py) and limits/gcra.py adjust().
--
-- KEYS[1]  hash  fleetgate:limits:{<tenant>}:s
-- KEYS[2]  zset  fleetgate:limits:{<tenant>}:l
-- ARGV     now ("" = Redis TIME), lease id, used tokens ("" = release, charge nothing),
--          reserved tokens, day quota 0|1, month quota 0|1, nbuckets, {field, interval s}*
-- Returns  1 if the lease was still held, 0 if it had expired (or was never recorded),
--          2 if it was settled before (nothing changes)

local S, L = KEYS[1], KEYS[2]
local now = clock(ARGV[1])
local lease_id, reserve = ARGV[2], tonumber(ARGV[4])
local used = 0
if ARGV[3] ~= '' then used = math.max(tonumber(ARGV[3]), 0) end
local day_quota, month_quota = ARGV[5] == '1', ARGV[6] == '1'

local names = {unpack(QUOTA_FIELDS)}
names[#names + 1] = 'l|' .. lease_id
local vals = redis.call('HMGET', S, unpack(names))
local q = read_quota(vals)
local payload = vals[7]
if payload == SETTLED then return 2 end  -- a retried settle: applied already
local qdirty, keep = false, 0

if day_quota or month_quota then
  local w = windows(now)
  qdirty = roll(q, w)
  if day_quota then keep = math.max(keep, w.day_reset - now) end
  if month_quota then keep = math.max(keep, w.month_reset - now) end
end
if payload then qdirty = release(S, q, payload, nil) or qdirty end
if day_quota then q.du = q.du + used; qdirty = true end
if month_quota then q.mu = q.mu + used; qdirty = true end
local writes = {'l|' .. lease_id, SETTLED}
if qdirty then quota_writes(q, writes) end

-- True the token buckets up to the real usage: refund or charge the difference.
local delta = used - reserve
if delta ~= 0 then
  for k = 0, tonumber(ARGV[7]) - 1 do
    local field, interval = ARGV[8 + 2 * k], tonumber(ARGV[9 + 2 * k])
    local st = redis.call('HMGET', S, field .. '|d', field .. '|a')
    local debt, at = tonumber(st[1]) or 0, tonumber(st[2]) or 0
    debt = math.max(math.max(debt - math.max(now - at, 0), 0) + delta * interval, 0)
    writes[#writes + 1] = field .. '|d'; writes[#writes + 1] = fmt(debt)
    writes[#writes + 1] = field .. '|a'; writes[#writes + 1] = fmt(math.max(now, at))
    keep = math.max(keep, debt)
  end
end
redis.call('HSET', S, unpack(writes))
keep = math.max(keep, SETTLED_TOMBSTONE_S)
extend(S, math.ceil(keep * 1000) + GRACE_MS)
redis.call('ZADD', L, fmt(now + SETTLED_TOMBSTONE_S), lease_id)
extend(L, SETTLED_TOMBSTONE_S * 1000 + GRACE_MS)
if payload then return 1 end
return 0
