"""KV-cache events end to end on the simulator: its block pool published as vLLM publishes,
read by the gateway's subscriber into the exact index. The index holds exactly the blocks the
simulated engine caches; a lost batch (a gap) is repaired from the replay socket; a restarted
engine clears the replica; and a gateway with managed simulated replicas reads a prompt's
cached tokens from the events, equal to the engine's own prefix-cache hits."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
from tokenizers import Tokenizer, models, pre_tokenizers

from dialects.openai import CHAT
from gateway.settings import hash_key
from replicas.config import EventsEndpoint
from replicas.launcher import free_port
from routing.kv_index import ReplicaBlocks
from routing.kv_subscriber import KvSubscriber
from sim.batched_engine import BatchedSimEngine
from sim.kv_publisher import KvEventPublisher
from sim.model import prompt_token_ids
from sim.prompts import chat_turns, render_chat
from sim.server import create_app, token_ids_with
from tests.integration.harness import API_KEY, in_process_gateway, serve_app
from tokens.model_tokenizer import ModelTokenizer

BLOCK = 4
ADMIN_KEY = "sk-kv-admin"
U64 = (1 << 64) - 1
SYSTEM = "You are a careful assistant who answers in one short paragraph and cites the manual ."
WORDS = sorted(set((SYSTEM + " what is a cache block and why does it matter here now ok zero one two three").split()))


def word_model(directory: Path) -> Path:
    """A word-level tokenizer over the test's words (each its own id) and ChatML, as a model directory."""
    vocab = ["<unk>", "<|im_start|>", "<|im_end|>", "<s>", *WORDS, "system", "user", "assistant"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", "<s>"])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "<|im_end|>"}))
    (directory / "chat_template.jinja").write_text(
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    return directory


def chat(question: str) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 3,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    }


def engine(num_blocks: int = 4096) -> BatchedSimEngine:
    return BatchedSimEngine.from_profile(
        "h100-llama-3.1-8b", seed=0, time_scale=50.0, num_blocks=num_blocks, block_size=BLOCK
    )


@contextlib.asynccontextmanager
async def published_sim(
    pub: int, replay: int, sim: BatchedSimEngine, tokenizer: str | None = None
) -> AsyncIterator[tuple[str, KvEventPublisher]]:
    """A simulated replica publishing its KV events; with ``tokenizer`` (a model directory)
    its prompts are that tokenizer's ids, as a gateway with it counts them."""
    publisher = KvEventPublisher(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    sim.publish_events(publisher)
    token_ids = token_ids_with(tokenizer) if tokenizer else None
    async with serve_app(create_app(sim, "m", kv_publisher=publisher, token_ids=token_ids)) as url:
        yield url, publisher


def engine_blocks(sim: BatchedSimEngine) -> set[int]:
    return {h & U64 for h in sim.model.pool._by_hash}


def indexed(blocks: ReplicaBlocks) -> set[object]:
    return set(blocks._digests)


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not check():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def ask(http: aiohttp.ClientSession, url: str, question: str, **headers: str) -> dict[str, Any]:
    async with http.post(f"{url}/v1/chat/completions", json=chat(question), headers=headers) as r:
        assert r.status == 200, await r.text()
        answer: dict[str, Any] = await r.json()
        return answer


async def test_the_index_holds_what_the_engine_caches_and_a_gap_is_repaired_from_the_replay() -> None:
    pub, replay = free_port(), free_port()
    sim = engine()
    async with published_sim(pub, replay, sim) as (url, publisher), aiohttp.ClientSession() as http:
        blocks = ReplicaBlocks()
        subscriber = KvSubscriber("r0", EventsEndpoint(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"), blocks)
        subscriber.start()
        try:
            await until(lambda: subscriber.counts.replays == 1)  # the first resync, of nothing yet
            await asyncio.sleep(0.3)  # a SUB socket misses what is sent before it has joined
            await ask(http, url, "what is a cache block")
            await until(lambda: indexed(blocks) == engine_blocks(sim) and len(blocks) > 0)
            assert blocks.exact and blocks.last_seq == publisher.seq - 1
            prompt = render_chat(chat_turns(chat("what is a cache block")["messages"]))
            assert blocks.cached_blocks(_own(prompt)) == len(prompt_token_ids(prompt)) // BLOCK

            # A batch lost on the way: the next one shows the gap, the replay rebuilds the set.
            publisher.drop(1)
            await ask(http, url, "why does it matter here")
            await ask(http, url, "zero one two three")
            await until(lambda: blocks.stats.gaps == 1 and blocks.exact)
            await until(lambda: indexed(blocks) == engine_blocks(sim))
            # The start's replay found nothing to rebuild; the gap's rebuilt the set.
            assert blocks.stats.resyncs == 1 and subscriber.counts.replays == 2
            assert subscriber.counts.decode_errors == 0
        finally:
            await subscriber.close()


def _own(prompt: str) -> list[int]:
    from routing.kv_index import chain_hashes

    return chain_hashes(prompt_token_ids(prompt), BLOCK)


async def test_a_restarted_engine_clears_the_replica() -> None:
    pub, replay = free_port(), free_port()
    blocks = ReplicaBlocks()
    where = EventsEndpoint(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    subscriber = KvSubscriber("r0", where, blocks, min_resync_interval_s=0.0)
    subscriber.start()
    try:
        async with aiohttp.ClientSession() as http:
            first = engine()
            async with published_sim(pub, replay, first) as (url, _):
                await asyncio.sleep(0.5)
                for q in ("what is a cache block", "why does it matter here", "zero one two three"):
                    await ask(http, url, q)
                await until(lambda: indexed(blocks) == engine_blocks(first) and len(blocks) > 0)
            held_before = len(blocks)
            second = engine()  # the same ports, a fresh engine: its sequence starts at 0 again
            async with published_sim(pub, replay, second) as (url, _):
                await asyncio.sleep(0.5)
                await ask(http, url, "ok")
                await until(lambda: blocks.stats.restarts + blocks.stats.gaps >= 1 and blocks.exact)
                await until(lambda: indexed(blocks) == engine_blocks(second))
                assert 0 < len(blocks) < held_before
    finally:
        await subscriber.close()


async def test_the_gateway_reads_a_prompts_cached_tokens_from_the_events(tmp_path: Path) -> None:
    model_dir = str(word_model(tmp_path / "model"))
    replica = {
        "engine": "sim",
        "count": 2,
        "kv_events": True,
        "sim": {"profile": "h100-llama-3.1-8b", "time_scale": 50, "tokenizer": model_dir},
        "args": ["--block-size", str(BLOCK)],
    }
    config = {
        "models": [{"name": "m", "tokenizer": model_dir, "replicas": [replica]}],
        "admin_api_keys": ["sha256:" + hash_key(ADMIN_KEY)],
    }
    auth = {"Authorization": f"Bearer {API_KEY}"}
    async with in_process_gateway(config, tmp_path) as (url, gateway, _), aiohttp.ClientSession() as http:
        streams = gateway.kv_events
        assert set(streams.subscribers) == {"m-0", "m-1"} and gateway.router.wants_token_ids("m")
        await until(lambda: all(s.counts.replays >= 1 for s in streams.subscribers.values()))
        await asyncio.sleep(0.5)
        body = chat("what is a cache block and why does it matter")
        await ask(http, url, "what is a cache block and why does it matter", **auth)
        ids = ModelTokenizer.load(Path(model_dir)).token_ids(CHAT, body)
        full = len(ids) // BLOCK * BLOCK
        index = gateway.router.kv
        assert index is not None
        await until(lambda: any(index.cached_tokens(ids, rid) == full for rid in ("m-0", "m-1")))
        served = next(rid for rid in ("m-0", "m-1") if index.cached_tokens(ids, rid) == full)
        other = "m-1" if served == "m-0" else "m-0"
        assert index.cached_tokens(ids, other) == 0

        # The replica's own count agrees: the same prompt again hits exactly those tokens there.
        hits_before = await _hits(http, gateway, served)
        async with http.post(f"{gateway.fleet.get(served).base_url}/v1/chat/completions", json=body) as r:  # type: ignore[union-attr]
            assert r.status == 200
        assert await _hits(http, gateway, served) - hits_before == full

        async with http.get(f"{url}/admin/fleet", headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as r:
            described = (await r.json())["kv_events"]
        assert described[served]["exact"] is True and described[served]["blocks"] == full // BLOCK
        assert described[served]["gaps"] == 0 and described[other]["blocks"] == 0
        async with http.get(f"{url}/metrics") as r:
            metrics = await r.text()
        assert f'fleetgate_kv_events_blocks{{replica="{served}"}} {float(full // BLOCK)}' in metrics


async def _hits(http: aiohttp.ClientSession, gateway: Any, rid: str) -> float:
    async with http.get(f"{gateway.fleet.get(rid).base_url}/metrics") as r:
        text = await r.text()
    for line in text.splitlines():
        if line.startswith("vllm:prefix_cache_hits_total"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no prefix_cache_hits_total")


async def test_a_discovered_pods_events_are_read_at_its_address_and_let_go_when_it_goes(tmp_path: Path) -> None:
    """A ``kubernetes`` source with ``kv_events_port``: no Kubernetes API runs here, so the
    test hands the fleet the pod set as the EndpointSlice watch would (``Fleet.sync``); the
    pod is a simulated replica publishing on that port at the pod's address."""
    model_dir = str(word_model(tmp_path / "model"))
    pub, replay = free_port(), free_port()
    source = {"service": "vllm", "kv_events_port": pub, "kv_events_replay_port": replay}
    config = {"models": [{"name": "m", "tokenizer": model_dir, "replicas": [{"kubernetes": source}]}]}
    async with (
        published_sim(pub, replay, engine(), model_dir) as (sim_url, _),
        in_process_gateway(config, tmp_path) as (_, gateway, _),
        aiohttp.ClientSession() as http,
    ):
        streams, index = gateway.kv_events, gateway.router.kv
        assert index is not None and gateway.router.wants_token_ids("m") and not streams.subscribers
        gateway.fleet.sync("m", {"vllm-pod-1": sim_url}, source=0)
        subscriber = streams.subscribers["vllm-pod-1"]
        assert subscriber.where == EventsEndpoint(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
        await until(lambda: subscriber.counts.replays >= 1)
        await asyncio.sleep(0.5)  # a SUB socket misses what is sent before it has joined
        body = chat("what is a cache block and why does it matter")
        await ask(http, sim_url, "what is a cache block and why does it matter")
        ids = ModelTokenizer.load(Path(model_dir)).token_ids(CHAT, body)
        await until(lambda: index.cached_tokens(ids, "vllm-pod-1") == len(ids) // BLOCK * BLOCK)

        # The pod goes: its subscriber closes and the index forgets it.
        gateway.fleet.sync("m", {}, source=0)
        assert not streams.subscribers and index.cached_tokens(ids, "vllm-pod-1") is None
        await until(lambda: subscriber._task is None or subscriber._task.done())
