"""Session keys and hot prefixes through a real in-process gateway on four simulated replicas.

One system prompt carries all the traffic, so it is hot: once the gateway has placed enough
requests it is spread over every replica, and the request's session (a header, the body's
``user``, or the conversation's opening turn) chooses among them.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from routing.config import AffinitySettings
from tests.integration.harness import API_KEY, in_process_gateway, sim_upstream

SYSTEM = "You are the travel desk's assistant: plan trips, compare fares and explain visas. " * 20


def config(urls: list[str], **affinity: Any) -> dict[str, Any]:
    return {
        "models": [{"name": "m", "tier": "small", "replicas": [{"url": u} for u in urls]}],
        "routing": {"affinity": affinity},
    }


async def ask(
    client: httpx.AsyncClient, url: str, question: str, headers: dict[str, str] | None = None, **body: Any
) -> str:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    reply = await client.post(
        f"{url}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 2, **body},
        headers={"Authorization": f"Bearer {API_KEY}", **(headers or {})},
    )
    assert reply.status_code == 200, reply.text
    return reply.headers["x-fleetgate-replica"]


@contextlib.asynccontextmanager
async def four_replicas() -> Any:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(sim_upstream("m")) for _ in range(4)]


async def test_a_session_header_keeps_every_turn_on_one_replica_and_sessions_spread(tmp_path: Path) -> None:
    async with four_replicas() as urls, in_process_gateway(config(urls), tmp_path) as (url, _, _):
        async with httpx.AsyncClient(timeout=20) as client:
            warm = {await ask(client, url, f"warm-up {i}") for i in range(40)}
            assert len(warm) > 1, "the hot prompt was never spread"
            where: dict[str, set[str]] = {}
            for turn in range(4):
                for s in range(16):
                    session = f"session-{s}"
                    # Each turn asks something else: only the session header ties them.
                    replica = await ask(client, url, f"turn {turn} of {s}", {"x-session-id": session})
                    where.setdefault(session, set()).add(replica)
    assert all(len(w) == 1 for w in where.values()), where
    assert len({next(iter(w)) for w in where.values()}) >= 3


async def test_the_user_field_is_a_session_key_only_when_configured(tmp_path: Path) -> None:
    async with four_replicas() as urls:
        for keys, sticky in ((["user"], True), (["header:x-session-id"], False)):
            async with in_process_gateway(config(urls, session_keys=keys), tmp_path) as (url, _, _):
                async with httpx.AsyncClient(timeout=20) as client:
                    for i in range(40):
                        await ask(client, url, f"warm-up {i}")
                    seen = {await ask(client, url, f"question {i}", user="alice") for i in range(12)}
            assert (len(seen) == 1) is sticky, (keys, seen)


def test_a_bad_session_key_setting_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match="unknown session key"):
        AffinitySettings(session_keys=["cookie"])
    assert AffinitySettings(session_keys=["header:X-Conversation"]).session_keys == ["header:x-conversation"]


async def test_a_responses_conversation_carries_its_first_responses_id_as_its_session(tmp_path: Path) -> None:
    """Each stored turn keeps the chain's id; the router is handed it as the session key."""
    async with four_replicas() as urls, in_process_gateway(config(urls), tmp_path) as (url, gw, _):
        sessions: list[str | None] = []
        route = gw.router.route

        def spy(*args: Any, **kwargs: Any) -> Any:
            sessions.append(inspect.signature(route).bind(*args, **kwargs).arguments.get("session"))
            return route(*args, **kwargs)

        gw.router.route = spy  # type: ignore[method-assign,assignment]
        ids: list[str] = []
        async with httpx.AsyncClient(timeout=20) as client:
            for turn in range(3):
                body: dict[str, Any] = {"model": "m", "input": f"turn {turn}", "max_output_tokens": 4}
                if ids:
                    body["previous_response_id"] = ids[-1]
                reply = await client.post(
                    f"{url}/v1/responses", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
                )
                assert reply.status_code == 200, reply.text
                ids.append(reply.json()["id"])
        tenant = next(iter(gw.settings.tenants)).id
        for response_id in ids:
            record = await gw.responses.store.get(tenant, response_id)
            assert record is not None and orjson.loads(record)["chain"] == ids[0]
    assert sessions == [None, ids[0], ids[0]]
