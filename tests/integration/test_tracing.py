"""W3C trace context through a real in-process gateway, and OpenTelemetry spans exported
over OTLP/HTTP in its JSON encoding to a small collector run by the test (no OTLP
collector can be installed here; this one reads what the OTLP specification defines)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from tests.integration.harness import (
    API_KEY,
    UpstreamLog,
    access_lines,
    in_process_gateway,
    openai_upstream,
    serve_app,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
MESSAGES = [{"role": "user", "content": "trace me"}]
# OTLP's SpanKind values.
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3


async def chat(url: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": MESSAGES, "max_tokens": 3, "n": 1},
            headers={"Authorization": f"Bearer {API_KEY}", **headers},
        )


async def test_traceparent_is_continued_forwarded_and_logged(tmp_path: Path) -> None:
    async with openai_upstream("m") as (up, seen):
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}]}
        async with in_process_gateway(config, tmp_path) as (url, gw, access):
            assert gw.spans is None  # no OTLP endpoint configured: tracing is off
            sent = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"
            assert (await chat(url, traceparent=sent, tracestate="vendor=x")).status_code == 200
            assert (await chat(url)).status_code == 200
            gw.access_log.flush()
            continued, created = access_lines(access)[-2:]
    forwarded = [h for h in seen.headers if "traceparent" in h]
    assert len(forwarded) == 2
    # The client's trace, with the gateway's span as the replica's parent; flags kept.
    assert continued["trace_id"] == TRACE_ID and continued["span_id"] != CLIENT_SPAN
    assert forwarded[0]["traceparent"] == f"00-{TRACE_ID}-{continued['span_id']}-01"
    assert forwarded[0]["tracestate"] == "vendor=x"
    # None sent: a new trace, not sampled (the gateway records no spans).
    assert created["trace_id"] != TRACE_ID and len(created["trace_id"]) == 32
    assert forwarded[1]["traceparent"] == f"00-{created['trace_id']}-{created['span_id']}-00"
    assert "tracestate" not in forwarded[1]


@contextlib.asynccontextmanager
async def otlp_collector() -> AsyncIterator[tuple[str, list[Any]]]:
    """POST /v1/traces, OTLP/HTTP protobuf: every span received, decoded."""
    spans: list[Any] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/json"
        export = orjson.loads(await request.read())
        for resource_spans in export["resourceSpans"]:
            service = resource_spans["resource"]["attributes"][0]
            assert service == {"key": "service.name", "value": {"stringValue": "fleetgate"}}
            for scope_spans in resource_spans["scopeSpans"]:
                spans.extend(scope_spans["spans"])
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    async with serve_app(app) as url:
        yield url, spans


@contextlib.asynccontextmanager
async def exporting(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[list[Any], str, UpstreamLog]]:
    """An OTLP collector that the next gateway built exports to, in batches of 50 ms, and
    an upstream serving model ``m``: (the spans received, its URL, what it was sent)."""
    async with otlp_collector() as (collector, spans), openai_upstream("m") as (up, seen):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector)
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
        yield spans, up, seen


async def until_exported(done: Callable[[], bool]) -> None:
    """Wait (30 s at most) for ``done``: the exporter posts spans in the background."""
    async with asyncio.timeout(30):
        while not done():  # noqa: ASYNC110 - nothing to await: the collector's list grows
            await asyncio.sleep(0.05)


async def test_spans_per_request_stage_and_attempt_reach_the_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with exporting(monkeypatch) as (spans, up, seen):
        # One replica refuses connections: a request sent there first takes two attempts.
        dead = "http://127.0.0.1:9"
        config = {
            "models": [{"name": "m", "replicas": [{"url": dead, "probe": "none"}, {"url": up}]}],
            "routing": {"policy": "round_robin"},
            "tracing": {"stage_spans": True},
        }
        async with in_process_gateway(config, tmp_path) as (url, gw, access):
            assert gw.spans is not None
            for _ in range(2):  # round robin: at least one of the two tries the dead replica first
                r = await chat(url, traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN}-01")
                assert r.status_code == 200
            gw.access_log.flush()
            lines = access_lines(access)[-2:]
            # 2 requests x (1 server span + 5 stages) + one span per attempt
            expected = 2 * 6 + sum(line["attempts"] for line in lines)
            await until_exported(lambda: len(spans) >= expected)
    assert len(spans) == expected
    by_name: dict[str, list[Any]] = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    assert {"chat m", "auth", "parse", "limits", "cache", "queue"} <= set(by_name)
    servers = [s for s in spans if s["kind"] == KIND_SERVER]
    server_ids = {s["spanId"] for s in servers}
    # The server spans carry the ids the access log and the traceparent sent upstream name.
    assert server_ids == {line["span_id"] for line in lines}
    assert all(s["traceId"] == TRACE_ID for s in spans)
    for s in servers:
        assert s["name"] == "chat m" and s["parentSpanId"] == CLIENT_SPAN
        assert int(s["startTimeUnixNano"]) < int(s["endTimeUnixNano"])
        attrs = {a["key"]: a["value"] for a in s["attributes"]}
        assert attrs["gen_ai.operation.name"] == {"stringValue": "chat"}
        assert attrs["gen_ai.request.model"] == {"stringValue": "m"}
        assert attrs["gen_ai.request.max_tokens"] == {"intValue": 3}
        assert attrs["gen_ai.usage.output_tokens"] == {"intValue": 3}
        assert attrs["http.response.status_code"] == {"intValue": 200}
    attempts = [s for s in spans if s["kind"] == KIND_CLIENT]
    assert len(attempts) == sum(line["attempts"] for line in lines)
    failed = [s for s in attempts if s.get("status") == {"code": 2}]
    # Every attempt but each request's last failed, and those went to the dead replica.
    assert len(failed) == len(attempts) - 2 >= 1
    assert all({"key": "server.port", "value": {"intValue": 9}} in s["attributes"] for s in failed)
    for stage in ("auth", "limits", "queue"):
        assert all(s["parentSpanId"] in server_ids and s["kind"] == KIND_INTERNAL for s in by_name[stage])
    forwarded = {h["traceparent"].split("-")[2] for h in seen.headers if "traceparent" in h}
    assert forwarded == server_ids


async def test_by_default_one_server_span_with_stage_times_and_one_span_per_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with exporting(monkeypatch) as (spans, up, _):
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}]}
        async with in_process_gateway(config, tmp_path) as (url, gw, access):
            assert (await chat(url, traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN}-01")).status_code == 200
            gw.access_log.flush()
            (line,) = access_lines(access)[-1:]
            await until_exported(lambda: len(spans) >= 2)
            await asyncio.sleep(0.2)  # nothing more comes
    server, attempt = sorted(spans, key=lambda s: s["kind"])
    assert (server["kind"], attempt["kind"]) == (KIND_SERVER, KIND_CLIENT)
    assert server["spanId"] == line["span_id"] and attempt["parentSpanId"] == server["spanId"]
    attrs = {a["key"]: a["value"] for a in server["attributes"]}
    # What the access log says of the request, the server span says too.
    assert attrs["fleetgate.request_id"] == {"stringValue": line["request_id"]}
    assert attrs["fleetgate.tenant"] == {"stringValue": line["tenant"]}
    assert attrs["fleetgate.replica"] == {"stringValue": line["replica"]}
    assert attrs["fleetgate.attempts"] == {"intValue": line["attempts"]}
    assert attrs["gen_ai.usage.input_tokens"] == {"intValue": line["prompt_tokens"]}
    assert attrs["gen_ai.usage.output_tokens"] == {"intValue": line["completion_tokens"]}
    assert "gen_ai.request.choice.count" not in attrs and "error.type" not in attrs  # n=1, no error
    stage_us = [int(attrs[f"fleetgate.{stage}_us"]["intValue"]) for stage in ("auth", "parse", "limits", "queue")]
    assert all(us >= 0 for us in stage_us)
    # The stages tile the start of the request: together no longer than the whole of it.
    assert sum(stage_us) * 1000 <= int(server["endTimeUnixNano"]) - int(server["startTimeUnixNano"])


@pytest.mark.parametrize(
    ("sampler", "flags", "recorded"),
    [
        ({}, "00", False),  # parentbased_always_on (the default): the caller said no
        ({"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "1"}, "00", False),
        ({"OTEL_TRACES_SAMPLER": "always_off"}, "01", False),
        ({"OTEL_TRACES_SAMPLER": "always_on"}, "00", True),
    ],
)
async def test_an_unsampled_request_has_no_spans_but_its_trace_goes_upstream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sampler: dict[str, str], flags: str, recorded: bool
) -> None:
    async with exporting(monkeypatch) as (spans, up, seen):
        for name, value in sampler.items():
            monkeypatch.setenv(name, value)
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}]}
        async with in_process_gateway(config, tmp_path) as (url, gw, access):
            assert gw.spans is not None
            r = await chat(url, traceparent=f"00-{TRACE_ID}-{CLIENT_SPAN}-{flags}", tracestate="vendor=x")
            assert r.status_code == 200
            # Then a request sampled under every one of these samplers but always_off, whose
            # spans arriving means the first request's would have arrived before them.
            other = "0af7651916cd43dd8448eb211c80319c"
            assert (await chat(url, traceparent=f"00-{other}-{CLIENT_SPAN}-01")).status_code == 200
            gw.access_log.flush()
            first = access_lines(access)[-2]
            await until_exported(
                lambda: sampler.get("OTEL_TRACES_SAMPLER") == "always_off" or any(s["traceId"] == other for s in spans)
            )
            await asyncio.sleep(0.2)
    mine = [s for s in spans if s["traceId"] == TRACE_ID]
    assert bool(mine) is recorded
    if recorded:
        assert {s["spanId"] for s in mine if s["kind"] == KIND_SERVER} == {first["span_id"]}
    # Propagated either way: the client's trace, the gateway's span as parent, the decision
    # in the sampled flag, and the client's tracestate.
    forwarded = [h for h in seen.headers if TRACE_ID in h.get("traceparent", "")]
    assert len(forwarded) == 1
    assert forwarded[0]["traceparent"] == f"00-{TRACE_ID}-{first['span_id']}-{'01' if recorded else '00'}"
    assert forwarded[0]["tracestate"] == "vendor=x"


async def test_a_request_refused_before_its_body_is_parsed_has_a_server_span_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with exporting(monkeypatch) as (spans, up, _):
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}]}
        async with in_process_gateway(config, tmp_path) as (url, gw, access), httpx.AsyncClient(timeout=30) as http:
            r = await http.post(
                f"{url}/v1/chat/completions", content=b"{not json", headers={"Authorization": f"Bearer {API_KEY}"}
            )
            assert r.status_code == 400
            gw.access_log.flush()
            (line,) = access_lines(access)[-1:]
            await until_exported(lambda: bool(spans))
    (server,) = spans
    assert (server["kind"], server["name"], server["spanId"]) == (KIND_SERVER, "chat", line["span_id"])
    attrs = {a["key"]: a["value"] for a in server["attributes"]}
    assert attrs["http.response.status_code"] == {"intValue": 400}
    # error.type is the error code the access log names, when the error has one.
    assert attrs.get("error.type") == ({"stringValue": line["error"]} if "error" in line else None)
    assert attrs["fleetgate.request_id"] == {"stringValue": line["request_id"]}
    assert attrs["fleetgate.tenant"] == {"stringValue": line["tenant"]}
    # Known only once the body is parsed: left out, not written empty.
    assert not {"gen_ai.request.model", "fleetgate.replica", "fleetgate.attempts"} & attrs.keys()
    assert "fleetgate.auth_us" in attrs and "fleetgate.parse_us" not in attrs
