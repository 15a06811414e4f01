"""OpenTelemetry spans per request and per upstream attempt, exported over OTLP/HTTP (JSON).

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is
set; then every request the sampler (``gateway.sampling``, ``OTEL_TRACES_SAMPLER``) keeps yields:

- a server span ``{operation} {model}`` (``chat``, ``text_completion`` or ``embeddings``)
  whose id is the one the ``traceparent`` sent upstream carries, child of the client's span;
- one internal span per stage: ``auth``, ``parse`` (with classification), ``limits``,
  ``cache`` (when some tenant uses the cache), ``queue``;
- one client span per upstream attempt, ``{operation} {served model}``, with the replica's
  address (an attempt followed by another is marked failed).

Attribute names follow OpenTelemetry's GenAI semantic conventions:
https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/

Why not the OpenTelemetry SDK: measured here (bench/results/tracing-overhead.md), building
its span objects and encoding them to protobuf cost ~100-200 µs per request, a third to a
half of the gateway's requests/s with every request sampled. Spans here are plain dicts in
OTLP's JSON encoding (https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding),
serialised in batches by orjson and posted from the event loop, at a fraction of that; no
dependency is needed. The request path only notes times on a ``Timeline`` (nothing when
off); spans are built after the response. The queue is bounded: when the collector is
slow or gone, spans are dropped (and counted), requests are never held up.

Standard variables read: the endpoint ones above, ``OTEL_EXPORTER_OTLP[_TRACES]_HEADERS``,
``OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT``, ``OTEL_SERVICE_NAME``, ``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import aiohttp
import orjson

from common.tasks import stop
from gateway.sampling import DEFAULT as DEFAULT_SAMPLER
from gateway.sampling import Sampler
from gateway.tracing import TraceContext

log = logging.getLogger("fleetgate.spans")

OPERATIONS = {"chat": "chat", "completions": "text_completion", "embeddings": "embeddings"}
# OTLP's SpanKind and StatusCode values.
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_ERROR = 2
_ERROR = {"code": STATUS_ERROR}


@dataclass(slots=True)
class Attempt:
    replica: str
    url: str
    served_model: str
    start: float
    end: float | None = None
    failed: bool = False


@dataclass(slots=True)
class Timeline:
    """When each stage of one request ended, and its upstream attempts (gateway clock)."""

    started: float
    stages: list[tuple[str, float]] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    def mark(self, stage: str, now: float) -> None:
        """``stage`` ran from the previous mark (or the start) until ``now``."""
        self.stages.append((stage, now))

    def attempt(self, replica: str, url: str, served_model: str, now: float) -> None:
        """A new attempt starts: the one before it, if any, failed."""
        if self.attempts:
            previous = self.attempts[-1]
            previous.end, previous.failed = now, True
        self.attempts.append(Attempt(replica, url, served_model, now))


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the access log knows of a finished request, for the spans' attributes."""

    endpoint: str
    model: str | None
    status: int
    error_code: str | None
    attributes: Mapping[str, Any]

    @classmethod
    def from_access_entry(cls, entry: Mapping[str, Any], asked: Mapping[str, Any] | None) -> Outcome:
        """From the request's access-log line and, once parsed, its body (``asked``)."""
        attrs: dict[str, Any] = {
            "gen_ai.response.model": entry.get("model"),
            "gen_ai.usage.input_tokens": entry.get("prompt_tokens"),
            "gen_ai.usage.output_tokens": entry.get("completion_tokens"),
            "fleetgate.request_id": entry.get("request_id"),
            "fleetgate.tenant": entry.get("tenant"),
            "fleetgate.replica": entry.get("replica"),
            "fleetgate.attempts": entry.get("attempts"),
        }
        if asked is not None:
            model = asked.get("model")
            attrs["gen_ai.request.model"] = model if isinstance(model, str) else None
            tokens = asked.get("max_completion_tokens") or asked.get("max_tokens")
            attrs["gen_ai.request.max_tokens"] = tokens if isinstance(tokens, int) else None
            n = asked.get("n")
            attrs["gen_ai.request.choice.count"] = n if isinstance(n, int) and n > 1 else None
        return cls(str(entry.get("endpoint")), entry.get("model"), int(entry["status"]), entry.get("error"), attrs)


def _value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": v}
    if isinstance(v, float):
        return {"doubleValue": v}
    return {"stringValue": str(v)}


def _attributes(attrs: Mapping[str, Any]) -> list[dict[str, Any]]:
    return [{"key": k, "value": _value(v)} for k, v in attrs.items() if v is not None]


def build_spans(
    trace: TraceContext,
    timeline: Timeline,
    outcome: Outcome,
    now: float,
    wall_ns: int,
    rng: random.Random,
) -> list[dict[str, Any]]:
    """The request's spans in OTLP JSON; ``wall_ns`` is the epoch time at gateway time ``now``."""
    offset = wall_ns - int(now * 1e9)
    tid = trace.trace_id
    root = trace.span_id
    operation = OPERATIONS.get(outcome.endpoint, outcome.endpoint)

    def ns(t: float) -> int:
        return int(t * 1e9) + offset

    attrs: dict[str, Any] = {"gen_ai.operation.name": operation, "http.response.status_code": outcome.status}
    attrs.update(outcome.attributes)
    if outcome.error_code:
        attrs["error.type"] = outcome.error_code
    server: dict[str, Any] = {
        "traceId": tid,
        "spanId": root,
        "name": f"{operation} {outcome.model}" if outcome.model else operation,
        "kind": KIND_SERVER,
        "startTimeUnixNano": ns(timeline.started),
        "endTimeUnixNano": ns(now),
        "attributes": _attributes(attrs),
    }
    if trace.parent_id:
        server["parentSpanId"] = trace.parent_id
    if outcome.status >= 500:
        server["status"] = _ERROR
    spans = [server]
    begin = timeline.started
    for stage, end in timeline.stages:
        spans.append(
            {
                "traceId": tid,
                "spanId": f"{rng.getrandbits(64) or 1:016x}",
                "parentSpanId": root,
                "name": stage,
                "kind": KIND_INTERNAL,
                "startTimeUnixNano": ns(begin),
                "endTimeUnixNano": ns(end),
            }
        )
        begin = end
    for attempt in timeline.attempts:
        host, _, port = attempt.url.partition("://")[2].partition("/")[0].rpartition(":")
        attempt_attrs: dict[str, Any] = {
            "gen_ai.operation.name": operation,
            "gen_ai.request.model": attempt.served_model,
            "server.address": host or port,
            "server.port": int(port) if host and port.isdigit() else None,
            "fleetgate.replica": attempt.replica,
            "error.type": "attempt_failed" if attempt.failed else None,
        }
        span: dict[str, Any] = {
            "traceId": tid,
            "spanId": f"{rng.getrandbits(64) or 1:016x}",
            "parentSpanId": root,
            "name": f"{operation} {attempt.served_model}",
            "kind": KIND_CLIENT,
            "startTimeUnixNano": ns(attempt.start),
            "endTimeUnixNano": ns(attempt.end if attempt.end is not None else now),
            "attributes": _attributes(attempt_attrs),
        }
        if attempt.failed:
            span["status"] = _ERROR
        spans.append(span)
    return spans


@dataclass(frozen=True, slots=True)
class ExportSettings:
    """Where and how spans go (from the standard OTEL_* variables)."""

    url: str
    headers: dict[str, str] = field(repr=False)
    service_name: str = "fleetgate"
    timeout_s: float = 10.0
    delay_s: float = 5.0
    max_queue: int = 2048
    batch: int = 512

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> ExportSettings | None:
        """None (tracing off) unless an OTLP endpoint is set."""
        url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
        if not url:
            base = environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
            if not base:
                return None
            url = base.rstrip("/") + "/v1/traces"
        raw = environ.get("OTEL_EXPORTER_OTLP_TRACES_HEADERS") or environ.get("OTEL_EXPORTER_OTLP_HEADERS") or ""
        headers = {}
        for pair in raw.split(","):
            name, sep, value = pair.partition("=")
            if sep and name.strip():
                headers[unquote(name.strip())] = unquote(value.strip())
        timeout = environ.get("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT") or environ.get("OTEL_EXPORTER_OTLP_TIMEOUT")
        return cls(
            url=url,
            headers=headers,
            service_name=environ.get("OTEL_SERVICE_NAME") or "fleetgate",
            timeout_s=_positive(timeout, 10_000) / 1000,
            delay_s=_positive(environ.get("OTEL_BSP_SCHEDULE_DELAY"), 5000) / 1000,
            max_queue=int(_positive(environ.get("OTEL_BSP_MAX_QUEUE_SIZE"), 2048)),
            batch=int(_positive(environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE"), 512)),
        )


def _positive(text: str | None, default: float) -> float:
    """A positive number from an OTEL_* variable (milliseconds, counts); else the spec's default."""
    try:
        value = float(text) if text else default
    except ValueError:
        return default
    return value if value > 0 else default


class RequestSpans:
    """Builds finished requests' spans and exports them in batches (an async context manager).

    ``sampler`` says which requests have spans (``gateway.tracing.start_trace`` asks it).
    """

    def __init__(
        self, settings: ExportSettings, sampler: Sampler | None = None, rng: random.Random | None = None
    ) -> None:
        self.settings = settings
        self.sampler = sampler or Sampler.named(DEFAULT_SAMPLER)
        self._rng = rng or random.Random()
        self._queue: list[dict[str, Any]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.dropped = 0
        self.exported = 0
        self.failed_exports = 0
        resource = {"attributes": _attributes({"service.name": settings.service_name})}
        # Everything of an export request around its spans, serialised once.
        self._envelope = (
            b'{"resourceSpans":[{"resource":'
            + orjson.dumps(resource)
            + b',"scopeSpans":[{"scope":{"name":"fleetgate"},"spans":'
        )

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> RequestSpans | None:
        settings = ExportSettings.from_environment(environ)
        return None if settings is None else cls(settings, Sampler.from_environment(environ))

    def emit(self, trace: TraceContext, timeline: Timeline, outcome: Outcome, now: float) -> None:
        """Queue the request's spans (dropped when the queue is full or the trace unsampled)."""
        if not trace.sampled:
            return
        spans = build_spans(trace, timeline, outcome, now, time.time_ns(), self._rng)
        room = self.settings.max_queue - len(self._queue)
        if room < len(spans):
            self.dropped += len(spans)
            return
        self._queue.extend(spans)
        if len(self._queue) >= self.settings.batch:
            self._wake.set()

    async def __aenter__(self) -> RequestSpans:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s))
        self._task = asyncio.create_task(self._run(), name="span-export")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await stop(self._task)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.timeout_s):
                while self._queue:
                    await self._export()
        if self._session is not None:
            await self._session.close()
        if self.dropped:
            log.warning("spans dropped: the collector did not keep up", extra={"spans": self.dropped})

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.delay_s):
                    await self._wake.wait()
            self._wake.clear()
            while self._queue:
                await self._export()

    async def _export(self) -> None:
        batch, self._queue = self._queue[: self.settings.batch], self._queue[self.settings.batch :]
        body = self._envelope + orjson.dumps(batch) + b"}]}]}"
        assert self._session is not None
        try:
            headers = {**self.settings.headers, "Content-Type": "application/json"}
            async with self._session.post(self.settings.url, data=body, headers=headers) as resp:
                await resp.read()
                ok = resp.status < 300
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok = False
            log.debug("span export failed", extra={"error": str(exc)})
        if ok:
            self.exported += len(batch)
        else:
            self.failed_exports += 1
            self.dropped += len(batch)
