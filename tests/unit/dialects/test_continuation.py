"""Continuing a stream on another replica: the plan per API, and the splice that makes the
relayed prefix plus the continuation's stream one uninterrupted stream.

The streams are built the way vLLM 0.32 writes them (compact JSON, the same key order), so a
stitched stream is compared byte for byte with the uninterrupted one.
"""

from __future__ import annotations

from typing import Any

import orjson

from dialects.continuation import plan, plan_chat, plan_completions, plan_messages, plan_responses
from dialects.continuation.base import Continuation

KEEP_ALIVE = b": keep-alive\n\n"


def data(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def typed(kind: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(obj) + b"\n\n"


def stitch(continuation: Continuation, relayed: bytes, rest: list[bytes], block: int = 2) -> bytes:
    """The relayed bytes, then the continuation's events spliced ``block`` events at a time."""
    out = [relayed]
    for i in range(0, len(rest), block):
        out.append(continuation.splice(b"".join(rest[i : i + block])))
    return b"".join(out)


# -- chat ---------------------------------------------------------------------------------------

CHAT_BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "Say hello"}],
    "max_tokens": 10,
    "temperature": 0,
    "stream": True,
    "stream_options": {"include_usage": True},
}
TOKENS = ["Hel", "lo", ",", " wor", "ld"]


def chat_chunk(ident: str, created: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return data(
        {"id": ident, "object": "chat.completion.chunk", "created": created, "model": "tiny", "choices": [choice]}
    )


def chat_stream(ident: str, created: int, tokens: list[str], prompt: int) -> list[bytes]:
    events = [chat_chunk(ident, created, {"role": "assistant", "content": ""})]
    for i, token in enumerate(tokens):
        events.append(chat_chunk(ident, created, {"content": token}, "length" if i == len(tokens) - 1 else None))
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + len(tokens), "completion_tokens": len(tokens)}
    events.append(
        data(
            {
                "id": ident,
                "object": "chat.completion.chunk",
                "created": created,
                "model": "tiny",
                "choices": [],
                "usage": usage,
            }
        )
    )
    return [*events, b"data: [DONE]\n\n"]


def test_chat_cut_anywhere_then_spliced_is_the_uninterrupted_stream() -> None:
    whole = chat_stream("chatcmpl-a", 100, TOKENS, prompt=12)
    # Cut after the role chunk and k token chunks (k = 1..4: the 5th finished the stream).
    for k in range(1, 5):
        relayed = whole[0] + KEEP_ALIVE + b"".join(whole[1 : 1 + k])
        continuation = plan_chat(CHAT_BODY, relayed)
        assert continuation is not None
        assert continuation.relayed_tokens == k
        assert continuation.partial_text == "".join(TOKENS[:k])
        # The replica re-tokenises the partial text into the same k tokens: prompt 12 + k.
        rest = chat_stream("chatcmpl-b", 200, TOKENS[k:], prompt=12 + k)
        stitched = stitch(continuation, relayed, rest)
        assert stitched == whole[0] + KEEP_ALIVE + b"".join(whole[1:])
        assert continuation.usage == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}


def test_chat_body_continues_the_assistant_message() -> None:
    whole = chat_stream("chatcmpl-a", 100, TOKENS, prompt=12)
    continuation = plan_chat({**CHAT_BODY, "max_completion_tokens": 8, "min_tokens": 4}, b"".join(whole[:3]))
    assert continuation is not None
    assert continuation.path == "/v1/chat/completions"
    assert continuation.body["messages"] == [
        {"role": "user", "content": "Say hello"},
        {"role": "assistant", "content": "Hello"},
    ]
    assert continuation.body["continue_final_message"] is True
    assert continuation.body["add_generation_prompt"] is False
    # 10 - 2 and 8 - 2 tokens left; 4 - 2 still owed to min_tokens.
    assert (continuation.body["max_tokens"], continuation.body["max_completion_tokens"]) == (8, 6)
    assert continuation.body["min_tokens"] == 2
    assert continuation.body["stream"] is True
    assert continuation.body["stream_options"] == {"include_usage": True}
    assert CHAT_BODY["messages"] == [{"role": "user", "content": "Say hello"}]  # the call's body is left alone


def test_chat_client_prefill_is_extended() -> None:
    body = {
        **CHAT_BODY,
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure:"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    whole = chat_stream("chatcmpl-a", 100, TOKENS, prompt=12)
    continuation = plan_chat(body, b"".join(whole[:3]))
    assert continuation is not None
    assert continuation.body["messages"][-1] == {"role": "assistant", "content": "Sure:Hello"}
    assert len(continuation.body["messages"]) == 2


def test_chat_bytes_held_upstream_are_not_counted() -> None:
    # Two tokens whose text is held (a character not finished): the client never saw them.
    relayed = chat_chunk("c", 1, {"role": "assistant", "content": ""})
    relayed += chat_chunk("c", 1, {"content": "Hi"}) + chat_chunk("c", 1, {"content": ""}) * 2
    continuation = plan_chat(CHAT_BODY, relayed)
    assert continuation is not None
    assert (continuation.relayed_tokens, continuation.partial_text) == (1, "Hi")
    assert continuation.body["max_tokens"] == 9
    # An empty chunk before text was a token whose bytes came out with a later one.
    relayed = chat_chunk("c", 1, {"content": ""}) + chat_chunk("c", 1, {"content": "\u00e9"})
    continuation = plan_chat(CHAT_BODY, relayed)
    assert continuation is not None and continuation.relayed_tokens == 2


def test_chat_usage_every_chunk_is_rewritten_too() -> None:
    relayed = b"".join(chat_stream("chatcmpl-a", 100, TOKENS, prompt=12)[:3])
    continuation = plan_chat(CHAT_BODY, relayed)
    assert continuation is not None
    usage = {"prompt_tokens": 14, "total_tokens": 17, "completion_tokens": 3}
    choice = {"index": 0, "delta": {"content": "x"}, "logprobs": None, "finish_reason": None}
    out = continuation.splice(data({"id": "b", "created": 2, "model": "tiny", "choices": [choice], "usage": usage}))
    sent = orjson.loads(out[len(b"data: ") :])
    assert (sent["id"], sent["created"]) == ("chatcmpl-a", 100)
    assert sent["usage"] == {"prompt_tokens": 12, "total_tokens": 17, "completion_tokens": 5}


def test_chat_refusals() -> None:
    whole = chat_stream("chatcmpl-a", 100, TOKENS, prompt=12)
    relayed = b"".join(whole[:3])
    assert plan_chat(CHAT_BODY, relayed) is not None
    for change in (
        {"n": 2},
        {"logprobs": True},
        {"top_logprobs": 2},
        {"echo": True},
        {"response_format": {"type": "json_object"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
        {"stop": ["lo!"]},  # "Hello" ends with "lo", which a "lo!" could finish
    ):
        assert plan_chat({**CHAT_BODY, **change}, relayed) is None, change
    # Tools the model may not call are no obstacle; a stop string that cannot straddle neither.
    tools = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"}
    assert plan_chat({**CHAT_BODY, **tools, "stop": ["xyz"]}, relayed) is not None
    call = {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}]
    }
    two = data({"id": "c", "created": 1, "model": "tiny", "choices": [
        {"index": 0, "delta": {"content": "a"}, "finish_reason": None},
        {"index": 1, "delta": {"content": "b"}, "finish_reason": None},
    ]})  # fmt: skip
    for stream in (
        b"",  # nothing relayed
        whole[0],  # the role chunk only: no token yet
        KEEP_ALIVE,
        relayed + chat_chunk("chatcmpl-a", 100, call),  # a tool call started
        relayed + chat_chunk("chatcmpl-a", 100, {"reasoning_content": "hmm"}),  # reasoning under way
        b"".join(whole[:6]),  # finished (finish_reason)
        b"".join(whole[:7]),  # the usage came
        b"".join(whole),  # [DONE]
        two,  # several choices
        relayed + data({"error": {"message": "boom"}}),
    ):
        assert plan_chat(CHAT_BODY, stream) is None, stream


# -- completions ---------------------------------------------------------------------------------

COMPLETIONS_BODY: dict[str, Any] = {
    "model": "tiny",
    "prompt": "Once",
    "max_tokens": 6,
    "temperature": 0,
    "stream": True,
}


def text_chunk(ident: str, created: int, text: str, finish: str | None = None) -> bytes:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None}
    return data({"id": ident, "object": "text_completion", "created": created, "model": "tiny", "choices": [choice]})


def completions_stream(ident: str, created: int, tokens: list[str], prompt: int) -> list[bytes]:
    events = [text_chunk(ident, created, t, "length" if i == len(tokens) - 1 else None) for i, t in enumerate(tokens)]
    usage = {"prompt_tokens": prompt, "total_tokens": prompt + len(tokens), "completion_tokens": len(tokens)}
    events.append(
        data(
            {
                "id": ident,
                "object": "text_completion",
                "created": created,
                "model": "tiny",
                "choices": [],
                "usage": usage,
            }
        )
    )
    return [*events, b"data: [DONE]\n\n"]


def test_completions_cut_anywhere_then_spliced_is_the_uninterrupted_stream() -> None:
    words = [" upon", " a", " time", " there", " was", " one"]
    whole = completions_stream("cmpl-a", 100, words, prompt=2)
    for k in range(1, 6):
        relayed = b"".join(whole[:k])
        continuation = plan_completions(COMPLETIONS_BODY, relayed)
        assert continuation is not None
        assert continuation.path == "/v1/completions"
        assert continuation.body["prompt"] == "Once" + "".join(words[:k])
        assert continuation.body["max_tokens"] == 6 - k
        assert continuation.body["stream_options"] == {"include_usage": True}
        rest = completions_stream("cmpl-b", 300, words[k:], prompt=2 + k)
        assert stitch(continuation, relayed, rest, block=3) == b"".join(whole)
        assert continuation.usage == {"prompt_tokens": 2, "completion_tokens": 6, "total_tokens": 8}


def test_completions_default_max_tokens_is_made_explicit() -> None:
    body = {k: v for k, v in COMPLETIONS_BODY.items() if k != "max_tokens"}
    continuation = plan_completions(body, text_chunk("c", 1, " upon") + text_chunk("c", 1, " a"))
    assert continuation is not None
    assert continuation.body["max_tokens"] == 16 - 2


def test_completions_refusals() -> None:
    relayed = text_chunk("c", 1, " upon")
    assert plan_completions(COMPLETIONS_BODY, relayed) is not None
    for change in (
        {"prompt": ["Once", "Twice"]},
        {"prompt": ["Once"]},
        {"prompt": [1, 2, 3]},
        {"echo": True},
        {"logprobs": 1},
        {"n": 3},
        {"best_of": 2},
        {"suffix": "end"},
    ):
        assert plan_completions({**COMPLETIONS_BODY, **change}, relayed) is None, change
    assert plan_completions(COMPLETIONS_BODY, text_chunk("c", 1, " upon", "stop")) is None
    assert plan_completions(COMPLETIONS_BODY, text_chunk("c", 1, "")) is None  # no text yet


# -- messages ------------------------------------------------------------------------------------

MESSAGES_BODY: dict[str, Any] = {
    "model": "tiny",
    "system": [{"type": "text", "text": "Be brief."}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}],
    "max_tokens": 10,
    "temperature": 0,
    "stop_sequences": ["\n\n"],
    "stream": True,
}


def messages_stream(tokens: list[str], input_tokens: int, stop: str = "max_tokens") -> list[bytes]:
    message = {
        "id": "chatcmpl-m",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "tiny",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": 0},
    }
    events = [
        typed("message_start", {"type": "message_start", "message": message}),
        typed(
            "content_block_start",
            {"type": "content_block_start", "content_block": {"type": "text", "text": ""}, "index": 0},
        ),
        typed("ping", {"type": "ping"}),
    ]
    for token in tokens:
        delta = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": token}, "index": 0}
        events.append(typed("content_block_delta", delta))
    usage = {"input_tokens": input_tokens, "output_tokens": len(tokens)}
    return [
        *events,
        typed("content_block_stop", {"type": "content_block_stop", "index": 0}),
        typed(
            "message_delta",
            {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": usage},
        ),
        typed("message_stop", {"type": "message_stop"}),
    ]


def test_messages_cut_anywhere_then_spliced_is_the_uninterrupted_stream() -> None:
    whole = messages_stream(TOKENS, input_tokens=15)
    # message_start, content_block_start, ping, then k deltas (k = 1..4; the answer ends
    # with the 5th, and a continuation generates at least one token).
    for k in range(1, 5):
        relayed = b"".join(whole[: 3 + k])
        continuation = plan_messages(MESSAGES_BODY, relayed)
        assert continuation is not None
        assert continuation.relayed_tokens == k
        # The continuation is a chat request, answered in chat chunks (15 + k prompt tokens).
        rest = chat_stream("chatcmpl-x", 5, TOKENS[k:], prompt=15 + k)
        assert stitch(continuation, relayed, rest) == b"".join(whole)
        assert continuation.usage == {"prompt_tokens": 15, "completion_tokens": 5, "total_tokens": 20}


def test_messages_continuation_is_a_chat_request() -> None:
    relayed = b"".join(messages_stream(TOKENS, 15)[:5])
    continuation = plan_messages({**MESSAGES_BODY, "top_k": 1}, relayed)
    assert continuation is not None
    assert continuation.path == "/v1/chat/completions"
    assert continuation.body == {
        "model": "tiny",
        # As vLLM's translation makes them: the system blocks joined, one text block as a string.
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hello"},
            {"role": "assistant", "content": "Hello"},
        ],
        "max_tokens": 8,
        "max_completion_tokens": 8,
        "stop": ["\n\n"],
        "top_k": 1,
        "temperature": 0,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_messages_stop_reasons_are_mapped_as_vllm_does() -> None:
    relayed = b"".join(messages_stream(TOKENS, 15)[:4])
    for finish, stop_reason, expected in (
        ("stop", None, {"stop_reason": "end_turn", "stop_sequence": None}),
        ("stop", "\n\n", {"stop_reason": "stop_sequence", "stop_sequence": "\n\n"}),
        ("length", None, {"stop_reason": "max_tokens", "stop_sequence": None}),
    ):
        continuation = plan_messages(MESSAGES_BODY, relayed)
        assert continuation is not None
        choice = {"index": 0, "delta": {"content": "lo"}, "finish_reason": finish, "stop_reason": stop_reason}
        usage = {"prompt_tokens": 16, "total_tokens": 17, "completion_tokens": 1}
        out = continuation.splice(
            data({"id": "x", "choices": [choice]})
            + data({"id": "x", "choices": [], "usage": usage})
            + b"data: [DONE]\n\n"
        )
        delta = next(e for e in out.split(b"\n\n") if e.startswith(b"event: message_delta"))
        sent = orjson.loads(delta.split(b"data: ", 1)[1])
        assert sent["delta"] == expected
        assert sent["usage"] == {"input_tokens": 15, "output_tokens": 2}
        assert out.endswith(typed("message_stop", {"type": "message_stop"}))
        assert b"[DONE]" not in out


def test_messages_refusals() -> None:
    whole = messages_stream(TOKENS, 15)
    relayed = b"".join(whole[:5])
    assert plan_messages(MESSAGES_BODY, relayed) is not None
    user = {"role": "user", "content": "Hi"}
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
    for change in (
        {"thinking": {"type": "enabled", "budget_tokens": 100}},
        {"tools": [{"name": "f", "input_schema": {"type": "object"}}]},
        {"output_config": {"effort": "low"}},
        {"messages": [user, {"role": "assistant", "content": "Sure"}]},  # the client's own prefill
        {"messages": [{"role": "user", "content": [image]}]},
        {"stop_sequences": ["lo!"]},
    ):
        assert plan_messages({**MESSAGES_BODY, **change}, relayed) is None, change
    thinking = typed(
        "content_block_start",
        {"type": "content_block_start", "content_block": {"type": "thinking", "thinking": ""}, "index": 0},
    )
    tool = typed(
        "content_block_start",
        {
            "type": "content_block_start",
            "content_block": {"type": "tool_use", "id": "t", "name": "f", "input": {}},
            "index": 1,
        },
    )
    for stream in (
        b"",
        whole[0] + whole[1],  # no text yet
        whole[0] + thinking,
        relayed + whole[-3],  # the block stopped
        relayed + whole[-3] + tool,  # a tool call began
        b"".join(whole),
        relayed + typed("error", {"type": "error", "error": {"type": "overloaded_error", "message": "busy"}}),
    ):
        assert plan_messages(MESSAGES_BODY, stream) is None, stream


# -- responses -----------------------------------------------------------------------------------

RESPONSES_BODY: dict[str, Any] = {
    "model": "tiny",
    "input": "Say hello",
    "max_output_tokens": 10,
    "temperature": 0,
    "store": False,
    "stream": True,
}


def response(ident: str, created: int, max_output: int, status: str, output: list[Any], usage: Any) -> dict[str, Any]:
    return {
        "id": ident,
        "created_at": created,
        "model": "tiny",
        "object": "response",
        "output": output,
        "max_output_tokens": max_output,
        "status": status,
        "usage": usage,
    }


def responses_stream(
    ident: str, item: str, created: int, max_output: int, tokens: list[str], input_tokens: int
) -> list[bytes]:
    opened = {"id": item, "content": [], "role": "assistant", "status": "in_progress", "type": "message"}
    empty = {"annotations": [], "text": "", "type": "output_text"}
    events: list[tuple[str, dict[str, Any]]] = [
        ("response.created", {"response": response(ident, created, max_output, "in_progress", [], None)}),
        ("response.in_progress", {"response": response(ident, created, max_output, "in_progress", [], None)}),
        ("response.output_item.added", {"item": opened, "output_index": 0}),
        ("response.content_part.added", {"content_index": 0, "item_id": item, "output_index": 0, "part": empty}),
    ]
    for token in tokens:
        events.append(
            ("response.output_text.delta", {"content_index": 0, "delta": token, "item_id": item, "output_index": 0})
        )
    text = "".join(tokens)
    part = {"annotations": [], "text": text, "type": "output_text"}
    done_item = {"id": item, "content": [part], "role": "assistant", "status": "completed", "type": "message"}
    usage = {"input_tokens": input_tokens, "output_tokens": len(tokens), "total_tokens": input_tokens + len(tokens)}
    events += [
        ("response.output_text.done", {"content_index": 0, "item_id": item, "output_index": 0, "text": text}),
        ("response.content_part.done", {"content_index": 0, "item_id": item, "output_index": 0, "part": part}),
        ("response.output_item.done", {"item": done_item, "output_index": 0}),
        ("response.completed", {"response": response(ident, created, max_output, "completed", [done_item], usage)}),
    ]
    return [typed(kind, {**obj, "sequence_number": i, "type": kind}) for i, (kind, obj) in enumerate(events)]


def test_responses_cut_anywhere_then_spliced_is_the_uninterrupted_stream() -> None:
    whole = responses_stream("resp_a", "msg_a", 100, 10, TOKENS, input_tokens=9)
    for k in range(1, 5):
        relayed = b"".join(whole[: 4 + k]) + KEEP_ALIVE
        continuation = plan_responses(RESPONSES_BODY, relayed)
        assert continuation is not None
        assert continuation.relayed_tokens == k
        # Its own ids, time and numbering; 10 - k tokens asked; 9 + k prompt tokens.
        rest = responses_stream("resp_b", "msg_b", 300, 10 - k, TOKENS[k:], input_tokens=9 + k)
        stitched = stitch(continuation, relayed, rest, block=3)
        assert stitched == b"".join(whole[: 4 + k]) + KEEP_ALIVE + b"".join(whole[4 + k :])
        assert continuation.usage == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}


def test_responses_continuation_without_text_still_closes_the_item() -> None:
    # The continuation's one token ended inside a character: vLLM opened no item at all.
    whole = responses_stream("resp_a", "msg_a", 100, 10, TOKENS, 9)
    relayed = b"".join(whole[:6])  # created, in_progress, item, part, "Hel", "lo": sequence 0-5
    continuation = plan_responses(RESPONSES_BODY, relayed)
    assert continuation is not None
    usage = {"input_tokens": 11, "output_tokens": 1, "total_tokens": 12}
    opened = response("resp_b", 300, 8, "in_progress", [], None)
    ended = response("resp_b", 300, 8, "incomplete", [], usage)
    rest = [
        typed("response.created", {"response": opened, "sequence_number": 0, "type": "response.created"}),
        typed("response.completed", {"response": ended, "sequence_number": 1, "type": "response.completed"}),
    ]
    out = continuation.splice(b"".join(rest))
    sent = [orjson.loads(e.split(b"data: ", 1)[1]) for e in out.split(b"\n\n") if e]
    assert [(e["type"], e["sequence_number"]) for e in sent] == [
        ("response.output_text.done", 6),
        ("response.content_part.done", 7),
        ("response.output_item.done", 8),
        ("response.completed", 9),
    ]
    assert sent[0]["text"] == "Hello"
    assert sent[2]["item"]["id"] == "msg_a"
    final = sent[3]["response"]
    assert (final["id"], final["max_output_tokens"]) == ("resp_a", 10)
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"] == {"input_tokens": 9, "output_tokens": 3, "total_tokens": 12}


def test_responses_body_ends_with_an_incomplete_assistant_message() -> None:
    relayed = b"".join(responses_stream("resp_a", "msg_a", 100, 10, TOKENS, 9)[:6])
    continuation = plan_responses({**RESPONSES_BODY, "instructions": "Be brief."}, relayed)
    assert continuation is not None
    assert continuation.path == "/v1/responses"
    assert continuation.body["input"] == [
        {"role": "user", "content": "Say hello"},
        {
            "type": "message",
            "role": "assistant",
            "status": "incomplete",
            "content": [{"type": "output_text", "text": "Hello", "annotations": []}],
        },
    ]
    assert continuation.body["instructions"] == "Be brief."
    assert continuation.body["max_output_tokens"] == 8
    assert (continuation.body["stream"], continuation.body["store"]) == (True, False)


def test_responses_refusals() -> None:
    whole = responses_stream("resp_a", "msg_a", 100, 10, TOKENS, 9)
    relayed = b"".join(whole[:6])
    assert plan_responses(RESPONSES_BODY, relayed) is not None
    for change in (
        {"reasoning": {"effort": "low"}},
        {"tools": [{"type": "function", "name": "f"}]},
        {"top_logprobs": 2},
        {"include": ["message.output_text.logprobs"]},
        {"text": {"format": {"type": "json_object"}}},
        {"previous_response_id": "resp_0"},
        {"input": []},
    ):
        assert plan_responses({**RESPONSES_BODY, **change}, relayed) is None, change
    assert plan_responses({**RESPONSES_BODY, "text": {"format": {"type": "text"}}}, relayed) is not None
    tools = {"tools": [{"type": "function", "name": "f"}], "tool_choice": "none"}
    assert plan_responses({**RESPONSES_BODY, **tools}, relayed) is not None
    reasoning = typed(
        "response.output_item.added",
        {
            "item": {"id": "rs_1", "type": "reasoning", "summary": []},
            "output_index": 0,
            "sequence_number": 2,
            "type": "response.output_item.added",
        },
    )
    call = typed(
        "response.output_item.added",
        {
            "item": {"id": "fc_1", "type": "function_call", "name": "f", "arguments": ""},
            "output_index": 1,
            "sequence_number": 6,
            "type": "response.output_item.added",
        },
    )
    for stream in (
        b"",
        b"".join(whole[:4]),  # opened, no text yet
        whole[0] + whole[1] + reasoning,
        relayed + call,
        b"".join(whole[:10]),  # the text is done
        b"".join(whole),
        relayed + typed("error", {"type": "error", "code": "x", "message": "boom", "sequence_number": 6}),
    ):
        assert plan_responses(RESPONSES_BODY, stream) is None, stream


def test_plan_by_dialect_name() -> None:
    relayed = b"".join(chat_stream("chatcmpl-a", 100, TOKENS, prompt=12)[:3])
    continuation = plan("chat", CHAT_BODY, relayed)
    assert continuation is not None and continuation.partial_text == "Hello"
    assert plan("embeddings", {"model": "tiny", "input": "x"}, relayed) is None


def test_tokens_merged_into_one_chunk_are_counted_exactly_when_the_stream_says() -> None:
    # vLLM merges a late reader's tokens: one chunk, three tokens.
    plain = chat_chunk("c", 1, {"content": "Hello"})
    continuation = plan_chat(CHAT_BODY, plain)
    assert continuation is not None and continuation.relayed_tokens == 1  # a lower bound
    # With continuous usage stats every chunk carries the cumulative count (no final chunk yet).
    choice = {"index": 0, "delta": {"content": "Hello"}, "logprobs": None, "finish_reason": None}
    usage = {"prompt_tokens": 12, "total_tokens": 15, "completion_tokens": 3}
    counted = data({"id": "c", "created": 1, "model": "tiny", "choices": [choice], "usage": usage})
    continuation = plan_chat(CHAT_BODY, counted)
    assert continuation is not None
    assert (continuation.relayed_tokens, continuation.body["max_tokens"]) == (3, 7)
    # With return_token_ids each chunk lists its ids.
    ids = text_chunk("c", 1, " upon a").replace(b'"stop_reason":null', b'"stop_reason":null,"token_ids":[7,8]')
    continuation = plan_completions(COMPLETIONS_BODY, ids + text_chunk("c", 1, " time"))
    assert continuation is not None and continuation.relayed_tokens == 3
    # Or the caller knows (/tokenize of the partial text).
    continuation = plan("chat", CHAT_BODY, plain, tokens=2)
    assert continuation is not None
    assert (continuation.relayed_tokens, continuation.body["max_tokens"]) == (2, 8)


def test_messages_usage_counts_the_partial_text_as_planned() -> None:
    # The prompts say the partial text is 2 tokens (17 - 15), re-tokenised; the deltas say 1,
    # which is what the continuation's max_tokens was lowered by: the usage counts that, so
    # it never passes the client's max_tokens.
    start, block = messages_stream(TOKENS, 15)[:2]
    relayed = (
        start
        + block
        + typed(
            "content_block_delta",
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hello"}, "index": 0},
        )
    )
    continuation = plan_messages(MESSAGES_BODY, relayed)
    assert continuation is not None and continuation.relayed_tokens == 1
    rest = chat_stream("chatcmpl-x", 5, [",", " wor", "ld"], prompt=17)
    stitch(continuation, relayed, rest)
    assert continuation.usage == {"prompt_tokens": 15, "completion_tokens": 4, "total_tokens": 19}
