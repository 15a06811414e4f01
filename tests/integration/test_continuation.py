"""A stream whose replica fails, or drains, after its first byte is finished on another
replica of the same model: the client sees one stream (one id, one end, no error event),
the access line says where it was continued and why, and usage counts the output once.

The failing replica is scripted (``FaultyUpstream`` "drop": two token events, then the
connection cut); the replica that takes over is the simulator, in process. Real vLLM
replicas, killed and stopped, are the end-to-end tests' and ``bench/continuation_failover.py``'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp

from gateway.settings import hash_key
from tests.integration.harness import (
    API_KEY,
    FaultyUpstream,
    access_lines,
    in_process_gateway,
    serve_app,
    sim_upstream,
    sse_events,
)

MODEL = "m"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
ADMIN_KEY = "sk-admin-continue"


def chat(max_tokens: int = 24, content: str = "tell me", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "temperature": 0,
        **extra,
    }


async def stream(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[str, list[Any]]:
    async with http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
        assert r.status == 200
        assert "x-fleetgate-replica" in r.headers, dict(r.headers)
        return r.headers["x-fleetgate-replica"], sse_events(await r.read())


def one_stream(got: list[Any]) -> str:
    """The text of a well-formed chat stream; fails on an error event, a missing or second
    end, several ids."""
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1, got
    chunks = [c for c in got if c != "[DONE]"]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1, {c["id"] for c in chunks}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert len(finishes) == 1, finishes
    return "".join(ch["delta"].get("content") or "" for c in chunks for ch in c["choices"])


async def test_a_stream_cut_mid_way_is_finished_on_another_replica(tmp_path: Path) -> None:
    faulty = FaultyUpstream(MODEL, "drop")
    async with serve_app(faulty.app()) as a, sim_upstream(MODEL) as b:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": a}, {"url": b}]}],
            "routing": {"policy": "round_robin"},
        }
        async with in_process_gateway(config, tmp_path) as (url, gateway, access), aiohttp.ClientSession() as http:
            asked = [chat(content=f"tell me {i}", stream_options={"include_usage": True}) for i in range(4)]
            results = [await stream(http, url, body) for body in asked]
            # The exact cache kept a continued stream's whole stitched answer.
            index = next(i for i, (replica, _) in enumerate(results) if replica == "m-0")
            async with http.post(f"{url}/v1/chat/completions", json=asked[index], headers=AUTH) as r:
                assert r.headers["x-fleetgate-cache"] == "exact"
                again = sse_events(await r.read())
                replayed = one_stream(again)
            assert replayed == one_stream(results[index][1])
            gateway.access_log.flush()
            lines = access_lines(access)[: len(results)]
            metrics = gateway.metrics
    continued = 0
    for (replica, got), line in zip(results, lines, strict=True):
        text = one_stream(got)
        usage = got[-2]["usage"]
        assert usage["completion_tokens"] > 2 and line["status"] == 200 and "error" not in line
        if replica == "m-0":  # the faulty one: its two tokens, then the simulator's
            continued += 1
            assert text.startswith("one two"), text
            assert line["continued"] == [{"replica": "m-1", "reason": "upstream_closed"}]
            assert line["replica"] == "m-1"
            assert got[0]["id"] == "x"  # the first replica's id, kept by the continuation
        else:
            assert "continued" not in line
    assert continued >= 1
    sample = metrics.registry.get_sample_value
    assert sample("fleetgate_stream_continuations_total", {"model": MODEL, "reason": "upstream_closed"}) == continued
    assert sample("fleetgate_stream_cuts_total", {"model": MODEL, "reason": "upstream_closed"}) is None
    # The output is counted once: what the clients were told they received.
    told = sum(got[-2]["usage"]["completion_tokens"] for _, got in results) + again[-2]["usage"]["completion_tokens"]
    assert sample("fleetgate_tokens_total", {"tenant": "t1", "model": MODEL, "direction": "completion"}) == told


async def test_without_continuations_the_stream_is_cut_as_before(tmp_path: Path) -> None:
    faulty = FaultyUpstream(MODEL, "drop")
    async with serve_app(faulty.app()) as a, sim_upstream(MODEL) as b:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": a}, {"url": b}]}],
            "routing": {"policy": "round_robin"},
            "upstream": {"max_continuations": 0},
        }
        async with in_process_gateway(config, tmp_path) as (url, gateway, access), aiohttp.ClientSession() as http:
            results = [await stream(http, url, chat(content=f"cut {i}")) for i in range(2)]
            gateway.access_log.flush()
            lines = access_lines(access)
    (cut,) = [(got, line) for (replica, got), line in zip(results, lines, strict=True) if replica == "m-0"]
    got, line = cut
    assert any("error" in c for c in got if c != "[DONE]")
    assert line["cut"] == "upstream_closed" and "continued" not in line


async def test_a_drained_replicas_streams_move_to_another(tmp_path: Path) -> None:
    """A stream far from its end when its replica is drained finishes elsewhere, soon after
    ``upstream.migrate_after_s``, instead of holding the drain for its whole length; drained
    in turn there (a rolling restart), it moves back."""
    async with sim_upstream(MODEL, tokens_per_s=40) as a, sim_upstream(MODEL, tokens_per_s=40) as b:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": a}, {"url": b}]}],
            "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
            "upstream": {"migrate_after_s": 0.2},
        }
        async with in_process_gateway(config, tmp_path) as (url, gateway, access), aiohttp.ClientSession() as http:
            body = chat(max_tokens=400, ignore_eos=True)  # 10 s at 40 tokens/s
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
                first = r.headers["x-fleetgate-replica"]
                head = await r.content.readuntil(b"\n\n")
                assert head.startswith(b"data: ")
                started = asyncio.get_running_loop().time()
                admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
                other = "m-1" if first == "m-0" else "m-0"
                async with http.post(f"{url}/admin/replicas/{first}/drain", headers=admin) as d:
                    assert d.status == 200
                # A rolling restart's next step: the first back, the other drained; the
                # stream moves back to the replica it left.
                await asyncio.sleep(1.0)
                async with http.post(f"{url}/admin/replicas/{first}/undrain", headers=admin) as d:
                    assert d.status == 200
                async with http.post(f"{url}/admin/replicas/{other}/drain", headers=admin) as d:
                    assert d.status == 200
                got = sse_events(head + await r.read())
                took = asyncio.get_running_loop().time() - started
            gateway.access_log.flush()
            (line,) = [x for x in access_lines(access) if x["path"] == "/v1/chat/completions"]
    text = one_stream(got)
    assert text
    assert line["continued"] == [{"replica": other, "reason": "drain"}, {"replica": first, "reason": "drain"}], line
    assert took < 20, took


async def test_every_stream_of_a_failed_replica_is_continued_beyond_the_retry_budget(tmp_path: Path) -> None:
    """A replica that fails holding many streams has every one continued: continuations
    spend no retry budget (its burst, 10 retries here, would otherwise cut the rest)."""
    faulty = FaultyUpstream(MODEL, "drop")
    n = 60
    async with serve_app(faulty.app()) as a, sim_upstream(MODEL) as b:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": a}, {"url": b}]}],
            "routing": {"policy": "round_robin", "retry_budget": {"ratio": 0.1, "min_per_s": 0, "burst": 10}},
        }
        async with in_process_gateway(config, tmp_path) as (url, gateway, access), aiohttp.ClientSession() as http:
            results = await asyncio.gather(*(stream(http, url, chat(content=f"many {i}")) for i in range(n)))
            gateway.access_log.flush()
            lines = [x for x in access_lines(access) if x["path"] == "/v1/chat/completions"]
    for _, got in results:
        one_stream(got)
    continued = [line for line in lines if "continued" in line]
    assert len(continued) >= 20, len(continued)  # round robin: about half began on the faulty one
    assert not any("cut" in line for line in lines), [line for line in lines if "cut" in line]


async def test_a_rolling_restart_of_managed_replicas_cuts_no_stream(tmp_path: Path) -> None:
    """``POST /admin/replicas/{id}/restart``, one replica after the other, under streams far
    longer than the roll: each replica's streams move to the other, each restart takes
    seconds whatever the streams' length, and every stream ends whole. The replicas are
    simulator processes the gateway launches, as it launches vLLM."""
    config = {
        "models": [
            {
                "name": MODEL,
                "replicas": [{"engine": "sim", "count": 2, "sim": {"ttft_ms": 1, "tokens_per_s": 40}}],
            }
        ],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
        "upstream": {"migrate_after_s": 0.2},
    }
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    n = 8
    async with in_process_gateway(config, tmp_path) as (url, gateway, access), aiohttp.ClientSession() as http:

        async def fleet() -> dict[str, Any]:
            async with http.get(f"{url}/admin/fleet", headers=admin) as r:
                return {x["id"]: x for x in (await r.json())["replicas"]}

        async def restart(rid: str) -> float:
            pid = (await fleet())[rid]["pid"]
            started = asyncio.get_running_loop().time()
            async with http.post(f"{url}/admin/replicas/{rid}/restart", headers=admin) as r:
                assert r.status == 202, await r.text()
            async with http.post(f"{url}/admin/replicas/{rid}/restart", headers=admin) as r:
                assert r.status == 409 and (await r.json())["error"]["code"] == "replica_restarting"
            async with asyncio.timeout(30):  # polled, as an operator's script would
                while (state := (await fleet())[rid])["state"] != "healthy" or state["pid"] == pid:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
            assert state["restarts"] == 1
            return asyncio.get_running_loop().time() - started

        # 800 tokens at 40 tokens/s: 20 s a stream.
        usage = {"include_usage": True}
        bodies = [chat(max_tokens=800, content=f"long {i}", ignore_eos=True, stream_options=usage) for i in range(n)]
        streams = [asyncio.create_task(stream(http, url, body)) for body in bodies]
        async with asyncio.timeout(30):
            while sum(r["outstanding_requests"] for r in (await fleet()).values()) < n:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        took = [await restart("m-0"), await restart("m-1")]
        assert not any(s.done() for s in streams), "the roll waited for the streams"
        results = await asyncio.gather(*streams)
        async with http.post(f"{url}/admin/replicas/m-0/restart?grace_s=x", headers=admin) as r:
            assert r.status == 400 and (await r.json())["error"]["param"] == "grace_s"
        async with http.post(f"{url}/admin/replicas/m-9/restart", headers=admin) as r:
            assert r.status == 404
        gateway.access_log.flush()
        lines = [x for x in access_lines(access) if x["path"] == "/v1/chat/completions"]
    assert all(t < 15 for t in took), took
    for _, got in results:
        one_stream(got)
        assert got[-2]["usage"]["completion_tokens"] == 800
    assert not any("cut" in line for line in lines), lines
    assert sum("continued" in line for line in lines) == n  # every stream moved at least once


async def test_a_moved_stream_leaves_its_replica_before_the_new_one_answers(tmp_path: Path) -> None:
    """A drained replica is empty once its streams are moved, not once the replicas taking
    them send their first token (a long prompt's prefill, seconds on a busy replica): a
    restart waiting for it to empty waits that much less."""
    async with sim_upstream(MODEL, tokens_per_s=40) as a, sim_upstream(MODEL, ttft_ms=3000, tokens_per_s=40) as b:
        config = {
            "models": [{"name": MODEL, "replicas": [{"url": a}, {"url": b}]}],
            "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
            "upstream": {"migrate_after_s": 0.2},
        }
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        async with in_process_gateway(config, tmp_path) as (url, gateway, _), aiohttp.ClientSession() as http:
            async with http.post(f"{url}/admin/replicas/m-1/drain", headers=admin) as d:
                assert d.status == 200
            body = chat(max_tokens=400, ignore_eos=True)
            async with http.post(f"{url}/v1/chat/completions", json=body, headers=AUTH) as r:
                assert r.headers["x-fleetgate-replica"] == "m-0"
                await r.content.readuntil(b"\n\n")
                async with http.post(f"{url}/admin/replicas/m-1/undrain", headers=admin) as d:
                    assert d.status == 200
                m0 = gateway.fleet.get("m-0")
                assert m0 is not None
                loop = asyncio.get_running_loop()
                drained = loop.time()
                async with http.post(f"{url}/admin/replicas/m-0/drain", headers=admin) as d:
                    assert d.status == 200
                async with asyncio.timeout(10):
                    while m0.outstanding_requests:  # noqa: ASYNC110
                        await asyncio.sleep(0.02)
                emptied = loop.time() - drained
                text = one_stream(sse_events(await r.read()))
    assert text
    assert emptied < 2.0, emptied  # the move (0.2 s after the drain), not b's 3 s to its first token
