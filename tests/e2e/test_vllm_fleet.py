"""End to end: the gateway in front of real vLLM replicas on CPU, driven with the openai SDK.

The tests run in file order and, after the first, share one fleet (two replicas of the
tiny model; vLLM takes about a minute to start):

1. A SIGKILLed gateway leaves no vLLM process behind (its own one-replica gateway, done
   before the fleet starts so the two never compete for the cores).
2. Chat and legacy completions, streamed and not, with exact token counts; both replicas
   serve; an endpoint vLLM lacks comes back as an OpenAI error.
3. ``vllm:num_requests_running``, scraped into ``/admin/fleet``, rises under a burst.
4. Streams of every API outlive their replica: drained, then cut off, it hands them to the
   other (a second gateway, continuations on, the official SDKs as clients).
5. One replica's API server is frozen (SIGSTOP) while long streams run on it, sent more
   requests it never answers, then SIGKILLed under steady load: no non-streaming request
   fails (the ones it held are retried on the other), the streams it was serving end with
   an error event, and the launcher restarts it until it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anthropic
import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import (
    ADMIN,
    ADMIN_KEY,
    FLEET_START_TIMEOUT_S,
    MODEL,
    ROOT,
    SINGLE_START_TIMEOUT_S,
    E2EGateway,
    bounded,
    describe_group,
    gateway_config,
    group_alive,
    group_members,
    kill_group,
    record_timing,
    run_dir,
    start_gateway,
    stop_gateway,
    vllm_replica,
    wait_group_gone,
)
from tests.e2e.freezer import ROUTED
from tests.integration.harness import API_KEY

pytestmark = pytest.mark.e2e

# The tiny model emits its EOS now and then; exact token counts need ignore_eos (a vLLM extension).
IGNORE_EOS = {"ignore_eos": True}
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about a gateway."}]
REPLICA_HEADER = "x-fleetgate-replica"
REQUEST_ID_HEADER = "x-request-id"
# As long as the tiny model's 4096 positions allow, to still be generating when the
# replica is frozen, which the test does as soon as they have begun: on a quiet machine
# such a stream runs out within a few seconds.
LONG_TOKENS = 4000
# Few streams: relaying thousands of chunks a second keeps this test's event loop and the
# gateway's busy, which delays the control calls that lead up to the kill.
N_STREAMS = 2
# Non-streaming requests sent to the frozen replica: in flight there, by construction,
# until the kill. Long requests running beside the streams were the first design; on a
# busy machine they were seen to run out before this test's event loop saw the streams'
# first chunks (all eight requests done after 10.7 s, the replica then frozen with nothing
# in flight).
N_PINNED = 6
PINNED_TOKENS = 256
# Rounds of streams until the freeze falls inside one (``frozen_mid_stream``).
STREAM_ROUNDS = 5
RESTART_TIMEOUT_S = 240.0
BURST_TOKENS = 1024

T = TypeVar("T")


def request_id(tag: str) -> str:
    """The ``x-request-id`` a test request sends: its tag, so its access-log line can be found."""
    return "e2e-" + tag.replace(" ", "-")


def messages(tag: str) -> list[ChatCompletionMessageParam]:
    return [{"role": "user", "content": f"{tag}: tell me a long story about a gateway."}]


async def chat(client: AsyncOpenAI, tag: str, max_tokens: int) -> tuple[str, ChatCompletion]:
    """A non-streaming chat of exactly ``max_tokens``; (the replica that answered, the reply)."""
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages(tag),
        max_tokens=max_tokens,
        extra_body=IGNORE_EOS,
        extra_headers={REQUEST_ID_HEADER: request_id(tag)},
    )
    return raw.headers.get(REPLICA_HEADER, ""), raw.parse()


@pytest.fixture
async def client(vllm_fleet: E2EGateway) -> AsyncIterator[AsyncOpenAI]:
    """The SDK's async client on the fleet's gateway, closed on this test's event loop."""
    async with vllm_fleet.client() as sdk:
        yield sdk


# -- 1. the gateway dies -------------------------------------------------------------------


@pytest.mark.timeout(SINGLE_START_TIMEOUT_S + 120)
def test_sigkilled_gateway_leaves_no_vllm_processes(tiny_model: Path) -> None:
    config = gateway_config([vllm_replica(tiny_model, core=0)])
    e2e, elapsed = start_gateway(config, run_dir("gateway-sigkill"), SINGLE_START_TIMEOUT_S, every=True)
    record_timing("single replica start (gateway SIGKILL test)", elapsed)
    pgid: int | None = None
    try:
        (replica,) = e2e.fleet_sync().values()
        pgid = int(replica["pid"])
        assert os.getpgid(pgid) == pgid, "the replica does not lead its own process group"
        members = group_members(pgid)
        names = [name for *_, name in members]
        assert any("EngineCor" in n for n in names), f"expected vLLM's engine in the group, found {names}"
        with e2e.sync_client() as sdk:
            reply = sdk.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=8, extra_body=IGNORE_EOS)
        assert reply.usage is not None and reply.usage.completion_tokens == 8

        assert e2e.gw.proc is not None
        e2e.gw.proc.kill()
        e2e.gw.proc.wait(10)
        gone = wait_group_gone(pgid)
        if gone is None:
            server_alive = any(pid == pgid and state != "Z" for pid, _, state, _ in group_members(pgid))
            why = (
                "the API server itself is alive: PR_SET_PDEATHSIG never reached it"
                if server_alive
                else "the API server died but its engine/worker outlived it"
            )
            pytest.fail(
                f"15 s after the gateway's SIGKILL, replica group {pgid} still has: {describe_group(pgid)} ({why}); "
                f"at start it held {[(pid, name) for pid, _, _, name in members]}"
            )
        record_timing("gateway SIGKILL -> every vLLM process of its replica gone", gone)
    finally:
        stop_gateway(e2e, signal.SIGKILL)
        if pgid is not None:
            kill_group(pgid)


# -- 2. plain traffic ---------------------------------------------------------------------


@pytest.mark.timeout(FLEET_START_TIMEOUT_S + 120)
async def test_completions_streamed_and_not(vllm_fleet: E2EGateway, client: AsyncOpenAI) -> None:
    ids = set(await vllm_fleet.fleet())
    assert len(ids) == 2

    replica, reply = await chat(client, "hello", 24)
    assert replica in ids
    assert reply.model == MODEL
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].message.content
    assert reply.usage is not None and reply.usage.completion_tokens == 24

    stream = await client.chat.completions.create(
        model=MODEL,
        messages=PROMPT,
        max_tokens=24,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    pieces, finish, usage = [], None, None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert pieces and finish == "length"
    assert usage is not None and usage.completion_tokens == 24

    completion = await client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=16, extra_body=IGNORE_EOS
    )
    assert completion.choices[0].text and completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 16

    text_stream = await client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=16,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
    )
    texts, finish, usage = [], None, None
    async for piece in text_stream:
        usage = piece.usage or usage
        for c in piece.choices:
            texts.append(c.text)
            finish = c.finish_reason or finish
    assert "".join(texts) and finish == "length"
    assert usage is not None and usage.completion_tokens == 16

    # Concurrent requests spread over both replicas (least outstanding tokens).
    spread = await asyncio.gather(*(chat(client, f"spread {i}", 64) for i in range(8)))
    assert {replica for replica, _ in spread} == ids

    # A generation replica has no /v1/embeddings: vLLM's 404 reaches the SDK as an OpenAI error.
    with pytest.raises(openai.NotFoundError) as missing:
        await client.embeddings.create(model=MODEL, input="hello")
    assert missing.value.status_code == 404


# -- 3. scraped load ------------------------------------------------------------------------


@pytest.mark.timeout(180)
async def test_num_requests_running_rises_under_load(vllm_fleet: E2EGateway, client: AsyncOpenAI) -> None:
    start = time.monotonic()
    # Long enough to span several probe rounds: 16 requests of 256 tokens took a replica ~1.5 s,
    # about one scrape interval under load, so such a burst could fall between two scrapes.
    burst = [asyncio.create_task(chat(client, f"burst {i}", BURST_TOKENS)) for i in range(32)]
    peaks: dict[str, float] = {}
    while not all(task.done() for task in burst):
        for rid, replica in (await vllm_fleet.fleet()).items():
            running = float(replica["gauges"].get("vllm:num_requests_running", 0.0))
            peaks[rid] = max(peaks.get(rid, 0.0), running)
        await asyncio.sleep(0.2)
    outcomes = await asyncio.gather(*burst, return_exceptions=True)
    record_timing(f"burst: 32 concurrent requests of {BURST_TOKENS} tokens", time.monotonic() - start)
    failed = [o for o in outcomes if isinstance(o, BaseException)]
    assert not failed, f"{len(failed)} of 32 burst requests failed: {failed[:3]}"
    served = Counter(o[0] for o in outcomes if not isinstance(o, BaseException))
    print(f"[e2e] burst served by {dict(served)}; peak vllm:num_requests_running {peaks}", flush=True)
    for outcome in outcomes:
        assert not isinstance(outcome, BaseException)
        assert outcome[1].usage is not None and outcome[1].usage.completion_tokens == BURST_TOKENS
    assert max(peaks.values(), default=0.0) >= 2, f"vllm:num_requests_running never reached 2: {peaks}"


# -- 4. streams that outlive their replica ---------------------------------------------------

# Each API's stream: long enough (seconds on these cores) to be under way when its replica goes.
CONTINUED_TOKENS = 1200


class Cutter:
    """A TCP relay standing for the network path to one replica: ``cut`` resets every
    connection through it and refuses new ones, as a node that is gone would. What the
    replica sends back goes at ``answer_bytes_per_s`` (the tiny model writes a 1200-token
    stream in about a second, sometimes all at once), and ``hold`` keeps it back until
    ``release``: a stream cannot end before the test takes its replica away, however fast
    the engine. The shared fleet's replica behind it keeps running for the tests after
    this one."""

    def __init__(self, target: str, answer_bytes_per_s: float = 64_000) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self._target = (host, int(port))
        self._links: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._answer_bytes_per_s = answer_bytes_per_s
        self.url = ""

    def hold(self) -> None:
        self._flowing.clear()

    def release(self) -> None:
        self._flowing.set()

    async def __aenter__(self) -> Cutter:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.transport.abort()
            return
        self._links.update((writer, up_writer))

        async def answer(chunk: bytes) -> None:
            await self._flowing.wait()
            await asyncio.sleep(len(chunk) / self._answer_bytes_per_s)

        async def pipe(
            src: asyncio.StreamReader,
            dst: asyncio.StreamWriter,
            size: int,
            pace: Callable[[bytes], Awaitable[None]] | None = None,
        ) -> None:
            with contextlib.suppress(OSError):
                while chunk := await src.read(size):
                    if pace is not None:
                        await pace(chunk)
                    dst.write(chunk)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer, 65536), pipe(up_reader, writer, 2048, answer))
        self._links.difference_update((writer, up_writer))

    def cut(self) -> None:
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.transport.abort()


async def test_streams_of_every_api_outlive_their_replica(vllm_fleet: E2EGateway) -> None:
    """A second gateway in front of the fleet's two replicas, with continuations on (the
    default), and the official SDKs as its clients: streams of chat completions (openai),
    Messages (anthropic) and Responses (openai, stored) all begin on one replica. Once
    each has its first token, that replica is drained (its streams move after
    ``migrate_after_s``); then, a second round, its network path is cut (every connection
    reset, new ones refused, as a node gone). Every stream ends whole, as one stream, with
    its full length; the access lines say where each was continued and why; the
    completion tokens counted equal what the clients were told; the stored Responses turn
    is retrieved whole and a conversation goes on from it with ``previous_response_id``.
    (The replica behind the cut keeps running for the tests after this one.)"""
    fleet = await vllm_fleet.fleet()
    first, second = sorted(fleet)
    async with Cutter(fleet[first]["url"]) as cutter:
        config = gateway_config([{"url": cutter.url}, {"url": fleet[second]["url"]}])
        config["upstream"] = {"connect_timeout_s": 15.0, "migrate_after_s": 0.5}
        gw, _ = await asyncio.to_thread(start_gateway, config, run_dir("continuation"), 60.0, True)
        try:
            async with (
                gw.client() as oai,
                anthropic.AsyncAnthropic(base_url=gw.url, api_key=API_KEY, max_retries=0, timeout=180) as claude,
            ):
                clients = StreamClients(oai, claude)
                await streams_moved(gw, clients, "drain", cutter, lambda: gw.drain("tiny-0"))
                await gw.undrain("tiny-0")
                await streams_moved(gw, clients, "upstream_closed", cutter, cutter.cut)
                await chained_after_continuation(oai, clients.response_ids[-1])
        finally:
            await asyncio.to_thread(stop_gateway, gw, signal.SIGTERM)


@dataclass
class StreamClients:
    """One stream of each API through the official SDKs; each call returns (its request id,
    the output tokens the client was told, the text) and notes its first token in ``begun``."""

    oai: AsyncOpenAI
    claude: Any
    begun: list[str] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)

    async def chat(self, tag: str) -> tuple[str, int, str]:
        rid = request_id(tag)
        stream = await self.oai.chat.completions.create(
            model=MODEL,
            messages=messages(tag),
            max_tokens=CONTINUED_TOKENS,
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            extra_body=IGNORE_EOS,
            extra_headers={REQUEST_ID_HEADER: rid},
        )
        text: list[str] = []
        finishes: list[str] = []
        usage = 0
        async for chunk in stream:
            for choice in chunk.choices:
                if not text:
                    self.begun.append(rid)
                text.append(choice.delta.content or "")
                if choice.finish_reason:
                    finishes.append(choice.finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        assert finishes == ["length"] and usage == CONTINUED_TOKENS, (finishes, usage)
        return rid, usage, "".join(text)

    async def messages(self, tag: str) -> tuple[str, int, str]:
        rid = request_id(tag)
        async with self.claude.messages.stream(
            model=MODEL,
            max_tokens=CONTINUED_TOKENS,
            messages=[{"role": "user", "content": f"{tag}: tell me a long story about a gateway."}],
            extra_body={"temperature": 0},
            extra_headers={REQUEST_ID_HEADER: rid},
        ) as stream:
            async for event in stream:
                if event.type == "text" and rid not in self.begun:
                    self.begun.append(rid)
            final = await stream.get_final_message()
        # vLLM's Messages API takes no ignore_eos: the answer may end on its own.
        assert final.stop_reason == "end_turn" or (
            final.stop_reason == "max_tokens" and final.usage.output_tokens == CONTINUED_TOKENS
        ), (final.stop_reason, final.usage)
        return rid, final.usage.output_tokens, "".join(b.text for b in final.content if b.type == "text")

    async def responses(self, tag: str) -> tuple[str, int, str]:
        rid = request_id(tag)
        stream = await self.oai.responses.create(
            model=MODEL,
            input=f"{tag}: tell me a long story about a gateway.",
            max_output_tokens=CONTINUED_TOKENS,
            stream=True,
            temperature=0,
            extra_body=IGNORE_EOS,
            extra_headers={REQUEST_ID_HEADER: rid},
        )
        final = None
        deltas: list[str] = []
        async for event in stream:
            if event.type == "response.output_text.delta":
                if not deltas:
                    self.begun.append(rid)
                deltas.append(event.delta)
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                final = event.response
        assert final is not None and final.usage is not None, final
        assert final.usage.output_tokens == CONTINUED_TOKENS, final.usage
        assert final.output_text == "".join(deltas)
        self.response_ids.append(final.id)
        return rid, final.usage.output_tokens, final.output_text


async def streams_moved(
    gw: E2EGateway, clients: StreamClients, reason: str, path: Cutter, leave: Callable[[], Any]
) -> None:
    """Streams of every API begun on tiny-0 (tiny-1 drained meanwhile); once all have a token,
    tiny-0's ``path`` holds what it sends and ``leave`` takes tiny-0 away: every stream still
    under way is finished by tiny-1, counted once."""
    await gw.drain("tiny-1")
    completion_before = await completion_tokens(gw)
    clients.begun.clear()
    calls = [clients.chat, clients.chat, clients.messages, clients.messages, clients.responses]
    tasks = [asyncio.create_task(call(f"{reason} {i}")) for i, call in enumerate(calls)]
    start = time.monotonic()
    try:
        async with asyncio.timeout(bounded(120)):
            while len(clients.begun) < len(tasks):
                assert not any(t.done() for t in tasks), [t.exception() or t.result() for t in tasks if t.done()]
                await asyncio.sleep(0.02)
        # A fast engine could finish a stream while tiny-1 comes back: from here tiny-0's
        # answers wait in the path until every stream still under way has moved.
        path.hold()
        running = sum(not t.done() for t in tasks)
        moved_before = await gw.counter("fleetgate_stream_continuations_total")
        await gw.undrain("tiny-1")
        await gw.wait_fleet(lambda f: f["tiny-1"]["state"] == "healthy", 30, "tiny-1 back in rotation")
        result = leave()
        if asyncio.iscoroutine(result):
            await result
        moved = 0.0
        async with asyncio.timeout(bounded(60)):
            while moved < running:
                await asyncio.sleep(0.1)
                moved = await gw.counter("fleetgate_stream_continuations_total") - moved_before
        path.release()
        async with asyncio.timeout(bounded(180)):
            results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    took = time.monotonic() - start
    continued = 0
    for (rid, _, _), call in zip(results, calls, strict=True):
        line = await gw.access_line(rid, 15)
        assert line["status"] == 200 and "cut" not in line and "error" not in line, line
        if call == clients.messages and "continued" not in line:
            continue  # it ended on its own before tiny-0 went (no ignore_eos for Messages)
        assert line["replica"] == "tiny-1" and line["continued"] == [{"replica": "tiny-1", "reason": reason}], line
        continued += 1
    record_timing(f"continuation ({reason}): 5 streams of {CONTINUED_TOKENS} tokens, {continued} continued", took)
    # Each stream's output is counted once: what its client was told.
    assert await completion_tokens(gw) - completion_before == sum(n for _, n, _ in results)


async def completion_tokens(gw: E2EGateway) -> float:
    text = (await asyncio.to_thread(httpx.get, f"{gw.url}/metrics", headers=ADMIN)).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "fleetgate_tokens_total" and sample.labels.get("direction") == "completion"
    )


async def chained_after_continuation(oai: AsyncOpenAI, response_id: str) -> None:
    """The stored answer of a continued Responses turn is whole, and the conversation goes on."""
    stored = await oai.responses.retrieve(response_id)
    assert stored.status == "incomplete" and stored.incomplete_details is not None, stored
    assert stored.incomplete_details.reason == "max_output_tokens"
    assert stored.usage is not None and stored.usage.output_tokens == CONTINUED_TOKENS
    nxt = await oai.responses.create(
        model=MODEL, input="And then?", previous_response_id=response_id, max_output_tokens=8, temperature=0
    )
    assert nxt.status in ("completed", "incomplete") and nxt.output_text, nxt
    assert nxt.previous_response_id == response_id


# -- 5. a replica dies under load -------------------------------------------------------------


@dataclass
class StreamOutcome:
    replica: str
    chunks: int
    error: openai.APIError | None
    # Completion tokens from the final usage chunk (None when the stream never got there).
    tokens: int | None = None


@dataclass
class Result:
    ok: bool
    replica: str
    seconds: float
    detail: str = ""
    done_at: float = field(default_factory=time.monotonic)


async def long_stream(client: AsyncOpenAI, tag: str, max_tokens: int = LONG_TOKENS) -> StreamOutcome:
    """A long streamed chat; an error event from the gateway ends it as ``error``."""
    async with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=messages(tag),
        max_tokens=max_tokens,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=IGNORE_EOS,
        extra_headers={REQUEST_ID_HEADER: request_id(tag)},
    ) as response:
        replica = response.headers.get(REPLICA_HEADER, "")
        stream = await response.parse()
        # Chunks, not tokens: vLLM merges tokens into one chunk when its sender falls behind.
        chunks, tokens = 0, None
        try:
            async for chunk in stream:
                chunks += len(chunk.choices)
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                # Let the other tasks run between chunks: a stream that fell behind would
                # otherwise parse its whole buffer without yielding to the event loop.
                await asyncio.sleep(0)
        except openai.APIError as err:
            return StreamOutcome(replica, chunks, err, tokens)
        return StreamOutcome(replica, chunks, None, tokens)


async def steady_load(client: AsyncOpenAI, worker: int, go: asyncio.Event, results: list[Result]) -> None:
    """Short non-streaming chats back to back, from ``go`` until cancelled; every outcome is kept."""
    await go.wait()
    i = 0
    while True:
        start = time.monotonic()
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=messages(f"steady {worker}.{i}"), max_tokens=8, extra_body=IGNORE_EOS
            )
            reply = raw.parse()
            ok = reply.usage is not None and reply.usage.completion_tokens == 8
            results.append(Result(ok, raw.headers.get(REPLICA_HEADER, ""), time.monotonic() - start, str(reply.usage)))
        except openai.APIError as err:
            results.append(Result(False, "", time.monotonic() - start, repr(err)))
        i += 1


async def served_whole_before_freeze(fleet: E2EGateway, tag: str, target: str, seen_after_s: float) -> None:
    """A request that came back whole from the frozen-then-killed ``target`` was generated
    before the freeze: a stopped server writes nothing. What could fake it is the gateway
    finishing it elsewhere under the target's name, so its access line must show one attempt,
    on the target, with every token. The client's own clock cannot tell: the tokens may sit in
    the sockets and reach this test's busy event loop seconds later (seen: 11.7 s, while the
    launcher's new vLLM took a core to start)."""
    line = await fleet.access_line(request_id(tag), timeout_s=10.0)
    print(f"[e2e] {tag}: whole from {target}, read {seen_after_s:.2f} s after the freeze", flush=True)
    assert line.get("status") == 200 and line.get("replica") == target, line
    assert line.get("attempts") == 1, f"{tag} was retried yet came back under {target}'s name: {line}"
    assert line.get("completion_tokens") == LONG_TOKENS, line


async def finished_at(call: Awaitable[T]) -> tuple[float, T]:
    """``call``'s result with the monotonic time it came back."""
    result = await call
    return time.monotonic(), result


def start_freezer(fleet: E2EGateway, target: str, pid: int, routed: float, timeout_s: float) -> subprocess.Popen[str]:
    """``tests/e2e/freezer.py`` on ``target``'s API server (``pid``), once ``routed`` routing decisions were made."""
    args = [fleet.url, ADMIN_KEY, target, str(pid), str(routed), str(timeout_s)]
    return subprocess.Popen(
        [sys.executable, "-m", "tests.e2e.freezer", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def frozen_mid_stream(
    fleet: E2EGateway, client: AsyncOpenAI, target: str, pid: int
) -> tuple[list[str], list[asyncio.Task[tuple[float, StreamOutcome]]], float]:
    """Long streams on ``target`` (the only pick), its API server (``pid``) frozen the moment
    the gateway has each of them past its first token; (their tags, their tasks, the
    monotonic time of the freeze).

    The freeze comes from a process of its own (``tests/e2e/freezer.py``), started, and
    polling, before the streams are sent (one started beside them was seen to begin polling
    only after both had ended, five rounds running): the tiny model may
    finish 4000 tokens within the seconds this process can take to see the first chunks, or a
    control call to go through, on a busy machine (seen: 7.7 s before the first chunk, 16 s
    for one POST, 11 s before a worker thread ran). A stopped server sends nothing more, so
    what is in flight then is what the kill cuts; the kill comes well within the health
    probes' 15 s timeout, so the gateway sees what it would of a plain SIGKILL.

    On a loaded machine vLLM's API server was seen to send a whole stream at once (its first
    token 11.3 s after the request, the rest within 50 ms): the engine had generated it all
    meanwhile, and no freeze could fall inside it. A round in which the gateway held none of
    the streams open once the frozen server's written bytes were read is thawed and run
    again, up to ``STREAM_ROUNDS`` times. (vLLM's own running gauge was the judge first; under
    load it read 0 while the streams were far from written, and rounds that would have cut
    them were thrown away: ``tests/e2e/freezer.py``.)
    """
    for round_ in range(1, STREAM_ROUNDS + 1):
        tags = [f"stream {round_}.{i}" for i in range(N_STREAMS)]
        routed = await fleet.counter(ROUTED)
        freezer = start_freezer(fleet, target, pid, routed + N_STREAMS, bounded(60))
        assert freezer.stdout is not None
        ready = await asyncio.wait_for(asyncio.to_thread(freezer.stdout.readline), bounded(60))
        assert ready.strip() == "polling", f"the freezer did not start: {ready!r}, {freezer.poll()}"
        streams = [asyncio.create_task(finished_at(long_stream(client, tag))) for tag in tags]
        try:
            out, err = await asyncio.to_thread(freezer.communicate, timeout=bounded(60) + 10)
            assert freezer.returncode == 0, f"{target} was not frozen: {err.strip()}"
            frozen, open_ = out.split()
            print(f"[e2e] round {round_}: {target} {err.strip()}, {open_} of {N_STREAMS} open", flush=True)
            if int(open_):
                return tags, streams, float(frozen)
            os.kill(pid, signal.SIGCONT)
            await asyncio.gather(*streams)
        except BaseException:
            freezer.kill()
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            raise
    pytest.fail(f"in {STREAM_ROUNDS} rounds every stream on {target} had ended before its replica was frozen")


def undrain_and_kill(
    fleet: E2EGateway,
    target: str,
    other: str,
    pid: int,
    decisions: float,
    start_load: Callable[[], object],
    results: list[Result],
) -> tuple[float, float]:
    """With ``pid`` frozen: once the gateway has routed ``decisions`` requests in all (the
    requests sent to the frozen ``target``: ``other`` is drained), undrain ``other``, start the
    steady load, and SIGKILL ``pid`` once a steady request was answered (at most 1 s later).

    Returns the monotonic and wall-clock time of the kill.
    """
    print(f"[e2e] kill thread running at {time.monotonic():.2f}", flush=True)
    start, routed = time.monotonic(), 0.0
    while (routed := fleet.counter_sync(ROUTED)) < decisions:
        assert time.monotonic() - start < bounded(30), f"{routed:g} of {decisions:g} requests routed within 30 s"
        time.sleep(0.05)
    print(f"[e2e] every request to {target} routed after {time.monotonic() - start:.2f} s", flush=True)
    fleet.admin_post(other, "undrain")
    back, _ = fleet.wait_fleet_sync(lambda s: s[other]["state"] == "healthy", 30, f"{other} back in rotation")
    start_load()
    deadline = time.monotonic() + 1.0
    while not results and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_at, killed_wall = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    print(f"[e2e] {other} back after {back:.2f} s; killed at {killed_at:.2f} ({len(results)} steady done)", flush=True)
    return killed_at, killed_wall


def error_code(err: openai.APIError) -> Any:
    return err.body.get("code") if isinstance(err.body, dict) else None


@pytest.mark.timeout(RESTART_TIMEOUT_S + 240)
async def test_sigkilled_replica_under_load(vllm_fleet: E2EGateway, client: AsyncOpenAI) -> None:
    fleet = vllm_fleet
    snapshot = await fleet.fleet()
    target, other = sorted(snapshot)
    old_pid = int(snapshot[target]["pid"])
    assert os.getpgid(old_pid) == old_pid, "the replica does not lead its own process group"
    assert snapshot[target]["restarts"] == 0
    retries_before = await fleet.counter("fleetgate_retries_total")
    stream_errors_before = await fleet.counter("fleetgate_stream_errors_total")

    # 1. Long streams on the target, frozen while they run: with the other replica drained
    #    it is the only one the gateway may pick.
    await fleet.drain(other)
    streams: list[asyncio.Task[tuple[float, StreamOutcome]]] = []
    pinned: list[asyncio.Task[tuple[float, tuple[str, ChatCompletion]]]] = []
    go = asyncio.Event()
    results: list[Result] = []
    workers = [asyncio.create_task(steady_load(client, w, go, results)) for w in range(4)]
    try:
        stream_tags, streams, frozen_at = await frozen_mid_stream(fleet, client, target, old_pid)
        # 2. Non-streaming requests to the frozen target (still the only pick): sent, never
        #    answered. Then undrain the other replica, start the steady load, SIGKILL the
        #    target's API server, all from a worker thread: the kill must not wait for turns
        #    of this event loop (busy with what the streams had buffered).
        routed = await fleet.counter(ROUTED)
        pinned += [
            asyncio.create_task(finished_at(chat(client, f"pinned {i}", PINNED_TOKENS))) for i in range(N_PINNED)
        ]
        loop = asyncio.get_running_loop()
        killed_at, killed_wall = await asyncio.to_thread(
            undrain_and_kill,
            fleet,
            target,
            other,
            old_pid,
            routed + N_PINNED,
            lambda: loop.call_soon_threadsafe(go.set),
            results,
        )
        out_s, _ = await fleet.wait_fleet(
            lambda s: s[target]["state"] != "healthy" or s[target]["pid"] != old_pid, 30, f"{target} out of rotation"
        )
        record_timing("replica SIGKILL -> /admin/fleet shows it out of rotation", out_s)
        await asyncio.sleep(3.0)  # the survivor carries the steady load alone for a while
        stopped_at = time.monotonic()
        outcomes = await asyncio.gather(*streams, return_exceptions=True)
        retried = await asyncio.gather(*pinned, return_exceptions=True)
    finally:
        # Should the test fail before the kill, a frozen server must not outlive it stopped.
        with contextlib.suppress(ProcessLookupError):
            os.kill(old_pid, signal.SIGCONT)
        await fleet.undrain(other)
        for task in [*streams, *pinned, *workers]:
            task.cancel()
        await asyncio.gather(*streams, *pinned, *workers, return_exceptions=True)

    by_replica = {rid: sum(r.replica == rid for r in results) for rid in (target, other)}
    print(f"[e2e] steady load: {len(results)} requests, by replica {by_replica}", flush=True)
    # What the gateway saw of each long request (queue wait, first token, attempts), should
    # an assertion below fail.
    for tag in [*stream_tags, *(f"pinned {i}" for i in range(N_PINNED))]:
        with contextlib.suppress(AssertionError):
            print(f"[e2e] {tag}: {await fleet.access_line(request_id(tag), timeout_s=5.0)}", flush=True)
    failures = [r for r in results if not r.ok]
    assert not failures, f"{len(failures)} non-streaming requests failed during the kill: {failures[:5]}"
    after_kill = sum(killed_at < r.done_at < stopped_at for r in results)
    assert after_kill >= 4, f"too little steady load to show anything: {after_kill} requests after the kill"

    # Every request the frozen replica held was retried on the survivor: its first attempt
    # went to the target (the only pick when it was sent), its last to the other.
    for i, outcome in enumerate(retried):
        assert not isinstance(outcome, BaseException), f"a request in flight on the killed replica failed: {outcome!r}"
        _, (replica, reply) = outcome
        assert replica == other, f"expected a retry on {other}, got {replica!r}"
        assert reply.usage is not None and reply.usage.completion_tokens == PINNED_TOKENS
        line = await fleet.access_line(request_id(f"pinned {i}"), timeout_s=10.0)
        assert line.get("attempts", 0) >= 2, f"pinned {i} was not retried: {line}"
    retries = await fleet.counter("fleetgate_retries_total") - retries_before
    assert retries >= N_PINNED, f"the gateway counted {retries} retries; {N_PINNED} requests were retried"

    cut = 0
    for tag, ended in zip(stream_tags, outcomes, strict=True):
        assert not isinstance(ended, BaseException), f"a stream failed outside the SSE error path: {ended!r}"
        done_at, o = ended
        print(f"[e2e] stream on {o.replica}: {o.chunks} chunks, then {o.error!r}", flush=True)
        assert o.replica == target
        if o.error is None:  # ran out before the freeze
            assert o.tokens == LONG_TOKENS
            await served_whole_before_freeze(fleet, tag, target, done_at - frozen_at)
            continue
        assert not isinstance(o.error, openai.APIConnectionError), "the stream was cut without an error event"
        assert error_code(o.error) == "upstream_stream_error", o.error.body
        # Every token may have been sent before the cut; the final usage chunk never is.
        assert 0 < o.chunks <= LONG_TOKENS and o.tokens is None
        cut += 1
    assert cut >= N_STREAMS // 2, f"only {cut} of {N_STREAMS} streams were still running at the kill"
    stream_errors = await fleet.counter("fleetgate_stream_errors_total") - stream_errors_before
    assert stream_errors >= cut

    # 3. The launcher starts a new server; it joins the rotation once /health answers.
    _, snap = await fleet.wait_fleet(
        lambda s: s[target]["state"] == "healthy" and s[target]["pid"] not in (None, old_pid),
        RESTART_TIMEOUT_S - (time.monotonic() - killed_at),
        f"{target} restarted and healthy again",
    )
    record_timing("replica SIGKILL -> /admin/fleet shows it restarted and healthy", time.monotonic() - killed_at)
    assert snap[target]["restarts"] == 1
    # The gateway's own log has the exact moments.
    exited = fleet.logged_at("replica exited", target, killed_wall - 0.01)
    respawned = fleet.logged_at("replica started", target, exited or killed_wall)
    healthy = fleet.logged_at("replica healthy", target, respawned or killed_wall)
    assert exited is not None and respawned is not None and healthy is not None, "restart missing from the log"
    record_timing("replica SIGKILL -> launcher saw the exit", exited - killed_wall)
    record_timing("replica SIGKILL -> new server spawned (after backoff)", respawned - killed_wall)
    record_timing("restarted server spawned -> healthy (vLLM start)", healthy - respawned)

    # 4. It serves again: the only choice while the other one is drained.
    await fleet.drain(other)
    try:
        replica, reply = await chat(client, "after restart", 32)
        assert replica == target
        assert reply.usage is not None and reply.usage.completion_tokens == 32
        again = await long_stream(client, "stream after restart", max_tokens=64)
        assert again.replica == target and again.error is None and again.tokens == 64, again
    finally:
        await fleet.undrain(other)
    await fleet.wait_fleet(lambda s: s[other]["state"] == "healthy", 30, f"{other} back in rotation")

    # 5. Nothing of the killed server may live on: its engine and worker are in its group.
    if group_alive(old_pid):
        left = describe_group(old_pid)
        kill_group(old_pid)
        pytest.fail(
            f"{time.monotonic() - killed_at:.0f} s after the SIGKILL of {target}'s API server (pid {old_pid}) "
            f"and its restart, its process group still holds {left}: the launcher restarted the replica "
            "without signalling the dead server's process group, so vLLM's engine and worker live on (killed now)"
        )
