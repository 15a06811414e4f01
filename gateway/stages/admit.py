"""The ``admit`` stage: rate limits, concurrency and quotas, as a lease on the tenant's budget."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from gateway.errors import GatewayError, RateLimited, ServiceUnavailable
from gateway.exchange import Exchange
from gateway.stages import CONTINUE, Reply
from limits.config import reservation
from limits.decision import Decision, Lease
from limits.limiter import Limiter
from limits.plan import Subject


class Admit:
    """A lease on the tenant's budget (an estimate reserved), or a refusal; the lease is
    settled on the tokens the request really used when the path ends: in the background
    when the limit store is remote, so the response never waits for Redis."""

    name = "admit"

    def __init__(self, limiter: Limiter, clock: Callable[[], float]) -> None:
        self.limiter = limiter
        self.clock = clock
        self._background: set[asyncio.Task[None]] = set()

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        call, tenant = ex.call, ex.tenant
        assert tenant is not None and ex.key_id is not None
        reserve = reservation(call.prompt_tokens, call.max_tokens, tenant.limits, call.n)
        decision = await self.limiter.admit(Subject(tenant.id, ex.key_id, call.model), tenant.limits, reserve)
        ex.headers.update(decision.headers())
        if ex.timeline is not None:
            ex.timeline.mark("limits", self.clock())
        if not decision.allowed:
            return _rejection(decision)
        lease, settle = decision.lease, self.settle
        if lease is not None:

            def release(_: BaseException | None) -> None:
                settle(lease, ex.used_tokens())

            ex.release(release)
        return CONTINUE

    def settle(self, lease: Lease, used: int | None) -> None:
        """Settle ``lease`` on ``used`` tokens (None: release the reservation whole)."""
        if lease.origin == "none":
            return
        if self.limiter.settle_locally(lease, used):
            return  # memory store: done synchronously, no task needed
        task = asyncio.create_task(self.limiter.settle(lease, used), name="settle")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def finish_background(self, timeout_s: float) -> None:
        """Let settlements still in flight reach the limit store before it closes (bounded)."""
        if self._background:
            await asyncio.wait(self._background, timeout=timeout_s)


def _rejection(decision: Decision) -> GatewayError:
    """A limiter's rejection as the client's error: 429 (or 503 when the limit store is down)."""
    err: GatewayError
    if decision.status == ServiceUnavailable.status:
        err = ServiceUnavailable(decision.message, code=decision.error_code, headers=decision.headers())
    else:
        err = RateLimited(decision.message, code=decision.error_code, headers=decision.headers())
        err.type = decision.error_type or err.type
    return err
