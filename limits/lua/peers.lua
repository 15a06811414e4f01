-- fleetgate limits: a gateway's heartbeat; returns how many gateways are alive.
-- While Redis is down, each gateway divides the limits by the last count it saw
-- (fail_open), so together they stay near the configured limits.
--
-- KEYS[1]  zset  fleetgate:limits:gateways  instance id -> last heartbeat (seconds)
-- ARGV     now ("" = Redis TIME), instance id, ttl s ("0" = leave: remove this instance)

local now = clock(ARGV[1])
local id, ttl = ARGV[2], tonumber(ARGV[3])
if ttl <= 0 then
  redis.call('ZREM', KEYS[1], id)
else
  redis.call('ZADD', KEYS[1], fmt(now), id)
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. fmt(now - ttl))
  extend(KEYS[1], math.ceil(ttl * 1000) + GRACE_MS)
end
return redis.call('ZCARD', KEYS[1])
