"""What a finished request leaves behind: metrics, one access-log line, spans.

``Accounting.close`` runs once per request of the request path, after the response, however
the request ended (answered, refused, failed, or left by its client); ``record_plain`` writes
the line of a request answered beside it (models, stored responses, probes, 404s). Every
line carries the request's method and path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from gateway.exchange import Exchange, request_id
from gateway.logs import AccessLog
from gateway.metrics import GatewayMetrics
from gateway.spans import Outcome, RequestSpans

log = logging.getLogger("fleetgate.app")

# Where a request answered beside the request path keeps its id and, once authenticated,
# its tenant (for its response and its log line).
REQUEST_ID_KEY = web.RequestKey("request_id", str)
TENANT_KEY = web.RequestKey("tenant", str)


class Accounting:
    """Settles, counts and logs each finished request."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        access_log: AccessLog,
        spans: RequestSpans | None,
        clock: Callable[[], float],
        *,
        log_prompts: bool,
    ) -> None:
        self.metrics = metrics
        self.access_log = access_log
        self.spans = spans
        self.clock = clock
        self.log_prompts = log_prompts

    def open(self) -> None:
        """A request of the request path begins."""
        self.metrics.requests_in_flight += 1
        self.metrics.requests_started += 1

    def close(self, ex: Exchange) -> None:
        """The request is over: metrics, one log line, and its spans (tracing on)."""
        self.metrics.requests_in_flight -= 1
        entry = self.record(ex)
        if self.spans is not None and ex.timeline is not None:
            self.emit_spans(self.spans, ex, entry)

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
        m.series(m.requests, endpoint, model_label, str(status), ex.band or "-").inc()
        m.latency.observe((endpoint, model_label), elapsed)
        trace = ex.trace
        entry: dict[str, Any] = {
            "request_id": ex.request_id,
            "method": "POST",
            "path": ex.dialect.path,
            "tenant": tenant_id,
            "endpoint": endpoint,
            "model": model,
            "band": ex.band,
            "status": status,
            "duration_ms": round(elapsed * 1000, 2),
            "trace_id": trace.trace_id if trace is not None else None,
            "span_id": trace.span_id if trace is not None else None,
        }
        if ex.error_code:
            entry["error"] = ex.error_code
        if ex.continued:
            entry["continued"] = [{"replica": c.replica, "reason": c.reason} for c in ex.continued]
        if ex.cut is not None:
            entry["cut"] = ex.cut
            m.series(m.stream_cuts, model_label, ex.cut).inc()
        if ex.parsed:
            entry["stream"] = ex.call.stream
            entry["attempts"] = ex.attempts
            # What limits and routing took the prompt to be, beside the replica's usage below.
            entry["prompt_tokens_gateway"] = ex.call.prompt_tokens
            entry["prompt_tokens_source"] = "tokenizer" if ex.call.prompt_tokens_counted else "estimate"
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

    def record_plain(self, request: web.Request, endpoint: str, status: int, started: float) -> None:
        """The access-log line of a request answered beside the request path."""
        self.access_log.write(
            {
                "request_id": request.get(REQUEST_ID_KEY) or request_id(request),
                "method": request.method,
                "path": request.path,
                "tenant": request.get(TENANT_KEY),
                "endpoint": endpoint,
                "status": status,
                "duration_ms": round((self.clock() - started) * 1000, 2),
            }
        )

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
