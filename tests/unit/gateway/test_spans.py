"""Span building and export settings (no network: the exporter's queue is looked at directly)."""

from __future__ import annotations

import random

import orjson

from gateway.spans import (
    KIND_CLIENT,
    KIND_INTERNAL,
    KIND_SERVER,
    ExportSettings,
    Outcome,
    RequestSpans,
    Timeline,
    build_spans,
)
from gateway.tracing import TraceContext

STAGES = ("auth", "parse", "limits", "cache", "queue")
TRACE = TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "1111111111111111", "00f067aa0ba902b7", "01")


def timeline() -> Timeline:
    t = Timeline(10.0)
    for i, stage in enumerate(STAGES):
        t.mark(stage, 10.0 + (i + 1) * 0.001)
    t.attempt("m-0", "http://10.0.0.1:8000", "served", 10.006)
    t.attempt("m-1", "http://[::1]:8001", "served", 10.010)
    t.attempts[-1].end = 10.050
    return t


def test_spans_of_a_request_with_a_retried_attempt() -> None:
    outcome = Outcome(
        "chat", "m", 200, attempts=2, request_model="m", choices=2, request_id="r1", output_tokens=9, max_tokens=16
    )
    # gateway time 10.060 is epoch 1_000_000_000.060 s: every time shifts by the same offset
    text = build_spans(
        TRACE, timeline(), outcome, 10.060, 1_000_000_000_060_000_000, random.Random(1), stage_spans=True
    )
    spans = orjson.loads(f"[{text}]")
    server, *stages, first, second = spans
    assert server["spanId"] == "1111111111111111" and server["parentSpanId"] == "00f067aa0ba902b7"
    assert (server["name"], server["kind"]) == ("chat m", KIND_SERVER)
    assert server["startTimeUnixNano"] == 1_000_000_000_000_000_000
    assert server["endTimeUnixNano"] == 1_000_000_000_060_000_000
    attrs = {a["key"]: a["value"] for a in server["attributes"]}
    assert attrs["gen_ai.request.choice.count"] == {"intValue": 2}
    assert attrs["gen_ai.usage.output_tokens"] == {"intValue": 9}
    assert "gen_ai.usage.input_tokens" not in attrs  # unknown: left out, not null
    assert [s["name"] for s in stages] == ["auth", "parse", "limits", "cache", "queue"]
    assert all(s["kind"] == KIND_INTERNAL and s["parentSpanId"] == server["spanId"] for s in stages)
    # stages tile the time from the start: each begins where the one before ended
    assert [s["startTimeUnixNano"] for s in stages[1:]] == [s["endTimeUnixNano"] for s in stages[:-1]]
    assert first["kind"] == second["kind"] == KIND_CLIENT
    assert first["status"] == {"code": 2} and "status" not in second
    assert {"key": "server.port", "value": {"intValue": 8000}} in first["attributes"]
    assert {"key": "server.address", "value": {"stringValue": "[::1]"}} in second["attributes"]
    assert second["endTimeUnixNano"] - second["startTimeUnixNano"] == 40_000_000


def test_export_settings_from_the_standard_variables() -> None:
    assert ExportSettings.from_environment({}) is None
    s = ExportSettings.from_environment(
        {
            "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/",
            "OTEL_EXPORTER_OTLP_HEADERS": "x-api-key=abc%3D,bad,tenant = t1",
            "OTEL_EXPORTER_OTLP_TIMEOUT": "2500",
            "OTEL_BSP_SCHEDULE_DELAY": "nonsense",
            "OTEL_SERVICE_NAME": "gw-eu",
        }
    )
    assert s is not None
    assert s.url == "http://collector:4318/v1/traces"
    assert s.headers == {"x-api-key": "abc=", "tenant": "t1"}
    assert (s.timeout_s, s.delay_s, s.service_name) == (2.5, 5.0, "gw-eu")
    traces = ExportSettings.from_environment({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c/otlp/traces"})
    assert traces is not None and traces.url == "http://c/otlp/traces"


def test_the_queue_is_bounded_and_unsampled_traces_are_not_queued() -> None:
    spans = RequestSpans(ExportSettings(url="http://c/v1/traces", headers={}, max_queue=10), stage_spans=True)
    outcome = Outcome("chat", "m", 200)
    spans.emit(TRACE, timeline(), outcome, 11.0)  # 1 + 5 + 2 = 8 spans
    spans.emit(TRACE, timeline(), outcome, 11.0)  # 8 more do not fit in 10: dropped whole
    unsampled = TraceContext(TRACE.trace_id, TRACE.span_id, None, "00")
    spans.emit(unsampled, timeline(), outcome, 11.0)
    assert (spans.queued, spans.dropped) == (8, 8)


def test_by_default_stage_times_are_attributes_of_the_server_span() -> None:
    outcome = Outcome("chat", "m", 200)
    text = build_spans(TRACE, timeline(), outcome, 10.060, 1_000_000_000_060_000_000, random.Random(1))
    server, first, second = orjson.loads(f"[{text}]")
    assert (server["kind"], first["kind"], second["kind"]) == (KIND_SERVER, KIND_CLIENT, KIND_CLIENT)
    attrs = {a["key"]: a["value"] for a in server["attributes"]}
    # each stage took 1 ms of the timeline (10.000 -> 10.001 -> ... -> 10.005), in whole
    # microseconds: 1000, or 999 when the float difference falls just short
    assert all(999 <= attrs[f"fleetgate.{stage}_us"]["intValue"] <= 1000 for stage in STAGES)


def test_queued_spans_count_what_will_be_exported() -> None:
    spans = RequestSpans(ExportSettings(url="http://c/v1/traces", headers={}, max_queue=10, batch=4))
    outcome = Outcome("chat", "m", 200)
    for _ in range(4):
        spans.emit(TRACE, timeline(), outcome, 11.0)  # 1 server + 2 attempts = 3 spans each
    assert (spans.queued, spans.dropped) == (9, 3)
    body, count = spans.take_batch()  # requests are not split: 3 spans, then 3 more would pass 4
    export = orjson.loads(body)
    (scope,) = export["resourceSpans"][0]["scopeSpans"]
    assert count == len(scope["spans"]) == 3 and spans.queued == 6


def test_batches_fill_in_order_and_each_is_a_whole_export_request() -> None:
    spans = RequestSpans(ExportSettings(url="http://c/v1/traces", headers={}, service_name="gw", batch=7))
    outcome = Outcome("chat", "m", 200)
    traces = [TraceContext(f"{i + 1:032x}", f"{i + 1:016x}", None, "01") for i in range(5)]
    for trace in traces:
        spans.emit(trace, timeline(), outcome, 11.0)  # 3 spans each: two requests fill 6 of 7
    assert spans.queued == 15
    bodies = []
    while spans.queued:
        body, count = spans.take_batch()
        bodies.append((orjson.loads(body), count))
    # 3 + 3 (a third would pass 7), 3 + 3, then the last request's 3 from the batch still filling
    assert [count for _, count in bodies] == [6, 6, 3]
    for export, count in bodies:
        (resource,) = export["resourceSpans"]
        assert resource["resource"]["attributes"] == [{"key": "service.name", "value": {"stringValue": "gw"}}]
        (scope,) = resource["scopeSpans"]
        assert scope["scope"] == {"name": "fleetgate"} and len(scope["spans"]) == count
    trace_ids = [s["traceId"] for export, _ in bodies for s in export["resourceSpans"][0]["scopeSpans"][0]["spans"]]
    assert trace_ids == [t.trace_id for t in traces for _ in range(3)]  # the order they finished in


def test_a_request_with_more_spans_than_a_batch_goes_whole_in_a_batch_of_its_own() -> None:
    spans = RequestSpans(ExportSettings(url="http://c/v1/traces", headers={}, batch=4), stage_spans=True)
    outcome = Outcome("chat", "m", 200)
    spans.emit(TRACE, timeline(), outcome, 11.0)  # 1 + 5 stages + 2 attempts = 8 spans
    body, count = spans.take_batch()
    assert count == len(orjson.loads(body)["resourceSpans"][0]["scopeSpans"][0]["spans"]) == 8
    assert spans.queued == 0


def test_every_field_of_the_outcome_is_an_attribute_of_the_server_span_once() -> None:
    outcome = Outcome(
        "completions",
        "m",
        503,
        "upstream_error",
        tenant="t1",
        replica="m-1",
        attempts=2,
        request_model="auto",
        choices=3,
        request_id='r"1\\',  # escaped, not written as is
        input_tokens=7,
        output_tokens=0,
        max_tokens=64,
    )
    text = build_spans(TRACE, timeline(), outcome, 10.060, 1_000_000_000_060_000_000, random.Random(1))
    server = orjson.loads(f"[{text}]")[0]
    assert (server["name"], server["status"]) == ("text_completion m", {"code": 2})
    keys = [a["key"] for a in server["attributes"]]
    assert len(keys) == len(set(keys))
    attrs = {a["key"]: a["value"] for a in server["attributes"]}
    stage_times = {f"fleetgate.{stage}_us" for stage in STAGES}
    assert {k: v for k, v in attrs.items() if k not in stage_times} == {
        "gen_ai.operation.name": {"stringValue": "text_completion"},
        "http.response.status_code": {"intValue": 503},
        "gen_ai.response.model": {"stringValue": "m"},
        "fleetgate.tenant": {"stringValue": "t1"},
        "fleetgate.replica": {"stringValue": "m-1"},
        "fleetgate.attempts": {"intValue": 2},
        "gen_ai.request.model": {"stringValue": "auto"},
        "gen_ai.request.choice.count": {"intValue": 3},
        "error.type": {"stringValue": "upstream_error"},
        "fleetgate.request_id": {"stringValue": 'r"1\\'},
        "gen_ai.usage.input_tokens": {"intValue": 7},
        "gen_ai.usage.output_tokens": {"intValue": 0},
        "gen_ai.request.max_tokens": {"intValue": 64},
    }
    assert stage_times <= attrs.keys()


def test_requests_alike_but_for_their_own_fields_each_keep_theirs() -> None:
    # The text for the recurring fields is written once and remembered; the rest is per request.
    first = Outcome("chat", "m", 200, tenant="t1", request_id="a", input_tokens=1, output_tokens=2)
    second = first._replace(request_id="b", input_tokens=3, output_tokens=None, max_tokens=9)
    refused = Outcome("chat", None, 429, "rate_limited", tenant="t1", request_id="c")
    servers = [
        orjson.loads(f"[{build_spans(TRACE, Timeline(10.0), o, 10.5, 1_000_000_000_500_000_000, random.Random(1))}]")[0]
        for o in (first, second, refused)
    ]
    attrs = [{a["key"]: a["value"] for a in s["attributes"]} for s in servers]
    assert [a["fleetgate.request_id"]["stringValue"] for a in attrs] == ["a", "b", "c"]
    assert attrs[0]["gen_ai.usage.output_tokens"] == {"intValue": 2} and "gen_ai.usage.output_tokens" not in attrs[1]
    assert "gen_ai.request.max_tokens" not in attrs[0] and attrs[1]["gen_ai.request.max_tokens"] == {"intValue": 9}
    assert servers[2]["name"] == "chat" and attrs[2]["error.type"] == {"stringValue": "rate_limited"}
    assert "status" not in servers[2]  # a 4xx is the client's error: the span's status stays unset
