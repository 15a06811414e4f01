"""Request bodies whose prompt tokens the gateway counts and vLLM's usage reports: every API,
tools and tool calls, system prompts, content parts, the Claude Code Messages body, and a
sample of the benchmarks' prompts. Shared by the end-to-end check and the cost bench."""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from capacity.workload import make_text

ROOT = Path(__file__).resolve().parents[2]
CLAUDE_CODE_BODY = ROOT / "tests" / "data" / "claude_code_messages.json"
CLASSIFIER_PROMPTS = ROOT / "tests" / "data" / "classifier_fixture.jsonl"

# A ChatML template that renders tools (as JSON, with transformers' tojson), tool calls,
# tool results and reasoning, and loops over content parts (vLLM then hands it parts, not
# strings): what tool-calling models' templates do, on the tiny model's special tokens.
TOOL_TEMPLATE = """\
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}
{%- elif content is not none -%}
{%- for part in content -%}{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools %}<|im_start|>system
{%- if messages[0].role == 'system' %}

{{ text(messages[0].content) }}
{%- endif %}

# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ text(messages[0].content) }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}
{%- elif message.role == 'tool' %}<|im_start|>tool
{{ text(message.content) }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{%- if message.reasoning_content %}
<think>{{ message.reasoning_content }}</think>
{%- endif %}
{{ text(message.content) }}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
<tool_call>{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}</tool_call>
{%- endfor %}
{%- endif %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city, now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "Name of the city, e.g. Zürich"}},
            "required": ["city"],
        },
    },
}


def claude_code_body(max_tokens: int = 4) -> dict[str, Any]:
    """Claude Code's first request (24 tool schemas, a system prompt in blocks, a reminder),
    asking few tokens, not streamed."""
    body: dict[str, Any] = json.loads(CLAUDE_CODE_BODY.read_text())
    body.update(max_tokens=max_tokens, stream=False)
    body.pop("thinking", None)  # a thinking budget needs a reasoning parser on the replica
    return body


def chat_bodies() -> Iterator[tuple[str, dict[str, Any]]]:
    yield "chat: one user message", {"messages": [{"role": "user", "content": "Hello there, how are you?"}]}
    yield (
        "chat: system, turns, content parts",
        {
            "messages": [
                {"role": "system", "content": "You are terse.  Answer in one line."},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Name a prime."}, {"type": "text", "text": "Odd."}],
                },
                {"role": "assistant", "content": "Seven."},
                {"role": "user", "content": "Another, with accents: café, naïve, 東京."},
            ]
        },
    )
    yield (
        "chat: tools, a tool call and its result",
        {
            "messages": [
                {"role": "system", "content": "Use tools when they help."},
                {"role": "user", "content": "Weather in Zürich?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "12 °C, rain"}]},
                {"role": "user", "content": "And tomorrow?"},
            ],
            "tools": [WEATHER_TOOL],
        },
    )
    yield (
        "chat: developer role",
        {
            "messages": [
                {"role": "system", "content": "Be kind."},
                {"role": "developer", "content": "Prefer metric units."},
                {"role": "user", "content": "How tall is Everest?"},
            ]
        },
    )


def messages_bodies() -> Iterator[tuple[str, dict[str, Any]]]:
    yield "messages: Claude Code, 24 tools and a system prompt", claude_code_body()
    yield (
        "messages: a tool round trip",
        {
            "max_tokens": 4,
            "system": "You are a weather bot.",
            "tools": [
                {
                    "name": "get_weather",
                    "description": "The weather in a city.",
                    "input_schema": WEATHER_TOOL["function"]["parameters"],
                }
            ],
            "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "The user wants Oslo.", "signature": "sig"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "3 °C"}],
                        },
                        {"type": "text", "text": "Thanks. Dress advice?"},
                    ],
                },
            ],
        },
    )
    claude = claude_code_body()
    second = copy.deepcopy(claude)
    second["messages"] += [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "toolu_9", "name": "Read", "input": {"file_path": "/repo/README.md"}}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "content": "# fleetgate\nA gateway."}],
        },
    ]
    yield "messages: Claude Code, second turn with a tool result", second


def responses_bodies() -> Iterator[tuple[str, dict[str, Any]]]:
    yield "responses: string input with instructions", {"instructions": "Be brief.", "input": "What is HTTP/2?"}
    yield (
        "responses: items, a function call and its output",
        {
            "instructions": "Use tools.",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "Weather in Rome?"}]},
                {
                    "type": "message",
                    "role": "assistant",
                    "id": "msg_1",
                    "status": "completed",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city":"Rome"}'},
                {"type": "function_call_output", "call_id": "call_7", "output": "24 °C"},
                {"role": "user", "content": "Shorts or trousers?"},
            ],
            "tools": [{"type": "function", **WEATHER_TOOL["function"]}],
        },
    )


def sample_prompts(count: int = 100, seed: int = 7) -> list[str]:
    """The classifier benchmark's prompts, then texts of the capacity benchmark's generator
    (its word corpus) from 20 to 2,000 tokens, ``count`` in all."""
    prompts = [json.loads(line)["prompt"] for line in CLASSIFIER_PROMPTS.read_text().splitlines() if line.strip()]
    rng = random.Random(seed)
    while len(prompts) < count:
        prompts.append(make_text(rng.randint(20, 2000), rng, tag=f"p{len(prompts)}"))
    return prompts[:count]


def sample_bodies(count: int = 100) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """Each sample prompt in one API, in turn: (api, name, body)."""
    for i, prompt in enumerate(sample_prompts(count)):
        api = ("chat", "messages", "responses")[i % 3]
        if api == "chat":
            body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
        elif api == "messages":
            body = {"max_tokens": 2, "messages": [{"role": "user", "content": prompt}]}
        else:
            body = {"input": prompt}
        yield api, f"sample {i}", body


# Long enough for the Claude Code body in the tiny model's small vocabulary (its 24 tool
# schemas alone are tens of thousands of its tokens); the random weights do not care.
LONG_CONTEXT = 65536


def tool_template_model(tiny_model: Path, out: Path) -> Path:
    """The tiny model in ``out`` with ``TOOL_TEMPLATE`` as its chat template and a context of
    ``LONG_CONTEXT`` positions (its weights linked, not copied)."""
    out.mkdir(parents=True, exist_ok=True)
    for path in tiny_model.iterdir():
        target = out / path.name
        if path.name in ("chat_template.jinja", "config.json") or target.exists():
            continue
        target.symlink_to(path.resolve())
    config = json.loads((tiny_model / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "chat_template.jinja").write_text(TOOL_TEMPLATE)
    return out
