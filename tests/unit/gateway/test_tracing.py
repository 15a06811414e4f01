"""W3C traceparent: accepted, created when absent or invalid, passed on with a new span."""

from __future__ import annotations

import random

import pytest

from gateway.sampling import Sampler
from gateway.tracing import parse_traceparent, start_trace

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_header_is_continued_with_the_gateways_own_span() -> None:
    trace = start_trace(VALID, "vendor=abc", random.Random(1), None)
    assert trace.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert trace.parent_id == "00f067aa0ba902b7"
    assert trace.span_id != trace.parent_id and len(trace.span_id) == 16
    assert trace.sampled
    assert trace.upstream_headers() == {
        "traceparent": f"00-4bf92f3577b34da6a3ce929d0e0e4736-{trace.span_id}-01",
        "tracestate": "vendor=abc",
    }


def test_a_new_trace_when_absent_or_invalid() -> None:
    rng = random.Random(7)
    first = start_trace(None, "vendor=abc", rng, None)
    second = start_trace("garbage", None, rng, Sampler.named("always_on"))
    assert first.parent_id is None and len(first.trace_id) == 32 and first.trace_id != second.trace_id
    assert first.flags == "00" and second.flags == "01"
    # tracestate without a valid traceparent is dropped (the spec's rule)
    assert first.upstream_headers() == {"traceparent": first.traceparent}
    assert parse_traceparent(first.traceparent) == (first.trace_id, first.span_id, "00")


@pytest.mark.parametrize(
    "header",
    [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # forbidden version
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # v00 is exact
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
        "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "",
    ],
)
def test_invalid_headers_are_refused(header: str) -> None:
    assert parse_traceparent(header) is None


def test_a_later_version_with_more_fields_is_read() -> None:
    assert parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what") == (
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "00f067aa0ba902b7",
        "01",
    )


@pytest.mark.parametrize(("flags", "sampled"), [("00", False), ("01", True), ("02", False), ("03", True), ("ff", True)])
def test_sampled_is_the_flags_low_bit(flags: str, sampled: bool) -> None:
    trace = start_trace(f"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-{flags}", None, random.Random(1), None)
    assert trace.flags == flags and trace.sampled is sampled
