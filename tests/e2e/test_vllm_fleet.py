"""End to end: the gateway in front of real vLLM replicas on CPU, driven with the openai SDK.

The tests run in file order and, after the first, share one fleet (two replicas of the
tiny model; vLLM takes about a minute to start):

1. A SIGKILLed gateway leaves no vLLM process behind (its own one-replica gateway, done
   before the fleet starts so the two never compete for the cores).
2. Chat and legacy completions, streamed and not, with exact token counts; both replicas
   serve; an endpoint vLLM lacks comes back as an OpenAI error.
3. ``vllm:num_requests_running``, scraped into ``/admin/fleet``, rises under a burst.
4. One replica's API server is frozen (SIGSTOP) while long requests run on it, then SIGKILLed
   under steady load: no non-streaming request fails (the ones it was working on are
   retried on the other), the streams it was serving end with an error event, and the
   launcher restarts it until it serves again.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import openai
import pytest
from openai import AsyncOpenAI
from openai.types.chat import ChatCompletion, ChatCompletionMessageParam

from tests.e2e.conftest import (
    FLEET_START_TIMEOUT_S,
    MODEL,
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

pytestmark = pytest.mark.e2e

# The tiny model emits its EOS now and then; exact token counts need ignore_eos (a vLLM extension).
IGNORE_EOS = {"ignore_eos": True}
PROMPT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Tell me a long story about a gateway."}]
REPLICA_HEADER = "x-fleetgate-replica"
REQUEST_ID_HEADER = "x-request-id"
# As long as the tiny model's 4096 positions allow, to still be generating when the
# replica dies a second or two after they start. How long that lasts depends on the
# machine: eight such requests kept one replica busy for 15 s or more on a busy one; on a
# quiet one they ran out within a few seconds, which is why the test freezes the replica
# as soon as they have begun.
LONG_TOKENS = 4000
# Few streams: relaying thousands of chunks a second keeps this test's event loop and the
# gateway's busy, which delays the control calls that lead up to the kill.
N_STREAMS = 2
N_PINNED = 6
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


# -- 4. a replica dies under load -------------------------------------------------------------


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


async def long_stream(
    client: AsyncOpenAI, tag: str, started: asyncio.Event, max_tokens: int = LONG_TOKENS
) -> StreamOutcome:
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
                started.set()
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
    print(f"[e2e] {tag}: whole from {target}, read {seen_after_s:.2f} s after the freeze: {line}", flush=True)
    assert line.get("status") == 200 and line.get("replica") == target, line
    assert line.get("attempts") == 1, f"{tag} was retried yet came back under {target}'s name: {line}"
    assert line.get("completion_tokens") == LONG_TOKENS, line


async def finished_at(call: Awaitable[T]) -> tuple[float, T]:
    """``call``'s result with the monotonic time it came back."""
    result = await call
    return time.monotonic(), result


def undrain_and_kill(
    fleet: E2EGateway,
    target: str,
    other: str,
    pid: int,
    start_load: Callable[[], object],
    results: list[Result],
) -> tuple[float, float, dict[str, Any]]:
    """With ``pid`` frozen: undrain ``other``, start the steady load, and SIGKILL ``pid`` once a
    steady request was answered (at most 1 s later).

    Returns (monotonic and wall-clock time of the kill, the target's snapshot before it).
    """
    print(f"[e2e] kill thread running at {time.monotonic():.2f}", flush=True)
    snap = fleet.fleet_sync()
    fleet.admin_post(other, "undrain")
    back, _ = fleet.wait_fleet_sync(lambda s: s[other]["state"] == "healthy", 30, f"{other} back in rotation")
    start_load()
    deadline = time.monotonic() + 1.0
    while not results and time.monotonic() < deadline:
        time.sleep(0.02)
    killed_at, killed_wall = time.monotonic(), time.time()
    os.kill(pid, signal.SIGKILL)
    print(f"[e2e] {other} back after {back:.2f} s; killed at {killed_at:.2f} ({len(results)} steady done)", flush=True)
    return killed_at, killed_wall, snap[target]


async def wait_started(events: list[asyncio.Event], tasks: list[asyncio.Task[Any]], timeout_s: float) -> None:
    """Until every stream had its first chunk; fails at once if one of ``tasks`` already ended."""
    deadline = time.monotonic() + bounded(timeout_s)
    while not all(e.is_set() for e in events):
        ended = [t for t in tasks if t.done()]
        assert not ended, f"a long request ended before the kill: {ended[0].exception() or ended[0].result()!r}"
        assert time.monotonic() < deadline, f"the streams had no first chunk within {timeout_s:g} s"
        await asyncio.sleep(0.05)


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

    # 1. Long streams and long non-streaming requests on the target: with the other
    #    replica drained it is the only one the gateway may pick.
    await fleet.drain(other)
    started = [asyncio.Event() for _ in range(N_STREAMS)]
    streams = [
        asyncio.create_task(finished_at(long_stream(client, f"stream {i}", started[i]))) for i in range(N_STREAMS)
    ]
    pinned = [asyncio.create_task(finished_at(chat(client, f"pinned {i}", LONG_TOKENS))) for i in range(N_PINNED)]
    go = asyncio.Event()
    results: list[Result] = []
    workers = [asyncio.create_task(steady_load(client, w, go, results)) for w in range(4)]
    try:
        # A long non-streaming request may already have run out (checked below).
        await wait_started(started, streams, 60)
        # Freeze the target's API server at once, from this coroutine: the tiny model may
        # finish 4000 tokens within the seconds the control calls below can take on a busy
        # machine (seen: 16 s for one POST, 11 s before a worker thread ran). A stopped
        # server answers nothing more, so what is in flight now is what the kill cuts; it
        # stays short of the health probes' 15 s timeout, so the gateway sees what it
        # would of a plain SIGKILL.
        os.kill(old_pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        # When the replica was frozen, and (below) when the worker thread ran.
        print(f"[e2e] streams started, {target} frozen at {frozen_at:.2f}", flush=True)
        # 2. Undrain the other replica, start the steady load, SIGKILL the target's API server,
        #    all from a worker thread: the kill must not wait for turns of this event loop
        #    (busy with the streams).
        loop = asyncio.get_running_loop()
        killed_at, killed_wall, before = await asyncio.to_thread(
            undrain_and_kill, fleet, target, other, old_pid, lambda: loop.call_soon_threadsafe(go.set), results
        )
        print(f"[e2e] {target} before the kill: {before['outstanding_requests']} in flight", flush=True)
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
    failures = [r for r in results if not r.ok]
    assert not failures, f"{len(failures)} non-streaming requests failed during the kill: {failures[:5]}"
    after_kill = sum(killed_at < r.done_at < stopped_at for r in results)
    assert after_kill >= 4, f"too little steady load to show anything: {after_kill} requests after the kill"

    # Each long request either ran out on the target before the freeze (a fast machine gets
    # through 4000 tokens in a few seconds) or was retried on the survivor; at least half
    # must have been in flight, or the test showed nothing.
    moved = 0
    for i, outcome in enumerate(retried):
        assert not isinstance(outcome, BaseException), f"a request in flight on the killed replica failed: {outcome!r}"
        done_at, (replica, reply) = outcome
        assert reply.usage is not None and reply.usage.completion_tokens == LONG_TOKENS
        if replica == target:
            await served_whole_before_freeze(fleet, f"pinned {i}", target, done_at - frozen_at)
            continue
        assert replica == other, f"expected a retry on {other}, got {replica!r}"
        moved += 1
    print(f"[e2e] long requests retried on {other}: {moved} of {N_PINNED}", flush=True)
    assert moved >= N_PINNED // 2, f"only {moved} of {N_PINNED} long requests were still running at the kill"
    retries = await fleet.counter("fleetgate_retries_total") - retries_before
    assert retries >= moved, f"the gateway counted {retries} retries; {moved} requests were retried"

    cut = 0
    for i, ended in enumerate(outcomes):
        assert not isinstance(ended, BaseException), f"a stream failed outside the SSE error path: {ended!r}"
        done_at, o = ended
        print(f"[e2e] stream on {o.replica}: {o.chunks} chunks, then {o.error!r}", flush=True)
        assert o.replica == target
        if o.error is None:
            # Ran out before the freeze, like a long request above.
            assert o.tokens == LONG_TOKENS
            await served_whole_before_freeze(fleet, f"stream {i}", target, done_at - frozen_at)
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
        again = await long_stream(client, "stream after restart", asyncio.Event(), max_tokens=64)
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
