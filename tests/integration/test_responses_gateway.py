"""``/v1/responses`` through the gateway, driven by the official ``openai`` SDK against the
simulator: streamed and not, stored conversations across two gateway pods sharing one real
``redis-server``, retrieval and deletion, tenant isolation, and the faults (Redis stopped
mid-conversation, the replica of the last turn gone)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.harness import (
    API_KEY,
    OTHER_KEY,
    access_lines,
    gateway_process,
    in_process_gateway,
    sim_upstream,
    tenants,
)
from tests.integration.redis_server import RedisServer

MODEL = "sim-model"


def config(*urls: str, redis_url: str | None = None, **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "models": [{"name": MODEL, "tier": "small", "replicas": [{"url": u} for u in urls]}],
        **extra,
    }
    if redis_url is not None:
        cfg["redis_url"] = redis_url
    return cfg


def client(url: str, key: str = API_KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=20)


@contextlib.asynccontextmanager
async def one_gateway(tmp_path: Path, **extra: Any) -> AsyncIterator[tuple[str, Any, Any]]:
    async with sim_upstream(MODEL) as sim, in_process_gateway(config(sim, **extra), tmp_path) as (url, gw, access):
        yield url, gw, access


async def test_responses_create_not_streamed(tmp_path: Path) -> None:
    async with one_gateway(tmp_path) as (url, gw, access):
        raw = await client(url).responses.with_raw_response.create(model=MODEL, input="Say hello", max_output_tokens=8)
        reply = raw.parse()
        assert reply.status in ("completed", "incomplete")
        assert reply.output_text
        assert reply.usage is not None and reply.usage.output_tokens == 8 and reply.usage.input_tokens > 0
        assert raw.headers["x-fleetgate-replica"].startswith(MODEL)
        gw.access_log.flush()
        line = access_lines(access)[-1]
        assert line["endpoint"] == "responses" and line["status"] == 200
        assert (line["prompt_tokens"], line["completion_tokens"]) == (reply.usage.input_tokens, 8)


async def test_responses_stream_events_pass_through_and_settle_usage(tmp_path: Path) -> None:
    async with one_gateway(tmp_path) as (url, gw, access):
        stream = await client(url).responses.create(model=MODEL, input="Count to ten", max_output_tokens=6, stream=True)
        kinds: list[str] = []
        deltas: list[str] = []
        final = None
        async for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert kinds[0] == "response.created"
        assert kinds[-1] in ("response.completed", "response.incomplete")
        assert final is not None and final.usage is not None
        assert len(deltas) == final.usage.output_tokens == 6
        assert "".join(deltas) == final.output_text
        gw.access_log.flush()
        line = access_lines(access)[-1]
        assert line["endpoint"] == "responses" and line["stream"] is True and "error" not in line
        assert line["completion_tokens"] == 6 and line["prompt_tokens"] == final.usage.input_tokens
        metric = gw.metrics.tokens.labels("t1", MODEL, "completion")._value.get()
        assert metric == 6  # counted once


async def test_a_conversation_continues_on_another_pod_and_can_be_retrieved_and_deleted(tmp_path: Path) -> None:
    """Two real ``fleetgate serve`` processes (two pods), each with its own managed simulated
    replica, sharing one real ``redis-server``: the turns alternate between them."""
    managed = {
        "models": [{"name": MODEL, "replicas": [{"engine": "sim", "sim": {"ttft_ms": 5, "tokens_per_s": 2000}}]}]
    }
    with RedisServer() as redis:
        pod = {**managed, "redis_url": redis.url, "health": {"interval_s": 0.2}}
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        with gateway_process(pod, tmp_path / "a") as pod_a, gateway_process(pod, tmp_path / "b") as pod_b:
            a, b = client(pod_a.url), client(pod_b.url)
            first = await a.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=5)
            second = await b.responses.create(
                model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=5
            )
            third = await a.responses.create(
                model=MODEL, input="And again?", previous_response_id=second.id, max_output_tokens=5
            )
            assert first.usage and second.usage and third.usage
            # The answers name the turn they continue, as OpenAI's do (the replica saw none).
            assert (second.previous_response_id, third.previous_response_id) == (first.id, second.id)
            # Each turn's replica read the whole conversation: the earlier inputs and outputs.
            assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
            assert third.usage.input_tokens > second.usage.input_tokens + second.usage.output_tokens
            kept = await b.responses.retrieve(second.id)
            assert kept.id == second.id and kept.output_text == second.output_text
            assert kept.previous_response_id == first.id
            items = await a.responses.input_items.list(third.id)
            texts = [str(item) for item in items.data]
            assert len(items.data) == 5  # turn 1 in, out; turn 2 in, out; turn 3 in
            assert "My name is Ada." in texts[0] and "And again?" in texts[-1]
            await a.responses.delete(first.id)
            with pytest.raises(openai.NotFoundError):
                await b.responses.retrieve(first.id)
            with pytest.raises(openai.NotFoundError):
                await b.responses.create(model=MODEL, input="more", previous_response_id=first.id, max_output_tokens=2)


async def test_another_tenant_can_neither_read_delete_nor_continue_a_response(tmp_path: Path) -> None:
    async with one_gateway(tmp_path) as (url, _, _):
        mine, theirs = client(url), client(url, OTHER_KEY)
        kept = await mine.responses.create(model=MODEL, input="secret", max_output_tokens=3)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.delete(kept.id)
        with pytest.raises(openai.NotFoundError):
            await theirs.responses.create(model=MODEL, input="x", previous_response_id=kept.id, max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            await mine.responses.retrieve("resp_" + "0" * 32)  # unknown reads the same
        assert (await mine.responses.retrieve(kept.id)).id == kept.id


async def test_a_thousand_interleaved_requests_of_two_tenants_never_cross(tmp_path: Path) -> None:
    async with one_gateway(tmp_path) as (url, _, _):
        clients = {"t1": client(url), "t2": client(url, OTHER_KEY)}
        gate = asyncio.Semaphore(32)

        async def create(tenant: str, i: int) -> tuple[str, str, str]:
            async with gate:
                reply = await clients[tenant].responses.create(
                    model=MODEL, input=f"{tenant} question {i}", max_output_tokens=2
                )
            return tenant, reply.id, reply.output_text

        made = await asyncio.gather(*(create("t1" if i % 2 else "t2", i) for i in range(500)))

        async def check(tenant: str, response_id: str, text: str) -> tuple[bool, bool]:
            other = "t2" if tenant == "t1" else "t1"
            async with gate:
                own = await clients[tenant].responses.retrieve(response_id)
                try:
                    await clients[other].responses.retrieve(response_id)
                    crossed = True
                except openai.NotFoundError:
                    crossed = False
            return own.output_text == text, crossed

        checked = await asyncio.gather(*(check(*m) for m in made))
        assert len(made) + 2 * len(checked) == 1500
        assert all(own for own, _ in checked)
        assert sum(crossed for _, crossed in checked) == 0


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
async def test_redis_stopped_mid_conversation(tmp_path: Path, policy: str) -> None:
    """A stored turn that cannot be read is a 503, never a shorter context; a new answer that
    cannot be kept is served (fail_open) or refused (fail_closed)."""
    people = [{**t, "limits": {"on_store_failure": policy}} for t in tenants()]
    with RedisServer() as redis:
        async with (
            sim_upstream(MODEL) as sim,
            in_process_gateway(
                config(sim, redis_url=redis.url, tenants=people, responses={"redis_timeout_ms": 200}), tmp_path
            ) as (url, _, _),
        ):
            c = client(url)
            first = await c.responses.create(model=MODEL, input="remember this", max_output_tokens=3)
            redis.stop()
            with pytest.raises(openai.InternalServerError) as caught:
                await c.responses.create(model=MODEL, input="go on", previous_response_id=first.id, max_output_tokens=2)
            assert caught.value.status_code == 503
            assert caught.value.code == "response_store_unavailable"
            if policy == "fail_open":
                served = await c.responses.create(model=MODEL, input="new", max_output_tokens=2)
                assert served.output_text
            else:
                with pytest.raises(openai.InternalServerError) as refused:
                    await c.responses.create(model=MODEL, input="new", max_output_tokens=2)
                assert refused.value.status_code == 503
            # Not stored answers go through either way.
            unstored = await c.responses.create(model=MODEL, input="no store", max_output_tokens=2, store=False)
            assert unstored.output_text
            redis.start()


async def test_the_conversation_survives_the_loss_of_the_replica_of_its_last_turn(tmp_path: Path) -> None:
    stack = contextlib.AsyncExitStack()
    async with stack:
        sims = {}
        for _ in range(2):
            sim_stack = contextlib.AsyncExitStack()
            url = await sim_stack.enter_async_context(sim_upstream(MODEL))
            sims[url] = sim_stack
            stack.push_async_callback(sim_stack.aclose)
        cfg = config(*sims, health={"interval_s": 0.1, "timeout_s": 0.5})
        url, gw, _ = await stack.enter_async_context(in_process_gateway(cfg, tmp_path))
        c = client(url)
        raw = await c.responses.with_raw_response.create(model=MODEL, input="first turn", max_output_tokens=4)
        first = raw.parse()
        served_by = raw.headers["x-fleetgate-replica"]
        replica = next(r for r in gw.fleet.all() if r.id == served_by)
        await sims[replica.base_url].aclose()  # that replica is gone
        second = await c.responses.create(
            model=MODEL, input="second turn", previous_response_id=first.id, max_output_tokens=4
        )
        assert second.status in ("completed", "incomplete") and second.output_text
        assert second.usage is not None and second.usage.output_tokens == 4
        assert second.usage.input_tokens > first.usage.input_tokens  # type: ignore[union-attr]


async def test_an_agent_turn_with_a_tool_call_through_the_gateway(tmp_path: Path) -> None:
    """The OpenAI Agents SDK speaks Responses by default: one agent turn whose model must
    call a tool, then answers with the tool's output in its input (two requests through the
    gateway, the second carrying the function call and its output)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    async with one_gateway(tmp_path) as (url, gw, access):
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client(url))
        agent = agents.Agent(
            name="adder",
            instructions="Use the tool.",
            model=model,
            tools=[add],
            model_settings=agents.ModelSettings(tool_choice="required"),
        )
        result = await agents.Runner.run(agent, "What is 1 + 1?")
        assert calls == [(1, 1)]
        assert isinstance(result.final_output, str) and result.final_output
        gw.access_log.flush()
        lines = [line for line in access_lines(access) if line["endpoint"] == "responses"]
        assert len(lines) == 2 and all(line["status"] == 200 for line in lines)


async def test_a_streamed_continuation_names_its_previous_response_in_every_event(tmp_path: Path) -> None:
    async with one_gateway(tmp_path) as (url, _, _):
        c = client(url)
        first = await c.responses.create(model=MODEL, input="One.", max_output_tokens=2)
        stream = await c.responses.create(
            model=MODEL, input="Two.", previous_response_id=first.id, max_output_tokens=2, stream=True
        )
        named = [event.response.previous_response_id async for event in stream if hasattr(event, "response")]
        assert len(named) >= 3 and set(named) == {first.id}  # created, in_progress, completed


async def test_a_stream_under_way_can_be_cancelled_by_its_id(tmp_path: Path) -> None:
    """``POST /v1/responses/{id}/cancel`` stops a stream in progress (the replica's
    connection closes) and answers the response as cancelled; its client's stream ends with
    an error event; a finished response cannot be cancelled; another tenant's is a 404."""
    async with (
        sim_upstream(MODEL, tokens_per_s=20) as sim,
        in_process_gateway(config(sim), tmp_path) as (url, gw, access),
    ):
        c = client(url)
        stream = await c.responses.create(model=MODEL, input="a long answer", max_output_tokens=500, stream=True)
        events = stream.__aiter__()
        created = await events.__anext__()
        assert created.type == "response.created"
        response_id = created.response.id
        with pytest.raises(openai.NotFoundError):
            await client(url, OTHER_KEY).responses.cancel(response_id)
        cancelled = await c.responses.cancel(response_id)
        assert (cancelled.id, cancelled.status) == (response_id, "cancelled")
        with pytest.raises(openai.APIError) as ended:
            async for _ in events:
                pass
        assert "cancelled" in str(ended.value)
        gw.access_log.flush()
        line = access_lines(access)[-1]
        assert line["error"] == "response_cancelled"
        assert gw.metrics.stream_errors.labels(MODEL)._value.get() == 0  # not the replica's fault
        finished = await c.responses.create(model=MODEL, input="short", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError):
            await c.responses.cancel(finished.id)
