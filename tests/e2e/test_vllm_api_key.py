"""A real vLLM started with ``--api-key``, fronted through its replica source's ``api_key``.

vLLM refuses its OpenAI routes without the key; the gateway sends it as a bearer token on
every request (read from the environment, never logged), and the OpenAI SDK's chat,
streaming, ``models.list`` and ``models.retrieve`` work through the gateway.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.conftest import (
    MODEL,
    SINGLE_START_TIMEOUT_S,
    VLLM_ARGS,
    gateway_config,
    record_timing,
    run_dir,
    start_gateway,
    stop_gateway,
    vllm_replica,
)

UPSTREAM_KEY = "sk-vllm-e2e-upstream-7d1c"
KEY_VAR = "FLEETGATE_E2E_VLLM_KEY"
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello"}]
IGNORE_EOS = {"ignore_eos": True}


@pytest.mark.timeout(SINGLE_START_TIMEOUT_S + 120)
def test_vllm_with_api_key_through_its_source_key(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, UPSTREAM_KEY)  # the gateway process inherits the environment
    replica = vllm_replica(tiny_model, core=0)
    replica["args"] = [*VLLM_ARGS, "--api-key", UPSTREAM_KEY]
    replica["api_key"] = f"env:{KEY_VAR}"
    e2e, elapsed = start_gateway(gateway_config([replica]), run_dir("api-key"), SINGLE_START_TIMEOUT_S, every=True)
    record_timing("single replica start (vLLM --api-key test)", elapsed)
    try:
        (snapshot,) = e2e.fleet_sync().values()
        # vLLM enforces its key: without it, its OpenAI routes answer 401.
        direct = httpx.get(f"{snapshot['url']}/v1/models", timeout=30)
        assert direct.status_code == 401, direct.text
        with e2e.sync_client() as sdk:
            reply = sdk.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=6, extra_body=IGNORE_EOS)
            assert reply.usage is not None and reply.usage.completion_tokens == 6
            chunks = list(
                sdk.chat.completions.create(
                    model=MODEL,
                    messages=PROMPT,
                    max_tokens=5,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body=IGNORE_EOS,
                )
            )
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
            assert {m.id for m in sdk.models.list()} == {"auto", MODEL}
            model = sdk.models.retrieve(MODEL)
            assert (model.id, model.object) == (MODEL, "model")
    finally:
        stop_gateway(e2e, signal.SIGTERM)
    logs = e2e.gw.stdout() + e2e.gw.stderr_path.read_text()
    assert UPSTREAM_KEY not in logs
