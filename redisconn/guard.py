"""One store's calls to Redis: a deadline each, a bound on calls in flight, and a breaker.

The response cache and the response store call Redis the same way: a call that fails,
times out or finds the breaker open raises the store's own "unavailable" error (with a
reason: ``timeout``, ``error`` or ``circuit_open``), the breaker counts it, and a caller
that leaves mid-call frees the half-open trial without a verdict on Redis. ``Guard`` is that
once, so each store keeps only its keys, scripts and error type.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common.breaker import CircuitBreaker


class Guard:
    """Runs a store's Redis calls (``run``); ``unavailable(message, reason)`` makes its error."""

    def __init__(
        self,
        *,
        breaker: CircuitBreaker,
        clock: Callable[[], float],
        max_in_flight: int,
        unavailable: Callable[[str, str], Exception],
        log: logging.Logger,
        down_message: str,
        up_message: str,
    ) -> None:
        self.breaker = breaker
        self._clock = clock
        # One connection per call in flight: a pool of max_connections never runs dry (a
        # cluster or sentinel pool would raise instead of waiting; redisconn.factory).
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self._unavailable = unavailable
        self._log = log
        self._down_message = down_message
        self._up_message = up_message

    async def run(self, call: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
        """``call``'s result, within ``timeout_s``, behind the breaker; else the store's error."""
        if not self.breaker.allow(self._clock()):
            raise self._unavailable("redis: circuit open", "circuit_open")
        trial = self.breaker.trial  # this call's number if it is the half-open trial
        try:
            async with asyncio.timeout(timeout_s), self._in_flight:
                result = await call()
        except (RedisError, OSError, TimeoutError) as exc:
            if self.breaker.record_failure(self._clock()):
                self._log.warning(self._down_message, extra={"error": repr(exc)})
            reason = "timeout" if isinstance(exc, TimeoutError | RedisTimeoutError) else "error"
            raise self._unavailable(f"redis: {type(exc).__name__}: {exc}", reason) from exc
        except asyncio.CancelledError:
            # Our caller gave up; say nothing about Redis, but free the half-open trial slot.
            if trial is not None:
                self.breaker.abandon_trial(trial)
            raise
        if self.breaker.record_success():
            self._log.info(self._up_message)
        return result
