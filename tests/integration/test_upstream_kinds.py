"""Upstreams that are not a bare vLLM, through a real in-process gateway and the OpenAI SDK.

The upstreams are the real simulator, dressed by ``harness.openai_upstream`` as servers
without ``/health`` or ``/metrics`` and as a hosted API that demands a key (a stand-in:
no hosted API is reachable from here).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from replicas.replica import Replica, ReplicaState
from tests.integration.harness import (
    API_KEY,
    SseUpstream,
    access_lines,
    in_process_gateway,
    openai_upstream,
    serve_app,
)

HOSTED_KEY = "sk-hosted-stand-in-4f2a9c"
KEY_VAR = "FLEETGATE_TEST_HOSTED_KEY"
MESSAGES = [{"role": "user", "content": "hello there"}]
# Generous bounds for a loaded machine: they only cut a hang, they time nothing.
STATE_WAIT_S = 30.0


async def wait_for_state(replica: Replica, state: ReplicaState) -> None:
    async with asyncio.timeout(STATE_WAIT_S):
        # Polled: the health loop sets the state and signals nobody.
        while replica.state is not state:  # noqa: ASYNC110
            await asyncio.sleep(0.05)


def client(url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=30)


async def chat_and_stream(sdk: AsyncOpenAI, model: str) -> None:
    reply = await sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=5)  # type: ignore[arg-type]
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    stream = await sdk.chat.completions.create(
        model=model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 4
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4


async def test_the_sdk_works_through_every_kind_of_upstream(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    monkeypatch.setenv(KEY_VAR, HOSTED_KEY)
    async with contextlib.AsyncExitStack() as stack:
        health_only, _ = await stack.enter_async_context(openai_upstream("health-only", metrics=False))
        bare, bare_log = await stack.enter_async_context(openai_upstream("bare", health=False, metrics=False))
        passive, passive_log = await stack.enter_async_context(openai_upstream("passive", health=False, metrics=False))
        hosted, hosted_log = await stack.enter_async_context(
            openai_upstream("gpt-hosted-1", health=False, metrics=False, api_key=HOSTED_KEY)
        )
        local_stack = contextlib.AsyncExitStack()
        stack.push_async_exit(local_stack)
        local, _ = await local_stack.enter_async_context(openai_upstream("local"))
        hosted_source = {
            "url": hosted,
            "probe": "models",
            "api_key": f"env:{KEY_VAR}",
            "upstream_model": "gpt-hosted-1",
            "headers": {"OpenAI-Project": "proj-fleetgate"},
        }
        config = {
            "models": [
                {"name": "health-only", "replicas": [{"url": health_only}]},
                {"name": "bare", "replicas": [{"url": bare, "probe": "models"}]},
                {"name": "passive", "replicas": [{"url": passive, "probe": "none"}]},
                {"name": "local", "replicas": [{"url": local}], "fallback": ["hosted"]},
                {"name": "hosted", "replicas": [hosted_source]},
            ],
            "health": {"interval_s": 0.1, "timeout_s": 1.0, "failures_to_down": 2},
        }
        async with in_process_gateway(config, tmp_path) as (url, gw, access):
            # The local pool goes down: its only replica stops answering.
            await local_stack.aclose()
            await wait_for_state(gw.fleet.by_model["local"][0], ReplicaState.DOWN)
            sdk = client(url)
            names = ["health-only", "bare", "passive", "hosted", "local"]
            for name in names:
                await chat_and_stream(sdk, name)
                model = await sdk.models.retrieve(name)
                assert (model.id, model.object, model.owned_by) == (name, "model", "fleetgate")
            assert {m.id async for m in sdk.models.list()} == {"auto", *names}
            with pytest.raises(openai.NotFoundError) as info:
                await sdk.models.retrieve("no-such-model")
            assert info.value.code == "model_not_found"
            raw = await sdk.chat.completions.with_raw_response.create(
                model="local",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=2,
            )
            assert raw.headers["x-fleetgate-replica"] == "hosted-0"
            lines = access_lines(access)
            gw.access_log.flush()

    # No gauges from an upstream without /metrics: routing uses the gateway's own counts.
    assert gw.fleet.by_model["health-only"][0].gauges == {}
    # Each was probed its own way: /v1/models without /health, and "none" not at all.
    assert set(bare_log.paths("GET")) == {"/v1/models"}
    assert passive_log.paths("GET") == []
    # The hosted stand-in saw its key (and the static header) on every request, probes
    # included, and the upstream's own model name; the key is in no log line.
    assert hosted_log.requests and all(auth == f"Bearer {HOSTED_KEY}" for _, _, auth in hosted_log.requests)
    assert all(h.get("OpenAI-Project") == "proj-fleetgate" for h in hosted_log.headers)
    assert {"/v1/models", "/v1/chat/completions"} <= {p for _, p, _ in hosted_log.requests}
    assert any(line.get("fallback") == "hosted" for line in lines)
    assert HOSTED_KEY not in access.getvalue().decode()
    assert HOSTED_KEY not in caplog.text


async def test_a_refused_gateway_key_is_a_502_never_the_clients_401(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_VAR, "sk-wrong")
    async with openai_upstream("m", api_key=HOSTED_KEY) as (up, _):
        # Probed "none": the stand-in refuses the probe too, and the request must still reach it.
        source = {"url": up, "probe": "none", "api_key": f"env:{KEY_VAR}"}
        config = {"models": [{"name": "m", "replicas": [source]}]}
        async with in_process_gateway(config, tmp_path) as (url, _, _):
            for stream in (False, True):
                async with httpx.AsyncClient(timeout=30) as http:
                    r = await http.post(
                        f"{url}/v1/chat/completions",
                        json={"model": "m", "messages": MESSAGES, "max_tokens": 2, "stream": stream},
                        headers={"Authorization": f"Bearer {API_KEY}"},
                    )
                assert r.status_code == 502, r.text
                assert r.json()["error"]["code"] == "upstream_error"


@pytest.mark.parametrize("progress_window_s", [10.0, 1e-9], ids=["passive-signal-on", "passive-signal-off"])
async def test_a_busy_replica_that_answers_health_slowly_while_streaming_stays_in(
    tmp_path: Path, progress_window_s: float
) -> None:
    """The simulator answers /health 1.5 s late while it generates (as vLLM's API server
    does under load); probes time out after 0.2 s. With the passive signal (tokens arriving
    on our streams) the replica stays in rotation and every stream completes; with the
    window shrunk to nothing (the old behaviour) the same probes take it down."""
    async with openai_upstream("m", busy_health_delay_s=1.5, tokens_per_s=40) as (up, _):
        health = {"interval_s": 0.1, "timeout_s": 0.2, "failures_to_down": 2, "progress_window_s": progress_window_s}
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}], "health": health}
        async with in_process_gateway(config, tmp_path) as (url, gw, _):
            replica = gw.fleet.by_model["m"][0]
            sdk = client(url)

            async def stream() -> str:
                chunks = await sdk.chat.completions.create(
                    model="m",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=80,  # 2 s at 40 tokens/s: many probe rounds
                    stream=True,
                )
                return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

            seen: set[ReplicaState] = set()

            async def watch() -> None:
                while True:
                    seen.add(replica.state)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            texts = await asyncio.gather(*(stream() for _ in range(4)))
            watcher.cancel()
            assert all(len(t.split()) == 80 for t in texts)
            if progress_window_s > 1:
                # Probes did time out while the streams ran (the check is not vacuous), and
                # none counted: the replica never left the rotation.
                assert replica.excused_probe_timeouts >= 2
                assert replica.probe_failures == 0
                assert seen == {ReplicaState.HEALTHY}
            else:
                # Without the passive signal the same timeouts count: the replica was ejected.
                assert replica.excused_probe_timeouts == 0
                assert replica.probe_failures >= 2
                assert ReplicaState.DOWN in seen


async def test_a_stream_framed_with_crlf_is_relayed_as_it_comes(tmp_path: Path) -> None:
    """SSE allows CRLF line ends, and servers on sse-starlette send them. The gateway found
    no event boundary in such a stream and held it all until the end (then counted no
    tokens): each word must reach the client while the replica is still writing, and the
    usage must be read."""
    upstream = SseUpstream("m", tokens=5, gap_s=0.3, line_end=b"\r\n")
    async with serve_app(upstream.app()) as up:
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}]}
        async with in_process_gateway(config, tmp_path) as (url, _, access):
            async with client(url) as sdk:
                stream = await sdk.chat.completions.create(
                    model="m",
                    messages=MESSAGES,  # type: ignore[arg-type]
                    max_tokens=5,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                chunks = []
                async for chunk in stream:
                    if not chunks:
                        assert not upstream.last_sent.is_set(), "the first word came only after the last was sent"
                    chunks.append(chunk)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == " w0 w1 w2 w3 w4"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
            await asyncio.sleep(0.2)
            (line,) = access_lines(access)
            assert line["status"] == 200 and line["completion_tokens"] == 5 and "error" not in line, line


@pytest.mark.parametrize("finish", [True, False], ids=["finished", "cut-short"])
async def test_a_stream_that_ends_without_done(tmp_path: Path, finish: bool) -> None:
    """llama.cpp's server (before September 2024, and forks since) ends a stream without
    ``[DONE]``. The gateway called every such stream broken: an error event for a whole
    answer, and a failure against the replica's breaker each time. Finished (the last event
    stopped its choice, usage came), it now ends as OpenAI ends it; a body that ends before
    that is still an error, as before."""
    upstream = SseUpstream("m", tokens=3, gap_s=0.01, send_done=False, finish=finish)
    async with serve_app(upstream.app()) as up:
        config = {"models": [{"name": "m", "replicas": [{"url": up}]}]}
        async with in_process_gateway(config, tmp_path) as (url, gw, access):
            async with httpx.AsyncClient(timeout=30) as http:
                body = {"model": "m", "messages": MESSAGES, "max_tokens": 3, "stream": True}
                reply = await http.post(
                    f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
                )
            events = [line for line in reply.text.split("\n") if line.startswith("data: ")]
            failures = gw.metrics.registry.get_sample_value(
                "fleetgate_upstream_errors_total", {"replica": "m-0", "kind": "stream"}
            )
            await asyncio.sleep(0.2)
            (line,) = access_lines(access)
            if finish:
                assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events), events
                assert len(events) == 4  # three words and the end
                assert line["status"] == 200 and "error" not in line and line["completion_tokens"] == 3, line
                assert failures is None
            else:
                assert '"upstream_stream_error"' in events[-1], events
                assert line["error"] == "upstream_stream_error"
                assert failures == 1
