"""End to end: the gateway's other APIs (dialects) in front of one real vLLM replica on CPU.

Each test makes its calls through the gateway with the official SDK (``openai`` for the
Responses API, ``anthropic`` for Messages) or plain HTTP (vLLM's own endpoints), makes the
same calls straight to the replica's own URL, and checks that the two answers have the same
shape (top-level keys, the order of the stream's event types) and, decoding greedily, the
same text and token counts; and that the gateway's ``fleetgate_tokens_total`` counted each
answer's completion tokens once.

1. Responses, streamed and not; a two-turn conversation through ``previous_response_id``,
   stored by the gateway (the replica keeps nothing), retrieved and deleted.
2. Messages, streamed, and ``/v1/messages/count_tokens``; a refusal of vLLM's comes back in
   Anthropic's shape.
3. ``/tokenize`` and ``/detokenize``; ``/v1/rerank`` and ``/v1/score``, which vLLM 0.32 does
   not serve for a generation model: its refusal comes back with its status.

One replica, on a core of its own, serves the whole module: starting vLLM takes a minute of
the e2e budget, and a handful of requests of at most 8 tokens takes well under a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import (
    ADMIN,
    MODEL,
    SINGLE_START_TIMEOUT_S,
    E2EGateway,
    describe_group,
    gateway_config,
    kill_group,
    log_tail,
    record_timing,
    run_dir,
    start_gateway,
    stop_gateway,
    vllm_replica,
    wait_group_gone,
)
from tests.integration.harness import API_KEY

# The module's first test also waits for vLLM to start.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(SINGLE_START_TIMEOUT_S + 120)]

# Greedy decoding: the gateway's answer and the replica's own are then the same text, so a
# difference in what the gateway relays shows. ignore_eos (a vLLM extension the Responses
# API takes, Messages does not) makes the token counts exact.
TOKENS = 8
GREEDY = {"temperature": 0}
EXACT = {**GREEDY, "ignore_eos": True}
REQUEST_ID_HEADER = "x-request-id"
# What an access-log line may take to appear: it is written after the last byte went out.
ACCESS_LINE_TIMEOUT_S = 15.0
# Events the anthropic SDK's MessageStream adds to the wire's events (one per text delta).
SDK_DERIVED_EVENTS = {"text"}


@pytest.fixture(scope="module")
def vllm_one(tiny_model: Path) -> Iterator[E2EGateway]:
    """One gateway with one vLLM replica (core 0), healthy; SIGTERM at the end, after which
    none of the replica's processes may be left."""
    config = gateway_config([vllm_replica(tiny_model, core=0)])
    e2e, elapsed = start_gateway(config, run_dir("apis"), SINGLE_START_TIMEOUT_S, every=True)
    record_timing("single replica start (vLLM APIs test)", elapsed)
    try:
        yield e2e
    finally:
        with contextlib.suppress(httpx.HTTPError):
            e2e.fleet_sync()
        stop_gateway(e2e, signal.SIGTERM)
        code = e2e.gw.proc.returncode if e2e.gw.proc else None
        left = {pgid: describe_group(pgid) for pgid in sorted(e2e.seen_pgids) if wait_group_gone(pgid) is None}
        for pgid in left:
            kill_group(pgid)
        assert not left, f"vLLM processes left after the gateway's SIGTERM shutdown (killed now): {left}"
        assert code == 0, f"the gateway exited with {code} on SIGTERM\n{log_tail(e2e.gw.stderr_path)}"


@pytest.fixture(scope="module")
def replica_url(vllm_one: E2EGateway) -> str:
    """The replica's own base URL, for the same calls made without the gateway."""
    (snapshot,) = vllm_one.fleet_sync().values()
    url: str = snapshot["url"]
    return url


# -- helpers ----------------------------------------------------------------------------------


def completion_tokens_sync(fleet: E2EGateway) -> float:
    """``fleetgate_tokens_total{direction="completion"}``, summed over tenants and models."""
    text = httpx.get(f"{fleet.url}/metrics", headers=ADMIN, timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "fleetgate_tokens_total" and sample.labels.get("direction") == "completion"
    )


async def completion_tokens(fleet: E2EGateway) -> float:
    return await asyncio.to_thread(completion_tokens_sync, fleet)


async def settled(fleet: E2EGateway, *request_ids: str) -> list[dict[str, Any]]:
    """The access-log lines of ``request_ids``: once written, the request's tokens are in
    the metrics (the gateway counts them just before it writes the line)."""
    return [await fleet.access_line(rid, ACCESS_LINE_TIMEOUT_S) for rid in request_ids]


def tagged(tag: str) -> dict[str, str]:
    """Headers giving a gateway request the id its access-log line is found by."""
    return {REQUEST_ID_HEADER: f"e2e-apis-{tag}"}


def shape(kinds: Iterable[str]) -> list[str]:
    """Event types in order, a run of one type as one: vLLM sends a delta per detokenized
    step, and merges tokens into one delta when its sender falls behind, so how many deltas
    there are depends on timing, not on the API."""
    out: list[str] = []
    for kind in kinds:
        if not out or out[-1] != kind:
            out.append(kind)
    return out


def openai_clients(fleet: E2EGateway, replica: str) -> tuple[openai.AsyncOpenAI, openai.AsyncOpenAI]:
    """(through the gateway, straight to the replica); no retries, so a failure shows."""
    direct = openai.AsyncOpenAI(base_url=f"{replica}/v1", api_key="unused", max_retries=0, timeout=180)
    return fleet.client(), direct


async def responses_stream(
    client: openai.AsyncOpenAI, text: str, headers: dict[str, str] | None = None
) -> tuple[list[str], str, Any]:
    """A streamed Responses call: (event types in order, the text of its deltas, the final response)."""
    stream = await client.responses.create(
        model=MODEL, input=text, max_output_tokens=TOKENS, stream=True, extra_body=EXACT, extra_headers=headers
    )
    kinds: list[str] = []
    deltas: list[str] = []
    final = None
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None, kinds
    return kinds, "".join(deltas), final


# -- 1. Responses -------------------------------------------------------------------------------


async def test_responses_streamed_and_whole_answer_as_vllm_does(vllm_one: E2EGateway, replica_url: str) -> None:
    fleet = vllm_one
    before = await completion_tokens(fleet)
    gateway, direct = openai_clients(fleet, replica_url)
    async with gateway, direct:
        prompt = "Tell me about the gateway, streamed."
        kinds, text, final = await responses_stream(gateway, prompt, tagged("responses-stream"))
        direct_kinds, direct_text, direct_final = await responses_stream(direct, prompt)
        print(f"[e2e] responses stream: gateway {kinds}\n[e2e]                   vLLM    {direct_kinds}", flush=True)
        assert shape(kinds) == shape(direct_kinds)
        assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
        # Eight tokens of max_output_tokens 8: an incomplete answer (vLLM still ends with
        # response.completed), the tokens counted in its usage, as the replica counts them.
        assert final.usage is not None and direct_final.usage is not None
        assert final.usage.output_tokens == direct_final.usage.output_tokens == TOKENS
        assert final.usage.input_tokens == direct_final.usage.input_tokens > 0
        assert final.status == direct_final.status
        assert text == final.output_text == direct_text == direct_final.output_text
        assert 1 <= kinds.count("response.output_text.delta") <= TOKENS

        prompt = "Tell me about the gateway, whole."
        raw = await gateway.responses.with_raw_response.create(
            model=MODEL, input=prompt, max_output_tokens=TOKENS, extra_body=EXACT, extra_headers=tagged("responses")
        )
        direct_raw = await direct.responses.with_raw_response.create(
            model=MODEL, input=prompt, max_output_tokens=TOKENS, extra_body=EXACT
        )
        whole, direct_whole = json.loads(raw.text), json.loads(direct_raw.text)
        assert sorted(whole) == sorted(direct_whole)
        assert whole["usage"] == direct_whole["usage"]
        assert whole["usage"]["output_tokens"] == TOKENS
        assert (whole["status"], whole["incomplete_details"]) == (
            direct_whole["status"],
            direct_whole["incomplete_details"],
        )
        assert raw.parse().output_text == direct_raw.parse().output_text

        # The gateway kept the streamed answer (store defaults to true) from its last event.
        kept = await gateway.responses.retrieve(final.id)
        assert kept.id == final.id and kept.output_text == final.output_text
        assert kept.usage is not None and kept.usage.output_tokens == TOKENS

    lines = await settled(fleet, "e2e-apis-responses-stream", "e2e-apis-responses")
    assert [(line["endpoint"], line["status"], line["stream"]) for line in lines] == [
        ("responses", 200, True),
        ("responses", 200, False),
    ]
    assert [line["completion_tokens"] for line in lines] == [TOKENS, TOKENS]
    assert await completion_tokens(fleet) - before == TOKENS + TOKENS  # each answer counted once


async def test_responses_conversation_kept_by_the_gateway(vllm_one: E2EGateway, replica_url: str) -> None:
    fleet = vllm_one
    before = await completion_tokens(fleet)
    gateway, direct = openai_clients(fleet, replica_url)
    first_text, second_text = "My name is Ada and I run a gateway.", "What is my name?"
    async with gateway, direct:
        raw_first = await gateway.responses.with_raw_response.create(
            model=MODEL, input=first_text, max_output_tokens=TOKENS, extra_body=EXACT, extra_headers=tagged("turn-1")
        )
        first = raw_first.parse()
        second = await gateway.responses.create(
            model=MODEL,
            input=second_text,
            previous_response_id=first.id,
            max_output_tokens=TOKENS,
            extra_body=EXACT,
            extra_headers=tagged("turn-2"),
        )
        assert first.usage is not None and second.usage is not None
        assert first.usage.output_tokens == second.usage.output_tokens == TOKENS
        # Turn 2's prompt is turn 1's input and output, then its own input.
        assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

        # vLLM keeps nothing (no VLLM_ENABLE_RESPONSES_API_STORE): the gateway sent it the
        # whole conversation. The same input sent straight gets the same prompt and answer.
        expanded = [
            {"role": "user", "content": first_text},
            *json.loads(raw_first.text)["output"],
            {"role": "user", "content": second_text},
        ]
        straight = await direct.responses.create(
            model=MODEL,
            input=expanded,
            max_output_tokens=TOKENS,
            extra_body=EXACT,
        )
        assert straight.usage is not None
        assert second.usage.input_tokens == straight.usage.input_tokens
        assert second.output_text == straight.output_text
        with pytest.raises(openai.NotFoundError):  # the replica itself never kept turn 1
            await direct.responses.retrieve(first.id)

        kept = await gateway.responses.retrieve(second.id)
        assert (kept.id, kept.output_text, kept.previous_response_id) == (second.id, second.output_text, first.id)
        assert kept.usage is not None and kept.usage.input_tokens == second.usage.input_tokens
        items = await gateway.responses.input_items.list(second.id)
        assert len(items.data) == 3  # turn 1 in, turn 1 out, turn 2 in

        await gateway.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            await gateway.responses.retrieve(second.id)
        with pytest.raises(openai.NotFoundError):
            await gateway.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):  # refused before any replica is asked
            await gateway.responses.create(
                model=MODEL, input="And now?", previous_response_id=second.id, max_output_tokens=TOKENS
            )
        assert (await gateway.responses.retrieve(first.id)).id == first.id  # only turn 2 went

    lines = await settled(fleet, "e2e-apis-turn-1", "e2e-apis-turn-2")
    assert [(line["prompt_tokens"], line["completion_tokens"]) for line in lines] == [
        (first.usage.input_tokens, TOKENS),
        (second.usage.input_tokens, TOKENS),
    ]
    assert await completion_tokens(fleet) - before == TOKENS + TOKENS


async def test_a_continued_answer_names_its_previous_response(vllm_one: E2EGateway) -> None:
    """OpenAI's API, and vLLM when it keeps responses itself, echo ``previous_response_id``
    in the answer; the gateway's ``GET /v1/responses/{id}`` does (checked above), its answer
    should too. Only that assertion here, so no other failure passes for the known one."""
    async with vllm_one.client() as gateway:
        first = await gateway.responses.create(model=MODEL, input="One.", max_output_tokens=2, extra_body=EXACT)
        second = await gateway.responses.create(
            model=MODEL, input="Two.", previous_response_id=first.id, max_output_tokens=2, extra_body=EXACT
        )
    assert second.previous_response_id == first.id


# -- 2. Messages --------------------------------------------------------------------------------


async def messages_stream(
    client: anthropic.AsyncAnthropic, text: str, headers: dict[str, str] | None = None
) -> tuple[list[str], Any]:
    """A streamed Messages call: (the wire's event types in order, the final message)."""
    kinds: list[str] = []
    async with client.messages.stream(
        model=MODEL,
        max_tokens=TOKENS,
        messages=[{"role": "user", "content": text}],
        extra_body=GREEDY,
        extra_headers=headers,
    ) as stream:
        async for event in stream:
            if event.type not in SDK_DERIVED_EVENTS:
                kinds.append(event.type)
        final = await stream.get_final_message()
    return kinds, final


async def test_messages_streamed_and_count_tokens_as_vllm_does(vllm_one: E2EGateway, replica_url: str) -> None:
    fleet = vllm_one
    before = await completion_tokens(fleet)
    # x-api-key, as Anthropic's SDK sends it; then a bearer token, as Claude Code does with
    # ANTHROPIC_AUTH_TOKEN.
    gateway = anthropic.AsyncAnthropic(base_url=fleet.url, api_key=API_KEY, max_retries=0, timeout=180)
    bearer = anthropic.AsyncAnthropic(base_url=fleet.url, auth_token=API_KEY, max_retries=0, timeout=180)
    direct = anthropic.AsyncAnthropic(base_url=replica_url, api_key="unused", max_retries=0, timeout=180)
    async with gateway, bearer, direct:
        prompt = "Tell me about the gateway, in Anthropic's words."
        kinds, final = await messages_stream(gateway, prompt, tagged("messages-stream"))
        direct_kinds, direct_final = await messages_stream(direct, prompt)
        print(f"[e2e] messages stream: gateway {kinds}\n[e2e]                  vLLM    {direct_kinds}", flush=True)
        assert shape(kinds) == shape(direct_kinds)
        assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
        # No ignore_eos here (vLLM's Messages API takes none): the tiny model may end early.
        assert 1 <= final.usage.output_tokens <= TOKENS
        assert final.usage.output_tokens == direct_final.usage.output_tokens
        assert final.usage.input_tokens == direct_final.usage.input_tokens > 0
        assert final.stop_reason == direct_final.stop_reason
        assert [b.model_dump() for b in final.content] == [b.model_dump() for b in direct_final.content]

        # vLLM 0.32 serves count_tokens for the tiny model: the prompt just streamed.
        counted = await bearer.messages.count_tokens(
            model=MODEL, messages=[{"role": "user", "content": prompt}], extra_headers=tagged("count-tokens")
        )
        direct_counted = await direct.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": prompt}])
        assert counted.model_dump() == direct_counted.model_dump()
        assert counted.input_tokens == final.usage.input_tokens

        # A refusal of vLLM's (an image for a text-only model) in Anthropic's shape, with its status.
        looks = [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image", "source": {"type": "url", "url": "http://127.0.0.1:9/none.png"}},
                ],
            }
        ]
        with pytest.raises(anthropic.BadRequestError) as refused:
            await gateway.messages.create(model=MODEL, max_tokens=TOKENS, messages=looks)  # type: ignore[arg-type]
        with pytest.raises(anthropic.BadRequestError) as direct_refused:
            await direct.messages.create(model=MODEL, max_tokens=TOKENS, messages=looks)  # type: ignore[arg-type]
        print(f"[e2e] messages refusal: gateway {refused.value.body}, vLLM {direct_refused.value.body}", flush=True)
        body = refused.value.body
        assert isinstance(body, dict) and body["type"] == "error" and set(body["error"]) >= {"type", "message"}
        assert body["error"]["message"] == direct_refused.value.body["error"]["message"]  # type: ignore[index]

    lines = await settled(fleet, "e2e-apis-messages-stream", "e2e-apis-count-tokens")
    assert [(line["endpoint"], line["status"]) for line in lines] == [("messages", 200), ("count_tokens", 200)]
    assert lines[0]["completion_tokens"] == final.usage.output_tokens
    assert "completion_tokens" not in lines[1]  # nothing generated, nothing charged
    assert await completion_tokens(fleet) - before == final.usage.output_tokens


# -- 3. vLLM's own endpoints --------------------------------------------------------------------


async def test_tokenize_detokenize_and_what_vllm_refuses(vllm_one: E2EGateway, replica_url: str) -> None:
    fleet = vllm_one
    before = await completion_tokens(fleet)
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with (
        httpx.AsyncClient(base_url=fleet.url, headers=auth, timeout=60) as gateway,
        httpx.AsyncClient(base_url=replica_url, timeout=60) as direct,
    ):

        async def both(path: str, body: dict[str, Any]) -> tuple[httpx.Response, httpx.Response]:
            return await gateway.post(path, json=body), await direct.post(path, json=body)

        text = "hello there, gateway"
        via, straight = await both("/tokenize", {"model": MODEL, "prompt": text})
        assert via.status_code == straight.status_code == 200
        assert via.json() == straight.json()
        tokens = via.json()["tokens"]
        assert via.json()["count"] == len(tokens) > 0
        via, straight = await both("/detokenize", {"model": MODEL, "tokens": tokens})
        assert via.status_code == straight.status_code == 200
        assert via.json() == straight.json() == {"prompt": text}
        # The chat form: the model's chat template rendered by the replica.
        chat = {"model": MODEL, "messages": [{"role": "user", "content": text}]}
        via, straight = await both("/tokenize", chat)
        assert via.status_code == 200 and via.json() == straight.json()
        assert via.json()["count"] > len(tokens)

        # Rerank and score need a pooling model; vLLM 0.32 serves neither for the tiny
        # generation model. What it answers, the gateway answers, with the same status.
        pooling = {
            "/v1/rerank": {"model": MODEL, "query": "a gateway", "documents": ["a proxy", "a cat"]},
            "/v1/score": {"model": MODEL, "text_1": "a gateway", "text_2": ["a proxy", "a cat"]},
        }
        for path, body in pooling.items():
            via, straight = await both(path, body)
            print(f"[e2e] {path}: vLLM {straight.status_code} {straight.text[:200]}", flush=True)
            print(f"[e2e] {path}: gateway {via.status_code} {via.text[:200]}", flush=True)
            assert via.status_code == straight.status_code
            if straight.status_code == 200:
                assert sorted(via.json()) == sorted(straight.json())
            else:  # in OpenAI's envelope, whatever vLLM's body was
                error = via.json()["error"]
                assert isinstance(error["message"], str) and error["message"]

    assert await completion_tokens(fleet) - before == 0
