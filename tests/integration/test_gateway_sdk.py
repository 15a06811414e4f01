"""The real `fleetgate serve` with managed simulated replicas, driven by the openai SDK."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.integration.harness import API_KEY, GatewayProcess, gateway_process

MODEL = "sim-model"
CONFIG = {
    "models": [
        {
            "name": MODEL,
            "tier": "small",
            "replicas": [{"engine": "sim", "count": 2, "sim": {"ttft_ms": 5, "tokens_per_s": 1000}}],
        }
    ],
    "server": {"max_body_bytes": 100_000},
    "health": {"interval_s": 0.2},
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with gateway_process(CONFIG, tmp_path_factory.mktemp("gw")) as gw:
        yield gw


@pytest.fixture
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=API_KEY, max_retries=0, timeout=20)


def test_chat_completion(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello"}], max_tokens=8
    )
    reply = raw.parse()
    assert reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 8
    assert raw.headers["x-fleetgate-cache"] == "miss"
    assert raw.headers["x-fleetgate-tier"] == "small"
    assert raw.headers["x-fleetgate-replica"].startswith(f"{MODEL}-")
    assert len(raw.headers["x-request-id"]) >= 16


def test_auto_model_is_routed(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "x"}], max_tokens=2)
    assert reply.model == MODEL


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "count"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text.split()) == 12
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_stream_without_usage_gets_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "count"}], max_tokens=5, stream=True
        )
    )
    assert all(c.choices for c in chunks)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completions_plain_and_streamed(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6)
    assert reply.choices[0].text and reply.usage is not None and reply.usage.completion_tokens == 6
    chunks = list(client.completions.create(model=MODEL, prompt="Once", max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in chunks).count(" ") == 3


def test_embeddings_forwarded(client: openai.OpenAI) -> None:
    reply = client.embeddings.create(model=MODEL, input=["a", "b"])
    assert len(reply.data) == 2 and len(reply.data[0].embedding) > 0


def test_models_list(client: openai.OpenAI) -> None:
    assert {m.id for m in client.models.list()} == {"auto", MODEL}


def test_wrong_key(gateway: GatewayProcess) -> None:
    bad = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"
    assert info.value.param == "model"


def test_invalid_parameters(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1)
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.param == "messages"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=None)  # type: ignore[arg-type]


def test_body_too_large(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 200_000}])
    assert info.value.status_code == 413
    assert info.value.code == "request_too_large"


@pytest.mark.parametrize("body", [b"{", b"", b"null", b'{"model": 1}'])
def test_malformed_bodies_are_openai_errors(gateway: GatewayProcess, body: bytes) -> None:
    r = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_request_id_is_honoured_and_logged(gateway: GatewayProcess) -> None:
    r = httpx.post(
        f"{gateway.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "secret prompt text"}], "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}", "x-request-id": "req-abc-123"},
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "req-abc-123"
    logs = gateway.stdout()
    line = next(line for line in logs.splitlines() if "req-abc-123" in line)
    assert '"tenant":"t1"' in line and '"completion_tokens":2' in line
    # never the key, never the prompt
    assert API_KEY not in logs
    assert "secret prompt text" not in logs


def test_health_and_metrics(gateway: GatewayProcess) -> None:
    assert httpx.get(f"{gateway.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{gateway.url}/readyz").json()
    assert ready["healthy_replicas"] == 2
    text = httpx.get(f"{gateway.url}/metrics").text
    for name in (
        "fleetgate_requests_total",
        "fleetgate_request_duration_seconds_bucket",
        "fleetgate_time_to_first_token_seconds_bucket",
        "fleetgate_inter_token_latency_seconds_bucket",
        "fleetgate_tokens_total",
        "fleetgate_requests_in_flight",
        "fleetgate_overhead_seconds_bucket",
        f'fleetgate_replica_healthy{{model="{MODEL}",replica="{MODEL}-0"}} 1.0',
        "fleetgate_replica_outstanding_tokens",
    ):
        assert name in text, name


def test_unknown_path_and_method(gateway: GatewayProcess) -> None:
    r = httpx.get(f"{gateway.url}/v2/whatever")
    assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_url"
    r = httpx.get(f"{gateway.url}/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
