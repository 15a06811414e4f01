-- fleetgate limits: push a held lease's expiry (a long stream keeps its slot).
--
-- KEYS[1]  hash  fleetgate:limits:{<tenant>}:s
-- KEYS[2]  zset  fleetgate:limits:{<tenant>}:l
-- ARGV     now ("" = Redis TIME), lease id, ttl s
-- Returns  1 if renewed, 0 if the lease had already expired or been settled

local S, L = KEYS[1], KEYS[2]
local now = clock(ARGV[1])
local lease_id, ttl = ARGV[2], tonumber(ARGV[3])

local score = redis.call('ZSCORE', L, lease_id)
if not score or tonumber(score) <= now then return 0 end
if redis.call('HGET', S, 'l|' .. lease_id) == SETTLED then return 0 end
redis.call('ZADD', L, fmt(now + ttl), lease_id)
local ttl_ms = math.ceil(ttl * 1000) + GRACE_MS
extend(S, ttl_ms)
extend(L, ttl_ms)
return 1
