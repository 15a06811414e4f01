"""A model with a tokenizer: the gateway's context check, access log and /admin/fleet read its
count, not the estimate; a body it cannot count passes on its estimate; a configured
tokenizer that cannot be read stops the start."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from gateway import build
from gateway.settings import ConfigError, Settings, hash_key
from tests.integration.harness import API_KEY, access_lines, in_process_gateway, sim_upstream
from tests.unit.tokens.test_counting import tiny_model

ADMIN_KEY = "sk-admin-test"
MODEL = "m"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# One word of 400 characters: the estimate says 100 tokens, the word-level tokenizer one.
LONG_WORD = "a" * 400


@pytest.mark.parametrize("tokenizer", ["dir", "none"])
async def test_the_context_check_reads_the_count(tmp_path: Path, tokenizer: str) -> None:
    reference = str(tiny_model(tmp_path / "model")) if tokenizer == "dir" else "none"
    async with sim_upstream(MODEL) as upstream:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": upstream}], "max_model_len": 50, "tokenizer": reference}],
            "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        }
        async with in_process_gateway(config, tmp_path) as (url, _, access), aiohttp.ClientSession() as http:
            body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": LONG_WORD}]}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
                answer = await r.json()
                status = r.status
            async with http.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
                models = (await r.json())["models"]
    line = next(x for x in access_lines(access) if x["endpoint"] == "chat")
    if tokenizer == "dir":
        # <|im_start|> user LONG_WORD <|im_end|> <|im_start|> assistant: 6 tokens, + 4 fits in 50.
        assert status == 200, answer
        assert (line["prompt_tokens_gateway"], line["prompt_tokens_source"]) == (6, "tokenizer")
        assert models[MODEL]["prompt_tokens"] == "tokenizer"
        assert models[MODEL]["counted"] == 1
    else:
        assert status == 400
        assert answer["error"]["code"] == "context_length_exceeded"
        assert "about" in answer["error"]["message"]
        assert line["prompt_tokens_source"] == "estimate"
        assert models[MODEL] == {"prompt_tokens": "estimate"}


async def test_a_body_the_template_cannot_render_keeps_its_estimate(tmp_path: Path) -> None:
    refusing = (
        "{{ raise_exception('no tools here') if tools else '' }}{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    reference = str(tiny_model(tmp_path / "model", refusing))
    async with sim_upstream(MODEL) as upstream:
        config = {"models": [{"name": MODEL, "replicas": [{"url": upstream}], "tokenizer": reference}]}
        async with in_process_gateway(config, tmp_path) as (url, _, access), aiohttp.ClientSession() as http:
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
                assert r.status == 200
    line = next(x for x in access_lines(access) if x["endpoint"] == "chat")
    assert line["prompt_tokens_source"] == "estimate"


def test_a_configured_tokenizer_that_cannot_be_read_stops_the_start(tmp_path: Path) -> None:
    settings = Settings(
        models=[{"name": MODEL, "replicas": [{"url": "http://127.0.0.1:1"}], "tokenizer": str(tmp_path / "nowhere")}]
    )
    with pytest.raises(ConfigError, match=r"models\[\]\.tokenizer: model 'm'"):
        build.prompt_counter(settings, {})


def test_a_managed_vllm_replicas_model_path_is_the_default(tmp_path: Path) -> None:
    model_dir = tiny_model(tmp_path / "model")
    replica = {"engine": "vllm", "model_path": str(model_dir)}
    settings = Settings(models=[{"name": MODEL, "replicas": [replica]}])
    assert build.prompt_counter(settings, {}).source(MODEL) == "tokenizer"
    unreadable = {"engine": "vllm", "model_path": "org/not-cached"}
    settings = Settings(models=[{"name": MODEL, "replicas": [unreadable]}])
    assert build.prompt_counter(settings, {"HF_HOME": str(tmp_path)}).source(MODEL) == "estimate"
