"""vLLM's other model-addressed endpoints through the gateway: rerank, score, tokenize and
detokenize against the simulator; audio (a multipart upload) against a small stand-in, since
the simulator transcribes nothing. Each is routed by its model, limited, counted per endpoint,
settled on the usage it reports, and refused in OpenAI's shape."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from tests.integration.harness import API_KEY, access_lines, in_process_gateway, serve_app, sim_upstream, tenants

MODEL = "sim-model"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def config(url: str, **extra: Any) -> dict[str, Any]:
    return {"models": [{"name": MODEL, "replicas": [{"url": url}]}], **extra}


async def test_rerank_score_tokenize_detokenize(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as sim, in_process_gateway(config(sim), tmp_path) as (url, gw, access):
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=20) as http:
            direct = httpx.AsyncClient(base_url=sim, timeout=20)
            rerank = {"model": MODEL, "query": "capital of France", "documents": ["Paris", "a cat", "Berlin"]}
            via = await http.post("/v1/rerank", json=rerank)
            straight = await direct.post("/v1/rerank", json=rerank)
            assert via.status_code == 200
            assert via.json()["results"] == straight.json()["results"]  # same answer as the replica's
            assert (await http.post("/rerank", json=rerank)).status_code == 200
            score = {"model": MODEL, "text_1": "a", "text_2": ["a", "b"]}
            scored = (await http.post("/v1/score", json=score)).json()
            assert [d["score"] for d in scored["data"]] == [
                d["score"] for d in (await direct.post("/v1/score", json=score)).json()["data"]
            ]
            tokens = (await http.post("/tokenize", json={"model": MODEL, "prompt": "hello there world"})).json()
            assert tokens["count"] == len(tokens["tokens"]) > 0
            text = (await http.post("/detokenize", json={"model": MODEL, "tokens": tokens["tokens"]})).json()
            assert "hello" in text["prompt"]
            await direct.aclose()
        gw.access_log.flush()
        lines = access_lines(access)
        assert [line["endpoint"] for line in lines] == ["rerank", "rerank", "score", "tokenize", "detokenize"]
        assert all(line["status"] == 200 for line in lines)
        assert lines[0]["prompt_tokens"] == via.json()["usage"]["total_tokens"]  # settled on the reported usage
        metrics = gw.metrics.requests
        assert metrics.labels("rerank", MODEL, "200", "interactive")._value.get() == 2
        assert metrics.labels("tokenize", MODEL, "200", "interactive")._value.get() == 1


async def test_unknown_model_and_bad_bodies_are_refused_in_openai_shape(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as sim, in_process_gateway(config(sim), tmp_path) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=20) as http:
            missing = await http.post("/v1/rerank", json={"model": "nope", "query": "q", "documents": ["d"]})
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
            no_model = await http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
            assert no_model.status_code == 400 and no_model.json()["error"]["param"] == "model"
            bad = await http.post("/detokenize", json={"model": MODEL, "tokens": "abc"})
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
            unknown = await http.post("/v1/fine_tuning/jobs", json={})
            assert unknown.status_code == 404
            message = unknown.json()["error"]["message"]
            assert "/v1/responses" in message and "/v1/messages" in message and "/v1/rerank" in message
            no_key = await http.post("/tokenize", json={"model": MODEL, "prompt": "x"}, headers={"Authorization": ""})
            assert no_key.status_code == 401


async def test_the_request_rate_limit_applies(tmp_path: Path) -> None:
    people = [{**t, "limits": {"requests_per_minute": 2}} for t in tenants()]
    async with sim_upstream(MODEL) as sim, in_process_gateway(config(sim, tenants=people), tmp_path) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=20) as http:
            codes = [(await http.post("/tokenize", json={"model": MODEL, "prompt": "x"})).status_code for _ in range(3)]
        assert codes == [200, 200, 429]


async def test_audio_is_routed_by_its_multipart_model_field(tmp_path: Path) -> None:
    """The form passes through untouched but for the model, rewritten to the served name."""
    seen: list[tuple[str, dict[str, Any]]] = []

    async def transcribe(request: web.Request) -> web.Response:
        form = await request.post()
        upload = form["file"]
        assert isinstance(upload, web.FileField)
        seen.append((request.content_type, {"model": form["model"], "audio": upload.file.read()}))
        if form.get("response_format") == "text":
            return web.Response(text="hello\n")  # plain text, not JSON: still an answer
        return web.json_response({"text": "hello", "usage": {"type": "duration", "seconds": 1}})

    async def health(_: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcribe)
    app.router.add_get("/health", health)
    audio = b"RIFF" + bytes(range(256)) * 64
    async with serve_app(app) as upstream:
        models = [{"name": MODEL, "replicas": [{"url": upstream, "upstream_model": "whisper-tiny"}]}]
        async with in_process_gateway({"models": models}, tmp_path) as (url, _, _):
            c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            result = await c.audio.transcriptions.create(model=MODEL, file=("a.wav", audio, "audio/wav"))
            assert result.text == "hello"
            text = await c.audio.transcriptions.create(
                model=MODEL, file=("a.wav", audio, "audio/wav"), response_format="text"
            )
            assert text.strip() == "hello"
            with pytest.raises(openai.BadRequestError):
                await c.audio.transcriptions.create(model="", file=("a.wav", audio, "audio/wav"))
    content_type, form = seen[0]
    assert content_type == "multipart/form-data"
    assert form == {"model": "whisper-tiny", "audio": audio}
