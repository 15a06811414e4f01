"""Agents finish their turns against `make run`'s fleet: config.example.yaml as it is, the real
`fleetgate serve` and its two simulated replicas, whose answers end on their own.

A turn of Claude Code or of the Agents SDK ends only when the model stops by itself
(Messages ``end_turn``, Responses ``completed``); an answer that runs to ``max_tokens`` would
take Claude Code's 32,000 tokens at the example's 50 tokens/s (over ten minutes) and end as
``max_tokens``. The simulator answers ``auto`` tool choice with text, so each run ends with a
text answer: the natural end of an agent's turn.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.integration.harness import ROOT, GatewayProcess, gateway_process

# The example's development tenant (config.example.yaml: "The development key is ...").
DEV_KEY = "sk-fleetgate-dev"
MODEL = "fleetgate-sim"  # what ANTHROPIC_MODEL / the agent's model names: the example's fleet model
# What Claude Code sends for a one-line question: 24 tools, its system prompt, thinking on.
CLAUDE_CODE_BODY = ROOT / "tests" / "data" / "claude_code_messages.json"
# Each answer is a few hundred tokens at 50 tokens/s; well under a run to max_tokens.
TURN_BUDGET_S = 60.0
ANSWER_LIMIT = 4000  # the agents' max_tokens: an answer that stops below it ended on its own


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    config = yaml.safe_load((ROOT / "config.example.yaml").read_text())
    assert config["models"][0]["replicas"][0]["sim"] == {"ttft_ms": 50, "tokens_per_s": 50}
    # The harness gives the gateway a free port instead of 8080; nothing else of the example changes.
    del config["server"]["port"]
    with gateway_process(config, tmp_path_factory.mktemp("gw")) as gw:
        yield gw


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, Any]]:
    event = None
    for line in lines:
        if line.startswith("event: "):
            event = line.removeprefix("event: ")
        elif line.startswith("data: ") and event is not None:
            yield event, json.loads(line.removeprefix("data: "))
            event = None


def test_a_claude_code_turn_ends_with_end_turn(gateway: GatewayProcess) -> None:
    body = json.loads(CLAUDE_CODE_BODY.read_text())
    assert (body["max_tokens"], body["thinking"]["type"], len(body["tools"])) == (32000, "enabled", 24)
    headers = {
        "x-api-key": DEV_KEY,  # ANTHROPIC_API_KEY; ANTHROPIC_AUTH_TOKEN sends it as a bearer key
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
        "user-agent": "claude-cli/2.1.0 (external, cli)",
    }
    started = time.monotonic()
    with (
        httpx.Client(timeout=TURN_BUDGET_S) as http,
        http.stream("POST", f"{gateway.url}/v1/messages?beta=true", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        events = list(sse_events(response.iter_lines()))
    elapsed = time.monotonic() - started
    names = [name for name, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] == "end_turn"
    assert 0 < delta["usage"]["output_tokens"] < body["max_tokens"]
    assert elapsed < TURN_BUDGET_S


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
async def test_an_agents_sdk_run_finishes(gateway: GatewayProcess, api: str) -> None:
    agents = pytest.importorskip("agents")
    openai = pytest.importorskip("openai")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def lookup(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    client = openai.AsyncOpenAI(base_url=f"{gateway.url}/v1", api_key=DEV_KEY, max_retries=0, timeout=TURN_BUDGET_S)
    if api == "responses":
        model: Any = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
    else:
        model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=client)
    agent = agents.Agent(
        name="weather",
        instructions="Answer about the weather; use the tool when you need it.",
        model=model,
        tools=[lookup],
        model_settings=agents.ModelSettings(max_tokens=ANSWER_LIMIT),
    )
    started = time.monotonic()
    # Runner.run raises MaxTurnsExceeded when the turns do not end; the model's answer ends this one.
    result = await agents.Runner.run(agent, "What is the weather in Lisbon?", max_turns=3)
    elapsed = time.monotonic() - started
    await client.close()
    assert isinstance(result.final_output, str) and result.final_output
    assert calls == []  # "auto" tool choice: the simulator answers with text
    usage = result.raw_responses[-1].usage
    assert 0 < usage.output_tokens < ANSWER_LIMIT
    assert elapsed < TURN_BUDGET_S


def test_the_fixture_reads_like_claude_code() -> None:
    body = json.loads(Path(CLAUDE_CODE_BODY).read_text())
    names = [tool["name"] for tool in body["tools"]]
    assert {"Bash", "Read", "Edit", "Write", "Glob", "Grep", "TodoWrite", "Task"} <= set(names)
    assert all(tool["input_schema"]["type"] == "object" for tool in body["tools"])
    assert body["stream"] is True and body["thinking"]["budget_tokens"] < body["max_tokens"]
    assert body["system"][0]["text"].startswith("You are Claude Code")
