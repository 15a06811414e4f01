"""Cache keys and cacheability: what splits the cache, what does not, what is never cached."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from cache.config import CacheSettings
from cache.keys import (
    Cacheability,
    cacheability,
    canonical_body,
    escape_scope,
    exact_key,
    parse_cache_control,
    plan_request,
    split_key,
)
from dialects.anthropic import COUNT_TOKENS, MESSAGES
from dialects.base import Dialect
from dialects.openai import CHAT, COMPLETIONS, EMBEDDINGS
from dialects.responses import RESPONSES_API as RESPONSES

DEFAULTS = CacheSettings()


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **fields}


def key(body: dict[str, Any], scope: str = "t1", model: str = "m", endpoint: Dialect = CHAT) -> str:
    return exact_key(scope, model, endpoint, body)


def test_key_order_and_whitespace_do_not_matter() -> None:
    raw_a = b'{"model":"m","temperature":0,"messages":[{"role":"user","content":"hi"}]}'
    raw_b = b'{ "messages" : [ { "content" : "hi", "role" : "user" } ],\n  "temperature": 0, "model": "m" }'
    assert key(orjson.loads(raw_a)) == key(orjson.loads(raw_b))


def test_delivery_and_labels_are_not_in_the_key() -> None:
    base = key(chat())
    assert key(chat(stream=True, stream_options={"include_usage": True})) == base
    assert key(chat(user="alice", metadata={"job": "7"}, store=True, service_tier="auto")) == base


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"temperature": 0}, {"temperature": 0.0}),
        ({"top_p": 1}, {}),
        ({"n": 1}, {}),
        ({"presence_penalty": 0}, {}),
        ({"stop": "END"}, {"stop": ["END"]}),
        ({"stop": []}, {}),
        ({"seed": None}, {}),
        ({"max_completion_tokens": 10}, {"max_tokens": 10}),
    ],
)
def test_equivalent_spellings_share_a_key(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert key(chat(**a)) == key(chat(**b))


@pytest.mark.parametrize(
    "change",
    [
        {"messages": [{"role": "user", "content": "hello"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        {"max_tokens": 11},
        {"stop": ["x"]},
        {"seed": 7},
        {"top_p": 0.5},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        {"response_format": {"type": "json_object"}},
        {"top_k": 5},  # a vLLM extension nobody listed still splits the cache
        {"some_future_parameter": True},
    ],
)
def test_anything_that_can_change_the_answer_splits_the_cache(change: dict[str, Any]) -> None:
    base = chat(max_tokens=10)
    assert key({**base, **change}) != key(base)


def test_model_endpoint_and_tenant_split_the_cache() -> None:
    body = {"model": "m", "prompt": "hi", "temperature": 0}
    base = key(body, endpoint=COMPLETIONS)
    assert key(body, endpoint=CHAT) != base
    assert key(body, model="other", endpoint=COMPLETIONS) != base
    assert key(body, scope="t2", endpoint=COMPLETIONS) != base
    assert base.startswith("t1:") and key(body, scope="t2", endpoint=COMPLETIONS).startswith("t2:")


def test_a_scope_cannot_forge_another_tenants_key() -> None:
    # "a:b" must not produce keys inside scope "a", nor open a Redis hash tag.
    forged = key(chat(), scope="a:b{x}")
    scope, digest = split_key(forged)
    assert scope == "a%3Ab%7Bx%7D" == escape_scope("a:b{x}")
    assert len(digest) == 64
    assert split_key(key(chat(), scope="a"))[0] == "a"


def test_canonical_body_leaves_content_alone() -> None:
    body = chat(tools=[{"function": {"parameters": {"minimum": 1.0}}}])
    assert canonical_body(body)["tools"] == [{"function": {"parameters": {"minimum": 1.0}}}]
    assert canonical_body(body)["temperature"] == 0.0 and "model" not in canonical_body(body)


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (chat(), Cacheability.CACHEABLE),
        (chat(temperature=0.7, seed=3), Cacheability.CACHEABLE),
        (chat(temperature=1.0, top_k=1), Cacheability.CACHEABLE),
        (chat(temperature=None), Cacheability.NONDETERMINISTIC),  # absent = 1.0, sampling
        (chat(temperature=0.7), Cacheability.NONDETERMINISTIC),
        (chat(seed=True, temperature=0.5), Cacheability.NONDETERMINISTIC),
        (chat(n=2), Cacheability.MULTIPLE_CHOICES),
        (chat(logprobs=True), Cacheability.LOGPROBS),
        (chat(top_logprobs=2), Cacheability.LOGPROBS),
        (chat(logprobs=False), Cacheability.CACHEABLE),
    ],
)
def test_chat_cacheability(body: dict[str, Any], expected: Cacheability) -> None:
    assert cacheability(CHAT, body, DEFAULTS) is expected


def test_completions_cacheability() -> None:
    base = {"model": "m", "temperature": 0}
    assert cacheability(COMPLETIONS, {**base, "prompt": "x"}, DEFAULTS) is Cacheability.CACHEABLE
    assert cacheability(COMPLETIONS, {**base, "prompt": [1, 2, 3]}, DEFAULTS) is Cacheability.CACHEABLE
    assert cacheability(COMPLETIONS, {**base, "prompt": ["x"]}, DEFAULTS) is Cacheability.CACHEABLE
    assert cacheability(COMPLETIONS, {**base, "prompt": ["x", "y"]}, DEFAULTS) is Cacheability.BATCH_PROMPT
    assert cacheability(COMPLETIONS, {**base, "prompt": "x", "logprobs": 0}, DEFAULTS) is Cacheability.LOGPROBS
    assert cacheability(EMBEDDINGS, {"model": "m", "input": "x"}, DEFAULTS) is Cacheability.ENDPOINT


def test_tenant_switches() -> None:
    assert cacheability(CHAT, chat(), CacheSettings(enabled=False)) is Cacheability.DISABLED
    sampled = chat(temperature=0.9)
    assert cacheability(CHAT, sampled, CacheSettings(cache_nondeterministic=True)) is Cacheability.CACHEABLE
    # The switch does not lift the other rules.
    assert cacheability(CHAT, chat(n=3), CacheSettings(cache_nondeterministic=True)) is Cacheability.MULTIPLE_CHOICES


@pytest.mark.parametrize(
    ("header", "lookup", "store"),
    [
        (None, True, True),
        ("", True, True),
        ("no-cache", False, True),
        ("No-Store", True, False),
        ("no-cache, no-store", False, False),
        ("max-age=0", False, True),
        ("max-age=60", True, True),
        ("private, no-store", True, False),
    ],
)
def test_cache_control(header: str | None, lookup: bool, store: bool) -> None:
    directives = parse_cache_control(header)
    assert (directives.lookup, directives.store) == (lookup, store)


def test_plan_request() -> None:
    plan = plan_request("t1", "m", CHAT, chat(), DEFAULTS, None)
    assert plan.key == key(chat()) and plan.lookup and plan.store and plan.coalesce
    no_cache = plan_request("t1", "m", CHAT, chat(), DEFAULTS, "no-cache")
    assert no_cache.key == plan.key and not no_cache.lookup and no_cache.store and not no_cache.coalesce
    assert no_cache.reason is Cacheability.NO_CACHE
    no_store = plan_request("t1", "m", CHAT, chat(), DEFAULTS, "no-store")
    assert no_store.lookup and not no_store.store and not no_store.coalesce
    assert no_store.reason is Cacheability.NO_STORE
    neither = plan_request("t1", "m", CHAT, chat(), DEFAULTS, "no-cache, no-store")
    assert neither.key is None and not neither.lookup and not neither.store
    sampled = plan_request("t1", "m", CHAT, chat(temperature=1), DEFAULTS, None)
    assert sampled.key is None and sampled.reason is Cacheability.NONDETERMINISTIC


# -- Responses and Messages --------------------------------------------------------------------


def responses(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "input": [{"role": "user", "content": "hi"}], "temperature": 0, **fields}


def messages(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 9, "messages": [{"role": "user", "content": "hi"}], "temperature": 0, **fields}


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        (RESPONSES, responses(), Cacheability.CACHEABLE),
        (RESPONSES, responses(temperature=None, top_k=1), Cacheability.CACHEABLE),
        (RESPONSES, responses(temperature=0.7, seed=3), Cacheability.CACHEABLE),
        (RESPONSES, responses(temperature=None), Cacheability.NONDETERMINISTIC),
        (RESPONSES, responses(top_logprobs=2), Cacheability.LOGPROBS),
        (RESPONSES, responses(include=["message.output_text.logprobs"]), Cacheability.LOGPROBS),
        (RESPONSES, responses(include=["reasoning.encrypted_content"]), Cacheability.CACHEABLE),
        (MESSAGES, messages(), Cacheability.CACHEABLE),
        (MESSAGES, messages(temperature=None, top_k=1), Cacheability.CACHEABLE),
        (MESSAGES, messages(temperature=None), Cacheability.NONDETERMINISTIC),
        (MESSAGES, messages(temperature=0.5, seed=3), Cacheability.NONDETERMINISTIC),  # Anthropic's API has no seed
        (COUNT_TOKENS, messages(), Cacheability.ENDPOINT),
    ],
)
def test_responses_and_messages_cacheability(endpoint: Dialect, body: dict[str, Any], expected: Cacheability) -> None:
    assert cacheability(endpoint, body, DEFAULTS) is expected


def test_responses_delivery_state_and_labels_are_not_in_the_key() -> None:
    base = key(responses(), endpoint=RESPONSES)
    labelled = responses(stream=True, store=False, metadata={"a": "b"}, user="u", previous_response_id="resp_1")
    assert key(labelled, endpoint=RESPONSES) == base
    # The gateway expands previous_response_id into input: a different input is a different key.
    longer = responses(input=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert key(longer, endpoint=RESPONSES) != base
    assert key(responses(instructions="Be brief."), endpoint=RESPONSES) != base
    assert key(messages(stream=True, metadata={"user_id": "u"}), endpoint=MESSAGES) == key(
        messages(), endpoint=MESSAGES
    )
    assert key(messages(stop_sequences=["END"]), endpoint=MESSAGES) != key(messages(), endpoint=MESSAGES)
    # Only the Responses kind leaves previous_response_id out: chat's key material is unchanged.
    assert key(chat(previous_response_id="resp_1")) != key(chat())
    assert canonical_body(responses(previous_response_id="x")) == canonical_body(responses()) | {
        "previous_response_id": "x"
    }


def test_the_same_body_on_each_endpoint_has_its_own_key() -> None:
    body = messages()
    assert len({key(body, endpoint=e) for e in (CHAT, RESPONSES, MESSAGES)}) == 3
