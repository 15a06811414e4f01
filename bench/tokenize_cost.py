"""What counting prompt tokens with the model's tokenizer costs the gateway.

One command (needs `nginx` and `wrk`, as bench/overhead.py)::

    .venv/bin/python bench/tokenize_cost.py [--duration 10] [--rounds 3]

Method:
- Counting alone, in this process: a chat request whose prompt is 4,096 tokens of the tiny
  test model (.cache/tiny-llama, built by scripts/build_tiny_model.py), its user message
  made new each time (a number in front: nothing remembered), counted (template rendered,
  text encoded) `--runs` times inline: p50 and p99; the same body counted again and again
  (its pieces' counts remembered, tokens/segments.py); through the counter's worker
  threads (the event loop's view: the await); the event loop's longest stall while 32
  counts run at once (worker threads vs inline). Also bench/overhead.py's small chat
  request, which decides where counting stays inline.
- Requests/s: two `fleetgate serve` on core 0 in front of nginx (core 1) answering a
  fixed chat completion (bench/overhead.py's setup), one with `models[].tokenizer` set to
  the tiny model, one without (the estimate); wrk on core 1, concurrency 32, keep-alive,
  `--duration` s per point, the two alternating for `--rounds` rounds, medians reported.
  Bodies: bench/overhead.py's small chat request and the 4,096-token prompt, each either
  the same every time or with a new number opening the user's message in every request
  (wrk's Lua), so that every count encodes it. The gateway and its worker threads share
  core 0: what counting costs shows whole, as it would on a gateway with no spare core.

Writes bench/results/tokenize-cost.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from bench.machine import cpu_model
from bench.overhead import API_KEY, BODY, PY, ROOT, WrkResult, gateway_config, nginx_conf, process, wait_http, wrk
from capacity.workload import make_text
from dialects.base import Call
from dialects.openai import CHAT
from replicas.launcher import free_port
from tokens.counter import PromptCounter
from tokens.model_tokenizer import ModelTokenizer

TINY = ROOT / ".cache" / "tiny-llama"
RESULTS = ROOT / "bench" / "results"
PROMPT_TOKENS = 4096


def long_prompt(tokenizer: ModelTokenizer, tokens: int) -> dict[str, Any]:
    """A chat body whose prompt (template included) is ``tokens`` tokens of this tokenizer."""
    rng = random.Random(4096)
    text = make_text(tokens * 2, rng, tag="bench")
    body = {"model": "bench", "max_tokens": 16, "messages": [{"role": "user", "content": text}]}
    low, high = 0, len(text)
    while low < high:  # the longest prefix of the text that keeps the prompt within ``tokens``
        mid = (low + high + 1) // 2
        body["messages"][0]["content"] = text[:mid]
        if tokenizer.count(CHAT, body) <= tokens:
            low = mid
        else:
            high = mid - 1
    body["messages"][0]["content"] = text[:low]
    return body


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def call_of(body: dict[str, Any]) -> Call:
    return CHAT.parse(json.dumps(body).encode())


_serial = iter(range(10**9))


def fresh(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with a new number opening the user's message: no piece of it is remembered."""
    new = copy.deepcopy(body)
    new["messages"][-1]["content"] = f"{next(_serial)} {new['messages'][-1]['content']}"
    return new


async def counting(tokenizer: ModelTokenizer, body: dict[str, Any], runs: int) -> dict[str, float]:
    """Inline and worker-thread counts of ``body``, each with its user message new (nothing
    remembered): p50/p99 in µs; the same body again (its pieces remembered); the loop's
    longest stall with 32 counts in flight (ms)."""
    inline: list[float] = []
    for _ in range(runs):
        one = fresh(body)
        start = time.perf_counter()
        tokenizer.count(CHAT, one)
        inline.append((time.perf_counter() - start) * 1e6)
    again: list[float] = []
    for _ in range(runs):
        start = time.perf_counter()
        tokenizer.count(CHAT, body)
        again.append((time.perf_counter() - start) * 1e6)
    threaded = PromptCounter({"bench": tokenizer}, inline_max_tokens=0)
    always_inline = PromptCounter({"bench": tokenizer}, inline_max_tokens=10**9)
    awaited: list[float] = []
    for _ in range(runs):
        call = call_of(fresh(body))
        start = time.perf_counter()
        await threaded.count("bench", call)
        awaited.append((time.perf_counter() - start) * 1e6)
    stalls = {}
    for name, counter in (("threads", threaded), ("inline", always_inline)):
        stalls[name] = await _longest_stall(counter, body)
    threaded.close()
    always_inline.close()
    return {
        "inline_p50_us": percentile(inline, 0.5),
        "inline_p99_us": percentile(inline, 0.99),
        "remembered_p50_us": percentile(again, 0.5),
        "remembered_p99_us": percentile(again, 0.99),
        "thread_p50_us": percentile(awaited, 0.5),
        "thread_p99_us": percentile(awaited, 0.99),
        "stall_threads_ms": stalls["threads"],
        "stall_inline_ms": stalls["inline"],
    }


async def _longest_stall(counter: PromptCounter, body: dict[str, Any]) -> float:
    """The event loop's longest gap between 1 ms ticks while 32 counts run concurrently."""
    done = False
    longest = 0.0

    async def ticker() -> None:
        nonlocal longest
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            longest = max(longest, now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)

    async def one() -> None:
        await asyncio.sleep(0)
        await counter.count("bench", call_of(fresh(body)))

    await asyncio.gather(*(one() for _ in range(32)))
    done = True
    await tick
    return longest * 1000


def _lua(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def wrk_script(tmp: Path, name: str, body: dict[str, Any], unique: bool) -> Path:
    """wrk's script: ``body`` as it is, or (``unique``) with a counter opening the user's
    message, so no two requests share it (every count encodes it: no piece is remembered)."""
    script = tmp / f"{name}.lua"
    lines = [
        'wrk.method = "POST"',
        'wrk.headers["Content-Type"] = "application/json"',
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"',
    ]
    if not unique:
        lines.append(f"wrk.body = {_lua(json.dumps(body, separators=(',', ':')))}")
    else:
        marked = copy.deepcopy(body)
        marked["messages"][-1]["content"] = "@@N@@ " + marked["messages"][-1]["content"]
        before, after = json.dumps(marked, separators=(",", ":")).split("@@N@@")
        lines += [
            "counter = 0",
            f"before, after = {_lua(before)}, {_lua(after)}",
            "request = function()",
            "  counter = counter + 1",
            "  return wrk.format(nil, nil, nil, before .. counter .. '-' .. math.random(1000000000) .. after)",
            "end",
        ]
    script.write_text("\n".join(lines) + "\n")
    return script


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=int, default=10, help="seconds per load point")
    parser.add_argument("--rounds", type=int, default=3, help="alternating estimate/tokenizer rounds")
    parser.add_argument("--runs", type=int, default=300, help="counts per in-process measurement")
    parser.add_argument("--out", type=Path, default=RESULTS / "tokenize-cost.md")
    args = parser.parse_args()
    for tool in ("nginx", "wrk", "taskset"):
        if shutil.which(tool) is None:
            print(f"bench/tokenize_cost.py needs `{tool}`: apt-get install nginx-light wrk", file=sys.stderr)
            return 2
    if not (TINY / "tokenizer.json").exists():
        print(f"no tiny model at {TINY}: run scripts/build_tiny_model.py", file=sys.stderr)
        return 2
    tokenizer = ModelTokenizer.load(TINY)
    big = long_prompt(tokenizer, PROMPT_TOKENS)
    small = {**BODY, "model": "bench"}
    counts = {
        "4k": asyncio.run(counting(tokenizer, big, args.runs)),
        "small": asyncio.run(counting(tokenizer, small, args.runs)),
    }
    print(json.dumps(counts, indent=1), file=sys.stderr)

    tmp = Path(tempfile.mkdtemp(prefix="fleetgate-tokenize-"))
    (tmp / "body").mkdir()
    p_nginx, p_est, p_tok = (free_port() for _ in range(3))
    scripts = {
        f"{size} {kind}": wrk_script(tmp, f"{size}-{kind}", body, kind == "unique")
        for size, body in (("small", small), ("4k", big))
        for kind in ("unique", "repeated")
    }
    runs: dict[str, dict[str, list[WrkResult]]] = {b: {"estimate": [], "tokenizer": []} for b in scripts}
    with contextlib.ExitStack() as stack:
        stack.enter_context(process(["nginx", "-c", str(nginx_conf(tmp, p_nginx))], 1, tmp / "nginx.log"))
        wait_http(f"http://127.0.0.1:{p_nginx}/health")
        upstream = f"http://127.0.0.1:{p_nginx}"
        ports = {"estimate": p_est, "tokenizer": p_tok}
        for name, port in ports.items():
            config = gateway_config(port, upstream, upstream, upstream)
            config["server"]["max_body_bytes"] = 4 * 1024 * 1024  # type: ignore[index]
            if name == "tokenizer":
                config["models"][0]["tokenizer"] = str(TINY)  # type: ignore[index]
            path = tmp / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config))
            stack.enter_context(
                process(
                    [PY, "-m", "gateway.cli", "serve", "--config", str(path), "--log-dir", str(tmp / f"logs-{name}")],
                    0,
                    tmp / f"{name}.log",
                    env={"PYTHONPATH": str(ROOT)},
                )
            )
            wait_http(f"http://127.0.0.1:{port}/readyz", timeout=180.0)  # slow on a busy machine
        for body_name, script in scripts.items():
            for port in ports.values():  # warm-up
                wrk(f"http://127.0.0.1:{port}/v1/chat/completions", 32, 2, script)
            for r in range(args.rounds):
                order = list(ports.items()) if r % 2 == 0 else list(reversed(ports.items()))
                for name, port in order:
                    result = wrk(f"http://127.0.0.1:{port}/v1/chat/completions", 32, args.duration, script)
                    runs[body_name][name].append(result)
                    print(f"{body_name} {name} round {r}: {result.rps:.0f} req/s", file=sys.stderr, flush=True)
    write_report(args, counts, runs)
    return 0


def write_report(args: argparse.Namespace, counts: dict[str, dict[str, float]], runs: Any) -> None:
    lines = [
        "# Counting prompt tokens with the model's tokenizer: its cost",
        "",
        f"Machine: {cpu_model()}, {len(__import__('os').sched_getaffinity(0))} cores. "
        f"Command: `.venv/bin/python bench/tokenize_cost.py --duration {args.duration} --rounds {args.rounds}`.",
        "Method: see the script's docstring (bench/tokenize_cost.py). Tokenizer: the tiny test model's "
        "(a byte-level BPE, 2,000 tokens), its ChatML template.",
        "",
        "## One count (in one process)",
        "",
        "Each count's user message is new (nothing remembered) but in the `remembered` columns, where the "
        "same body is counted again (its pieces' counts remembered, the template still rendered).",
        "",
        "| prompt | inline p50 | inline p99 | via a worker thread p50 | p99 | remembered p50 | p99 "
        "| loop's longest stall, 32 at once: threads | inline |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, label in (("4k", f"{PROMPT_TOKENS} tokens"), ("small", "small chat request")):
        c = counts[name]
        lines.append(
            f"| {label} | {c['inline_p50_us']:.0f} µs | {c['inline_p99_us']:.0f} µs | {c['thread_p50_us']:.0f} µs "
            f"| {c['thread_p99_us']:.0f} µs | {c['remembered_p50_us']:.0f} µs | {c['remembered_p99_us']:.0f} µs "
            f"| {c['stall_threads_ms']:.1f} ms | {c['stall_inline_ms']:.1f} ms |"
        )
    lines += [
        "",
        "## Requests/s through the gateway, concurrency 32 (medians of the rounds)",
        "",
        "| body | estimate | tokenizer | ratio | p99 estimate | p99 tokenizer |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    labels = {"small": "small chat request", "4k": f"{PROMPT_TOKENS}-token prompt"}
    for body_name in runs:
        size, kind = body_name.split()
        label = f"{labels[size]}, {'every prompt new' if kind == 'unique' else 'the same prompt every time'}"
        est, tok = runs[body_name]["estimate"], runs[body_name]["tokenizer"]
        e = statistics.median(r.rps for r in est)
        t = statistics.median(r.rps for r in tok)
        pe = statistics.median(r.p99_ms for r in est)
        pt = statistics.median(r.p99_ms for r in tok)
        lines.append(f"| {label} | {e:.0f} | {t:.0f} | {t / e:.3f} | {pe:.1f} ms | {pt:.1f} ms |")
    lines.append("")
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
