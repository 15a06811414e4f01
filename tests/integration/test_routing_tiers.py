"""Tier routing through a real in-process gateway: auto -> tier, forced tiers, policies, degradation.

Upstreams are the simulator (one per tier) and ``CountingUpstream`` where a slow replica
is needed to fill a pool.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.settings import ConfigError
from routing.static_head import default_static_head, encode_table
from tests.integration.harness import (
    API_KEY,
    OTHER_KEY,
    CountingUpstream,
    access_lines,
    in_process_gateway,
    serve_app,
    sim_upstream,
    tenants,
)
from tests.integration.test_routing_queue import until

EASY = [{"role": "user", "content": "hi"}]
HARD = [
    {
        "role": "user",
        "content": "Compute the integral of x^2 * sin(x) dx from 0 to pi, step by step, and verify the result.",
    }
]


def tiered(small_url: str, large_url: str, **extra: Any) -> dict[str, Any]:
    return {
        "models": [
            {"name": "small-m", "tier": "small", "replicas": [{"url": small_url}]},
            {"name": "large-m", "tier": "large", "replicas": [{"url": large_url}]},
        ],
        **extra,
    }


async def chat(url: str, messages: list[dict[str, str]], key: str = API_KEY, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=20) as client:
        return await client.post(
            f"{url}/v1/chat/completions",
            json={"model": "auto", "messages": messages, "max_tokens": 3},
            headers={"Authorization": f"Bearer {key}", **headers},
        )


async def test_auto_goes_to_the_tier_of_its_score(tmp_path: Path) -> None:
    async with sim_upstream("small-m") as small, sim_upstream("large-m") as large:
        async with in_process_gateway(tiered(small, large), tmp_path) as (url, _, access):
            easy = await chat(url, EASY)
            assert easy.status_code == 200 and easy.json()["model"] == "small-m"
            assert easy.headers["x-fleetgate-tier"] == "small"
            assert easy.headers["x-fleetgate-route"].endswith("tier=small; classified")
            hard = await chat(url, HARD)
            assert hard.json()["model"] == "large-m"
            assert hard.headers["x-fleetgate-tier"] == "large"
            route = hard.headers["x-fleetgate-route"]
            # The reasons are the word pieces (and the words' frequency) that moved the score most
            # (``+`` towards large).
            assert route.startswith("score=") and "; static; " in route and "+t:" in route
            line = access_lines(access)[-1]
            assert line["tier"] == "large" and line["tier_reason"] == "classified"
            assert line["classifier"] == route.removesuffix("; tier=large; classified")
            assert line["route"] == "no_prefix"  # a short prompt: least loaded


async def test_medium_without_a_model_uses_the_nearest_tier(tmp_path: Path) -> None:
    # A coding ask, briefly put, in a wide medium band; medium has no model, small and large
    # are as near (tie -> larger). The band is the test's own: the default medium is thin.
    text = "Using numpy only, implement k-means, vectorised, and return the labels and the centroids."
    medium = [{"role": "user", "content": text}]
    tiers = [
        {"name": "small", "min_score": 0.0, "max_score": 0.2},
        {"name": "medium", "min_score": 0.2, "max_score": 0.8},
        {"name": "large", "min_score": 0.8, "max_score": 1.0},
    ]
    async with sim_upstream("small-m") as small, sim_upstream("large-m") as large:
        async with in_process_gateway(tiered(small, large, routing={"tiers": tiers}), tmp_path) as (url, _, _):
            reply = await chat(url, medium)
            assert "tier=medium" in reply.headers["x-fleetgate-route"]
            assert reply.json()["model"] == "large-m"


async def test_a_static_head_of_ones_own_is_read_from_its_path(tmp_path: Path) -> None:
    """``routing.classifier.static_head_path``: a head retrained on one's own prompts
    (``scripts/train_static_head.py --out``) classifies in place of the shipped one; a file
    that is not a head stops the gateway at start, naming the setting."""
    shipped = default_static_head()
    # The shipped vocabulary and table, with weights that send every text up: "hi" goes large.
    mine = tmp_path / "static.json"
    mine.write_text(
        json.dumps(
            {
                "format": 1,
                "tokens": shipped.tokens,
                "table": encode_table(shipped.table),
                "weights": [0.0] * shipped.weights.size,
                "bias": 5.0,
                "length_weight": 0.0,
                "chars_per_piece_weight": 0.0,
                "scale": 1.0,
                "shift": 0.0,
            }
        )
    )
    async with sim_upstream("small-m") as small, sim_upstream("large-m") as large:
        routing = {"classifier": {"static_head_path": str(mine)}}
        async with in_process_gateway(tiered(small, large, routing=routing), tmp_path) as (url, _, _):
            reply = await chat(url, EASY)
            assert reply.json()["model"] == "large-m"
            assert reply.headers["x-fleetgate-route"].startswith("score=0.99; static; ")
        broken = tmp_path / "broken.json"
        broken.write_text('{"format": 1, "tokens": []}')
        routing = {"classifier": {"static_head_path": str(broken)}}
        with pytest.raises(ConfigError, match=r"routing\.classifier\.static_head_path: .*malformed"):
            async with in_process_gateway(tiered(small, large, routing=routing), tmp_path / "broken"):
                pass


async def test_forced_tier_only_where_the_tenant_allows_it(tmp_path: Path) -> None:
    ts = tenants()
    ts[0]["allow_force_tier"] = ["large"]
    async with sim_upstream("small-m") as small, sim_upstream("large-m") as large:
        async with in_process_gateway(tiered(small, large, tenants=ts), tmp_path) as (url, _, access):
            allowed = await chat(url, EASY, **{"x-fleetgate-tier": "large"})
            assert allowed.json()["model"] == "large-m"
            assert allowed.headers["x-fleetgate-route"].endswith("tier=large; forced")
            denied = await chat(url, EASY, OTHER_KEY, **{"x-fleetgate-tier": "large"})
            assert denied.status_code == 200 and denied.json()["model"] == "small-m"
            assert denied.headers["x-fleetgate-route"].endswith("tier=small; force_denied")
            assert access_lines(access)[-1]["tier_reason"] == "force_denied"


async def test_tenant_classify_models_are_routed_like_auto(tmp_path: Path) -> None:
    ts = tenants()
    ts[0]["classify_models"] = ["large-m"]
    async with sim_upstream("small-m") as small, sim_upstream("large-m") as large:
        async with in_process_gateway(tiered(small, large, tenants=ts), tmp_path) as (url, _, _):
            async with httpx.AsyncClient(timeout=20) as client:
                body = {"model": "large-m", "messages": EASY, "max_tokens": 3}
                mine = await client.post(
                    f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
                )
                other = await client.post(
                    f"{url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {OTHER_KEY}"}
                )
            assert mine.json()["model"] == "small-m" and "x-fleetgate-route" in mine.headers
            assert other.json()["model"] == "large-m" and "x-fleetgate-route" not in other.headers


async def test_policy_selected_in_config(tmp_path: Path) -> None:
    async with sim_upstream("m") as a, sim_upstream("m") as b:
        cfg = {"models": [{"name": "m", "replicas": [{"url": a}, {"url": b}]}], "routing": {"policy": "round_robin"}}
        async with in_process_gateway(cfg, tmp_path) as (url, gw, access):
            async with httpx.AsyncClient(timeout=20) as client:
                seen = []
                for _ in range(4):
                    r = await client.post(
                        f"{url}/v1/chat/completions",
                        json={"model": "m", "messages": EASY, "max_tokens": 2},
                        headers={"Authorization": f"Bearer {API_KEY}"},
                    )
                    seen.append(r.headers["x-fleetgate-replica"])
                metrics = (await client.get(f"{url}/metrics")).text
            assert seen == ["m-0", "m-1", "m-0", "m-1"]
            assert access_lines(access)[-1]["route"] == "round_robin"
            series = 'fleetgate_routing_decisions_total{model="m",policy="round_robin",reason="round_robin"}'
            assert f"{series} 4.0" in metrics
            assert gw.router.policy == "round_robin"


async def test_saturated_tier_overflows_to_a_smaller_one(tmp_path: Path) -> None:
    ts = tenants()
    ts[0]["degrade"] = {"overflow": True}
    slow_large = CountingUpstream("large-m", delay=2.0)  # long enough to stay busy on a loaded machine
    async with sim_upstream("small-m") as small, serve_app(slow_large.app()) as large:
        cfg = tiered(small, large, tenants=ts)
        cfg["models"][1]["capacity"] = {"max_requests": 1}
        async with in_process_gateway(cfg, tmp_path) as (url, _, access):
            first = asyncio.create_task(chat(url, HARD))
            await until(lambda: slow_large.in_flight == 1)
            second = await chat(url, HARD)  # large is full: overflow to small
            assert second.json()["model"] == "small-m"
            assert second.headers["x-fleetgate-tier"] == "small"
            line = access_lines(access)[-1]
            assert line["degraded"] == "overflow"
            assert (await first).json()["model"] == "large-m"
