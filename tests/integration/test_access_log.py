"""Every request the gateway answers leaves exactly one access-log line, with its method and
path: the APIs of the request path, the endpoints beside it (models, stored responses,
probes, metrics, admin), and every refusal (no key, an unknown path, a wrong method, a bad
``Expect``), before authentication included. The replica is the simulator, in process."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from dialects.registry import DIALECTS
from gateway.settings import hash_key
from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream

MODEL = "m"
ADMIN_KEY = "sk-admin-access"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


async def test_every_route_and_refusal_writes_exactly_one_line(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as upstream:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": upstream}]}],
            "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        }
        async with in_process_gateway(config, tmp_path) as (url, gateway, access), aiohttp.ClientSession() as http:
            sent: list[tuple[str, str, int]] = []

            async def call(method: str, path: str, expect: int, **kwargs: Any) -> dict[str, Any]:
                async with http.request(method, url + path, **kwargs) as r:
                    assert r.status == expect, (method, path, r.status, await r.text())
                    sent.append((method, path, r.status))
                    body = await r.read()
                    return {"body": body, "headers": r.headers}

            created = await call(
                "POST", "/v1/responses", 200, json={"model": MODEL, "input": "hi", "max_output_tokens": 2}, headers=AUTH
            )
            response_id = orjson.loads(created["body"])["id"]
            await call("POST", "/v1/chat/completions", 200, json=CHAT, headers=AUTH)
            await call("POST", "/v1/chat/completions", 401, json=CHAT)  # before authentication
            await call("POST", "/v1/chat/completions", 400, data=b"{", headers=AUTH)
            await call("GET", "/v1/chat/completions", 405, headers=AUTH)  # a served path, another method
            await call("HEAD", "/", 404)  # Claude Code's probe: an unknown path
            await call("GET", "/nowhere", 404, headers=AUTH)
            await call("GET", "/v1/models", 200, headers=AUTH)
            await call("GET", "/v1/models", 401)
            await call("GET", f"/v1/models/{MODEL}", 200, headers=AUTH)
            await call("GET", "/v1/models/nope", 404, headers=AUTH)
            await call("GET", f"/v1/responses/{response_id}", 200, headers=AUTH)
            await call("GET", f"/v1/responses/{response_id}/input_items", 200, headers=AUTH)
            await call("POST", f"/v1/responses/{response_id}/cancel", 400, headers=AUTH)  # finished
            await call("GET", "/v1/responses/resp_missing", 404, headers=AUTH)
            await call("DELETE", f"/v1/responses/{response_id}", 200, headers=AUTH)
            await call("GET", "/healthz", 200)
            await call("GET", "/readyz", 200)
            await call("GET", "/metrics", 200)
            await call("GET", "/admin/fleet", 200, headers=ADMIN)
            await call("GET", "/admin/fleet", 401)
            await call("POST", "/v1/chat/completions", 417, json=CHAT, headers={**AUTH, "Expect": "something-else"})

            await asyncio.sleep(0)
            gateway.access_log.flush()
            # Every line, the probes' included (the harness's own readiness polling is done by now).
            lines = [orjson.loads(line) for line in access.getvalue().splitlines()]
            assert len(lines) == len(sent), (len(lines), len(sent))
            assert [(line["method"], line["path"], line["status"]) for line in lines] == sent
            for line in lines:
                assert line["request_id"], line
                assert isinstance(line["duration_ms"], float | int), line
            tenants = [line["tenant"] for line in lines]
            # Known once the key is: the first two, the models and stored responses with a key.
            assert tenants[0] == tenants[1] == "t1"
            assert tenants[2] is None and tenants[5] is None  # no key; HEAD / before any key


async def test_the_404_lists_every_served_path(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as upstream:
        config = {"models": [{"name": MODEL, "replicas": [{"url": upstream}]}]}
        async with in_process_gateway(config, tmp_path) as (url, _, _), aiohttp.ClientSession() as http:
            async with http.get(f"{url}/v2/nothing") as r:
                assert r.status == 404
                message = (await r.json())["error"]["message"]
    for path in (
        "/v1/responses/{response_id}/input_items",
        "/v1/responses/{response_id}/cancel",
        "/v1/responses/{response_id}",
        "/v1/models/{model}",
        "/healthz",
        "/readyz",
        "/metrics",
        "/admin/fleet",
        *(d.path for d in DIALECTS),
    ):
        assert path in message, path
