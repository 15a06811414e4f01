"""Limit state in Redis, shared by every gateway process: one script call per operation.

Each tenant owns two keys with the same hash tag, so the scripts touch a single slot and run
unchanged on Redis Cluster::

    fleetgate:limits:{<tenant>}:s   hash: bucket states, concurrency counters, quota
                                    counters, lease payloads
    fleetgate:limits:{<tenant>}:l   sorted set: lease id -> expiry time

``admit`` and ``settle`` are one EVALSHA each (``limits/lua``); the scripts read Redis's
clock (TIME), so gateways with skewed clocks still share one timeline. Scripts are sent by
digest; after a restart or SCRIPT FLUSH, Redis answers NOSCRIPT once and the store loads
the script and retries. Every call is bounded by ``timeout_s``; any failure is raised as
``StoreUnavailableError`` for the limiter's breaker.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from redis.exceptions import NoScriptError, RedisError

from limits.decision import Lease, Outcome, RateView
from limits.plan import AdmissionPlan, escape
from limits.store import StoreUnavailableError
from redisconn.config import RedisSecurity
from redisconn.factory import ClientOptions, RedisClient, connect

DEFAULT_PREFIX = "fleetgate:limits"
# An admission sits on every request's path: a Redis that cannot answer within 250 ms is
# treated as down (the breaker and the fail policy take over) rather than waited for. Not
# less: the timeout is an event-loop timer, and on a busy gateway it can fire before the
# loop gets round to a reply that already arrived (seen at 100 ms with four saturated
# gateways on two cores), sending a request to the per-gateway fallback for nothing.
DEFAULT_TIMEOUT_S = 0.25
DEFAULT_MAX_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script with the shared helpers prepended, and its SHA1 for EVALSHA."""

    name: str
    source: str
    sha: str

    @classmethod
    def load(cls, name: str) -> Script:
        folder = resources.files("limits") / "lua"
        common = (folder / "common.lua").read_text(encoding="utf-8")
        body = (folder / f"{name}.lua").read_text(encoding="utf-8")
        source = f"{common}\n{body}"
        return cls(name, source, hashlib.sha1(source.encode()).hexdigest())


ADMIT = Script.load("admit")
SETTLE = Script.load("settle")
RENEW = Script.load("renew")
PEERS = Script.load("peers")


def _num(x: float | int) -> str:
    # repr() is the shortest string that reads back to the same double (Lua's tonumber
    # uses strtod), so both stores compute with bit-identical inputs.
    return repr(x) if isinstance(x, float) else str(x)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _view(field: bytes | str, remaining: int, reset: bytes | str) -> RateView | None:
    name = _text(field)
    return RateView(name, int(remaining), float(_text(reset))) if name else None


class RedisStore:
    """Buckets, counters, quotas and leases in Redis; exact across gateway processes."""

    def __init__(
        self,
        client: RedisClient,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        clock: Callable[[], float] | None = None,
        owns_client: bool = True,
        max_in_flight: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        self._client = client
        # One connection per call in flight: a pool of max_connections never runs dry (a
        # cluster or sentinel pool would raise instead of waiting; redisconn.factory).
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._prefix = prefix
        self._timeout_s = timeout_s
        # Tests only: pass "now" into the scripts instead of Redis TIME. With more than one
        # gateway this gives up the single shared clock, so production leaves it None.
        self._clock = clock
        self._owns_client = owns_client
        self._closed = False

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] | None = None,
        security: RedisSecurity | None = None,
    ) -> RedisStore:
        """A store with its own connections (any scheme of ``redisconn``), tuned to fail fast."""
        options = ClientOptions(
            socket_timeout_s=timeout_s,
            connect_timeout_s=timeout_s,
            max_connections=max_connections,
            # Waiting for a free connection counts against the same deadline.
            pool_timeout_s=timeout_s,
            # One immediate retry on a broken connection, so the pooled connections a Redis
            # restart or a failover left stale reconnect instead of failing requests. Safe
            # because the scripts are idempotent per lease id. No retry on timeouts: the
            # breaker decides when to try a slow Redis again.
            connection_retries=1,
        )
        client = connect(url, options, security)
        return cls(
            client, prefix=prefix, timeout_s=timeout_s, clock=clock, owns_client=True, max_in_flight=max_connections
        )

    def keys(self, tenant: str) -> tuple[str, str]:
        """The tenant's state hash and lease set, sharing one hash tag."""
        base = f"{self._prefix}:{{{escape(tenant)}}}"
        return f"{base}:s", f"{base}:l"

    def _now_arg(self) -> str:
        return "" if self._clock is None else _num(float(self._clock()))

    async def _guard(self, call: Any) -> Any:
        if self._closed:
            raise RuntimeError("RedisStore is closed")
        try:
            async with asyncio.timeout(self._timeout_s), self._in_flight:
                return await call
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailableError(f"redis: {type(exc).__name__}: {exc}") from exc

    async def _run(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        return await self._guard(self._evalsha(script, keys, args))

    async def _evalsha(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        try:
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted or SCRIPT FLUSH ran: load once, then the digest works again.
            await self._client.script_load(script.source)
            return await self._client.evalsha(script.sha, len(keys), *keys, *args)

    async def admit(self, plan: AdmissionPlan, lease_id: str, lease_ttl_s: float) -> Outcome:
        args: list[str] = [
            self._now_arg(),
            lease_id,
            _num(lease_ttl_s),
            str(plan.reserve),
            "" if plan.tokens_per_day is None else str(plan.tokens_per_day),
            "" if plan.tokens_per_month is None else str(plan.tokens_per_month),
            str(len(plan.caps)),
        ]
        for cap in plan.caps:
            args += (cap.field, str(cap.cap))
        args.append(str(len(plan.buckets)))
        for b in plan.buckets:
            kind = "r" if b.kind == "requests" else "t"
            args += (b.field, kind, _num(b.rate.interval), _num(b.rate.tolerance), str(plan.cost(b)))
        reply = await self._run(ADMIT, self.keys(plan.tenant), args)
        allowed, failed, retry, rf, rr, rs, tf, tr, ts, now = reply
        return Outcome(
            allowed=bool(allowed),
            failed=_text(failed),
            retry_after_s=float(_text(retry)),
            requests=_view(rf, rr, rs),
            tokens=_view(tf, tr, ts),
            now=float(_text(now)),
        )

    async def settle(self, lease: Lease, used_tokens: int | None) -> None:
        args: list[str] = [
            self._now_arg(),
            lease.id,
            "" if used_tokens is None else str(max(used_tokens, 0)),
            str(lease.reserve),
            "1" if lease.day_quota else "0",
            "1" if lease.month_quota else "0",
            str(len(lease.token_buckets)),
        ]
        for b in lease.token_buckets:
            args += (b.field, _num(b.rate.interval))
        await self._run(SETTLE, self.keys(lease.tenant), args)

    async def renew(self, lease: Lease, lease_ttl_s: float) -> bool:
        args = [self._now_arg(), lease.id, _num(lease_ttl_s)]
        return bool(await self._run(RENEW, self.keys(lease.tenant), args))

    async def heartbeat(self, instance_id: str, ttl_s: float) -> int:
        """Announce this gateway for ``ttl_s``; returns how many gateways are alive.

        ``ttl_s <= 0`` withdraws the instance (on shutdown).
        """
        args = [self._now_arg(), instance_id, _num(ttl_s)]
        return int(await self._run(PEERS, [f"{self._prefix}:gateways"], args))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await self._client.aclose()
