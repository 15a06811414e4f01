"""The semantic scope: what must match exactly around the text compared by meaning."""

from __future__ import annotations

from typing import Any

from cache.keys import semantic_query
from dialects.base import Dialect
from dialects.openai import CHAT, COMPLETIONS, EMBEDDINGS


def chat(question: str = "What is the capital of France?", **fields: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": question}]
    return {"model": "m", "messages": messages, "temperature": 0, **fields}


def scope(body: dict[str, Any], tenant: str = "t1", model: str = "m", endpoint: Dialect = CHAT) -> str:
    query = semantic_query(tenant, model, endpoint, body)
    assert query is not None
    return query.scope


def test_the_text_is_the_last_user_message_and_not_in_the_scope() -> None:
    query = semantic_query("t1", "m", CHAT, chat("  How do I boil an egg?  "))
    assert query is not None and query.text == "How do I boil an egg?"
    assert query.tenant == "t1" and query.scope.startswith("t1:")
    assert scope(chat("How do I boil an egg?")) == scope(chat("What is the capital of Peru?"))


def test_everything_else_splits_the_scope() -> None:
    base = scope(chat())
    system = chat()
    system["messages"][0]["content"] = "Answer in French."
    earlier = chat()
    earlier["messages"].insert(1, {"role": "user", "content": "Hello"})
    variants = [
        scope(system),
        scope(earlier),
        scope(chat(max_tokens=10)),
        scope(chat(seed=3)),
        scope(chat(tools=[{"type": "function", "function": {"name": "f"}}])),
        scope(chat(min_p=0.1)),  # a field the gateway has never heard of
        scope(chat(), model="other"),
        scope(chat(), tenant="t2"),
        scope({"prompt": "x", "temperature": 0}, endpoint=COMPLETIONS),
    ]
    assert base not in variants
    assert len(set(variants)) == len(variants)


def test_delivery_fields_do_not_split_the_scope() -> None:
    assert scope(chat()) == scope(chat(stream=True, stream_options={"include_usage": True}, user="u"))
    assert scope(chat()) == scope(chat(temperature=0.0, top_p=1))


def test_tenants_get_different_scopes_for_the_same_request() -> None:
    a, b = scope(chat(), tenant="t1"), scope(chat(), tenant="t2")
    assert a != b and a.split(":")[1] != b.split(":")[1]
    # A tenant id cannot forge another's prefix.
    assert scope(chat(), tenant="t1:x").startswith("t1%3Ax:")


def test_completions_take_the_one_prompt() -> None:
    one = semantic_query("t1", "m", COMPLETIONS, {"prompt": ["Once upon"], "temperature": 0})
    plain = semantic_query("t1", "m", COMPLETIONS, {"prompt": "Once upon", "temperature": 0})
    assert one == plain and plain is not None and plain.text == "Once upon"


def test_no_text_to_compare() -> None:
    tool_result = chat()
    tool_result["messages"].append({"role": "tool", "content": "42", "tool_call_id": "c1"})
    parts = chat()
    parts["messages"][-1]["content"] = [{"type": "text", "text": "hi"}]
    assert semantic_query("t1", "m", CHAT, tool_result) is None
    assert semantic_query("t1", "m", CHAT, parts) is None
    assert semantic_query("t1", "m", CHAT, chat("   ")) is None
    assert semantic_query("t1", "m", CHAT, {"messages": []}) is None
    assert semantic_query("t1", "m", COMPLETIONS, {"prompt": [1, 2, 3]}) is None
    assert semantic_query("t1", "m", EMBEDDINGS, {"input": "x"}) is None
