-- fleetgate limits: helpers prepended to admit.lua, settle.lua and renew.lua when they are
-- loaded (limits/redis_store.py), so the calendar maths exists once.

local DAY = 86400
local GRACE_MS = 60000      -- keys outlive their last meaningful value by this much

-- A settled lease leaves this tombstone for a while, so that a settle retried after a lost
-- reply is recognised and not applied twice (limits.memory_store.SETTLED_TOMBSTONE_S).
local SETTLED = '-'
local SETTLED_TOMBSTONE_S = 10

local function fmt(x) return string.format('%.17g', x) end

-- ARGV[1] is "" in production: Redis's own clock decides, the same for every gateway.
local function clock(override)
  if override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Howard Hinnant's civil-date algorithms, as in limits/windows.py.
local function civil_from_days(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
                          - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local month = mp < 10 and mp + 3 or mp - 9
  local year = yoe + era * 400
  if month <= 2 then year = year + 1 end
  return year, month
end

local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

-- The UTC day and month windows at `now`: names and reset times (limits/windows.py).
local function windows(now)
  local today = math.floor(now / DAY)
  local year, month = civil_from_days(today)
  local ny, nm = year, month + 1
  if nm > 12 then ny, nm = year + 1, 1 end
  return {day = today, day_reset = (today + 1) * DAY, month = year * 12 + month - 1,
          month_reset = days_from_civil(ny, nm, 1) * DAY}
end

-- The quota fields of the state hash, read in one HMGET with `extra` more fields.
local QUOTA_FIELDS = {'q|d', 'q|dr', 'q|du', 'q|m', 'q|mr', 'q|mu'}
local function read_quota(vals)
  return {d = tonumber(vals[1]) or -1, dr = tonumber(vals[2]) or 0, du = tonumber(vals[3]) or 0,
          m = tonumber(vals[4]) or -1, mr = tonumber(vals[5]) or 0, mu = tonumber(vals[6]) or 0}
end
local function quota_writes(q, out)
  for _, kv in ipairs({{'q|d', q.d}, {'q|dr', q.dr}, {'q|du', q.du}, {'q|m', q.m},
                       {'q|mr', q.mr}, {'q|mu', q.mu}}) do
    out[#out + 1] = kv[1]; out[#out + 1] = kv[2]
  end
  return out
end

-- Give a lease's slots and quota reservation back (settle, or expiry of a dead holder).
-- Returns true if a reservation in the current windows changed.
local function release(S, q, payload, counters)
  local res, d, m, cl = string.match(payload, '^([^;]*);([^;]*);([^;]*);(.*)$')
  res = tonumber(res)
  for cap in string.gmatch(cl, '[^,]+') do
    local n = redis.call('HINCRBY', S, cap, -1)
    if n <= 0 then redis.call('HDEL', S, cap) end
    if counters ~= nil and counters[cap] ~= nil then counters[cap] = math.max(n, 0) end
  end
  local dirty = false
  if d ~= '' and tonumber(d) == q.d then q.dr = math.max(q.dr - res, 0); dirty = true end
  if m ~= '' and tonumber(m) == q.m then q.mr = math.max(q.mr - res, 0); dirty = true end
  return dirty
end

local function roll(q, w)
  local dirty = false
  if q.d ~= w.day then q.d, q.du, q.dr = w.day, 0, 0; dirty = true end
  if q.m ~= w.month then q.m, q.mu, q.mr = w.month, 0, 0; dirty = true end
  return dirty
end

local function extend(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end
