"""The gateway's prompt-token count equals the replica's ``usage`` exactly: chat, Messages and
Responses, tools and tool calls, system prompts, content parts, Claude Code's Messages body
with its 24 tool schemas, and 100 of the benchmarks' prompts.

One vLLM replica (core 0) serves the tiny model with a template that renders tools and
loops over content parts (``prompt_bodies.TOOL_TEMPLATE``), started with a tool parser so
Messages with tools (``tool_choice: auto``) are accepted. The gateway's count is in each
request's access-log line (``prompt_tokens_gateway``), beside the replica's usage.
"""

from __future__ import annotations

import asyncio
import random
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import prompt_bodies
from tests.e2e.conftest import (
    MODEL,
    E2EGateway,
    gateway_config,
    record_timing,
    run_dir,
    start_gateway,
    stop_gateway,
    vllm_replica,
)
from tests.integration.harness import API_KEY

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 240.0
# Room for the Claude Code body in the tiny model's vocabulary (~11k tokens) and an answer.
MAX_MODEL_LEN = 16384
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


@pytest.fixture(scope="module")
def counting_gateway(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[E2EGateway]:
    model_dir = prompt_bodies.tool_template_model(tiny_model, tmp_path_factory.mktemp("tool-model"))
    replica = vllm_replica(model_dir, core=0)
    replica["args"] = [
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
    ]
    config = gateway_config([replica])
    # The context check runs on the count: a request that fits is never refused by it.
    config["models"][0]["max_model_len"] = MAX_MODEL_LEN
    e2e, elapsed = start_gateway(config, run_dir("prompt-tokens"), START_TIMEOUT_S, every=True)
    record_timing("prompt tokens: one vLLM replica healthy", elapsed)
    try:
        yield e2e
    finally:
        stop_gateway(e2e, signal.SIGTERM)


def _ask(e2e: E2EGateway, api: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """The replica's prompt tokens (its usage) and the request's access-log line."""
    request_id = f"tok-{uuid.uuid4().hex[:12]}"
    body = {**body, "model": MODEL}
    if api == "chat":
        body.setdefault("max_tokens", 2)
    elif api == "responses":
        body.setdefault("max_output_tokens", 2)
    headers = {"Authorization": f"Bearer {API_KEY}", "x-request-id": request_id}
    resp = httpx.post(f"{e2e.url}{PATHS[api]}", json=body, headers=headers, timeout=180)
    assert resp.status_code == 200, resp.text[:2000]
    usage = resp.json()["usage"]
    replica = usage["prompt_tokens"] if api == "chat" else usage["input_tokens"]
    line = asyncio.run(e2e.access_line(request_id, 10.0))
    return int(replica), line


def _cases() -> Iterator[tuple[str, str, dict[str, Any]]]:
    for name, body in prompt_bodies.chat_bodies():
        yield "chat", name, body
    for name, body in prompt_bodies.messages_bodies():
        yield "messages", name, body
    for name, body in prompt_bodies.responses_bodies():
        yield "responses", name, body


def test_admin_fleet_says_the_model_counts_with_its_tokenizer(counting_gateway: E2EGateway) -> None:
    resp = httpx.get(f"{counting_gateway.url}/admin/fleet", headers={"Authorization": "Bearer sk-e2e-admin"})
    model = resp.json()["models"][MODEL]
    assert model["prompt_tokens"] == "tokenizer"
    assert model["chat_templates"] == ["default"]


def test_count_equals_the_replicas_usage_for_every_api(counting_gateway: E2EGateway) -> None:
    mismatches = []
    for api, name, body in _cases():
        replica, line = _ask(counting_gateway, api, body)
        assert line["prompt_tokens_source"] == "tokenizer", (name, line)
        if line["prompt_tokens_gateway"] != replica:
            mismatches.append((name, line["prompt_tokens_gateway"], replica))
    assert not mismatches, f"(case, gateway, replica): {mismatches}"


def test_count_equals_the_replicas_usage_for_100_benchmark_prompts(counting_gateway: E2EGateway) -> None:
    mismatches = []
    for api, name, body in prompt_bodies.sample_bodies(100):
        replica, line = _ask(counting_gateway, api, body)
        assert line["prompt_tokens_source"] == "tokenizer", (name, line)
        if line["prompt_tokens_gateway"] != replica:
            mismatches.append((api, name, line["prompt_tokens_gateway"], replica))
    assert not mismatches, f"(api, case, gateway, replica): {mismatches}"


def test_a_request_that_fits_is_not_refused_but_one_that_does_not_is(counting_gateway: E2EGateway) -> None:
    """The Claude Code body fits the context by the count (its estimate may say otherwise);
    a prompt past max_model_len by the count is refused before any replica sees it."""
    replica, line = _ask(counting_gateway, "messages", prompt_bodies.claude_code_body())
    assert line["prompt_tokens_gateway"] == replica
    long = {"messages": [{"role": "user", "content": prompt_bodies.make_text(20000, random.Random(1))}]}
    resp = httpx.post(
        f"{counting_gateway.url}/v1/chat/completions",
        json={"model": MODEL, "max_tokens": 2, **long},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "context_length_exceeded"
