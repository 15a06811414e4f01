"""Build the Redis client a URL asks for: one node, a Redis Cluster, or a Sentinel master.

The limiter, the exact cache and the semantic cache all connect through ``connect``, so the
three schemes behave the same everywhere (timeouts, TLS, credentials), and the stores see
one type, ``RedisClient``: each call they make names keys of a single hash slot, which is
all a cluster needs (``EVALSHA`` is routed by its first key; ``SCRIPT LOAD`` after a
``NOSCRIPT`` goes to every primary).

What each client does when a master fails:

- single node: the call fails; ``connection_retries`` immediate reconnects, then the
  caller's breaker decides when to try again;
- cluster: a connection error marks the topology stale; the next call re-reads it from any
  reachable node and follows ``MOVED``/``ASK`` redirects, so a promoted replica is found
  without a restart;
- sentinel: every new connection asks the sentinels for the current master; a demoted
  master's ``READONLY`` reply closes the connection, so the next one finds the new master.

The single-node pool waits up to ``pool_timeout_s`` for a free connection; redis-py's
cluster and sentinel pools do not wait (they raise at once when ``max_connections`` are
busy), so each store lets at most ``max_connections`` of its calls be in flight (an
``asyncio.Semaphore`` under the call's deadline), the same bound for every scheme.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeAlias

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from redisconn.config import RedisSecurity
from redisconn.target import RedisTarget

RedisClient: TypeAlias = "Redis | RedisCluster"


@dataclass(frozen=True, slots=True)
class ClientOptions:
    """What one store needs of its connections (each store picks its own deadlines)."""

    socket_timeout_s: float
    connect_timeout_s: float
    max_connections: int = 64
    # Single node: how long a call may wait for a free pooled connection.
    pool_timeout_s: float | None = None
    # Immediate reconnects after a broken connection (0: leave it to the caller's breaker).
    connection_retries: int = 0


class _SentinelPool(SentinelConnectionPool):
    """Connections to the master Sentinel names, asking the sentinels once per burst.

    redis-py asks the sentinels on every new connection; a cold pool under load would send
    one ``SENTINEL MASTERS`` per request in flight. Connections opened together share one
    question (the answer is the same for all of them).
    """

    _asking: asyncio.Future[Any] | None = None

    async def get_master_address(self) -> Any:
        if self._asking is None:
            self._asking = asyncio.ensure_future(super().get_master_address())  # type: ignore[no-untyped-call]
            self._asking.add_done_callback(self._forget)
        return await asyncio.shield(self._asking)

    def _forget(self, done: asyncio.Future[Any]) -> None:
        self._asking = None
        if not done.cancelled():
            done.exception()  # retrieved: whoever awaited it has seen it already


class _SentinelMaster(Redis):
    """The master's client, which also closes the connections to the sentinels."""

    sentinels: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinels is not None:
                await self.sentinels.aclose()


def connect(url: str, options: ClientOptions, security: RedisSecurity | None = None) -> RedisClient:
    """A client for ``url`` (``redisconn.target`` lists the schemes); connects lazily."""
    target = RedisTarget.parse(url)
    security = security or RedisSecurity()
    retry = Retry(NoBackoff(), options.connection_retries, supported_errors=(RedisConnectionError,))
    common: dict[str, Any] = {
        "socket_timeout": options.socket_timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
        "health_check_interval": 0,
        **_auth(target, security),
    }
    tls = _tls(security) if target.tls else {}
    if target.kind == "single":
        pool = BlockingConnectionPool.from_url(
            url, max_connections=options.max_connections, timeout=options.pool_timeout_s, retry=retry, **common, **tls
        )
        return Redis.from_pool(pool)  # owns the pool: closing the client closes it
    if target.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            max_connections=options.max_connections,
            retry=retry,
            ssl=target.tls,
            **common,
            **tls,
        )
    sentinel_side = {
        "socket_timeout": options.socket_timeout_s,
        "socket_connect_timeout": options.connect_timeout_s,
        **({"ssl": True, **tls} if target.tls else {}),
    }
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_side)  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis 8.2
    client: _SentinelMaster = sentinel.master_for(
        target.service,
        redis_class=_SentinelMaster,
        connection_pool_class=_SentinelPool,
        db=target.db,
        max_connections=options.max_connections,
        retry=retry,
        ssl=target.tls,
        **common,
        **tls,
    )
    client.sentinels = sentinel
    return client


def _auth(target: RedisTarget, security: RedisSecurity) -> dict[str, Any]:
    """Credentials: the URL's if it has them, else the settings' (the URL wins, as in redis-py)."""
    if target.kind == "single":
        # redis-py lets the URL's userinfo override these keyword arguments.
        return {"username": security.username, "password": security.password}
    if target.password is not None or target.username is not None:
        return {"username": target.username, "password": target.password}
    return {"username": security.username, "password": security.password}


def _tls(security: RedisSecurity) -> dict[str, Any]:
    return {
        "ssl_ca_certs": security.tls_ca_file,
        "ssl_certfile": security.tls_cert_file,
        "ssl_keyfile": security.tls_key_file,
        "ssl_check_hostname": security.tls_check_hostname,
    }
