"""OpenTelemetry spans per request and per upstream attempt, exported over OTLP/HTTP (JSON).

Off unless ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) is
set; then every request the sampler (``gateway.sampling``) keeps yields:

- a server span ``{operation} {model}`` (``chat``, ``text_completion``, ``embeddings``...: the dialect's)
  whose id is the one the ``traceparent`` sent upstream carries, child of the client's span,
  with each stage's time as an attribute (``fleetgate.auth_us``, ``parse_us`` (with
  classification), ``limits_us``, ``cache_us`` (when some tenant uses the cache), ``queue_us``);
- one client span per upstream attempt, ``{operation} {served model}``, with the replica's
  address (an attempt followed by another is marked failed);
- with ``tracing.stage_spans``, one internal span per stage as well.

The stages are attributes, not spans, by default: a span per stage more than triples the
spans to build, export, store and pay for, for timings an attribute carries as well.

Attribute names follow OpenTelemetry's GenAI semantic conventions:
https://opentelemetry.io/docs/specs/semconv/gen-ai/gen-ai-spans/

Why not the OpenTelemetry SDK: building its span objects and encoding them to protobuf
costs several times what the rest of a request does (bench/results/tracing-overhead.md).
Here the request path only notes times on a ``Timeline`` (nothing when off or not sampled); when the request is over,
its spans are written as OTLP JSON text
(https://opentelemetry.io/docs/specs/otlp/#json-protobuf-encoding) straight into the body
of the export batch they go out in, which is posted from the event loop; no dependency is
needed. What recurs from one request to the next (span names, the attributes of a model,
tenant, replica and status) is written once and remembered; per request, only ids, times,
counts and the request id are. The queue is bounded: when the collector is slow or gone,
spans are dropped (and counted), requests are never held up.

Standard variables read: the endpoint ones above, ``OTEL_EXPORTER_OTLP[_TRACES]_HEADERS``,
``OTEL_EXPORTER_OTLP[_TRACES]_TIMEOUT``, ``OTEL_SERVICE_NAME``, ``OTEL_BSP_SCHEDULE_DELAY``,
``OTEL_BSP_MAX_QUEUE_SIZE``, ``OTEL_BSP_MAX_EXPORT_BATCH_SIZE``, and the sampler's
``OTEL_TRACES_SAMPLER`` and ``OTEL_TRACES_SAMPLER_ARG``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple
from urllib.parse import unquote

import aiohttp
import orjson

from common.tasks import stop
from dialects.registry import DIALECTS
from gateway.sampling import DEFAULT as DEFAULT_SAMPLER
from gateway.sampling import Sampler
from gateway.tracing import TraceContext

log = logging.getLogger("fleetgate.spans")

# The GenAI operation name of each endpoint label, as its dialect names it.
OPERATIONS = {d.name: d.operation for d in DIALECTS}
# OTLP's SpanKind and StatusCode values.
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3
STATUS_ERROR = 2
_ERROR = f',"status":{{"code":{STATUS_ERROR}}}'


@dataclass(slots=True)
class Attempt:
    replica: str
    url: str
    served_model: str
    start: float
    end: float | None = None
    failed: bool = False


class Timeline:
    """When each stage of one request ended, and its upstream attempts (gateway clock).

    A plain class: one is made for every sampled request, and a dataclass's generated
    ``__init__`` with list default factories costs several times this one."""

    __slots__ = ("attempts", "stages", "started")

    def __init__(self, started: float) -> None:
        self.started = started
        self.stages: list[tuple[str, float]] = []
        self.attempts: list[Attempt] = []

    def mark(self, stage: str, now: float) -> None:
        """``stage`` ran from the previous mark (or the start) until ``now``."""
        self.stages.append((stage, now))

    def attempt(self, replica: str, url: str, served_model: str, now: float) -> None:
        """A new attempt starts: the one before it, if any, failed."""
        if self.attempts:
            previous = self.attempts[-1]
            previous.end, previous.failed = now, True
        self.attempts.append(Attempt(replica, url, served_model, now))


class Outcome(NamedTuple):
    """What is known of a finished request, for the server span's attributes (None: unknown,
    left out of the span).

    The fields up to ``choices`` recur from one request to the next (a handful of models,
    tenants, replicas, statuses): the server span's text for them is written once per
    combination (``_server_fixed``). The last four are the request's own."""

    endpoint: str
    model: str | None
    status: int
    error_code: str | None = None
    tenant: str | None = None
    replica: str | None = None
    attempts: int | None = None
    # From the request's body, once parsed: the model asked for, and how many choices
    # (only when more than one).
    request_model: str | None = None
    choices: int | None = None
    request_id: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    max_tokens: int | None = None


# How many of ``Outcome``'s fields recur (see its docstring).
_RECURRING = 9


def _string(text: str) -> str:
    """``text`` as a JSON string literal, quoted and escaped."""
    return orjson.dumps(text).decode()


@functools.lru_cache(maxsize=1024)
def _string_attribute(key: str, value: str) -> str:
    """A string attribute in JSON. Remembered: most values (operation, models, tenant,
    replica, address) recur on every request, and a lookup costs less than escaping."""
    return f'{{"key":"{key}","value":{{"stringValue":{_string(value)}}}}}'


@functools.lru_cache(maxsize=256)
def _name(operation: str, model: str | None) -> str:
    """A span's name, ``{operation} {model}``, as a JSON string (a handful recur)."""
    return _string(f"{operation} {model}" if model else operation)


def _attributes(attrs: Iterable[tuple[str, object]]) -> str:
    """OTLP ``KeyValue`` objects, comma-separated; an attribute whose value is None is left
    out. Keys are this module's constants (plain ASCII, nothing to escape)."""
    parts = []
    for key, v in attrs:
        if v is None:
            continue
        if isinstance(v, str):
            parts.append(_string_attribute(key, v))
        elif isinstance(v, bool):
            parts.append(f'{{"key":"{key}","value":{{"boolValue":{"true" if v else "false"}}}}}')
        elif isinstance(v, int):
            parts.append(f'{{"key":"{key}","value":{{"intValue":{int(v)}}}}}')
        elif isinstance(v, float) and math.isfinite(v):
            parts.append(f'{{"key":"{key}","value":{{"doubleValue":{v!r}}}}}')
        else:
            parts.append(_string_attribute(key, str(v)))
    return ",".join(parts)


# How the span of an attempt followed by another ends: its last attribute, and its status.
_FAILED_ATTEMPT_END = ',{"key":"error.type","value":{"stringValue":"attempt_failed"}}]' + _ERROR + "}"
# What closes an export request's body after its spans (see ``RequestSpans._envelope``).
_CLOSE = b"]}]}]}"


@functools.lru_cache(maxsize=1024)
def _server_fixed(recurring: tuple[Any, ...]) -> tuple[str, str, str, str]:
    """What a server span's text owes to an ``Outcome``'s recurring fields (``recurring``,
    its first ``_RECURRING``), written once per combination: the operation, the span's name
    and kind, its attributes from those fields, and what closes it (with its status)."""
    endpoint, model, status, error_code, tenant, replica, attempts, request_model, choices = recurring
    operation = OPERATIONS.get(endpoint, endpoint)
    head = f'"name":{_name(operation, model)},"kind":{KIND_SERVER},'
    attrs = _attributes(
        (
            ("gen_ai.operation.name", operation),
            ("http.response.status_code", status),
            ("gen_ai.response.model", model),
            ("fleetgate.tenant", tenant),
            ("fleetgate.replica", replica),
            ("fleetgate.attempts", attempts),
            ("gen_ai.request.model", request_model),
            ("gen_ai.request.choice.count", choices),
            ("error.type", error_code),
        )
    )
    return operation, head, attrs, "]" + (_ERROR if status >= 500 else "") + "}"


@functools.lru_cache(maxsize=256)
def _stage_attribute(stage: str) -> str:
    """A stage's time attribute up to its value (stage names are identifiers: no escaping)."""
    return f',{{"key":"fleetgate.{stage}_us","value":{{"intValue":'


@functools.lru_cache(maxsize=256)
def _attempt_fixed(operation: str, replica: str, url: str, served_model: str) -> tuple[str, str]:
    """An attempt span's name and kind, and its attributes but ``error.type``: the same for
    every attempt on one replica, so written once."""
    host, _, port = url.partition("://")[2].partition("/")[0].rpartition(":")
    attrs = _attributes(
        (
            ("gen_ai.operation.name", operation),
            ("gen_ai.request.model", served_model),
            ("server.address", host or port),
            ("server.port", int(port) if host and port.isdigit() else None),
            ("fleetgate.replica", replica),
        )
    )
    return f'"name":{_name(operation, served_model)},"kind":{KIND_CLIENT},', attrs


def build_spans(
    trace: TraceContext,
    timeline: Timeline,
    outcome: Outcome,
    now: float,
    wall_ns: int,
    rng: random.Random,
    *,
    stage_spans: bool = False,
) -> str:
    """The request's spans, OTLP JSON objects separated by commas; ``wall_ns`` is the epoch
    time at gateway time ``now``. Each stage's time is an attribute of the server span
    (``fleetgate.<stage>_us``, whole microseconds, truncated), and with ``stage_spans`` a
    child span too.

    Written straight as JSON text: nested dicts for a serialiser cost more to build, to
    encode and to free on the event loop (bench/results/tracing-overhead.md). What recurs
    from request to request (names, the outcome's recurring attributes, an attempt's
    attributes) is written once and remembered; per request, only ids, times, counts and
    the request id are written. Ids are validated or generated lowercase hex, stage names
    are ``Timeline.mark``'s callers' identifiers: nothing written per request needs
    escaping but the request id, which ``_string`` escapes.
    """
    offset = wall_ns - int(now * 1e9)
    tid = trace.trace_id
    root = trace.span_id
    operation, head, attrs, tail = _server_fixed(outcome[:_RECURRING])
    request_id, input_tokens, max_tokens = outcome.request_id, outcome.input_tokens, outcome.max_tokens
    started = begin = timeline.started
    times = ""
    for stage, end in timeline.stages:
        times += f"{_stage_attribute(stage)}{int((end - begin) * 1e6)}}}}}"
        begin = end
    # The request's own attributes, each a small string: the span is put together once, at the end.
    parent = f',"parentSpanId":"{trace.parent_id}"' if trace.parent_id else ""
    rid = inp = out = most = ""
    if request_id is not None:  # unique to the request: escaped, not remembered
        rid = f',{{"key":"fleetgate.request_id","value":{{"stringValue":{_string(request_id)}}}}}'
    if input_tokens is not None:
        inp = f',{{"key":"gen_ai.usage.input_tokens","value":{{"intValue":{input_tokens}}}}}'
    if (output_tokens := outcome.output_tokens) is not None:
        out = f',{{"key":"gen_ai.usage.output_tokens","value":{{"intValue":{output_tokens}}}}}'
    if max_tokens is not None:
        most = f',{{"key":"gen_ai.request.max_tokens","value":{{"intValue":{max_tokens}}}}}'
    children = ""
    if stage_spans:
        begin = started
        for stage, end in timeline.stages:
            children += (
                f',{{"traceId":"{tid}","spanId":"{rng.getrandbits(64) or 1:016x}","parentSpanId":"{root}",'
                f'"name":"{stage}","kind":{KIND_INTERNAL},"startTimeUnixNano":{int(begin * 1e9) + offset},'
                f'"endTimeUnixNano":{int(end * 1e9) + offset}}}'
            )
            begin = end
    for a in timeline.attempts:
        named, fixed = _attempt_fixed(operation, a.replica, a.url, a.served_model)
        end = now if a.end is None else a.end
        children += (
            f',{{"traceId":"{tid}","spanId":"{rng.getrandbits(64) or 1:016x}","parentSpanId":"{root}",{named}'
            f'"startTimeUnixNano":{int(a.start * 1e9) + offset},"endTimeUnixNano":{int(end * 1e9) + offset},'
            f'"attributes":[{fixed}{_FAILED_ATTEMPT_END if a.failed else "]}"}'
        )
    return (
        f'{{"traceId":"{tid}","spanId":"{root}"{parent},{head}"startTimeUnixNano":{int(started * 1e9) + offset},'
        f'"endTimeUnixNano":{int(now * 1e9) + offset},"attributes":[{attrs}{rid}{inp}{out}{most}{times}{tail}'
        f"{children}"
    )


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
    """Queues finished requests and exports their spans in batches (an async context manager).

    ``sampler`` says which requests have spans (``gateway.tracing.start_trace`` asks it);
    ``stage_spans`` adds a child span per stage to each request's server and attempt spans.
    A request's spans are written as JSON text when it finishes, straight into the body of
    the export request it will go out in: a batch is one growing buffer, closed when the next
    request's spans would take it past ``batch`` spans (a request's spans are never split),
    so an export copies nothing. Keeping the request's objects instead, or a compact tuple
    of its values, to write them all at export time, measured slower
    (bench/results/tracing-overhead.md): the writing costs the same wherever it runs, and
    what is kept until then costs more.
    """

    def __init__(
        self,
        settings: ExportSettings,
        sampler: Sampler | None = None,
        rng: random.Random | None = None,
        *,
        stage_spans: bool = False,
    ) -> None:
        self.settings = settings
        self.stage_spans = stage_spans
        self.sampler = sampler or Sampler.named(DEFAULT_SAMPLER)
        self._rng = rng or random.Random()
        # Batches ready to go, each an export request's body but its closing brackets, with
        # its span count; then the batch being filled (None: none yet).
        self._full: deque[tuple[bytearray, int]] = deque()
        self._filling: bytearray | None = None
        self._filling_count = 0
        self.queued = 0  # spans in all of them
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None
        self.dropped = 0
        self.exported = 0
        self.failed_exports = 0
        # Everything of an export request around its spans, serialised once.
        resource = _attributes((("service.name", settings.service_name),))
        self._envelope = (
            f'{{"resourceSpans":[{{"resource":{{"attributes":[{resource}]}},'
            '"scopeSpans":[{"scope":{"name":"fleetgate"},"spans":['
        ).encode()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str], *, stage_spans: bool = False) -> RequestSpans | None:
        """None (tracing off) unless an OTLP endpoint is set."""
        settings = ExportSettings.from_environment(environ)
        if settings is None:
            return None
        return cls(settings, Sampler.from_environment(environ), stage_spans=stage_spans)

    def emit(self, trace: TraceContext, timeline: Timeline, outcome: Outcome, now: float) -> None:
        """Queue the request's spans (dropped when the queue is full or the trace unsampled)."""
        if not trace.sampled:
            return
        count = 1 + len(timeline.attempts) + (len(timeline.stages) if self.stage_spans else 0)
        if self.queued + count > self.settings.max_queue:
            self.dropped += count
            return
        spans = build_spans(trace, timeline, outcome, now, time.time_ns(), self._rng, stage_spans=self.stage_spans)
        if self._filling is None or self._filling_count + count > self.settings.batch:
            if self._filling is not None:
                self._close_batch()
            self._filling = bytearray(self._envelope)
        else:
            self._filling += b","
        self._filling += spans.encode()
        self._filling_count += count
        self.queued += count
        if self._filling_count >= self.settings.batch:
            self._close_batch()

    def _close_batch(self) -> None:
        """The batch being filled is ready to go."""
        assert self._filling is not None
        self._full.append((self._filling, self._filling_count))
        self._filling, self._filling_count = None, 0
        self._wake.set()

    def take_batch(self) -> tuple[bytearray, int]:
        """The next export request's body (the oldest full batch, else the one being filled),
        and how many spans it holds."""
        if not self._full:
            self._close_batch()
        body, count = self._full.popleft()
        body += _CLOSE
        self.queued -= count
        return body, count

    async def __aenter__(self) -> RequestSpans:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.settings.timeout_s))
        self._task = asyncio.create_task(self._run(), name="span-export")
        return self

    async def __aexit__(self, *exc: object) -> None:
        await stop(self._task)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.timeout_s):
                while self._full or self._filling is not None:
                    await self._export()
        if self._session is not None:
            await self._session.close()
        if self.dropped:
            log.warning("spans dropped: the collector did not keep up", extra={"spans": self.dropped})

    async def _run(self) -> None:
        """Export full batches as they fill, and what is left each time the delay passes
        without one (OpenTelemetry's batch span processor)."""
        while True:
            try:
                async with asyncio.timeout(self.settings.delay_s):
                    await self._wake.wait()
                partial_too = False
            except TimeoutError:
                partial_too = True
            self._wake.clear()
            while self._full or (partial_too and self._filling is not None):
                await self._export()

    async def _export(self) -> None:
        """Post the next batch of queued spans."""
        body, count = self.take_batch()
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
            self.exported += count
        else:
            self.failed_exports += 1
            self.dropped += count
