"""Limits through the gateway: 429s with OpenAI's headers, quotas, per-key limits,
settlement to real usage, and the Redis failure policies."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.settings import hash_key
from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream
from tests.integration.redis_server import RedisServer

MODEL = "m"
MESSAGES = [{"role": "user", "content": "hi"}]
BATCH_KEY = "sk-test-batch"


def config(url: str, limits: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "replicas": [{"url": url}]}],
        "tenants": [
            {
                "id": "t1",
                "api_keys": ["sha256:" + hash_key(API_KEY), {"id": "batch", "key": "sha256:" + hash_key(BATCH_KEY)}],
                "limits": limits,
            }
        ],
        **extra,
    }


async def post(url: str, key: str = API_KEY, **body: Any) -> httpx.Response:
    async with httpx.AsyncClient() as http:
        return await http.post(
            f"{url}/v1/chat/completions",
            json={"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **body},
            headers={"Authorization": f"Bearer {key}"},
        )


async def test_request_rate_429_with_openai_headers(tmp_path: Path) -> None:
    async with (
        sim_upstream(MODEL) as up,
        in_process_gateway(config(up, {"requests_per_minute": 3}), tmp_path) as (
            url,
            _,
            _,
        ),
    ):
        ok = [await post(url) for _ in range(3)]
        assert [r.status_code for r in ok] == [200, 200, 200]
        assert ok[0].headers["x-ratelimit-limit-requests"] == "3"
        assert ok[0].headers["x-ratelimit-remaining-requests"] == "2"
        assert ok[2].headers["x-ratelimit-remaining-requests"] == "0"
        rejected = await post(url)
        assert rejected.status_code == 429
        # one request per 20 s comes back: Retry-After is whole seconds, rounded up
        assert 19 <= int(rejected.headers["retry-after"]) <= 20
        error = rejected.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert error["type"] == "requests"
        assert "requests per minute" in error["message"]

        # the SDK raises its RateLimitError for it
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        with pytest.raises(openai.RateLimitError):
            await c.chat.completions.create(model=MODEL, messages=MESSAGES)  # type: ignore[arg-type]


async def test_daily_quota_is_insufficient_quota_and_settles_on_usage(tmp_path: Path) -> None:
    async with (
        sim_upstream(MODEL) as up,
        in_process_gateway(config(up, {"tokens_per_day": 60}), tmp_path) as (
            url,
            _,
            _,
        ),
    ):
        first = await post(url, max_tokens=4)
        assert first.status_code == 200
        used = first.json()["usage"]["total_tokens"]
        # reservations are settled to the real usage, so the quota lasts 60 // used requests
        statuses = []
        for _ in range(60 // used + 2):
            r = await post(url, max_tokens=4)
            statuses.append(r.status_code)
            await asyncio.sleep(0.01)  # settlement runs after each response
        assert statuses.count(200) == 60 // used - 1
        rejected = await post(url, max_tokens=4)
        assert rejected.status_code == 429
        assert rejected.json()["error"]["code"] == "insufficient_quota"
        assert rejected.json()["error"]["type"] == "insufficient_quota"


async def test_concurrency_cap_and_release(tmp_path: Path) -> None:
    async with sim_upstream(MODEL, ttft_ms=300) as up:
        async with in_process_gateway(config(up, {"max_concurrent": 2}), tmp_path) as (url, _, _):
            results = await asyncio.gather(*(post(url) for _ in range(4)))
            assert sorted(r.status_code for r in results) == [200, 200, 429, 429]
            rejected = next(r for r in results if r.status_code == 429)
            assert "concurrent" in rejected.json()["error"]["message"]
            # slots come back when requests end
            assert (await post(url)).status_code == 200


async def test_per_key_limit_applies_to_that_key_only(tmp_path: Path) -> None:
    limits = {"requests_per_minute": 100, "per_key": {"batch": {"requests_per_minute": 1}}}
    async with sim_upstream(MODEL) as up, in_process_gateway(config(up, limits), tmp_path) as (url, _, _):
        assert (await post(url, key=BATCH_KEY)).status_code == 200
        assert (await post(url, key=BATCH_KEY)).status_code == 429
        assert (await post(url, key=API_KEY)).status_code == 200


async def test_rejection_never_reveals_another_tenant(tmp_path: Path) -> None:
    async with (
        sim_upstream(MODEL) as up,
        in_process_gateway(config(up, {"requests_per_minute": 1}), tmp_path) as (
            url,
            _,
            _,
        ),
    ):
        await post(url)
        body = (await post(url)).text
        assert "t2" not in body and "t1" not in body


@pytest.mark.redis
@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
async def test_redis_down_policies(tmp_path: Path, redis_server: RedisServer, policy: str) -> None:
    limits = {"requests_per_minute": 1000, "on_store_failure": policy}
    async with sim_upstream(MODEL) as up:
        cfg = config(up, limits, redis_url=redis_server.url)
        async with in_process_gateway(cfg, tmp_path) as (url, gw, _):
            assert (await post(url)).status_code == 200
            redis_server.kill()
            started = time.monotonic()
            statuses = [(await post(url)).status_code for _ in range(5)]
            assert time.monotonic() - started < 5.0  # nothing hangs
            if policy == "fail_open":
                assert statuses == [200] * 5
            else:
                assert statuses == [503] * 5
            redis_server.start()
            for _ in range(100):  # the breaker half-opens and recovers on its own
                if (await post(url)).status_code == 200 and not gw.limiter.degraded:
                    break
                await asyncio.sleep(0.1)
            assert not gw.limiter.degraded
            assert (await post(url)).status_code == 200
