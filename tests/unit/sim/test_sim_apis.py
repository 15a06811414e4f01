"""The simulator's Responses, Messages, pooling and tokenizer endpoints, on the wire and through the SDKs.

Each test serves the simulator on a loopback port. The fixed-rate engine draws its words from
a generator seeded by the prompt, so the same request gives the same text, whole or streamed.
The ``sim`` fixture's engine ignores EOS, so every request runs to its token limit (vLLM's
"length") and the wire shapes can be counted; ``StopEngine`` ends answers on their own after a
few words, for the "completed" / "end_turn" paths, and ``natural_sim`` is the simulator's own
default (answers of a drawn length, ``sim.answer_lengths``) for the Agents SDK's runs.

The stand-in chat template renders a conversation as ``<|role|>text`` lines and a last
``<|assistant|>`` line; a token is 4 characters, rounded up.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer

from sim.engine import FixedRateConfig, FixedRateEngine, SimEngine, SimRequest, SimStream, count_tokens
from sim.generation import DEFAULT_MAX_TOKENS, NO_TOOLS, UNKNOWN_TOOL, arguments_for
from sim.model import prompt_token_ids
from sim.server import create_app

MODEL = "sim-model"
FAST = FixedRateConfig(ttft_s=0.0, tokens_per_s=50_000.0, ignore_eos=True)
NATURAL = FixedRateConfig(ttft_s=0.0, tokens_per_s=50_000.0)
# "<|user|>hello there" (8 + 11) + "\n" + "<|assistant|>" (13) = 33 characters = 9 tokens.
HELLO_TOKENS = 9
assert count_tokens("<|user|>hello there\n<|assistant|>") == HELLO_TOKENS


class _Words:
    """An answer that ends on its own after its words (finish "stop"), unless the limit comes first."""

    def __init__(self, request: SimRequest, words: list[str]) -> None:
        self.prompt_tokens = count_tokens(request.prompt)
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._words = words[: request.max_tokens]
        self._limited = request.max_tokens <= len(words)

    def cancel(self) -> None:
        return None

    async def __aiter__(self) -> AsyncIterator[str]:
        for word in self._words:
            self.completion_tokens += 1
            yield word
        self.finish_reason = "length" if self._limited else "stop"


class StopEngine:
    """Answers every prompt with the same few words, then stops: an answer that reached EOS."""

    WORDS = ("Hello", " from", " the", " fleet")

    def submit(self, request: SimRequest) -> SimStream:
        return _Words(request, list(self.WORDS))

    def gauges(self) -> dict[str, float]:
        return {}

    def cache_config(self) -> dict[str, int] | None:
        return None

    def reset_prefix_cache(self) -> bool:
        return True

    async def close(self) -> None:
        return None


async def _serve(engine: SimEngine) -> AsyncIterator[str]:
    server = TestServer(create_app(engine, MODEL, max_model_len=4096), host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture
async def sim() -> AsyncIterator[str]:
    async for url in _serve(FixedRateEngine(FAST)):
        yield url


@pytest.fixture
async def natural_sim() -> AsyncIterator[str]:
    async for url in _serve(FixedRateEngine(NATURAL)):
        yield url


@pytest.fixture
async def stopping_sim() -> AsyncIterator[str]:
    async for url in _serve(StopEngine()):
        yield url


async def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, str, bytes]:
    async with ClientSession() as http, http.post(url + path, json=body) as response:
        return response.status, response.headers.get("Content-Type", ""), await response.read()


async def post_json(url: str, path: str, body: dict[str, Any], status: int = 200) -> Any:
    got, _, raw = await post(url, path, body)
    assert got == status, raw
    return orjson.loads(raw)


def sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """Each event's ``event:`` name (None without one) and its parsed ``data:``."""
    events: list[tuple[str | None, Any]] = []
    for block in raw.decode().split("\n\n"):
        if not block:
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        assert set(fields) <= {"event", "data"}, block
        events.append((fields.get("event"), orjson.loads(fields["data"])))
    return events


# --- Responses ------------------------------------------------------------------------------


async def test_responses_whole_answer_is_vllms_response_object(sim: str) -> None:
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "hello there"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hi"}]},
            {"role": "user", "content": [{"type": "input_text", "text": "again"}]},
        ],
        "max_output_tokens": 5,
        "temperature": 0.2,
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
    }
    got = await post_json(sim, "/v1/responses", body)
    # "<|system|>Be brief." 19 + "<|user|>hello there" 19 + "<|assistant|>hi" 15 + "<|user|>again" 13
    # + "<|assistant|>" 13 + 4 newlines = 83 characters = 21 tokens.
    assert got["usage"] == {
        "input_tokens": 21,
        "input_tokens_details": {"cached_tokens": 0, "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": 5,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": 26,
    }
    assert got["id"].startswith("resp_") and got["object"] == "response"
    # Every simulated answer runs to its limit, which vLLM reports as incomplete.
    assert (got["status"], got["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert (got["model"], got["instructions"], got["max_output_tokens"], got["temperature"]) == (
        MODEL,
        "Be brief.",
        5,
        0.2,
    )
    assert (got["top_p"], got["tool_choice"], got["parallel_tool_calls"]) == (1.0, "auto", True)
    assert got["tools"] == body["tools"] and got["previous_response_id"] is None
    [message] = got["output"]
    assert message["id"].startswith("msg_")
    assert {k: message[k] for k in ("type", "role", "status")} == {
        "type": "message",
        "role": "assistant",
        "status": "completed",
    }
    [part] = message["content"]
    assert part["type"] == "output_text" and part["annotations"] == [] and len(part["text"].split()) == 5


async def test_responses_stream_sends_vllms_events_in_order(sim: str) -> None:
    body = {"model": MODEL, "input": "hello there", "max_output_tokens": 4}
    status, content_type, raw = await post(sim, "/v1/responses", {**body, "stream": True})
    assert status == 200 and content_type.startswith("text/event-stream")
    assert b"[DONE]" not in raw
    events = sse(raw)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(12))
    created = events[0][1]["response"]
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    item_id = events[2][1]["item"]["id"]
    deltas = [data["delta"] for _, data in events[4:8]]
    text = "".join(deltas)
    assert events[8][1]["text"] == text and events[9][1]["part"]["text"] == text
    assert all(data.get("item_id", item_id) == item_id for _, data in events[3:10])
    done = events[-1][1]["response"]
    assert done["status"] == "incomplete" and done["output"][0]["id"] == item_id
    assert done["output"][0]["content"][0]["text"] == text
    usage = done["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (HELLO_TOKENS, 4, HELLO_TOKENS + 4)
    # The engine seeds its words with the prompt: the whole answer is the same text.
    whole = await post_json(sim, "/v1/responses", body)
    assert whole["output"][0]["content"][0]["text"] == text


async def test_responses_completed_when_the_answer_ends_on_its_own(stopping_sim: str) -> None:
    got = await post_json(stopping_sim, "/v1/responses", {"input": "hello there"})  # model is optional
    assert (got["status"], got["incomplete_details"], got["model"]) == ("completed", None, MODEL)
    assert got["output"][0]["content"][0]["text"] == "Hello from the fleet"
    assert (got["usage"]["input_tokens"], got["usage"]["output_tokens"]) == (HELLO_TOKENS, 4)


async def test_responses_without_a_limit_end_at_the_stand_in_as_completed(sim: str) -> None:
    # No max_output_tokens: the simulator's stand-in limit plays the model's natural end.
    got = await post_json(sim, "/v1/responses", {"model": MODEL, "input": "hello there"})
    assert (got["status"], got["incomplete_details"]) == ("completed", None)
    assert got["max_output_tokens"] == got["usage"]["output_tokens"] == DEFAULT_MAX_TOKENS


async def test_responses_without_a_store_refuse_previous_response_and_background(sim: str) -> None:
    got = await post_json(sim, "/v1/responses", {"input": "x", "previous_response_id": "resp_1"}, status=404)
    assert got == {
        "error": {
            "message": "Response with id 'resp_1' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    got = await post_json(sim, "/v1/responses", {"input": "x", "background": True}, status=400)
    assert got["error"]["param"] == "background" and "VLLM_ENABLE_RESPONSES_API_STORE" in got["error"]["message"]
    got = await post_json(sim, "/v1/responses", {"model": MODEL}, status=400)
    assert got["error"]["type"] == "BadRequestError"


async def test_openai_sdk_parses_responses_whole_and_streamed(sim: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"{sim}/v1", api_key="sk-sim")
    whole = await client.responses.create(model=MODEL, input="hello there", max_output_tokens=6)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert len(whole.output_text.split()) == 6
    assert (whole.usage.input_tokens, whole.usage.output_tokens, whole.usage.total_tokens) == (9, 6, 15)

    stream = await client.responses.create(model=MODEL, input="hello there", max_output_tokens=6, stream=True)
    events = [event async for event in stream]
    assert [e.type for e in events[:4]] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    completed = events[-1]
    assert completed.type == "response.completed" and completed.response.usage.output_tokens == 6

    async with client.responses.stream(model=MODEL, input="hello there", max_output_tokens=6) as helper:
        final = await helper.get_final_response()
    assert final.output_text == whole.output_text and final.usage.input_tokens == HELLO_TOKENS
    await client.close()


async def test_agents_sdk_runs_an_agent_on_responses(natural_sim: str) -> None:
    openai = pytest.importorskip("openai")
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=f"{natural_sim}/v1", api_key="sk-sim")
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    agent = agents.Agent(name="sim", instructions="Be brief.", model=model)
    result = await agents.Runner.run(agent, "hello there")
    streamed = agents.Runner.run_streamed(agent, "hello there")
    async for _ in streamed.stream_events():
        pass
    # Same prompt, same words and the same drawn length, which ended the answer before the limit.
    assert 0 < len(result.final_output.split()) < DEFAULT_MAX_TOKENS
    assert streamed.final_output == result.final_output
    await client.close()


# --- Messages -------------------------------------------------------------------------------


MESSAGES_BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 3,
    "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
    "messages": [
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "2"}]},
    ],
}
# "<|system|>Be brief." 19 + "<|user|>hello there" 19 + '<|assistant|>f({"a":1})' 22 + "<|user|>2" 9
# + "<|assistant|>" 13 + 4 newlines = 86 characters = 22 tokens.
MESSAGES_TOKENS = 22


async def test_messages_whole_answer_drops_null_fields_as_vllm_does(sim: str) -> None:
    got = await post_json(sim, "/v1/messages", MESSAGES_BODY)
    assert got["id"].startswith("chatcmpl-")  # vLLM answers with the chat completion's id
    assert list(got) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    assert (got["type"], got["role"], got["model"], got["stop_reason"]) == ("message", "assistant", MODEL, "max_tokens")
    [block] = got["content"]
    assert block["type"] == "text" and len(block["text"].split()) == 3
    assert got["usage"] == {"input_tokens": MESSAGES_TOKENS, "output_tokens": 3}


async def test_messages_stream_sends_vllms_events_in_order(sim: str) -> None:
    status, content_type, raw = await post(sim, "/v1/messages", {**MESSAGES_BODY, "stream": True})
    assert status == 200 and content_type.startswith("text/event-stream")
    events = sse(raw)
    names = [name for name, _ in events]
    assert names == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 3,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [data["type"] for _, data in events] == names
    message = events[0][1]["message"]
    assert message["usage"] == {"input_tokens": MESSAGES_TOKENS, "output_tokens": 0}
    assert message["content"] == [] and message["stop_reason"] is None and "role" not in message
    assert events[1][1] == {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0}
    deltas = [data["delta"] for _, data in events[2:5]]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert events[5][1] == {"type": "content_block_stop", "index": 0}
    assert events[6][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "max_tokens"},
        "usage": {"input_tokens": MESSAGES_TOKENS, "output_tokens": 3},
    }
    whole = await post_json(sim, "/v1/messages", MESSAGES_BODY)
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]


async def test_messages_end_turn_when_the_answer_ends_on_its_own(stopping_sim: str) -> None:
    body = {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "hello there"}]}
    got = await post_json(stopping_sim, "/v1/messages", body)
    assert (got["stop_reason"], got["content"][0]["text"]) == ("end_turn", "Hello from the fleet")
    assert got["usage"] == {"input_tokens": HELLO_TOKENS, "output_tokens": 4}


async def test_messages_errors_take_vllms_envelopes(sim: str) -> None:
    unknown = {**MESSAGES_BODY, "model": "other"}
    got = await post_json(sim, "/v1/messages", unknown, status=404)
    assert got == {"type": "error", "error": {"type": "NotFoundError", "message": "The model `other` does not exist."}}
    # A body that fails the request schema is answered by vLLM's app-wide handler: OpenAI's envelope.
    got = await post_json(sim, "/v1/messages", {k: v for k, v in MESSAGES_BODY.items() if k != "max_tokens"}, 400)
    assert got["error"]["type"] == "BadRequestError" and got["error"]["code"] == 400


async def test_count_tokens_counts_what_messages_would(sim: str) -> None:
    body = {k: v for k, v in MESSAGES_BODY.items() if k != "max_tokens"}
    got = await post_json(sim, "/v1/messages/count_tokens", body)
    assert got == {"input_tokens": MESSAGES_TOKENS, "context_management": {"original_input_tokens": MESSAGES_TOKENS}}
    got = await post_json(sim, "/v1/messages/count_tokens", {**body, "model": "other"}, status=404)
    assert got["type"] == "error" and got["error"]["type"] == "NotFoundError"


async def test_messages_system_prompt_gathers_blocks_and_system_messages(sim: str) -> None:
    turn = {"role": "user", "content": "hello there"}
    plain = {"model": MODEL, "system": "Be brief.", "messages": [turn]}
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=0f3a"}
    split = {
        "model": MODEL,
        "system": [header, {"type": "text", "text": "Be "}],
        "messages": [{"role": "system", "content": "brief."}, turn],
    }
    # Both are "<|system|>Be brief." 19 + "<|user|>hello there" 19 + "<|assistant|>" 13
    # + 2 newlines = 53 characters = 14 tokens: vLLM drops the billing header.
    for body in (plain, split):
        got = await post_json(sim, "/v1/messages/count_tokens", body)
        assert got["input_tokens"] == 14


async def test_anthropic_sdk_parses_messages_whole_and_streamed(sim: str) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.AsyncAnthropic(base_url=sim, api_key="sk-sim")
    messages = [{"role": "user", "content": "hello there"}]
    whole = await client.messages.create(model=MODEL, max_tokens=5, messages=messages)
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (HELLO_TOKENS, 5)
    text = whole.content[0].text
    assert len(text.split()) == 5

    async with client.messages.stream(model=MODEL, max_tokens=5, messages=messages) as stream:
        pieces = [piece async for piece in stream.text_stream]
        final = await stream.get_final_message()
    assert "".join(pieces) == text and final.content[0].text == text
    assert (final.stop_reason, final.usage.input_tokens, final.usage.output_tokens) == ("max_tokens", 9, 5)

    counted = await client.messages.count_tokens(model=MODEL, messages=messages)
    assert counted.input_tokens == HELLO_TOKENS
    with pytest.raises(anthropic.NotFoundError):
        await client.messages.create(model="other", max_tokens=5, messages=messages)
    await client.close()


async def test_one_conversation_costs_the_same_prompt_tokens_on_every_api(sim: str) -> None:
    turn = {"role": "user", "content": "hello there"}
    chat = await post_json(sim, "/v1/chat/completions", {"model": MODEL, "messages": [turn], "max_tokens": 1})
    responses = await post_json(sim, "/v1/responses", {"model": MODEL, "input": [turn], "max_output_tokens": 1})
    messages = await post_json(sim, "/v1/messages", {"model": MODEL, "messages": [turn], "max_tokens": 1})
    tokenized = await post_json(sim, "/tokenize", {"model": MODEL, "messages": [turn]})
    counts = (
        chat["usage"]["prompt_tokens"],
        responses["usage"]["input_tokens"],
        messages["usage"]["input_tokens"],
        tokenized["count"],
    )
    assert counts == (HELLO_TOKENS,) * 4


# --- Pooling and the tokenizer --------------------------------------------------------------


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank"])
async def test_rerank_sorts_documents_by_relevance_and_keeps_top_n(sim: str, path: str) -> None:
    documents = ["cats purr", "the fleet serves tokens", "dogs bark", "the fleet serves tokens"]
    body = {"model": MODEL, "query": "the fleet serves tokens", "documents": documents}
    got = await post_json(sim, path, body)
    assert got["id"].startswith("rerank-") and got["model"] == MODEL
    results = got["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and all(0.0 <= s <= 1.0 for s in scores)
    # A document equal to the query scores 1.0; equal scores keep their input order.
    assert [(r["index"], r["relevance_score"]) for r in results[:2]] == [(1, 1.0), (3, 1.0)]
    assert all(r["document"] == {"text": documents[r["index"]], "multi_modal": None} for r in results)
    # Each pair reads query (23 characters = 6 tokens) and document: 6+3, 6+6, 6+3, 6+6.
    assert got["usage"] == {"prompt_tokens": 42, "total_tokens": 42}
    top = await post_json(sim, path, {**body, "top_n": 2})
    assert top["results"] == results[:2]


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
async def test_score_pairs_one_to_many_and_many_to_many(sim: str, path: str) -> None:
    got = await post_json(sim, path, {"model": MODEL, "text_1": "abcd", "text_2": ["abcd", "efgh", "ijklm"]})
    assert got["id"].startswith("score-") and got["object"] == "list" and got["model"] == MODEL
    assert [d["index"] for d in got["data"]] == [0, 1, 2] and {d["object"] for d in got["data"]} == {"score"}
    assert got["data"][0]["score"] == 1.0 and all(0.0 <= d["score"] <= 1.0 for d in got["data"])
    # Pairs of 1+1, 1+1 and 1+2 tokens: 7.
    assert got["usage"] == {
        "prompt_tokens": 7,
        "total_tokens": 7,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
    }
    pairwise = await post_json(sim, path, {"text_1": ["abcd", "efgh"], "text_2": ["efgh", "efgh"]})
    assert [d["score"] for d in pairwise["data"]] == [got["data"][1]["score"], 1.0]
    mismatch = await post_json(sim, path, {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, status=400)
    assert mismatch["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"


async def test_tokenize_gives_the_engines_tokens_and_detokenize_reverses_them(sim: str) -> None:
    prompt = "Explain continuous batching."  # 28 characters = 7 tokens
    got = await post_json(sim, "/tokenize", {"model": MODEL, "prompt": prompt})
    assert got == {"count": 7, "max_model_len": 4096, "tokens": prompt_token_ids(prompt), "token_strs": None}
    with_strs = await post_json(sim, "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert with_strs["token_strs"] == ["Expl", "ain ", "cont", "inuo", "us b", "atch", "ing."]
    back = await post_json(sim, "/detokenize", {"model": MODEL, "tokens": got["tokens"]})
    assert back == {"prompt": prompt}
    # Without the generation prompt the chat is "<|user|>hi": 10 characters = 3 tokens.
    chat = await post_json(
        sim, "/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": False}
    )
    assert chat["count"] == 3
    unknown = await post_json(sim, "/detokenize", {"tokens": [7]}, status=400)
    assert unknown["error"]["message"] == "Token id 7 is out of vocabulary"


NEW_ENDPOINTS = [
    ("/v1/responses", {"input": "hi"}),
    ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/rerank", {"query": "a", "documents": ["b"]}),
    ("/v1/rerank", {"query": "a", "documents": ["b"]}),
    ("/score", {"text_1": "a", "text_2": "b"}),
    ("/v1/score", {"text_1": "a", "text_2": "b"}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": []}),
]


@pytest.mark.parametrize(("path", "body"), NEW_ENDPOINTS)
async def test_an_unknown_model_is_vllms_404(sim: str, path: str, body: dict[str, Any]) -> None:
    got = await post_json(sim, path, {**body, "model": "other"}, status=404)
    message = "The model `other` does not exist."
    if path.startswith("/v1/messages"):
        assert got == {"type": "error", "error": {"type": "NotFoundError", "message": message}}
    else:
        assert got == {"error": {"message": message, "type": "NotFoundError", "param": None, "code": 404}}


# --- Forced tool calls ----------------------------------------------------------------------
#
# A tool_choice that forces a call is answered with one call of the tool, its arguments built
# from the schema's required properties and streamed one simulator token (4 characters) per
# delta. add's arguments are '{"a": 1, "b": 1}': 16 characters = 4 tokens = 4 deltas.

ADD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
ADD_ARGUMENTS = '{"a": 1, "b": 1}'
ADD_PIECES = ['{"a"', ": 1,", ' "b"', ": 1}"]
assert "".join(ADD_PIECES) == ADD_ARGUMENTS
# Every kind of property, nested objects, a $ref, bounds and minimum sizes; "note" is optional.
SEARCH_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "query": {"type": "string", "minLength": 3},
        "limit": {"type": "integer", "minimum": 5, "maximum": 10},
        "ratio": {"type": "number", "maximum": 0.5},
        "exact": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "minItems": 2},
        "mode": {"const": "fast"},
        "owner": {"type": ["null", "string"]},
        "filters": {"$ref": "#/$defs/Filters"},
        "extra": {"type": "object"},
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "note": {"type": "string"},
    },
    "required": ["query", "limit", "ratio", "exact", "tags", "mode", "owner", "filters", "extra", "any"],
    "additionalProperties": False,
    "$defs": {
        "Filters": {
            "type": "object",
            "properties": {"since": {"type": "integer"}, "lang": {"type": "string"}},
            "required": ["since"],
            "additionalProperties": False,
        }
    },
}
SEARCH_ARGUMENTS = {
    "query": "xxx",
    "limit": 5,
    "ratio": 0.5,
    "exact": True,
    "tags": ["red", "red"],
    "mode": "fast",
    "owner": "x",
    "filters": {"since": 1},
    "extra": {},
    "any": 1,
}
HELLO = [{"role": "user", "content": "hello there"}]


def responses_tools() -> list[dict[str, Any]]:
    return [
        {"type": "function", "name": "search", "parameters": SEARCH_SCHEMA, "strict": False},
        {"type": "function", "name": "add", "parameters": ADD_SCHEMA, "strict": True},
    ]


def chat_tools() -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": "search", "parameters": SEARCH_SCHEMA}},
        {"type": "function", "function": {"name": "add", "parameters": ADD_SCHEMA}},
    ]


def messages_tools() -> list[dict[str, Any]]:
    return [
        {"type": "web_search_20250305", "name": "web_search"},  # a server tool: no schema, never forced
        {"name": "search", "input_schema": SEARCH_SCHEMA},
        {"name": "add", "description": "Add two integers.", "input_schema": ADD_SCHEMA},
    ]


def test_arguments_fill_each_required_property_and_validate() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    got = arguments_for(SEARCH_SCHEMA)
    assert got == SEARCH_ARGUMENTS
    jsonschema.validate(got, SEARCH_SCHEMA)
    assert arguments_for(ADD_SCHEMA) == {"a": 1, "b": 1}
    assert arguments_for(None) == {} and arguments_for({"type": "object"}) == {}
    # A required property that contains itself ends in {} instead of recursing forever.
    looped = {"$defs": {"N": {"type": "object", "properties": {"n": {"$ref": "#/$defs/N"}}, "required": ["n"]}}}
    assert isinstance(arguments_for({**looped, "$ref": "#/$defs/N"}), dict)


async def test_responses_forced_call_is_one_function_call_item(sim: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    body = {"model": MODEL, "input": HELLO, "tools": responses_tools(), "tool_choice": "required"}
    got = await post_json(sim, "/v1/responses", body)
    # "required" calls the first tool.
    [item] = got["output"]
    assert list(item) == ["arguments", "call_id", "name", "type", "id", "status"]
    assert (item["type"], item["name"], item["status"]) == ("function_call", "search", "completed")
    assert item["id"].startswith("fc_") and item["call_id"].startswith("call_")
    arguments = orjson.loads(item["arguments"])
    jsonschema.validate(arguments, SEARCH_SCHEMA)
    assert arguments == SEARCH_ARGUMENTS
    assert (got["status"], got["incomplete_details"], got["tool_choice"]) == ("completed", None, "required")
    usage = got["usage"]
    assert (usage["input_tokens"], usage["output_tokens"]) == (HELLO_TOKENS, count_tokens(item["arguments"]))
    assert usage["total_tokens"] == HELLO_TOKENS + usage["output_tokens"]

    named = await post_json(sim, "/v1/responses", {**body, "tool_choice": {"type": "function", "name": "add"}})
    [item] = named["output"]
    assert (item["name"], item["arguments"], named["usage"]["output_tokens"]) == ("add", ADD_ARGUMENTS, 4)


async def test_responses_forced_call_streams_vllms_function_call_events(sim: str) -> None:
    body = {
        "model": MODEL,
        "input": "hello there",
        "tools": responses_tools(),
        "tool_choice": {"type": "function", "name": "add"},
        "max_output_tokens": 50,
        "stream": True,
    }
    status, content_type, raw = await post(sim, "/v1/responses", body)
    assert status == 200 and content_type.startswith("text/event-stream")
    events = sse(raw)
    names = [name for name, _ in events]
    assert names == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * 4,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(10))
    added = events[2][1]
    item_id, call_id = added["item"]["id"], added["item"]["call_id"]
    assert added == {
        "item": {
            "arguments": "",
            "call_id": call_id,
            "name": "add",
            "type": "function_call",
            "id": item_id,
            "status": "in_progress",
        },
        "output_index": 0,
        "sequence_number": 2,
        "type": "response.output_item.added",
    }
    deltas = [data for name, data in events if name == "response.function_call_arguments.delta"]
    assert [d["delta"] for d in deltas] == ADD_PIECES
    assert all((d["item_id"], d["output_index"]) == (item_id, 0) for d in deltas)
    assert events[7][1] == {
        "arguments": ADD_ARGUMENTS,
        "item_id": item_id,
        "name": "add",
        "output_index": 0,
        "sequence_number": 7,
        "type": "response.function_call_arguments.done",
    }
    item = {**added["item"], "arguments": ADD_ARGUMENTS, "status": "completed"}
    assert events[8][1]["item"] == item
    done = events[9][1]["response"]
    assert (done["status"], done["output"]) == ("completed", [item])
    # Usage counts the argument tokens: one per delta event.
    assert (done["usage"]["input_tokens"], done["usage"]["output_tokens"]) == (HELLO_TOKENS, len(deltas))


async def test_responses_without_a_forcing_choice_answer_text(sim: str) -> None:
    for choice in ("auto", "none", None):
        body = {"model": MODEL, "input": "hello there", "tools": responses_tools(), "max_output_tokens": 3}
        got = await post_json(sim, "/v1/responses", body if choice is None else {**body, "tool_choice": choice})
        [message] = got["output"]
        assert message["type"] == "message" and len(message["content"][0]["text"].split()) == 3


async def test_responses_turn_after_a_tool_call_answers_text(stopping_sim: str) -> None:
    body = {
        "model": MODEL,
        "input": [
            {"role": "user", "content": "hello there"},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": ADD_ARGUMENTS},
            {"type": "function_call_output", "call_id": "call_1", "output": "2"},
        ],
        "tools": responses_tools(),
        "tool_choice": "auto",
    }
    got = await post_json(stopping_sim, "/v1/responses", body)
    [message] = got["output"]
    assert (got["status"], message["type"], message["content"][0]["text"]) == (
        "completed",
        "message",
        "Hello from the fleet",
    )
    # "<|user|>hello there" 19 + '<|assistant|>add({"a": 1, "b": 1})' 34 + "<|tool|>2" 9
    # + "<|assistant|>" 13 + 3 newlines = 78 characters = 20 tokens.
    assert got["usage"]["input_tokens"] == 20


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/responses",
            {"input": "hi", "tools": responses_tools(), "tool_choice": {"type": "function", "name": "x"}},
        ),
        (
            "/v1/chat/completions",
            {"messages": HELLO, "tools": chat_tools(), "tool_choice": {"type": "function", "function": {"name": "x"}}},
        ),
        (
            "/v1/messages",
            {
                "max_tokens": 5,
                "messages": HELLO,
                "tools": messages_tools(),
                "tool_choice": {"type": "tool", "name": "x"},
            },
        ),
    ],
)
async def test_a_forcing_choice_needs_its_tool(sim: str, path: str, body: dict[str, Any]) -> None:
    got = await post_json(sim, path, {**body, "model": MODEL}, status=400)
    assert got["error"] == {"message": UNKNOWN_TOOL, "type": "BadRequestError", "param": None, "code": 400}
    without_tools = {k: v for k, v in body.items() if k != "tools"}
    got = await post_json(sim, path, {**without_tools, "model": MODEL}, status=400)
    assert got["error"]["message"] == NO_TOOLS


async def test_chat_forced_call_is_a_tool_call_message(sim: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    body = {"model": MODEL, "messages": HELLO, "tools": chat_tools(), "tool_choice": "required"}
    got = await post_json(sim, "/v1/chat/completions", body)
    [choice] = got["choices"]
    assert (choice["finish_reason"], choice["message"]["role"], choice["message"]["content"]) == (
        "tool_calls",
        "assistant",
        None,
    )
    [call] = choice["message"]["tool_calls"]
    assert list(call) == ["id", "type", "function"] and call["id"].startswith("chatcmpl-tool-")
    assert (call["type"], call["function"]["name"]) == ("function", "search")
    jsonschema.validate(orjson.loads(call["function"]["arguments"]), SEARCH_SCHEMA)
    usage = got["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
        HELLO_TOKENS,
        count_tokens(call["function"]["arguments"]),
    )

    named = {**body, "tool_choice": {"type": "function", "function": {"name": "add"}}}
    got = await post_json(sim, "/v1/chat/completions", named)
    [call] = got["choices"][0]["message"]["tool_calls"]
    assert (call["function"], got["usage"]["completion_tokens"]) == ({"name": "add", "arguments": ADD_ARGUMENTS}, 4)


async def test_chat_forced_call_streams_tool_call_deltas(sim: str) -> None:
    body = {
        "model": MODEL,
        "messages": HELLO,
        "tools": chat_tools(),
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, _, raw = await post(sim, "/v1/chat/completions", body)
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    chunks = [data for _, data in sse(raw.removesuffix(b"data: [DONE]\n\n"))]
    assert [c["choices"][0]["delta"] for c in chunks[:1]] == [{"role": "assistant", "content": ""}]
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks[1:-1]]
    assert len(calls) == 4 and all(len(call) == 1 and call[0]["index"] == 0 for call in calls)
    first = calls[0][0]
    assert list(first) == ["id", "type", "index", "function"] and first["id"].startswith("chatcmpl-tool-")
    assert (first["type"], first["function"]["name"]) == ("function", "add")
    assert all(list(call[0]) == ["index", "function"] for call in calls[1:])
    assert [call[0]["function"]["arguments"] for call in calls] == ADD_PIECES
    assert [c["choices"][0]["finish_reason"] for c in chunks[1:-1]] == [None, None, None, "tool_calls"]
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {
        "prompt_tokens": HELLO_TOKENS,
        "total_tokens": HELLO_TOKENS + 4,
        "completion_tokens": 4,
    }


async def test_chat_call_cut_by_the_token_limit_ends_with_length(sim: str) -> None:
    # add's arguments take 4 tokens; a limit of 2 leaves them unfinished, as vLLM's would be.
    named = {"type": "function", "function": {"name": "add"}}
    body = {"model": MODEL, "messages": HELLO, "tools": chat_tools(), "tool_choice": named, "max_tokens": 2}
    got = await post_json(sim, "/v1/chat/completions", body)
    [choice] = got["choices"]
    assert choice["finish_reason"] == "length" and got["usage"]["completion_tokens"] == 2
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == "".join(ADD_PIECES[:2])


async def test_chat_turn_after_a_tool_call_answers_text(stopping_sim: str) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": ADD_ARGUMENTS}}
    messages = [
        *HELLO,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
    ]
    body = {"model": MODEL, "messages": messages, "tools": chat_tools(), "tool_choice": "auto"}
    got = await post_json(stopping_sim, "/v1/chat/completions", body)
    [choice] = got["choices"]
    assert (choice["finish_reason"], choice["message"]["content"], choice["message"]["tool_calls"]) == (
        "stop",
        "Hello from the fleet",
        [],
    )


async def test_messages_forced_call_is_a_tool_use_block(sim: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "messages": HELLO,
        "tools": messages_tools(),
        "tool_choice": {"type": "any"},
    }
    got = await post_json(sim, "/v1/messages", body)
    assert list(got) == ["id", "type", "role", "content", "model", "stop_reason", "usage"]
    [block] = got["content"]
    assert list(block) == ["type", "id", "name", "input"] and block["id"].startswith("toolu_")
    assert (block["type"], block["name"], got["stop_reason"]) == ("tool_use", "search", "tool_use")
    jsonschema.validate(block["input"], SEARCH_SCHEMA)
    # The arguments went out as JSON text: usage counts its tokens.
    arguments = '{"query": "xxx", "limit": 5, "ratio": 0.5, "exact": true, "tags": ["red", "red"], "mode": "fast", '
    arguments += '"owner": "x", "filters": {"since": 1}, "extra": {}, "any": 1}'
    assert orjson.loads(arguments) == block["input"]
    assert got["usage"] == {"input_tokens": HELLO_TOKENS, "output_tokens": count_tokens(arguments)}

    named = await post_json(sim, "/v1/messages", {**body, "tool_choice": {"type": "tool", "name": "add"}})
    assert named["content"][0]["input"] == {"a": 1, "b": 1} and named["usage"]["output_tokens"] == 4


async def test_messages_forced_call_streams_input_json_deltas(sim: str) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "messages": HELLO,
        "tools": messages_tools(),
        "tool_choice": {"type": "tool", "name": "add"},
        "stream": True,
    }
    status, _, raw = await post(sim, "/v1/messages", body)
    assert status == 200
    events = sse(raw)
    assert [name for name, _ in events] == [
        "message_start",
        "content_block_start",
        *["content_block_delta"] * 4,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = events[1][1]
    tool_use_id = start["content_block"]["id"]
    assert tool_use_id.startswith("toolu_")
    assert start == {
        "type": "content_block_start",
        "content_block": {"type": "tool_use", "id": tool_use_id, "name": "add", "input": {}},
        "index": 0,
    }
    deltas = [data for _, data in events[2:6]]
    assert deltas == [
        {"type": "content_block_delta", "delta": {"type": "input_json_delta", "partial_json": piece}, "index": 0}
        for piece in ADD_PIECES
    ]
    assert events[6][1] == {"type": "content_block_stop", "index": 0}
    assert events[7][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use"},
        "usage": {"input_tokens": HELLO_TOKENS, "output_tokens": len(deltas)},
    }


async def test_messages_turn_after_a_tool_use_answers_text(stopping_sim: str) -> None:
    messages = [
        *HELLO,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 1, "b": 1}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "2"}]},
    ]
    body = {
        "model": MODEL,
        "max_tokens": 100,
        "messages": messages,
        "tools": messages_tools(),
        "tool_choice": {"type": "auto"},
    }
    got = await post_json(stopping_sim, "/v1/messages", body)
    assert (got["stop_reason"], got["content"]) == ("end_turn", [{"type": "text", "text": "Hello from the fleet"}])


async def test_agents_sdk_calls_a_forced_tool_then_answers(natural_sim: str) -> None:
    openai = pytest.importorskip("openai")
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    client = openai.AsyncOpenAI(base_url=f"{natural_sim}/v1", api_key="sk-sim")
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    settings = agents.ModelSettings(tool_choice="required")
    agent = agents.Agent(name="sim", instructions="Add.", model=model, tools=[add], model_settings=settings)
    result = await agents.Runner.run(agent, "add one and one")
    # The forced call ran the tool once; the SDK then resets tool_choice (reset_tool_choice),
    # so the next turn is answered with text: the run's final output.
    assert calls == [(1, 1)]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"]
    assert isinstance(result.final_output, str) and 0 < len(result.final_output.split()) < DEFAULT_MAX_TOKENS

    streamed = agents.Runner.run_streamed(agent, "add one and one")
    async for _ in streamed.stream_events():
        pass
    assert calls == [(1, 1), (1, 1)] and streamed.final_output == result.final_output
    await client.close()


async def test_openai_sdk_parses_a_forced_chat_tool_call(sim: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"{sim}/v1", api_key="sk-sim")
    tools = chat_tools()[1:]
    whole = await client.chat.completions.create(model=MODEL, messages=HELLO, tools=tools, tool_choice="required")
    [choice] = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, orjson.loads(call.function.arguments)) == (
        "function",
        "add",
        {"a": 1, "b": 1},
    )
    assert whole.usage.completion_tokens == 4

    async with client.chat.completions.stream(
        model=MODEL, messages=HELLO, tools=tools, tool_choice="required", stream_options={"include_usage": True}
    ) as stream:
        final = await stream.get_final_completion()
    [call] = final.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments, final.choices[0].finish_reason) == (
        "add",
        ADD_ARGUMENTS,
        "tool_calls",
    )
    await client.close()


async def test_anthropic_sdk_parses_a_forced_tool_use(sim: str) -> None:
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.AsyncAnthropic(base_url=sim, api_key="sk-sim")
    tools = messages_tools()[2:]
    whole = await client.messages.create(
        model=MODEL, max_tokens=100, messages=HELLO, tools=tools, tool_choice={"type": "any"}
    )
    [block] = whole.content
    assert isinstance(block, anthropic.types.ToolUseBlock)
    assert (block.name, block.input, whole.stop_reason, whole.usage.output_tokens) == (
        "add",
        {"a": 1, "b": 1},
        "tool_use",
        4,
    )

    async with client.messages.stream(
        model=MODEL, max_tokens=100, messages=HELLO, tools=tools, tool_choice={"type": "any"}
    ) as stream:
        final = await stream.get_final_message()
    [block] = final.content
    assert isinstance(block, anthropic.types.ToolUseBlock) and block.input == {"a": 1, "b": 1}
    assert (final.stop_reason, final.usage.output_tokens) == ("tool_use", 4)
    await client.close()
