"""What a finished request leaves behind: limits settled, metrics, one access-log line, spans.

``Accounting.close`` runs once per request, after the response, however the request ended
(answered, refused, failed, or left by its client). Settling the limiter's lease happens in
the background when its store is remote: the response never waits for Redis.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from gateway.exchange import Exchange
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.spans import Outcome, RequestSpans
from limits.decision import Lease
from limits.limiter import Limiter

log = logging.getLogger("fleetgate.app")


class Accounting:
    """Settles, counts and logs each finished request."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        access_log: AccessLog,
        limiter: Limiter,
        spans: RequestSpans | None,
        clock: Callable[[], float],
        *,
        log_prompts: bool,
    ) -> None:
        self.metrics = metrics
        self.access_log = access_log
        self.limiter = limiter
        self.spans = spans
        self.clock = clock
        self.log_prompts = log_prompts
        self._background: set[asyncio.Task[None]] = set()

    def close(self, ex: Exchange) -> None:
        """The request is over: limits, metrics, one log line, and its spans (tracing on)."""
        if ex.lease is not None:
            self.settle(ex.lease, ex.used_tokens())
        entry = self.record(ex)
        if self.spans is not None and ex.timeline is not None:
            self.emit_spans(self.spans, ex, entry)

    def settle(self, lease: Lease, used: int | None) -> None:
        """Settle in the background: the response need not wait for the limit store."""
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

    def record(self, ex: Exchange) -> dict[str, Any]:
        """Count the request in the metrics and write its access-log line (returned)."""
        now = self.clock()
        elapsed = now - ex.started
        model = ex.model
        model_label = model or "-"
        endpoint = ex.dialect.name
        tenant_id = ex.tenant.id if ex.tenant is not None else None
        status = ex.status
        m = self.metrics
        m.series(m.requests, endpoint, model_label, str(status)).inc()
        m.latency.observe((endpoint, model_label), elapsed)
        trace = ex.trace
        entry: dict[str, Any] = {
            "request_id": ex.request_id,
            "tenant": tenant_id,
            "endpoint": endpoint,
            "model": model,
            "status": status,
            "duration_ms": round(elapsed * 1000, 2),
            "trace_id": trace.trace_id if trace is not None else None,
            "span_id": trace.span_id if trace is not None else None,
        }
        if ex.error_code:
            entry["error"] = ex.error_code
        if ex.cut is not None:
            entry["cut"] = ex.cut
            m.series(m.stream_cuts, model_label, ex.cut).inc()
        if ex.parsed:
            entry["stream"] = ex.call.stream
            entry["attempts"] = ex.attempts
            if ex.route is not None:
                ex.route.annotate(entry)
            if ex.replica is not None:
                entry["replica"] = ex.replica.id
            if ex.first_token_at is not None:
                ttft = ex.first_token_at - ex.started
                entry["ttft_ms"] = round(ttft * 1000, 2)
                m.ttft.observe((model_label,), ttft)
            if ex.usage:
                prompt = int(ex.usage.get("prompt_tokens") or 0)
                completion = int(ex.usage.get("completion_tokens") or 0)
                entry["prompt_tokens"], entry["completion_tokens"] = prompt, completion
                if tenant_id is not None:
                    m.series(m.tokens, tenant_id, model_label, "prompt").inc(prompt)
                    m.series(m.tokens, tenant_id, model_label, "completion").inc(completion)
            if ex.upstream_started is not None:
                upstream = (ex.upstream_ended or now) - ex.upstream_started
                m.overhead.observe((endpoint,), max(0.0, elapsed - upstream))
            if self.log_prompts:
                entry["body"] = ex.call.body
        self.access_log.write(entry)
        return entry

    def emit_spans(self, spans: RequestSpans, ex: Exchange, entry: dict[str, Any]) -> None:
        """The request's OpenTelemetry spans (only with tracing on, after the response): the
        outcome's fields taken as ``record`` wrote them in ``entry``, or from ``ex``."""
        timeline, trace = ex.timeline, ex.trace
        assert timeline is not None and trace is not None
        if timeline.attempts and timeline.attempts[-1].end is None:
            timeline.attempts[-1].end = ex.upstream_ended
        try:
            get = entry.get
            recurring = (entry["endpoint"], ex.model, ex.status, ex.error_code or None, entry["tenant"])
            if ex.parsed:
                call = ex.call
                outcome = Outcome(
                    *recurring,
                    get("replica"),
                    ex.attempts,
                    call.model,
                    call.n if call.n > 1 else None,
                    ex.request_id,
                    get("prompt_tokens"),
                    get("completion_tokens"),
                    call.max_tokens,
                )
            else:
                outcome = Outcome(*recurring, request_id=ex.request_id)
            spans.emit(trace, timeline, outcome, self.clock())
        except Exception:  # tracing must never fail a request
            log.exception("could not record the request's spans", extra={"request_id": entry.get("request_id")})
