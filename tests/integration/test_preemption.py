"""Preemption: a higher band's request sent to a replica moves a preemptible band's streams
off it, each finished whole on another replica; a non-preemptible band's stay.

Two in-process simulators (``sim.server``, 40 tokens/s: a 160-token answer takes 4 s) behind
an in-process gateway that routes round robin, so the test knows where each request goes.
The simulator seeds its words with the whole prompt, so the words after a cut differ from an
uninterrupted answer's; what holds exactly is the stream itself: every word the client had
before the cut kept, no token repeated or missing (as many as were asked for), one
id, one end, one usage of the whole answer. Real vLLM's exact text is the e2e tests' and
``bench/continuation_failover.py``'s.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from gateway.settings import hash_key
from tests.integration.harness import access_lines, in_process_gateway, sim_upstream, sse_events, until

MODEL = "m"
CHAT_KEY = "sk-preempt-chat"
BULK_KEY = "sk-preempt-bulk"
BATCH_TOKENS = 160


def config(*urls: str, max_preemptions: int = 8) -> dict[str, Any]:
    return {
        "models": [{"name": MODEL, "replicas": [{"url": u} for u in urls]}],
        "routing": {"policy": "round_robin"},
        "bands": [
            "interactive",
            "standard",
            {"name": "batch", "preemptible": True, "max_preemptions": max_preemptions},
        ],
        "tenants": [
            {"id": "chat", "api_keys": ["sha256:" + hash_key(CHAT_KEY)]},
            {"id": "bulk", "api_keys": ["sha256:" + hash_key(BULK_KEY)], "band": "standard"},
        ],
    }


def body(content: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


class Stream:
    """A streamed request read in the background: its replica, and every event once it ends."""

    def __init__(
        self, http: aiohttp.ClientSession, url: str, key: str, request: dict[str, Any], band: str | None
    ) -> None:
        headers = {"Authorization": f"Bearer {key}"}
        if band is not None:
            headers["x-fleetgate-band"] = band
        self.first: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        # Bytes the client has received so far (read as they come).
        self.received = b""
        self.task = asyncio.create_task(self._run(http, f"{url}/v1/chat/completions", request, headers))

    async def _run(
        self, http: aiohttp.ClientSession, url: str, request: dict[str, Any], headers: dict[str, str]
    ) -> bytes:
        try:
            async with http.post(url, json=request, headers=headers) as r:
                assert r.status == 200, await r.text()
                # Every request here is new to the exact cache: each names its replica.
                replica = r.headers["x-fleetgate-replica"]
                self.received = await r.content.readuntil(b"\n\n")
                self.first.set_result(replica)
                async for chunk in r.content.iter_any():
                    self.received += chunk
                return self.received
        except BaseException as exc:
            if not self.first.done():
                self.first.set_exception(exc)
            raise

    def tokens_received(self) -> int:
        return self.received.count(b'"content":')

    async def started(self) -> str:
        return await asyncio.wait_for(asyncio.shield(self.first), 10)

    async def events(self) -> list[Any]:
        return sse_events(await asyncio.wait_for(self.task, 30))


def whole(got: list[Any]) -> tuple[list[str], dict[str, Any]]:
    """The tokens of a well-formed chat stream and its usage; fails on an error event, a
    missing or second end, several ids."""
    assert got[-1] == "[DONE]" and got.count("[DONE]") == 1, got
    chunks = [c for c in got if c != "[DONE]"]
    assert not any("error" in c for c in chunks), chunks
    assert len({c["id"] for c in chunks}) == 1, {c["id"] for c in chunks}
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == ["length"], finishes
    (usage,) = [c["usage"] for c in chunks if c.get("usage")]
    return tokens(chunks), usage


def tokens(chunks: list[Any]) -> list[str]:
    """The answer's tokens, one a chunk: the simulator sends one word a token, the first
    without its leading space (a continuation's too, so the joined text would run two
    words together at each cut)."""
    return [piece.strip() for c in chunks for ch in c["choices"] if (piece := ch["delta"].get("content"))]


async def test_a_higher_band_preempts_a_preemptible_stream_and_leaves_the_others(tmp_path: Path) -> None:
    async with sim_upstream(MODEL, tokens_per_s=40) as a, sim_upstream(MODEL, tokens_per_s=40) as b:
        async with in_process_gateway(config(a, b), tmp_path) as (url, gw, access), aiohttp.ClientSession() as http:
            replicas = {r.id: r for r in gw.router.pools[MODEL].replicas}
            # Round robin: the batch stream on m-0, the standard one on m-1.
            batch = Stream(http, url, CHAT_KEY, body("a batch item", BATCH_TOKENS), "batch")
            assert await batch.started() == "m-0"
            standard = Stream(http, url, BULK_KEY, body("a standard job", BATCH_TOKENS), None)
            assert await standard.started() == "m-1"
            # The client has some of the batch stream's answer (the test's timing is the
            # simulator's, slower on a loaded machine).
            await until(lambda: batch.tokens_received() >= 12, within_s=10)
            # An interactive request on m-0: the batch stream moves to the only other replica,
            # beside the standard one (no replica is free of higher-band work).
            first = Stream(http, url, CHAT_KEY, body("a question", 8), None)
            assert await first.started() == "m-0"
            await until(lambda: replicas["m-1"].streams == 2)
            whole(await first.events())
            filler = Stream(http, url, CHAT_KEY, body("filler", 2), None)
            assert await filler.started() == "m-0"
            whole(await filler.events())
            await until(lambda: replicas["m-0"].outstanding_requests == 0)
            await asyncio.sleep(0.3)
            # An interactive request on m-1: the batch stream moves again, to m-0, now free;
            # the standard stream beside it stays.
            second = Stream(http, url, CHAT_KEY, body("another question", 8), None)
            assert await second.started() == "m-1"
            await until(lambda: replicas["m-0"].streams == 1)
            assert replicas["m-1"].streams == 2
            ((words, usage), (standard_words, _), _) = [whole(await s.events()) for s in (batch, standard, second)]
            gw.access_log.flush()
            lines = access_lines(access)
            sample = gw.metrics.registry.get_sample_value
            moved = sample("fleetgate_stream_continuations_total", {"model": MODEL, "reason": "preempted"})
            # The same request straight to the simulator: the answer it gives uninterrupted.
            async with http.post(f"{a}/v1/chat/completions", json=body("a batch item", BATCH_TOKENS)) as r:
                alone = tokens(
                    [
                        orjson.loads(block[len(b"data: ") :])
                        for block in (await r.read()).split(b"\n\n")
                        if block.startswith(b"data: {")
                    ]
                )
    # Whole: as many tokens as asked for, each once, and the usage of the whole answer;
    # the tokens relayed before the first cut (at least 11: the first of the 12 content
    # fields waited for may be the opening chunk's empty one) as the replica sent them.
    assert len(words) == BATCH_TOKENS and usage["completion_tokens"] == BATCH_TOKENS, (len(words), usage)
    kept = next((i for i, (x, y) in enumerate(zip(words, alone, strict=True)) if x != y), len(words))
    assert kept >= 11, (kept, words, alone)
    assert len(standard_words) == BATCH_TOKENS
    (batch_line,) = [line for line in lines if line["band"] == "batch"]
    (standard_line,) = [line for line in lines if line["band"] == "standard"]
    moves = [{"replica": "m-1", "reason": "preempted"}, {"replica": "m-0", "reason": "preempted"}]
    assert batch_line["continued"] == moves, batch_line
    assert batch_line["replica"] == "m-0" and "cut" not in batch_line
    assert "continued" not in standard_line and standard_line["replica"] == "m-1"
    assert not any("continued" in line for line in lines if line["band"] != "batch")
    assert moved == 2


async def test_a_stream_stays_once_moved_its_bands_bound_or_with_nowhere_to_go(tmp_path: Path) -> None:
    """``max_preemptions: 1``: moved once, the batch stream stays where it is the second time
    (and finishes there); a lone replica's batch stream is never moved (no other can take it)."""
    async with sim_upstream(MODEL, tokens_per_s=40) as a, sim_upstream(MODEL, tokens_per_s=40) as b:
        async with (
            in_process_gateway(config(a, b, max_preemptions=1), tmp_path) as (url, gw, access),
            aiohttp.ClientSession() as http,
        ):
            replicas = {r.id: r for r in gw.router.pools[MODEL].replicas}
            batch = Stream(http, url, CHAT_KEY, body("a batch item", BATCH_TOKENS), "batch")
            assert await batch.started() == "m-0"
            order = ["m-1", "m-0", "m-0", "m-1"]  # round robin; the continuation's pick takes m-1
            for i, (question, tokens_) in enumerate(
                [("filler", 2), ("a question", 8), ("filler two", 2), ("again", 8)]
            ):
                if i == 1:
                    await asyncio.sleep(0.3)
                asked = Stream(http, url, CHAT_KEY, body(question, tokens_), None)
                assert await asked.started() == order[i], i
                whole(await asked.events())
                if i == 1:
                    await until(lambda: replicas["m-1"].streams == 1)
            words, usage = whole(await batch.events())
            gw.access_log.flush()
            (line,) = [x for x in access_lines(access) if x["band"] == "batch"]
    assert len(words) == BATCH_TOKENS and usage["completion_tokens"] == BATCH_TOKENS
    assert line["continued"] == [{"replica": "m-1", "reason": "preempted"}] and line["replica"] == "m-1"

    async with sim_upstream(MODEL, tokens_per_s=40) as a:
        async with in_process_gateway(config(a), tmp_path) as (url, gw, access), aiohttp.ClientSession() as http:
            batch = Stream(http, url, CHAT_KEY, body("a batch item", BATCH_TOKENS), "batch")
            await batch.started()
            await asyncio.sleep(0.3)
            asked = Stream(http, url, CHAT_KEY, body("a question", 8), None)
            whole(await asked.events())
            words, _ = whole(await batch.events())
            gw.access_log.flush()
            lines = access_lines(access)
    assert len(words) == BATCH_TOKENS
    assert not any("continued" in x for x in lines), lines


async def test_a_client_that_leaves_while_its_stream_moves_leaves_no_load_behind(tmp_path: Path) -> None:
    """The preempted stream's continuation is still opening (the replica that takes it
    answers after 3 s) when its client leaves: the claim on that replica is handed back."""
    async with (
        sim_upstream(MODEL, tokens_per_s=40) as a,
        sim_upstream(MODEL, ttft_ms=3000, tokens_per_s=40) as b,
        in_process_gateway(config(a, b), tmp_path) as (url, gw, _access),
        aiohttp.ClientSession() as http,
    ):
        replicas = {r.id: r for r in gw.router.pools[MODEL].replicas}
        batch = Stream(http, url, CHAT_KEY, body("a batch item", BATCH_TOKENS), "batch")
        assert await batch.started() == "m-0"
        filler = Stream(http, url, CHAT_KEY, body("filler", 2), None)  # round robin: m-1 next
        assert await filler.started() == "m-1"
        whole(await filler.events())
        asked = Stream(http, url, CHAT_KEY, body("a question", 8), None)
        assert await asked.started() == "m-0"
        await until(lambda: replicas["m-1"].outstanding_requests == 1)  # the continuation, opening
        batch.task.cancel()
        whole(await asked.events())
        await until(lambda: all(r.outstanding_requests == 0 and r.streams == 0 for r in replicas.values()))
        assert all(r.preempting == 0 and r.outstanding_tokens == 0 for r in replicas.values())
