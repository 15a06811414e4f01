"""The admin API: fleet view, drain and undrain, key checks."""

from __future__ import annotations

from pathlib import Path

import aiohttp

from gateway.settings import hash_key
from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream

ADMIN_KEY = "sk-admin-test"
MODEL = "m"


async def test_fleet_view_drain_undrain(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as a, sim_upstream(MODEL) as b:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": a}, {"url": b}]}],
            "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        }
        async with in_process_gateway(config, tmp_path) as (url, _, _), aiohttp.ClientSession() as http:
            admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
            async with http.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status == 401  # a tenant key is not an admin key
            async with http.get(f"{url}/admin/fleet") as r:
                assert r.status == 401
            async with http.get(f"{url}/admin/fleet", headers=admin) as r:
                fleet = await r.json()
            assert [x["id"] for x in fleet["replicas"]] == ["m-0", "m-1"]
            assert {x["state"] for x in fleet["replicas"]} == {"healthy"}
            assert "vllm:num_requests_running" in fleet["replicas"][0]["gauges"]

            async with http.post(f"{url}/admin/replicas/m-0/drain", headers=admin) as r:
                assert (await r.json())["state"] == "draining"
            body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            used = set()
            for _ in range(10):
                async with http.post(
                    f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
                ) as r:
                    assert r.status == 200
                    used.add(r.headers["x-fleetgate-replica"])
            assert used == {"m-1"}

            async with http.post(f"{url}/admin/replicas/m-0/undrain", headers=admin) as r:
                assert (await r.json())["state"] == "healthy"
            async with http.post(f"{url}/admin/replicas/nope/drain", headers=admin) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "replica_not_found"
            # Only a replica the gateway runs can be restarted by it.
            async with http.post(f"{url}/admin/replicas/m-0/restart", headers=admin) as r:
                assert r.status == 409
                assert (await r.json())["error"]["code"] == "replica_not_managed"


async def test_admin_api_disabled_without_keys(tmp_path: Path) -> None:
    async with sim_upstream(MODEL) as a:
        config = {"models": [{"name": MODEL, "replicas": [{"url": a}]}]}
        async with in_process_gateway(config, tmp_path) as (url, _, _), aiohttp.ClientSession() as http:
            async with http.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {API_KEY}"}) as r:
                assert r.status == 403
                assert "admin_api_keys" in (await r.json())["error"]["message"]
