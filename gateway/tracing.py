"""W3C Trace Context: the ``traceparent`` a request arrives with, or a new one, passed on.

https://www.w3.org/TR/trace-context/#traceparent-header: ``00-<trace-id>-<parent-id>-<flags>``,
lowercase hex, neither id all zeros. A valid header from the client keeps its trace id and
sampling flag; anything else (absent, malformed, version ``ff``) starts a new trace. The
gateway's own span gets a fresh id, and is the parent the replica sees. ``tracestate`` is
forwarded untouched with a valid ``traceparent``, dropped with an invalid one (the spec's
rule). Ids come from the ``random.Random`` passed in.

The sampled flag sent on is the gateway's decision when it records spans (the ``Sampler``
passed in; with a parent-based one, the caller's flag); with tracing off the caller's flags
pass on unchanged and a trace the gateway starts is not sampled.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from gateway.sampling import Sampler

# Flags of a trace the gateway starts: "sampled" only when it records spans itself.
SAMPLED, NOT_SAMPLED = "01", "00"
# Hex digits with the low bit set: flags ending in one have the "sampled" flag.
_ODD_DIGITS = frozenset("13579bdf")


@dataclass(frozen=True, slots=True)
class TraceContext:
    """The trace one request belongs to, and the gateway's span in it."""

    trace_id: str
    span_id: str
    # The client's span (None when the gateway started the trace).
    parent_id: str | None
    flags: str
    tracestate: str | None = None

    @property
    def traceparent(self) -> str:
        """The header sent upstream: the replica's parent is the gateway's span."""
        return f"00-{self.trace_id}-{self.span_id}-{self.flags}"

    @property
    def sampled(self) -> bool:
        # The flags' low bit, read off the last hex digit (flags are lowercase hex: parsed
        # by ``_TRACEPARENT`` or written here); asked twice per request when tracing is on.
        return self.flags[-1] in _ODD_DIGITS

    def upstream_headers(self) -> dict[str, str]:
        if self.tracestate is None:
            return {"traceparent": self.traceparent}
        return {"traceparent": self.traceparent, "tracestate": self.tracestate}


# version-traceid-parentid-flags, lowercase hex; a later version may append "-..." fields.
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


def parse_traceparent(value: str | None) -> tuple[str, str, str] | None:
    """(trace id, parent id, flags) of a valid header, else None."""
    if value is None:
        return None
    m = _TRACEPARENT.fullmatch(value.strip())
    if m is None:
        return None
    version, trace_id, parent_id, flags, more = m.groups()
    if version == "ff" or (version == "00" and more is not None):
        return None
    if trace_id == _ZERO_TRACE or parent_id == _ZERO_SPAN:
        return None
    return trace_id, parent_id, flags


def start_trace(
    traceparent: str | None, tracestate: str | None, rng: random.Random, sampler: Sampler | None
) -> TraceContext:
    """The request's trace context: the client's trace continued, or a new one; sampled as
    ``sampler`` decides (None: tracing off, the gateway records no spans)."""
    span_id = f"{rng.getrandbits(64) or 1:016x}"
    parsed = parse_traceparent(traceparent)
    if parsed is not None:
        trace_id, parent_id, flags = parsed
        if sampler is not None:
            bits = int(flags, 16)
            parent_sampled = bits & 1 == 1
            if sampler.sample(trace_id, parent_sampled) != parent_sampled:
                flags = f"{bits ^ 1:02x}"  # only the sampled bit changes; the others pass on
        return TraceContext(trace_id, span_id, parent_id, flags, tracestate or None)
    trace_id = f"{rng.getrandbits(128) or 1:032x}"
    sampled = sampler is not None and sampler.sample(trace_id, None)
    return TraceContext(trace_id, span_id, None, SAMPLED if sampled else NOT_SAMPLED)
