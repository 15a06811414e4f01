"""Streams that outlive their replica, on real vLLM (CPU): killed, hung and drained replicas.

This starts ``fleetgate serve`` with two managed ``engine: vllm`` replicas of the tiny test
model (``scripts/build_tiny_model.py``) through the gateway's own launcher, each pinned to its
own core (``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1), and runs, on that one gateway:

- ``kill``: 16 concurrent greedy chat streams (256-512 tokens, seeded); their uninterrupted
  answers are streamed first, the same requests; then once every stream has its first token
  the replica holding most of them gets SIGKILL (its process group). Every stream must end
  whole (its ``max_tokens`` or a natural stop, valid SSE, one ``[DONE]``, no error event, one
  id), and its text is compared with the uninterrupted answer (where it differs, the
  character offset, and the client's text length when its replica failed).
- ``stop``: the same with SIGSTOP (a hung engine): each stream's longest silence, no stream
  cut; SIGCONT afterwards.
- ``drain``: 16 streams of 1000-1200 tokens (``ignore_eos``); replica A is drained
  (``POST /admin/replicas/{id}/drain``) and the time until it holds no stream is measured,
  then it is undrained and, once healthy again, B gets the same (a rolling restart).
- ``drain-both``: both replicas drained at once, nowhere to move their streams to: they
  should finish where they are.
- ``restart``: a rolling restart, each replica in turn restarted by
  ``POST /admin/replicas/{id}/restart`` while 16 streams of 3000-3500 tokens are kept running
  (a new one as one ends) until both serve again: no stream may be cut, and each old process
  should be gone seconds after the call, whatever the streams' length.
- ``kill-messages``, ``kill-responses``: ``kill`` for ``/v1/messages`` and ``/v1/responses``.

For every stream the usage's completion tokens the client received are compared with the
access line's, and per scenario their sum with ``fleetgate_tokens_total{direction="completion"}``'s
delta on ``/metrics``.

    flock /tmp/vllm.lock .venv/bin/python bench/continuation_failover.py
    flock /tmp/vllm.lock .venv/bin/python bench/continuation_failover.py --scenarios kill,drain --no-write

Results go to ``bench/results/continuation-failover.md`` (and the per-stream data to ``.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import orjson
import yaml

from bench.routing_vllm import VLLM_PYTHON, build_tiny_model
from bench.soak import cpu_name
from gateway.settings import hash_key
from replicas.launcher import free_port, group_members

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "continuation-failover.md"
PARTIAL = Path(tempfile.gettempdir()) / "continuation-failover.partial.json"
MODEL = "tiny"
API_KEY = "sk-failover-bench"
ADMIN_KEY = "sk-failover-bench-admin"
VLLM_ARGS = ["--max-model-len", "4096", "--enforce-eager"]
READY_TIMEOUT_S = 400.0
CLIENT_TIMEOUT_S = 400.0
CHUNK_GAP_S = 4.0
STALL_TIMEOUT_S = 60.0
HEALTH = {
    "interval_s": 0.5,
    "timeout_s": 2.0,
    "failures_to_down": 2,
    "progress_window_s": 2.0,
    "start_timeout_s": READY_TIMEOUT_S,
}
SCENARIOS = ("kill", "stop", "drain", "drain-both", "restart", "kill-messages", "kill-responses")
# The rolling restart's streams: long enough to outlast a drain many times over.
RESTART_STREAM_TOKENS = (3000, 3500)
PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}
WORDS = "the fleet serves tokens while a gateway routes each request to a warm replica".split()
LOGGED = ("continued", "moved", "down", "cut", "restart", "exited", "drain", "stall", "budget", "retry")
_SERIES = re.compile(r"^(\w+)\{([^}]*)\} (\S+)$")


@dataclass
class Stream:
    """One streamed request as the client saw it."""

    rid: str
    api: str
    max_tokens: int
    started: float = 0.0
    replica: str = ""
    cache: str = ""
    status: int = 0
    text: str = ""
    # (time since start, characters of text so far) per event carrying text
    marks: list[tuple[float, int]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)
    dones: int = 0
    ends: int = 0  # message_stop / response.completed
    finish: list[str] = field(default_factory=list)
    usage_completion: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    bad_lines: int = 0
    ended_at: float = 0.0
    access: dict[str, Any] = field(default_factory=dict)

    @property
    def longest_gap(self) -> float:
        return max((b[0] - a[0] for a, b in itertools.pairwise(self.marks)), default=0.0)

    def gap_after(self, t: float) -> tuple[float, int]:
        """The longest silence after ``t`` (since start) and the text length before it."""
        best, at = 0.0, len(self.text)
        for a, b in itertools.pairwise(self.marks):
            if b[0] > t and b[0] - max(a[0], t) > best:
                best, at = b[0] - max(a[0], t), a[1]
        return best, at

    def whole(self) -> list[str]:
        """Why the stream is not a whole, valid one (empty: it is)."""
        faults = []
        if self.status != 200:
            faults.append(f"http {self.status}")
        if self.errors:
            faults.append("error event: " + ",".join(self.errors))
        if self.bad_lines:
            faults.append(f"{self.bad_lines} unparsable events")
        if len(set(self.ids)) != 1:
            faults.append(f"{len(set(self.ids))} ids")
        if self.api == "chat" and self.dones != 1:
            faults.append(f"{self.dones} [DONE]")
        if self.api != "chat" and self.ends != 1:
            faults.append(f"{self.ends} end events")
        if len(self.finish) != 1:
            faults.append(f"{len(self.finish)} finish reasons")
        if len(self.usage_completion) != 1:
            faults.append(f"{len(self.usage_completion)} usages")
        elif self.finish and self.finish[0] in ("length", "max_tokens", "incomplete"):
            if self.usage_completion[0] != self.max_tokens:
                faults.append(f"usage {self.usage_completion[0]} != max_tokens {self.max_tokens}")
        elif self.finish and self.finish[0] not in ("stop", "end_turn", "completed"):
            faults.append(f"finish {self.finish[0]}")
        return faults


def gateway_config(port: int, model_dir: Path, dtype: str) -> dict[str, Any]:
    def replica(core: int) -> dict[str, Any]:
        return {
            "engine": "vllm",
            "count": 1,
            "python": str(VLLM_PYTHON),
            "model_path": str(model_dir),
            "args": [*VLLM_ARGS, "--dtype", dtype],
            "env": {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core)},
        }

    return {
        "server": {"port": port, "shutdown_grace_s": 5.0},
        "models": [{"name": MODEL, "replicas": [replica(0), replica(1)]}],
        "upstream": {
            "connect_timeout_s": 5.0,
            "chunk_gap_timeout_s": CHUNK_GAP_S,
            "stall_timeout_s": STALL_TIMEOUT_S,
            "max_continuations": 2,
            "migrate_after_s": 2.0,
        },
        "health": HEALTH,
        "restart": {"backoff_initial_s": 0.5, "backoff_max_s": 5.0, "stop_timeout_s": 15.0},
        "tenants": [{"id": "bench", "api_keys": [f"sha256:{hash_key(API_KEY)}"]}],
        "admin_api_keys": [f"sha256:{hash_key(ADMIN_KEY)}"],
    }


class Gateway:
    def __init__(self, workdir: Path, port: int) -> None:
        self.workdir = workdir
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.pgids: set[int] = set()  # every replica process group seen
        self.stopped: set[int] = set()

    def admin(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ADMIN_KEY}"}

    async def fleet(self, session: aiohttp.ClientSession) -> dict[str, dict[str, Any]]:
        async with session.get(
            f"{self.url}/admin/fleet", headers=self.admin(), timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            body = await resp.json()
        replicas = body["replicas"] if isinstance(body, dict) else body
        out = {r["id"]: r for r in replicas}
        self.pgids.update(int(r["pid"]) for r in replicas if r.get("pid"))
        return out

    async def metrics(self, session: aiohttp.ClientSession) -> str:
        async with session.get(
            f"{self.url}/metrics", headers=self.admin(), timeout=aiohttp.ClientTimeout(total=10)
        ) as resp:
            return await resp.text()

    async def wait_healthy(self, session: aiohttp.ClientSession, within_s: float = READY_TIMEOUT_S) -> float:
        started = time.monotonic()
        while time.monotonic() - started < within_s:
            assert self.proc is not None and self.proc.poll() is None, "the gateway exited"
            with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError):
                fleet = await self.fleet(session)
                # Routable again: healthy, breaker closed, not stalled (a scenario's failures
                # open the victim's breaker for breaker_cooldown_s).
                if len(fleet) == 2 and all(
                    r["state"] == "healthy" and not r["breaker_open"] and not r["stalled"] for r in fleet.values()
                ):
                    return time.monotonic() - started
            await asyncio.sleep(0.5)
        raise RuntimeError("the two vLLM replicas did not become healthy")


@contextlib.contextmanager
def gateway(workdir: Path, port: int, model_dir: Path, dtype: str) -> Iterator[Gateway]:
    with serve(workdir, gateway_config(port, model_dir, dtype)) as gw:
        yield gw


@contextlib.contextmanager
def serve(workdir: Path, config: dict[str, Any]) -> Iterator[Gateway]:
    """``fleetgate serve`` on ``config`` (its access log and stderr in ``workdir``); on exit,
    it and every replica process group it started are gone, stopped ones woken first."""
    path = workdir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    gw = Gateway(workdir, int(config["server"]["port"]))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    with (workdir / "access.log").open("wb") as out, (workdir / "gateway.log").open("wb") as err:
        gw.proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--log-dir", str(workdir)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            start_new_session=True,
        )
        try:
            yield gw
        finally:
            for pgid in gw.stopped:  # a hung engine cannot stop
                with contextlib.suppress(OSError):
                    os.killpg(pgid, signal.SIGCONT)
            if gw.proc.poll() is None:
                gw.proc.send_signal(signal.SIGTERM)
                try:
                    gw.proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(gw.proc.pid, signal.SIGKILL)
                    gw.proc.wait()
            for pgid in gw.pgids | {gw.proc.pid}:  # nothing it started outlives it
                if group_members(pgid):
                    with contextlib.suppress(OSError):
                        os.killpg(pgid, signal.SIGKILL)


def series(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SERIES.match(line)
        if match and match.group(1) == name:
            out[match.group(2)] = float(match.group(3))
    return out


def completion_tokens_metric(text: str) -> float:
    return sum(v for k, v in series(text, "fleetgate_tokens_total").items() if 'direction="completion"' in k)


def metric_sum(text: str, name: str) -> float:
    return sum(series(text, name).values()) + sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
    )


def continuations_metric(text: str) -> dict[str, float]:
    out = {}
    for k, v in series(text, "fleetgate_stream_continuations_total").items():
        reason = re.search(r'reason="([^"]*)"', k)
        out[reason.group(1) if reason else k] = v
    return out


def request_body(api: str, prompt: str, max_tokens: int, ignore_eos: bool) -> dict[str, Any]:
    if api == "chat":
        body: dict[str, Any] = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens,
            "stream_options": {"include_usage": True},
        }
    elif api == "messages":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    else:
        body = {"input": prompt, "max_output_tokens": max_tokens}
    body.update({"model": MODEL, "stream": True, "temperature": 0})
    if ignore_eos:
        body["ignore_eos"] = True
    return body


def plan_requests(seed: int, n: int, lo: int, hi: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [(" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 120))), rng.randint(lo, hi)) for _ in range(n)]


def absorb(stream: Stream, api: str, event_name: str, data: bytes, now: float) -> None:
    """One SSE event into ``stream``."""
    if api == "chat" and data == b"[DONE]":
        stream.dones += 1
        return
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        stream.bad_lines += 1
        return
    if not isinstance(event, dict):
        stream.bad_lines += 1
        return
    kind = event.get("type") or event_name
    if "error" in event and (api == "chat" or kind == "error"):
        err = event["error"]
        stream.errors.append(str(err.get("code") or err.get("type")) if isinstance(err, dict) else str(err))
        return
    piece = ""
    if api == "chat":
        if event.get("id"):
            stream.ids.append(event["id"])
        for choice in event.get("choices") or []:
            piece += (choice.get("delta") or {}).get("content") or ""
            if choice.get("finish_reason"):
                stream.finish.append(choice["finish_reason"])
        if event.get("usage"):
            stream.usage_completion.append(int(event["usage"].get("completion_tokens") or 0))
    elif api == "messages":
        if kind == "message_start":
            stream.ids.append(event["message"]["id"])
        elif kind == "content_block_delta":
            piece = (event.get("delta") or {}).get("text") or ""
        elif kind == "message_delta":
            if (event.get("delta") or {}).get("stop_reason"):
                stream.finish.append(event["delta"]["stop_reason"])
            if event.get("usage"):
                stream.usage_completion.append(int(event["usage"].get("output_tokens") or 0))
        elif kind == "message_stop":
            stream.ends += 1
    else:
        if kind == "response.created":
            stream.ids.append(event["response"]["id"])
        elif kind == "response.output_text.delta":
            piece = event.get("delta") or ""
        elif kind in ("response.completed", "response.incomplete", "response.failed"):
            stream.ends += 1
            response = event.get("response") or {}
            if kind == "response.failed":
                stream.errors.append("response.failed")
            status = response.get("status")
            stream.finish.append("incomplete" if status == "incomplete" else str(status))
            if response.get("usage"):
                stream.usage_completion.append(int(response["usage"].get("output_tokens") or 0))
    if piece:
        stream.text += piece
        stream.marks.append((now - stream.started, len(stream.text)))


async def one_stream(
    session: aiohttp.ClientSession,
    url: str,
    api: str,
    rid: str,
    prompt: str,
    max_tokens: int,
    ignore_eos: bool,
    first: asyncio.Event | None = None,
) -> Stream:
    stream = Stream(rid, api, max_tokens, started=time.monotonic())
    headers = {
        "Authorization": f"Bearer {API_KEY}",
        "x-api-key": API_KEY,
        "Content-Type": "application/json",
        "x-request-id": rid,
        # Not from the gateway's answer cache (the same greedy requests run twice), nor kept in it.
        "Cache-Control": "no-cache, no-store",
    }
    try:
        async with session.post(
            url + PATHS[api],
            data=orjson.dumps(request_body(api, prompt, max_tokens, ignore_eos)),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
        ) as resp:
            stream.status = resp.status
            stream.replica = resp.headers.get("x-fleetgate-replica", "")
            stream.cache = resp.headers.get("x-fleetgate-cache", "")
            if resp.status != 200:
                stream.errors.append(f"http_{resp.status}: {(await resp.text())[:200]}")
                return stream
            event_name = ""
            async for raw in resp.content:
                line = raw.rstrip(b"\r\n")
                if line.startswith(b"event:"):
                    event_name = line[6:].strip().decode()
                elif line.startswith(b"data:"):
                    absorb(stream, api, event_name, line[5:].strip(), time.monotonic())
                    if first is not None and stream.text:
                        first.set()
                elif not line:
                    event_name = ""
    except (aiohttp.ClientError, TimeoutError) as exc:
        stream.errors.append(type(exc).__name__)
    finally:
        if first is not None:
            first.set()
        stream.ended_at = time.monotonic() - stream.started
    return stream


def read_json_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_bytes().splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            value = orjson.loads(line)
            if isinstance(value, dict):
                out.append(value)
    return out


def divergence_cause(row: dict[str, Any], continued: bool) -> str:
    """Why a stream's text differs from its uninterrupted answer, as far as the client can tell.

    - ``engine``: it differs where no continuation was involved: a stream that was never
      continued (its replica's batch changed when the failed replica's streams arrived), or
      one that diverged before its replica failed (greedy decoding on CPU varies with the
      batch it runs in);
    - ``longer``: the uninterrupted answer is a prefix of it: the continuation was given more
      tokens than were left (the tokens relayed before the cut were undercounted: the
      engine sends several tokens in one event when its reader falls behind);
    - ``continuation``: it diverges at or after the cut: re-tokenising the partial text
      changed its tokens, or the new replica's own numerics.
    """
    at = row["diverges_at"]
    if at is None:
        return "-"
    if not continued or at < row.get("chars_at_failure", 0):
        return "engine"
    if at == row["ref_chars"] and row["chars"] > at:
        return "longer"
    return "continuation"


def diverge_at(a: str, b: str) -> int | None:
    if a == b:
        return None
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


async def failure_scenario(
    gw: Gateway, session: aiohttp.ClientSession, name: str, api: str, sig: signal.Signals, args: argparse.Namespace
) -> dict[str, Any]:
    """Reference answers, then the same streams with their busiest replica killed or hung."""
    requests = plan_requests(args.seed, args.streams, 256, 512)
    print(f"[{name}] reference run ({len(requests)} streams)", flush=True)
    refs = await asyncio.gather(
        *(one_stream(session, gw.url, api, f"{name}-ref-{i}", p, m, False) for i, (p, m) in enumerate(requests))
    )
    # The engine's own repeatability: the same uninterrupted run again, compared with the first.
    again = await asyncio.gather(
        *(one_stream(session, gw.url, api, f"{name}-again-{i}", p, m, False) for i, (p, m) in enumerate(requests))
    )
    repeat_equal = sum(a.text == r.text for a, r in zip(again, refs, strict=True))
    await gw.wait_healthy(session)
    before = await gw.metrics(session)
    firsts = [asyncio.Event() for _ in requests]
    t0 = time.monotonic()
    tasks = [
        asyncio.create_task(one_stream(session, gw.url, api, f"{name}-{i}", p, m, False, firsts[i]))
        for i, (p, m) in enumerate(requests)
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
    fleet = await gw.fleet(session)
    held = {rid: r["outstanding_requests"] for rid, r in fleet.items()}
    victim = max(held, key=lambda k: held[k])
    pgid = int(fleet[victim]["pid"])
    members = len(group_members(pgid))
    t_fail = time.monotonic()
    os.killpg(pgid, sig)
    if sig == signal.SIGSTOP:
        gw.stopped.add(pgid)
    print(f"[{name}] {sig.name} {victim} (pgid {pgid}, {members} processes) holding {held}", flush=True)
    streams = await asyncio.gather(*tasks)
    if sig == signal.SIGSTOP:
        os.killpg(pgid, signal.SIGCONT)
        gw.stopped.discard(pgid)
    took = time.monotonic() - t0
    await asyncio.sleep(1.0)
    after = await gw.metrics(session)
    recover_started = time.monotonic()
    await gw.wait_healthy(session)
    recovered = time.monotonic() - recover_started
    return finish_scenario(
        gw,
        name,
        streams,
        before,
        after,
        extra={
            "signal": sig.name,
            "victim": victim,
            "held_at_failure": held,
            "failure_at_s": t_fail - t0,
            "took_s": took,
            "healthy_again_after_s": recovered,
            "repeat_equal": repeat_equal,
        },
        refs=refs,
        t_fail=t_fail,
    )


def finish_scenario(
    gw: Gateway,
    name: str,
    streams: list[Stream],
    before: str,
    after: str,
    extra: dict[str, Any],
    refs: list[Stream] | None = None,
    t_fail: float | None = None,
) -> dict[str, Any]:
    access = {a.get("request_id"): a for a in read_json_lines(gw.workdir / "access.log")}
    per = []
    for i, s in enumerate(streams):
        s.access = access.get(s.rid, {})
        row: dict[str, Any] = {
            "rid": s.rid,
            "replica": s.replica,
            "cache": s.cache,
            "max_tokens": s.max_tokens,
            "faults": s.whole(),
            "finish": s.finish,
            "usage_client": s.usage_completion[-1] if s.usage_completion else None,
            "usage_access": s.access.get("completion_tokens"),
            "continued": s.access.get("continued", []),
            "cut": s.access.get("cut"),
            "longest_gap_s": round(s.longest_gap, 2),
            "duration_s": round(s.ended_at, 2),
            "chars": len(s.text),
            "text": s.text,
        }
        if t_fail is not None:
            gap, at = s.gap_after(t_fail - s.started)
            row["gap_after_failure_s"] = round(gap, 2)
            row["chars_at_failure"] = at
        if refs is not None:
            ref = refs[i]
            row["ref_faults"] = ref.whole()
            row["ref_chars"] = len(ref.text)
            row["ref_text"] = ref.text
            row["equal"] = s.text == ref.text
            row["diverges_at"] = diverge_at(s.text, ref.text)
            row["cause"] = divergence_cause(row, bool(row["continued"]))
            row["ref_usage"] = ref.usage_completion[-1] if ref.usage_completion else None
        per.append(row)
    client_sum = sum(r["usage_client"] or 0 for r in per)
    metric_delta = completion_tokens_metric(after) - completion_tokens_metric(before)
    cont_before, cont_after = continuations_metric(before), continuations_metric(after)
    result = {
        "name": name,
        "streams": per,
        "whole": sum(not r["faults"] for r in per),
        "cut": sum(bool(r["cut"]) for r in per),
        "continued": sum(bool(r["continued"]) for r in per),
        "usage_match": sum(r["usage_client"] is not None and r["usage_client"] == r["usage_access"] for r in per),
        "usage_client_sum": client_sum,
        "usage_metric_delta": metric_delta,
        "continuations_metric_delta": {k: v - cont_before.get(k, 0.0) for k, v in cont_after.items()},
        "retry_budget_exhausted_delta": metric_sum(after, "fleetgate_retry_budget_exhausted_total")
        - metric_sum(before, "fleetgate_retry_budget_exhausted_total"),
        "stream_cuts_delta": metric_sum(after, "fleetgate_stream_cuts_total")
        - metric_sum(before, "fleetgate_stream_cuts_total"),
        **extra,
    }
    if refs is not None:
        result["equal"] = sum(r["equal"] for r in per)
        result["causes"] = {c: sum(r["cause"] == c for r in per) for c in ("engine", "longer", "continuation")}
    print(
        f"[{name}] whole {result['whole']}/{len(per)}, cut {result['cut']}, continued {result['continued']}, "
        f"equal {result.get('equal', '-')}, usage match {result['usage_match']}, "
        f"client sum {client_sum} vs metric delta {metric_delta:g}",
        flush=True,
    )
    return result


async def tokenize_texts(gw: Gateway, session: aiohttp.ClientSession, result: dict[str, Any]) -> None:
    """Each stream's text re-tokenised on a replica: the tokens the client holds, to set
    beside its usage (equal to it for an uninterrupted stream, bar re-tokenising)."""
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, KeyError, StopIteration):
        base = next(r["url"] for r in (await gw.fleet(session)).values() if r["state"] == "healthy")
        for row in result["streams"]:
            async with session.post(
                f"{base}/tokenize",
                json={"model": MODEL, "prompt": row["text"], "add_special_tokens": False},
                timeout=aiohttp.ClientTimeout(total=30),
            ) as resp:
                row["text_tokens"] = (await resp.json()).get("count")


async def drain_scenario(gw: Gateway, session: aiohttp.ClientSession, args: argparse.Namespace) -> dict[str, Any]:
    requests = plan_requests(args.seed + 1, args.streams, 1000, 1200)
    await gw.wait_healthy(session)
    before = await gw.metrics(session)
    firsts = [asyncio.Event() for _ in requests]
    t0 = time.monotonic()
    tasks = [
        asyncio.create_task(one_stream(session, gw.url, "chat", f"drain-{i}", p, m, True, firsts[i]))
        for i, (p, m) in enumerate(requests)
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
    order = sorted(await gw.fleet(session))
    drains = []
    for rid in order:
        fleet = await gw.fleet(session)
        held = {k: r["outstanding_requests"] for k, r in fleet.items()}
        t = time.monotonic()
        async with session.post(f"{gw.url}/admin/replicas/{rid}/drain", headers=gw.admin()) as resp:
            status = resp.status
        empty_after = None
        while time.monotonic() - t < 300:
            fleet = await gw.fleet(session)
            if fleet[rid]["outstanding_requests"] == 0:
                empty_after = time.monotonic() - t
                break
            if all(task.done() for task in tasks):
                break
            await asyncio.sleep(0.1)
        async with session.post(f"{gw.url}/admin/replicas/{rid}/undrain", headers=gw.admin()) as resp:
            undrain_status = resp.status
        healthy_after = await gw.wait_healthy(session, 120)
        open_streams = sum(not task.done() for task in tasks)
        drains.append(
            {
                "replica": rid,
                "drain_status": status,
                "undrain_status": undrain_status,
                "held_at_drain": held,
                "empty_after_s": empty_after,
                "healthy_after_undrain_s": healthy_after,
                "at_s": t - t0,
                "streams_open_after": open_streams,
            }
        )
        print(f"[drain] {rid}: held {held}, empty after {empty_after}, open streams {open_streams}", flush=True)
    streams = await asyncio.gather(*tasks)
    took = time.monotonic() - t0
    await asyncio.sleep(1.0)
    after = await gw.metrics(session)
    return finish_scenario(gw, "drain", streams, before, after, extra={"drains": drains, "took_s": took})


async def drain_both_scenario(gw: Gateway, session: aiohttp.ClientSession, args: argparse.Namespace) -> dict[str, Any]:
    """Both replicas drained at once (no other replica to move to): their streams should
    finish where they are, as they did before streams could move."""
    requests = plan_requests(args.seed + 2, args.streams, 1000, 1200)
    await gw.wait_healthy(session)
    before = await gw.metrics(session)
    firsts = [asyncio.Event() for _ in requests]
    t0 = time.monotonic()
    tasks = [
        asyncio.create_task(one_stream(session, gw.url, "chat", f"drain-both-{i}", p, m, True, firsts[i]))
        for i, (p, m) in enumerate(requests)
    ]
    await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
    fleet = await gw.fleet(session)
    held = {k: r["outstanding_requests"] for k, r in fleet.items()}
    for rid in sorted(fleet):
        async with session.post(f"{gw.url}/admin/replicas/{rid}/drain", headers=gw.admin()) as resp:
            assert resp.status == 200, resp.status
    streams = await asyncio.gather(*tasks)
    took = time.monotonic() - t0
    for rid in sorted(fleet):
        async with session.post(f"{gw.url}/admin/replicas/{rid}/undrain", headers=gw.admin()) as resp:
            assert resp.status == 200, resp.status
    await gw.wait_healthy(session, 120)
    after = await gw.metrics(session)
    print(f"[drain-both] held {held}", flush=True)
    return finish_scenario(gw, "drain-both", streams, before, after, extra={"held_at_drain": held, "took_s": took})


async def restart_scenario(gw: Gateway, session: aiohttp.ClientSession, args: argparse.Namespace) -> dict[str, Any]:
    """A rolling restart: each replica in turn restarted (``POST /admin/replicas/{id}/restart``:
    drained, stopped, started again) while ``args.streams`` streams are kept running the whole
    time, a new one starting as one ends, until both replicas serve again. Per restart: how
    long from the call until the old process was gone (its streams moved, it stopped), and
    until the new one was healthy."""
    lo, hi = RESTART_STREAM_TOKENS
    requests = plan_requests(args.seed + 3, 4 * args.streams, lo, hi)
    await gw.wait_healthy(session)
    before = await gw.metrics(session)
    t0 = time.monotonic()
    rolling = True
    streams: list[Stream] = []
    numbers = itertools.count()

    async def keep_one() -> None:
        while rolling:
            i = next(numbers)
            prompt, max_tokens = requests[i % len(requests)]
            streams.append(await one_stream(session, gw.url, "chat", f"restart-{i}", prompt, max_tokens, True))

    workers = [asyncio.create_task(keep_one()) for _ in range(args.streams)]
    await asyncio.sleep(5.0)  # every stream under way
    restarts = []
    for rid in sorted(await gw.fleet(session)):
        fleet = await gw.fleet(session)
        held = {k: r["outstanding_requests"] for k, r in fleet.items()}
        pid = fleet[rid]["pid"]
        t = time.monotonic()
        async with session.post(f"{gw.url}/admin/replicas/{rid}/restart", headers=gw.admin()) as resp:
            status = resp.status
        stopped_after = healthy_after = None
        while time.monotonic() - t < READY_TIMEOUT_S:
            now = (await gw.fleet(session))[rid]
            if stopped_after is None and now["pid"] != pid:
                stopped_after = time.monotonic() - t
            if now["pid"] != pid and now["state"] == "healthy":
                healthy_after = time.monotonic() - t
                break
            await asyncio.sleep(0.1)
        restarts.append(
            {
                "replica": rid,
                "status": status,
                "held_at_restart": held,
                "at_s": t - t0,
                "stopped_after_s": stopped_after,
                "healthy_after_s": healthy_after,
            }
        )
        print(f"[restart] {rid}: held {held}, stopped after {stopped_after}, healthy after {healthy_after}", flush=True)
    rolling = False
    await asyncio.gather(*workers)
    took = time.monotonic() - t0
    await asyncio.sleep(1.0)
    after = await gw.metrics(session)
    return finish_scenario(gw, "restart", streams, before, after, extra={"restarts": restarts, "took_s": took})


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    model_dir = build_tiny_model()
    port = free_port()
    results: dict[str, Any] = {"scenarios": []}
    with tempfile.TemporaryDirectory(prefix="failover-vllm-") as tmp:
        workdir = Path(tmp)
        with gateway(workdir, port, model_dir, args.dtype) as gw:
            async with aiohttp.ClientSession() as session:
                results["ready_s"] = await gw.wait_healthy(session)
                print(f"[failover] both replicas healthy after {results['ready_s']:.0f} s", flush=True)
                for name in args.scenarios.split(","):
                    try:
                        if name == "kill":
                            r = await failure_scenario(gw, session, name, "chat", signal.SIGKILL, args)
                        elif name == "stop":
                            r = await failure_scenario(gw, session, name, "chat", signal.SIGSTOP, args)
                        elif name == "drain":
                            r = await drain_scenario(gw, session, args)
                        elif name == "drain-both":
                            r = await drain_both_scenario(gw, session, args)
                        elif name == "restart":
                            r = await restart_scenario(gw, session, args)
                        elif name in ("kill-messages", "kill-responses"):
                            api = name.split("-")[1]
                            r = await failure_scenario(gw, session, name, api, signal.SIGKILL, args)
                        else:
                            raise SystemExit(f"unknown scenario {name}")
                    except (RuntimeError, TimeoutError, AssertionError, aiohttp.ClientError) as exc:
                        r = {"name": name, "failed": f"{type(exc).__name__}: {exc}"}
                        print(f"[{name}] failed: {exc}", flush=True)
                    if "streams" in r:
                        await tokenize_texts(gw, session, r)
                    results["scenarios"].append(r)
                    with contextlib.suppress(OSError, TypeError):  # what is done so far, should a later one hang
                        PARTIAL.write_bytes(orjson.dumps(results))
            logged = read_json_lines(workdir / "gateway.log")
            results["gateway_log"] = [line for line in logged if any(w in str(line.get("msg")) for w in LOGGED)]
    results["took_s"] = time.monotonic() - started
    return results


def _seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f} s"


def _bar(ok: bool) -> str:
    return "pass" if ok else "**FAIL**"


def report(results: dict[str, Any]) -> str:
    """The results page: method, figures and bars per scenario (the raw data: the .json)."""
    args = results["args"]
    dtype = args.get("dtype", "bfloat16")
    out = f" --out {args['out']}" if args.get("out") else ""
    lines = [
        "# Streams that outlive their replica, on real vLLM (CPU)",
        "",
        f"`flock /tmp/vllm.lock .venv/bin/python bench/continuation_failover.py --scenarios {args['scenarios']} "
        f"--streams {args['streams']} --seed {args['seed']} --dtype {dtype}{out}` at {results['commit']}, "
        f"on {results['cpu']} ({results['cores']} cores); {results['took_s']:.0f} s in all (replicas healthy "
        f"after {results['ready_s']:.0f} s). Per-stream data: `{Path(args.get('out') or RESULTS).stem}.json`.",
        "",
        "Method: `fleetgate serve` starts two managed `engine: vllm` replicas of the tiny test model "
        "(`scripts/build_tiny_model.py`) through its own launcher, one per core "
        "(`VLLM_CPU_OMP_THREADS_BIND` 0 and 1, `VLLM_CPU_KVCACHE_SPACE=1`, `--max-model-len 4096 "
        f"--enforce-eager --dtype {dtype}`), with `health` "
        + ", ".join(f"{k} {v:g}" for k, v in HEALTH.items() if k != "start_timeout_s")
        + f", `chunk_gap_timeout_s` {CHUNK_GAP_S:g}, `stall_timeout_s` {STALL_TIMEOUT_S:g}, "
        "`max_continuations` 2, `migrate_after_s` 2, restarts on (backoff 0.5-5 s), other settings default "
        "(retry budget: burst 10, 0.2 per request, 1 per s). Every request is streamed, greedy "
        "(`temperature: 0`) and sent with `Cache-Control: no-cache, no-store` (the answer cache would "
        "otherwise answer the second run of the same request). The client (aiohttp) reads every SSE "
        "event; a stream is *whole* when it has HTTP 200, no error event, one id, one `[DONE]` (chat) or "
        "one end event (`message_stop`, `response.completed`), one finish reason, one usage, and a usage "
        "of exactly `max_tokens` when it stopped for length. The failure scenarios first stream the same "
        "16 requests uninterrupted (the reference), then again, and once every stream has its first "
        "token the replica holding most of them (`/admin/fleet` `outstanding_requests`) gets the "
        "signal on its process group. *Cut point*: the characters the client held before its longest "
        "silence after the failure (client side, so within a chunk or two of the gateway's). "
        "*Text tokens*: the client's text re-tokenised by `/tokenize` on a replica (re-tokenising the "
        "tiny random model's output is not the identity: an uninterrupted 292-token answer re-tokenises "
        "to up to 484). Other work ran on the machine at the same time.",
        "",
    ]
    for r in results["scenarios"]:
        name = r["name"]
        lines += [f"## {name}", ""]
        if "failed" in r:
            lines += [f"The scenario did not complete: {r['failed']}", ""]
            continue
        streams = r["streams"]
        n = len(streams)
        usage_ok = r["usage_client_sum"] == r["usage_metric_delta"] and r["usage_match"] == sum(
            s["usage_client"] is not None for s in streams
        )
        lines += [
            f"- streams: {n}; whole: {r['whole']}; cut by the gateway: {r['cut']}; continued: {r['continued']} "
            f"(`fleetgate_stream_continuations_total` delta {r['continuations_metric_delta']}); retry budget "
            f"refusals (`fleetgate_retry_budget_exhausted_total` delta): {r.get('retry_budget_exhausted_delta')}",
            f"- usage: client's completion tokens = access line's for {r['usage_match']} of {n}; their sum "
            f'{r["usage_client_sum"]} vs `fleetgate_tokens_total{{direction="completion"}}` delta '
            f"{r['usage_metric_delta']:g}: {_bar(usage_ok)}",
        ]
        if "signal" in r:
            lines.append(
                f"- {r['signal']} to `{r['victim']}` {r['failure_at_s']:.2f} s after the streams started, "
                f"holding {r['held_at_failure']}; all streams over after {r['took_s']:.1f} s; both replicas "
                f"routable again {r['healthy_again_after_s']:.1f} s later"
            )
            lines.append(f"- bar, every stream whole ({r['whole']}/{n}): {_bar(r['whole'] == n)}")
            if r["name"] == "stop":
                worst = max(s["longest_gap_s"] for s in streams)
                lines.append(
                    f"- bar, 0 cut ({r['cut']}), longest silence {worst:.1f} s (within `stall_timeout_s` "
                    f"{STALL_TIMEOUT_S:g}): {_bar(r['cut'] == 0 and worst < STALL_TIMEOUT_S)}"
                )
            lines.append(
                f"- bar, text equal to the uninterrupted answer >= 14 of 16: {r['equal']}: {_bar(r['equal'] >= 14)}"
            )
            if "repeat_equal" in r:
                lines.append(
                    f"- the engine's own repeatability: the uninterrupted run made again, {r['repeat_equal']} of "
                    f"{n} texts equal to the first run's"
                )
            if "causes" in r:
                engine = r["causes"]["engine"]
                lines.append(
                    f"- where they differ: {r['causes']} (causes: `divergence_cause`); equal where the engine "
                    f"itself did not diverge: {r['equal']} of {n - engine}"
                )
                invalid = sum("\ufffd" in s["text"] for s in streams)
                after_cut = [s for s in streams if s.get("cause") in ("continuation", "longer")]
                held = sum("\ufffd" in s["text"][: s["chars_at_failure"] + 1] for s in after_cut)
                lines.append(
                    f"- texts holding U+FFFD (bytes the tiny random model emits that are no UTF-8, which "
                    f"re-tokenise to other tokens): {invalid} of {n}; of the {len(after_cut)} that differ at "
                    f"or after the cut, {held} held one in the text relayed before it"
                )
            lines += [
                "",
                "| stream | replica | max_tokens | continued | cut | whole | usage | text tokens | longest gap (s) "
                "| chars (ref) | equal | diverges at | cut point | cause |",
                "| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | --- |",
            ]
            for s in streams:
                cont = ", ".join(f"{c['replica']} ({c['reason']})" for c in s["continued"]) or "-"
                lines.append(
                    f"| {s['rid']} | {s['replica']} | {s['max_tokens']} | {cont} | {s['cut'] or '-'} | "
                    f"{'; '.join(s['faults']) or 'yes'} | {s['usage_client']} | {s.get('text_tokens')} | "
                    f"{s['longest_gap_s']:.2f} | {s['chars']} ({s['ref_chars']}) | {'yes' if s['equal'] else 'no'} | "
                    f"{'-' if s['diverges_at'] is None else s['diverges_at']} | "
                    f"{s['chars_at_failure'] if s['continued'] or s['cut'] else '-'} | {s.get('cause', '-')} |"
                )
        else:
            durations = sorted(s["duration_s"] for s in streams)
            lines.append(
                f"- streams' durations: {durations[0]:.1f}-{durations[-1]:.1f} s (median "
                f"{durations[len(durations) // 2]:.1f} s); all over after {r['took_s']:.1f} s"
            )
            for d in r.get("drains", []):
                empty = "never" if d["empty_after_s"] is None else f"{d['empty_after_s']:.2f} s"
                lines.append(
                    f"- drained `{d['replica']}` at {d['at_s']:.1f} s holding {d['held_at_drain']}: held no "
                    f"stream after {empty}; routable again {d['healthy_after_undrain_s']:.2f} s after its undrain"
                )
            for d in r.get("restarts", []):
                lines.append(
                    f"- restarted `{d['replica']}` at {d['at_s']:.1f} s (HTTP {d['status']}) holding "
                    f"{d['held_at_restart']}: its old process gone (streams moved, stopped) "
                    f"{_seconds(d['stopped_after_s'])} after the call, the new one healthy after "
                    f"{_seconds(d['healthy_after_s'])}"
                )
            lines.append(f"- bar, 0 streams cut ({r['cut']}): {_bar(r['cut'] == 0)}; whole {r['whole']}/{n}")
            lines += [
                "",
                "| stream | replica | max_tokens | continued | cut | whole | usage | duration (s) | longest gap (s) |",
                "| --- | --- | ---: | --- | --- | --- | ---: | ---: | ---: |",
            ]
            for s in streams:
                cont = ", ".join(f"{c['replica']} ({c['reason']})" for c in s["continued"]) or "-"
                lines.append(
                    f"| {s['rid']} | {s['replica']} | {s['max_tokens']} | {cont} | {s['cut'] or '-'} | "
                    f"{'; '.join(s['faults']) or 'yes'} | {s['usage_client']} | {s['duration_s']:.2f} | "
                    f"{s['longest_gap_s']:.2f} |"
                )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="the replicas' dtype (float32: their greedy answers vary less with the batch they run in)",
    )
    parser.add_argument("--out", default=None, help=f"the results page (default {RESULTS.relative_to(ROOT)})")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--report", default=None, help="only write the page again from this results .json")
    args = parser.parse_args()
    page = Path(args.out) if args.out else RESULTS
    if args.report:
        page.write_text(report(orjson.loads(Path(args.report).read_bytes())))
        return
    results = asyncio.run(main_async(args))
    results["args"] = vars(args)
    results["cpu"] = cpu_name()
    results["cores"] = os.cpu_count()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    results["commit"] = commit.stdout.strip()
    if not args.no_write:
        page.with_suffix(".json").write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
        page.write_text(report(results))
    print(orjson.dumps({k: v for k, v in results.items() if k != "gateway_log"}).decode()[:3000])


if __name__ == "__main__":
    main()
