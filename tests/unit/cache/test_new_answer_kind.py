"""A cacheable streaming API is one dialect: the cache keys, stores, finds and replays the
answers of a dialect defined here, with a shape of its own, without a line of ``cache/``
knowing it.

The API: ``POST /v1/echo`` with a ``prompt``; its stream is data events typed ``piece``
(``{"type": "piece", "text": ...}``) ending with one typed ``done`` (the model and usage),
its JSON answer ``{"id", "model", "text", "usage": {"in", "out"}}``. It takes no seed, marks
log-probabilities with ``scores``, takes several prompts as a list, and leaves ``trace`` out
of the key.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from cache.config import CacheSettings
from cache.keys import Cacheability
from cache.memory_store import MemoryStore
from cache.service import ResponseCache
from dialects.answer import Answers, CachedCompletion, StreamCollector, data_event, split_text
from dialects.base import Call, Dialect, PromptView, estimate, json_object, require_model, stream_flag
from dialects.openai import CHAT
from dialects.stream import SseScanner, TypedEventScanner


class EchoAnswers(Answers):
    takes_seed = False
    key_excluded = frozenset({"trace"})

    def collector(self, max_chars: int) -> StreamCollector:
        return EchoCollector(self.kind, max_chars=max_chars)

    def from_object(self, data: dict[str, Any]) -> CachedCompletion | None:
        text, model, usage = data.get("text"), data.get("model"), data.get("usage")
        if not isinstance(text, str) or not isinstance(model, str) or not isinstance(usage, dict):
            return None
        return CachedCompletion(self.kind, model, text, "done", usage["in"], usage["out"])

    def replay_object(
        self, entry: CachedCompletion, *, completion_id: str, created: int, request: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        usage = {"in": entry.prompt_tokens, "out": entry.completion_tokens}
        return {"id": completion_id, "model": entry.model, "text": entry.content, "usage": usage}

    def replay_events(
        self,
        entry: CachedCompletion,
        *,
        completion_id: str,
        created: int,
        include_usage: bool,
        request: dict[str, Any] | None = None,
    ) -> list[bytes]:
        events = [data_event({"type": "piece", "text": p}) for p in split_text(entry.content)]
        usage = {"in": entry.prompt_tokens, "out": entry.completion_tokens}
        events.append(data_event({"type": "done", "id": completion_id, "model": entry.model, "usage": usage}))
        return events

    def several_prompts(self, body: dict[str, Any]) -> bool:
        return isinstance(body.get("prompt"), list)

    def wants_logprobs(self, body: dict[str, Any]) -> bool:
        return bool(body.get("scores"))


class EchoCollector(StreamCollector):
    __slots__ = ("_done", "_kind", "_pieces")

    END: ClassVar[bytes] = b""

    def __init__(self, kind: str, *, max_chars: int) -> None:
        super().__init__(max_chars=max_chars)
        self._kind = kind
        self._pieces: list[str] = []
        self._done: dict[str, Any] | None = None

    def _take(self, data: dict[str, Any]) -> bool:
        if data.get("type") == "piece" and isinstance(data.get("text"), str):
            self._pieces.append(data["text"])
            self._chars += len(data["text"])
            return True
        if data.get("type") == "done":
            self._done = data
            return True
        return False

    def result(
        self, usage: dict[str, Any] | None = None, final: dict[str, Any] | None = None
    ) -> CachedCompletion | None:
        done = self._done
        if self._failed or done is None:
            return None
        return CachedCompletion(
            self._kind, done["model"], "".join(self._pieces), "done", done["usage"]["in"], done["usage"]["out"]
        )


class EchoScanner(TypedEventScanner):
    __slots__ = ()

    TOKENS = frozenset({b"piece"})
    ENDS = frozenset({b"done"})


class Echo(Dialect):
    name, path, operation, prompt_param = "echo", "/v1/echo", "chat", "prompt"
    streams = True
    generates = True
    answers = EchoAnswers("test-echo", "echo-")

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        body = json_object(raw)
        return Call(self, body, require_model(body), stream_flag(body), True, None, estimate(0), raw)

    def prompt(self, body: dict[str, Any]) -> PromptView:
        return PromptView((str(body.get("prompt")),), str(body.get("prompt")))

    def question(self, body: dict[str, Any]) -> str | None:
        prompt = body.get("prompt")
        return prompt.strip() or None if isinstance(prompt, str) else None

    def without_question(self, body: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in body.items() if k != "prompt"}

    def scanner(self, call: Call) -> SseScanner:
        return EchoScanner()


ECHO = Echo()
TENANT = CacheSettings()
BODY = {"model": "m", "prompt": "Say it back", "temperature": 0}
STREAM = (
    b'data: {"type":"piece","text":"Say"}\n\n'
    b'data: {"type":"piece","text":" it back"}\n\n'
    b'data: {"type":"done","id":"echo-live","model":"m","usage":{"in":3,"out":2}}\n\n'
)


def fold(data: bytes, chunk: int = 5) -> CachedCompletion | None:
    """``data`` through the dialect's scanner and collector, as the proxy feeds them."""
    call = ECHO.parse(orjson.dumps({**BODY, "stream": True}))
    scanner, collector = ECHO.scanner(call), ECHO.answers.collector(10_000)
    for i in range(0, len(data), chunk):
        out, _ = scanner.feed(data[i : i + chunk])
        collector.feed(out)
    assert scanner.done
    return collector.result(scanner.usage, scanner.final)


def test_the_dialects_key_rules_decide_cacheability_and_the_key() -> None:
    cache = ResponseCache(MemoryStore())
    plan = cache.plan("t1", "m", ECHO, BODY, TENANT, None)
    assert plan.key is not None and plan.reason is Cacheability.CACHEABLE
    assert cache.plan("t1", "m", ECHO, {**BODY, "trace": "abc"}, TENANT, None).key == plan.key
    assert cache.plan("t1", "m", ECHO, {**BODY, "prompt": "Other"}, TENANT, None).key != plan.key
    seeded = cache.plan("t1", "m", ECHO, {**BODY, "temperature": 0.7, "seed": 1}, TENANT, None)
    assert seeded.reason is Cacheability.NONDETERMINISTIC  # no seed in this API
    assert cache.plan("t1", "m", ECHO, {**BODY, "scores": True}, TENANT, None).reason is Cacheability.LOGPROBS
    several = cache.plan("t1", "m", ECHO, {**BODY, "prompt": ["a", "b"]}, TENANT, None)
    assert several.reason is Cacheability.BATCH_PROMPT
    assert cache.semantic_text(ECHO, BODY, TENANT, None) is None  # the tenant's semantic cache is off


async def test_a_stream_is_folded_stored_found_and_replayed() -> None:
    cache = ResponseCache(MemoryStore())
    plan = cache.plan("t1", "m", ECHO, BODY, TENANT, None)
    assert plan.key is not None
    entry = fold(STREAM)
    assert entry == CachedCompletion("test-echo", "m", "Say it back", "done", 3, 2)
    assert await cache.store(plan.key, entry, TENANT)
    hit = await cache.find(plan)
    assert hit is not None and hit.kind == "exact" and hit.completion == entry
    answers = ECHO.answers
    replayed = answers.replay_sse(
        hit.completion, completion_id="echo-live", created=1, include_usage=False, request=BODY
    )
    assert replayed == (
        b'data: {"type":"piece","text":"Say"}\n\n'
        b'data: {"type":"piece","text":" it"}\n\n'
        b'data: {"type":"piece","text":" back"}\n\n'
        b'data: {"type":"done","id":"echo-live","model":"m","usage":{"in":3,"out":2}}\n\n'
    )
    assert fold(replayed) == entry  # replay and fold are inverses
    whole = answers.replay_json(hit.completion, completion_id=answers.new_id(bytes(16)), created=1)
    assert orjson.loads(whole) == {
        "id": "echo-" + "00" * 16,
        "model": "m",
        "text": "Say it back",
        "usage": {"in": 3, "out": 2},
    }
    assert answers.from_json(whole) == entry


def test_its_entries_round_trip_and_other_kinds_stay_apart() -> None:
    entry = CachedCompletion("test-echo", "m", "hi", "done", 1, 1)
    raw = entry.to_bytes()
    assert orjson.loads(raw)["kind"] == "test-echo" and CachedCompletion.from_bytes(raw) == entry
    cache = ResponseCache(MemoryStore())
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "Say it back"}], "temperature": 0}
    assert (
        cache.plan("t1", "m", ECHO, BODY, TENANT, None).key != cache.plan("t1", "m", CHAT, chat_body, TENANT, None).key
    )
