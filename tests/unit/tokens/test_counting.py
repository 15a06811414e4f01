"""Counting a prompt as the replica does: the template's environment, the conversation vLLM
makes of each API's body, the count, and the fallback to the estimate."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path
from typing import Any

import orjson
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from capacity.workload import make_text
from dialects.anthropic import MESSAGES
from dialects.chat_input import NotCountable, TemplateTraits
from dialects.openai import CHAT, COMPLETIONS
from dialects.responses import RESPONSES_API
from tokens.conversation import conversation
from tokens.counter import PromptCounter, TokenizerSpec
from tokens.model_tokenizer import ModelTokenizer, TokenizerError
from tokens.segments import SegmentCounter
from tokens.template import ChatTemplate, TemplateError

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
PARTS = (
    "{% for message in messages %}{{ message.role }}:"
    "{% for part in message.content %}{{ part.text }}|{% endfor %}\n{% endfor %}"
)
TOOLS = "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% for m in messages %}{{ m.content }}\n{% endfor %}"


def tiny_model(directory: Path, template: str = CHATML) -> Path:
    """A word-level tokenizer (each whitespace-separated word or punctuation mark one token,
    ChatML's markers one each) and ``template``, as a model directory."""
    words = ["<unk>", "<|im_start|>", "<|im_end|>", "<s>"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "<|im_end|>"}})
    )
    (directory / "chat_template.jinja").write_text(template)
    return directory


# -- the template's environment --------------------------------------------------------------


def test_tojson_is_plain_json_dumps_keys_in_order_nothing_escaped() -> None:
    template = ChatTemplate("{{ x | tojson }}|{{ x | tojson(indent=2) }}")
    x = {"b": "<a & 'é'>", "a": 1}
    assert template.render([], None, {"x": x}, {}) == '{"b": "<a & \'é\'>", "a": 1}|' + json.dumps(
        x, indent=2, ensure_ascii=False
    )


def test_trim_and_lstrip_blocks_as_transformers_sets_them() -> None:
    template = ChatTemplate("  {% if true %}\nA\n  {% endif %}\nB")
    assert template.render([], None, {}, {}) == "A\nB"


def test_raise_exception_is_a_template_error_and_the_generation_tag_renders_its_body() -> None:
    with pytest.raises(TemplateError, match="no system"):
        ChatTemplate("{{ raise_exception('no system') }}").render([], None, {}, {})
    assert ChatTemplate("{% generation %}x{% endgeneration %}").render([], None, {}, {}) == "x"


def test_a_keyword_reaches_the_template_only_when_it_names_it() -> None:
    template = ChatTemplate("{{ enable_thinking }}")
    assert template.render([], None, {"enable_thinking": False, "other": 1}, {}) == "False"
    assert "other" not in template.variables


def test_content_format_string_parts_and_through_a_macro() -> None:
    assert ChatTemplate(CHATML).content_format == "string"
    assert ChatTemplate(PARTS).content_format == "openai"
    macro = (
        "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
        "{% for m in messages %}{{ show(m['content']) }}{% endfor %}"
    )
    assert ChatTemplate(macro).content_format == "openai"


def test_a_template_that_refuses_inline_system_messages_is_system_first() -> None:
    guard = (
        "{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('x') }}{% endif %}{% endfor %}"
    )
    assert ChatTemplate(guard).system_first
    assert not ChatTemplate(CHATML).system_first


def test_continue_final_message_ends_the_prompt_inside_the_last_message() -> None:
    template = ChatTemplate(CHATML)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    rendered = template.render(messages, None, {"continue_final_message": True}, {})
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nHel"


# -- the conversation vLLM makes of chat messages ----------------------------------------------


def test_parts_joined_with_newlines_for_a_string_template_kept_for_a_parts_one() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "x": 1}]}]
    assert conversation(messages, "string", True) == [{"role": "user", "content": "a\nb"}]
    assert conversation(messages, "openai", True) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "x": 1}]}
    ]
    assert conversation([{"role": "user", "content": "a"}], "openai", True) == [
        {"role": "user", "content": [{"type": "text", "text": "a"}]}
    ]


def test_billing_header_dropped_tool_text_joined_arguments_parsed() -> None:
    messages = [
        {"role": "system", "content": "x-anthropic-billing-header: cch=1;\nYou are helpful."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
            "reasoning": "think",
        },
        {
            "role": "tool",
            "tool_call_id": "c",
            "content": [{"type": "text", "text": "1"}, {"type": "text", "text": "2"}],
        },
    ]
    got = conversation(messages, "openai", True)
    assert got[0] == {"role": "system", "content": [{"type": "text", "text": "You are helpful."}]}
    assert got[1]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert got[1]["reasoning"] == got[1]["reasoning_content"] == "think"
    assert got[2] == {"role": "tool", "content": "1\n2", "tool_call_id": "c"}
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # the body is untouched


def test_developer_becomes_system_merged_into_the_first_when_the_template_lacks_it() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "developer", "content": "D"},
        {"role": "user", "content": "U"},
    ]
    assert conversation(messages, "string", False) == [
        {"role": "system", "content": "S\n\nD"},
        {"role": "user", "content": "U"},
    ]
    assert conversation(messages, "string", True)[1] == {"role": "developer", "content": "D", "tools": None}


def test_an_image_is_not_countable() -> None:
    with pytest.raises(NotCountable):
        conversation([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "string", True)


# -- each API's body as the chat completion vLLM builds -----------------------------------------


def test_messages_as_vllm_converts_them() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cch=9;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Be brief."},
        ],
        "tools": [{"name": "Read", "description": "Reads.", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "Read it"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "ok"},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "file"}]},
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    }
    got = MESSAGES.prompt_input(body, TemplateTraits())
    assert got.messages == [
        {"role": "system", "content": "You are Claude Code. Be brief."},
        {"role": "user", "content": "Read it"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "Read", "arguments": {"path": "a"}}}],
            "content": "ok",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "file"},
        {"role": "user", "content": "go on"},
    ]
    assert got.tools == [
        {"type": "function", "function": {"name": "Read", "description": "Reads.", "parameters": {"type": "object"}}}
    ]
    assert got.kwargs == {"add_generation_prompt": True, "continue_final_message": False}


def test_messages_inline_system_turns_merge_into_the_first_when_the_template_wants_it() -> None:
    body = {
        "system": "A",
        "messages": [
            {"role": "user", "content": "u"},
            {"role": "system", "content": "B"},
            {"role": "user", "content": "v"},
        ],
    }
    assert [m["role"] for m in MESSAGES.prompt_input(body, TemplateTraits()).messages] == [
        "system",
        "user",
        "system",
        "user",
    ]
    merged = MESSAGES.prompt_input(body, TemplateTraits(merge_inline_system=True)).messages
    assert merged == [
        {"role": "system", "content": "AB"},
        {"role": "user", "content": "u"},
        {"role": "user", "content": "v"},
    ]


def test_responses_items_as_vllm_converts_them() -> None:
    body = {
        "instructions": "be nice",
        "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
            {
                "type": "message",
                "role": "assistant",
                "id": "m1",
                "status": "completed",
                "content": [{"type": "output_text", "text": "yo", "annotations": []}],
            },
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"role": "user", "content": "next"},
        ],
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}],
        "reasoning": {"effort": "low"},
    }
    got = RESPONSES_API.prompt_input(body, TemplateTraits())
    assert got.messages == [
        {"role": "system", "content": "be nice"},
        {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {
            "role": "assistant",
            "content": "yo",
            "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a":1}'}, "type": "function"}],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "user", "content": "next"},
    ]
    assert got.tools == [
        {"type": "function", "function": {"name": "f", "description": None, "parameters": {"type": "object"}}}
    ]
    assert got.kwargs == {
        "add_generation_prompt": True,
        "continue_final_message": False,
        "reasoning_effort": "low",
        "enable_thinking": True,
    }


def test_chat_keywords_merge_over_the_requests_template_kwargs() -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"enable_thinking": False, "add_generation_prompt": False},
        "reasoning_effort": "high",
    }
    got = CHAT.prompt_input(body, TemplateTraits())
    # vLLM: the API's own keywords win when set; enable_thinking stays the request's.
    assert got.kwargs == {
        "enable_thinking": False,
        "add_generation_prompt": True,
        "continue_final_message": False,
        "reasoning_effort": "high",
    }


# -- counting --------------------------------------------------------------------------------


def test_chat_count_is_the_rendered_prompts_tokens(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m"))
    body = {"messages": [{"role": "system", "content": "Be brief ."}, {"role": "user", "content": "Hello world"}]}
    # <|im_start|> system Be brief . <|im_end|> / <|im_start|> user Hello world <|im_end|> / <|im_start|> assistant
    assert model.count(CHAT, body) == 6 + 5 + 2


def test_completions_count_adds_no_template_and_counts_token_ids(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m"))
    assert model.count(COMPLETIONS, {"prompt": "one two three"}) == 3
    assert model.count(COMPLETIONS, {"prompt": [[1, 2], "a b"]}) == 4


def test_tools_are_rendered_with_the_template(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m", TOOLS))
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    rendered = model.render(
        CHAT.prompt_input({"messages": [{"role": "user", "content": "hi"}], "tools": [tool]}, TemplateTraits())
    )
    schema = '{"type": "function", "function": {"name": "f", "description": null, "parameters": {"type": "object"}}}'
    assert rendered == schema + "\nhi\n"


def test_an_unreadable_directory_is_a_tokenizer_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        ModelTokenizer.load(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError):
        ModelTokenizer.load(tmp_path)


def _call(dialect: Any, body: dict[str, Any]) -> Any:
    return dialect.parse(orjson.dumps({"model": "m", **body}))


def test_counter_counts_inline_and_on_a_thread(tmp_path: Path) -> None:
    model = ModelTokenizer.load(tiny_model(tmp_path / "m"))
    body = {"messages": [{"role": "user", "content": "word " * 3000}]}
    for inline in (0, 10**9):
        counter = PromptCounter({"m": model}, inline_max_tokens=inline)
        call = _call(CHAT, body)
        asyncio.run(counter.count("m", call))
        counter.close()
        assert call.prompt_tokens == 3000 + 5 and call.prompt_tokens_counted


def test_counter_keeps_the_estimate_for_a_body_it_cannot_count_and_logs_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    counter = PromptCounter({"m": ModelTokenizer.load(tiny_model(tmp_path / "m"))})
    call = _call(CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]})
    estimate = call.prompt_tokens
    with caplog.at_level(logging.WARNING, "fleetgate.tokens"):
        asyncio.run(counter.count("m", call))
    assert call.prompt_tokens == estimate and not call.prompt_tokens_counted
    assert "could not count" in caplog.text
    assert counter.describe(["m", "other"]) == {
        "m": {
            "prompt_tokens": "tokenizer",
            "tokenizer": str(tmp_path / "m"),
            "chat_templates": ["default"],
            "counted": 0,
            "estimated": 1,
        },
        "other": {"prompt_tokens": "estimate"},
    }


def test_a_configured_tokenizer_must_load_a_defaulted_one_may_not(tmp_path: Path) -> None:
    missing = str(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="model 'm'"):
        PromptCounter.load([TokenizerSpec("m", missing, explicit=True)])
    counter = PromptCounter.load([TokenizerSpec("m", missing, explicit=False)])
    assert counter.source("m") == "estimate"


def test_a_model_id_is_found_in_the_hugging_face_cache(tmp_path: Path) -> None:
    repo = tmp_path / "hub" / "models--org--tiny"
    tiny_model(repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    counter = PromptCounter.load(
        [TokenizerSpec("m", "org/tiny", explicit=True, env={"HF_HUB_CACHE": str(tmp_path / "hub")})]
    )
    assert counter.describe(["m"])["m"]["tokenizer"] == str(repo / "snapshots" / "abc123")


def test_counting_piece_by_piece_between_special_tokens_is_exact(tmp_path: Path) -> None:
    """The tiny test model's byte-level BPE when it is there, else a word-level one: every
    text's count through the remembered pieces equals encoding it whole, hits and misses."""
    path = Path(__file__).resolve().parents[3] / ".cache" / "tiny-llama" / "tokenizer.json"
    if not path.exists():
        path = tiny_model(tmp_path / "m") / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(path))
    start, end = "<|im_start|>", "<|im_end|>"
    segments = SegmentCounter.for_tokenizer(tokenizer)
    assert segments is not None
    rng = random.Random(3)
    system = make_text(300, rng, tag="sys")
    for i in range(60):
        turns = "".join(f"{start}user\n{make_text(rng.randint(1, 200), rng)}{end}\n" for _ in range(rng.randint(0, 3)))
        text = f"{start}system\n{system}{end}\n{turns}{start}assistant\n" + (" x" * (i % 3))
        assert segments.count(text) == len(tokenizer.encode(text, add_special_tokens=False)), text


def test_a_tokenizer_whose_added_tokens_take_spaces_is_encoded_whole() -> None:
    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    tokenizer.add_special_tokens([AddedToken("<x>", lstrip=True)])
    assert SegmentCounter.for_tokenizer(tokenizer) is None
