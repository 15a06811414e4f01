"""Streams continued on real vLLM: does a continued stream equal the uninterrupted one?

For each API (chat, completions, messages, responses) and each of ``--prompts`` prompts,
this streams the uninterrupted greedy answer, cuts its events at a seeded random index (the
bytes a client would have had when the replica failed), plans the continuation
(``dialects.continuation``), sends it to the replica, splices its stream and compares the
stitched stream with the uninterrupted one:

- the client-visible text, equal or where it first differs (character offset, and whether
  it is after the cut);
- whether re-tokenising the partial text explains a difference: ``/tokenize`` of the
  partial text against the token ids the model generated (a greedy chat or completions
  answer with ``return_token_ids``, the same prompt);
- the stream's shape: one id, one opening, one end, one usage; the usage against the
  uninterrupted one.

Then the same with ``temperature`` > 0 and a ``seed``. It starts one vLLM replica of the
tiny test model (``scripts/build_tiny_model.py``) pinned to core 1, or uses ``--url``;
results go to ``bench/results/continuation-vllm.md``::

    .venv/bin/python bench/continuation_vllm.py                 # 48 prompts x 4 APIs, greedy and seeded
    .venv/bin/python bench/continuation_vllm.py --url http://127.0.0.1:8000 --prompts 8 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp

from bench.soak import cpu_name
from dialects.continuation import plan
from dialects.continuation.base import events
from replicas.launcher import free_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "continuation-vllm.md"
VLLM_PYTHON = Path(os.environ.get("FLEETGATE_VLLM_VENV", str(ROOT / ".venv-vllm"))) / "bin" / "python"
MODEL_DIR = ROOT / ".cache" / "tiny-llama"
MODEL = "tiny"
VLLM_ARGS = ["--max-model-len", "4096", "--dtype", "bfloat16", "--enforce-eager"]
READY_TIMEOUT_S = 300.0
APIS = ("chat", "completions", "messages", "responses")
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "messages": "/v1/messages",
    "responses": "/v1/responses",
}
WORDS = (
    "the licence grants permission to copy modify and distribute software provided that notice "
    "of copyright and this permission appear in all copies warranty liability"
).split()
CONCURRENCY = 6
# Large enough that no other token is ever chosen (vLLM's bound is 100).
WORD_BIAS = 100.0


@dataclass
class Outcome:
    api: str
    equal: bool = False
    refused: bool = False
    cut: int = 0  # the partial text's length, in characters
    differs_at: int | None = None
    longer_by: int = 0  # the stitched text is the uninterrupted one plus this many characters
    shorter_by: int = 0  # the stitched text is the uninterrupted one less this many characters
    retokenised: bool | None = None
    # Continued from the exact token ids instead (a completions request): the ids equal.
    control_equal: bool | None = None
    shape: list[str] = field(default_factory=list)
    usage_delta: int | None = None  # stitched completion tokens - uninterrupted
    text_tokens: int | None = None  # the stitched text re-tokenised (whole-word runs only)


def word_tokens() -> dict[str, float]:
    """A logit bias that keeps the model to whole-word tokens (a space, then ASCII letters)
    whose text tokenises back to them, alone and in any sequence: an answer made of them
    re-tokenises to the same ids, so a continuation can be exact."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    chosen = {}
    for piece, token in tokenizer.get_vocab().items():
        word = piece[1:]
        if piece.startswith("\u0120") and len(word) > 1 and word.isascii() and word.isalpha():
            if tokenizer.encode(tokenizer.decode([token]), add_special_tokens=False).ids == [token]:
                chosen[str(token)] = WORD_BIAS
    return chosen


def prompt_of(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))


def body_of(api: str, prompt: str, max_tokens: int, sampling: dict[str, Any]) -> dict[str, Any]:
    if api == "chat":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
        body["stream_options"] = {"include_usage": True}
    elif api == "completions":
        body = {"prompt": prompt, "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    elif api == "messages":
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    else:
        body = {"input": prompt, "max_output_tokens": max_tokens, "store": False}
    return {"model": MODEL, "stream": True, "ignore_eos": True, **sampling, **body}


async def post_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> bytes:
    async with session.post(url, json=body) as response:
        data = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {data[:300]!r}")
        return data.replace(b"\r\n", b"\n")


async def post_json(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Any:
    async with session.post(url, json=body) as response:
        data = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{url}: {response.status} {data}")
        return data


def text_of(api: str, stream: bytes) -> str:
    out: list[str] = []
    for event in events(stream):
        data = event.data
        if not isinstance(data, dict):
            continue
        if api in ("chat", "completions"):
            for choice in data.get("choices") or ():
                piece = choice.get("delta", {}).get("content") if api == "chat" else choice.get("text")
                out.append(piece or "")
        elif api == "messages" and event.kind == "content_block_delta":
            out.append(data["delta"].get("text", ""))
        elif api == "responses" and event.kind == "response.output_text.delta":
            out.append(data["delta"])
    return "".join(out)


def completion_tokens(api: str, stream: bytes) -> int | None:
    found = None
    for event in events(stream):
        data = event.data
        if not isinstance(data, dict):
            continue
        if api in ("chat", "completions") and isinstance(data.get("usage"), dict):
            found = data["usage"]["completion_tokens"]
        elif api == "messages" and event.kind == "message_delta":
            found = data["usage"]["output_tokens"]
        elif api == "responses" and event.kind == "response.completed":
            found = data["response"]["usage"]["output_tokens"]
    return found


def shape_faults(api: str, stream: bytes) -> list[str]:
    """What makes ``stream`` not look like one uninterrupted stream of ``api``."""
    faults: list[str] = []
    got = events(stream)
    kinds = Counter(e.kind for e in got)
    if api in ("chat", "completions"):
        chunks = [e.data for e in got if isinstance(e.data, dict)]
        if len({(c.get("id"), c.get("created")) for c in chunks}) != 1:
            faults.append("ids")
        finishes = sum(1 for c in chunks for ch in c.get("choices") or () if ch.get("finish_reason"))
        usages = sum(1 for c in chunks if c.get("usage"))
        roles = sum(1 for c in chunks for ch in c.get("choices") or () if "role" in (ch.get("delta") or {}))
        if finishes != 1 or usages != 1 or (api == "chat" and roles != 1):
            faults.append(f"finish {finishes} usage {usages} role {roles}")
        if sum(1 for e in got if e.done) != 1 or not got[-1].done:
            faults.append("[DONE]")
    elif api == "messages":
        for kind in ("message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop"):
            if kinds[kind] != 1:
                faults.append(f"{kind} x{kinds[kind]}")
    else:
        numbers = [e.data.get("sequence_number") for e in got if isinstance(e.data, dict)]
        if numbers != list(range(len(numbers))):
            faults.append("sequence_number")
        ids = {e.data["response"]["id"] for e in got if isinstance(e.data, dict) and "response" in e.data}
        items = {e.data.get("item_id") for e in got if isinstance(e.data, dict) and "item_id" in e.data}
        if len(ids) != 1 or len(items) != 1:
            faults.append("ids")
        for kind in ("response.created", "response.output_item.added", "response.completed"):
            if kinds[kind] != 1:
                faults.append(f"{kind} x{kinds[kind]}")
        done = [e.data for e in got if e.kind == "response.completed"]
        if done and done[0]["response"]["output"][0]["content"][0]["text"] != text_of(api, stream):
            faults.append("completed text")
    return faults


async def reference_ids(
    session: aiohttp.ClientSession, base: str, api: str, prompt: str, max_tokens: int, extra: dict[str, Any]
) -> list[int]:
    """The token ids of the greedy answer (vLLM's Messages and Responses render the same
    chat prompt as chat completions)."""
    common = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    common.update(extra)
    if api == "completions":
        answer = await post_json(session, base + "/v1/completions", {**common, "prompt": prompt})
    else:
        messages = [{"role": "user", "content": prompt}]
        answer = await post_json(session, base + "/v1/chat/completions", {**common, "messages": messages})
    return list(answer["choices"][0]["token_ids"])


async def one(
    session: aiohttp.ClientSession,
    base: str,
    api: str,
    prompt: str,
    cut_rng: random.Random,
    args: Any,
    mode: str,
    count: str,
    bias: dict[str, float],
) -> Outcome:
    greedy = mode != "seeded"
    sampling: dict[str, Any] = {"temperature": 0} if greedy else {"temperature": 0.8, "seed": 1234}
    if api == "messages" and not greedy:
        sampling = {"temperature": 0.8}  # Messages has no seed field
    if mode == "words":
        sampling["logit_bias"] = bias
    body = body_of(api, prompt, args.max_tokens, sampling)
    whole = await post_stream(session, base + PATHS[api], body)
    got = events(whole)
    cut = cut_rng.randrange(1, len(got))
    relayed = b"".join(e.raw for e in got[:cut])
    outcome = Outcome(api)
    upstream = dict(body)
    if api in ("chat", "completions"):
        upstream["stream_options"] = {"include_usage": True}
    continuation = plan(api, upstream, relayed)
    if continuation is not None and count == "tokenize":
        # What the gateway can do on any API: ask the next replica how many tokens the partial text holds.
        partial = {"model": MODEL, "prompt": continuation.partial_text, "add_special_tokens": False}
        held = (await post_json(session, base + "/tokenize", partial))["count"]
        continuation = plan(api, upstream, relayed, tokens=held)
    if continuation is None:
        outcome.refused = True
        return outcome
    outcome.cut = len(continuation.partial_text)
    rest = await post_stream(session, base + continuation.path, continuation.body)
    spliced = b"".join(continuation.splice(e.raw) for e in events(rest))
    stitched = relayed + spliced
    expected, actual = text_of(api, whole), text_of(api, stitched)
    outcome.shape = shape_faults(api, stitched)
    made, wanted = completion_tokens(api, stitched), completion_tokens(api, whole)
    outcome.usage_delta = None if made is None or wanted is None else made - wanted
    if mode == "words":
        # Whole-word tokens re-tokenise to themselves: the stitched text's true token count.
        answer = {"model": MODEL, "prompt": actual, "add_special_tokens": False}
        outcome.text_tokens = (await post_json(session, base + "/tokenize", answer))["count"]
    if actual == expected:
        outcome.equal = True
        return outcome
    if actual.startswith(expected):
        outcome.longer_by = len(actual) - len(expected)
    elif expected.startswith(actual):
        outcome.shorter_by = len(expected) - len(actual)
    else:
        outcome.differs_at = next(
            (i for i, (a, b) in enumerate(zip(actual, expected, strict=False)) if a != b),
            min(len(actual), len(expected)),
        )
    if greedy:
        extra = {"logit_bias": bias} if mode == "words" else {}
        ids = await reference_ids(session, base, api, prompt, args.max_tokens, extra)
        tokens = await post_json(
            session,
            base + "/tokenize",
            {"model": MODEL, "prompt": continuation.partial_text, "add_special_tokens": False},
        )
        outcome.retokenised = ids[: len(tokens["tokens"])] != tokens["tokens"]
        outcome.control_equal = await control(session, base, api, prompt, ids, continuation.relayed_tokens, extra)
    return outcome


async def control(
    session: aiohttp.ClientSession,
    base: str,
    api: str,
    prompt: str,
    ids: list[int],
    cut: int,
    extra: dict[str, Any],
) -> bool:
    """Whether the answer continued from its exact token ids (the prompt's and the first
    ``cut`` generated) gives the uninterrupted ids: the replica's own determinism, without
    re-tokenising."""
    rendered: dict[str, Any]
    if api == "completions":
        rendered = {"model": MODEL, "prompt": prompt}
    else:
        rendered = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "add_generation_prompt": True}
    prompt_ids = (await post_json(session, base + "/tokenize", rendered))["tokens"]
    cut = min(cut, len(ids) - 1)  # a count from /tokenize may exceed the generated tokens
    body = {
        "model": MODEL,
        "prompt": prompt_ids + ids[:cut],
        "max_tokens": len(ids) - cut,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    answer = await post_json(session, base + "/v1/completions", body)
    return bool(ids[:cut] + list(answer["choices"][0]["token_ids"]) == ids)


async def run_all(
    base: str, args: Any, mode: str, count: str, bias: dict[str, float], n: int
) -> dict[str, list[Outcome]]:
    apis = [api for api in APIS if not (mode == "words" and api == "messages")]  # Messages has no logit_bias
    rng = random.Random(args.seed)
    prompts = [prompt_of(rng) for _ in range(n)]
    gate = asyncio.Semaphore(CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def bounded(api: str, i: int) -> Outcome:
            async with gate:
                cut_rng = random.Random(f"{args.seed}/{api}/{i}")
                return await one(session, base, api, prompts[i], cut_rng, args, mode, count, bias)

        results = await asyncio.gather(*(bounded(api, i) for api in apis for i in range(n)))
    out: dict[str, list[Outcome]] = {api: [] for api in apis}
    for outcome in results:
        out[outcome.api].append(outcome)
    return out


def table(results: dict[str, list[Outcome]], greedy: bool, max_tokens: int) -> list[str]:
    lines = [
        "| API | streams | refused | text equal | longer than the original | shorter | diverged |"
        " re-tokenising changed the partial's ids | control: continued from exact ids, equal | shape faults |"
        " usage's completion tokens = uninterrupted's | stitched text re-tokenised = max_tokens |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for api, outcomes in results.items():
        tried = [o for o in outcomes if not o.refused]
        equal = sum(o.equal for o in tried)
        longer = [o for o in tried if o.longer_by]
        shorter = sum(1 for o in tried if o.shorter_by)
        diverged = [o for o in tried if o.differs_at is not None]
        explained = sum(1 for o in diverged if o.retokenised)
        controls = [o for o in tried if o.control_equal is not None]
        control = f"{sum(1 for o in controls if o.control_equal)} of {len(controls)}" if greedy else "-"
        faults = sum(1 for o in tried if o.shape)
        usage = sum(1 for o in tried if o.usage_delta == 0)
        counted = [o for o in tried if o.text_tokens is not None]
        exact = f"{sum(1 for o in counted if o.text_tokens == max_tokens)} of {len(counted)}" if counted else "-"
        lines.append(
            f"| {api} | {len(outcomes)} | {len(outcomes) - len(tried)} | {equal} of {len(tried)} | {len(longer)} |"
            f" {shorter} |"
            f" {len(diverged)} | {f'{explained} of {len(diverged)}' if greedy else '-'} | {control} | {faults} |"
            f" {usage} of {len(tried)} | {exact} |"
        )
    return lines


def divergence(results: dict[str, list[Outcome]]) -> list[str]:
    """Where greedy streams diverged, relative to the cut."""
    lines: list[str] = []
    for api, outcomes in results.items():
        after = sorted(o.differs_at - o.cut for o in outcomes if o.differs_at is not None)
        if after:
            at_cut = sum(1 for a in after if a <= 1)
            lines.append(
                f"- {api}: {len(after)} diverged, {at_cut} within one character of the cut,"
                f" median {after[len(after) // 2]} characters after it, none before it: {all(a >= 0 for a in after)}"
            )
    return lines


def details(results: dict[str, list[Outcome]]) -> list[str]:
    lines: list[str] = []
    for api, outcomes in results.items():
        for o in outcomes:
            if o.refused or (o.equal and not o.shape and o.usage_delta == 0):
                continue
            lines.append(
                f"- {api}: cut at {o.cut} chars; differs at {o.differs_at}; longer by {o.longer_by};"
                f" shorter by {o.shorter_by};"
                f" re-tokenised {o.retokenised}; control equal {o.control_equal}; shape {o.shape or 'ok'};"
                f" usage delta {o.usage_delta}; stitched text tokens {o.text_tokens}"
            )
    return lines


@contextlib.contextmanager
def replica(port: int) -> Any:
    """One vLLM replica of the tiny model, on core 1, killed (its whole group) at the end."""
    subprocess.run(
        [str(VLLM_PYTHON), str(ROOT / "scripts" / "build_tiny_model.py"), "--out", str(MODEL_DIR)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "1"}
    log = open(ROOT / ".cache" / "continuation-vllm.log", "wb")
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(MODEL_DIR)]
    command += ["--served-model-name", MODEL, "--port", str(port), *VLLM_ARGS]
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.close()


async def wait_ready(base: str) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(base + "/health") as response:
                    if response.status == 200:
                        return
            await asyncio.sleep(1.0)
    raise RuntimeError(f"{base} was not ready after {READY_TIMEOUT_S:g} s")


Results = dict[str, list[Outcome]]


async def messages_as_chat(base: str, args: Any) -> tuple[int, int]:
    """How many greedy ``/v1/messages`` answers equal the ``/v1/chat/completions`` answer
    to the same prompt (text and prompt tokens): Messages is continued through chat, so
    chat's exactness carries over when the two agree."""
    rng = random.Random(args.seed)
    prompts = [prompt_of(rng) for _ in range(args.prompts)]
    gate = asyncio.Semaphore(CONCURRENCY)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def same(prompt: str) -> bool:
            async with gate:
                messages = await post_stream(
                    session, base + PATHS["messages"], body_of("messages", prompt, args.max_tokens, {"temperature": 0})
                )
                chat = await post_stream(
                    session, base + PATHS["chat"], body_of("chat", prompt, args.max_tokens, {"temperature": 0})
                )
            start = next(e.data for e in events(messages) if e.kind == "message_start")
            usage = next(e.data["usage"] for e in events(chat) if isinstance(e.data, dict) and e.data.get("usage"))
            same_prompt = start["message"]["usage"]["input_tokens"] == usage["prompt_tokens"]
            return same_prompt and text_of("messages", messages) == text_of("chat", chat)

        agreed = await asyncio.gather(*(same(p) for p in prompts))
    return sum(agreed), len(agreed)


RUNS = (
    ("greedy", "events", "Greedy (`temperature: 0`), relayed tokens counted from the events"),
    ("greedy", "tokenize", "Greedy, relayed tokens counted by `/tokenize` of the partial text"),
    ("words", "events", "Greedy, whole-word tokens only, relayed tokens counted from the events"),
    ("words", "tokenize", "Greedy, whole-word tokens only, relayed tokens counted by `/tokenize`"),
    ("seeded", "tokenize", "Sampled (`temperature: 0.8`, `seed: 1234`; Messages has no seed field)"),
)
# The sampled run only shows that a seed does not carry over: fewer prompts suffice.
SEEDED_PROMPTS = 16


async def measure(base: str, args: Any) -> tuple[list[Results], tuple[int, int], float]:
    await wait_ready(base)
    bias = word_tokens()
    start = time.monotonic()
    runs = []
    for mode, count, _ in RUNS:
        n = min(args.prompts, SEEDED_PROMPTS) if mode == "seeded" else args.prompts
        runs.append(await run_all(base, args, mode, count, bias, n))
    agreed = await messages_as_chat(base, args)
    return runs, agreed, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--url", help="use this vLLM server instead of starting one")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    if args.url:
        runs, agreed, seconds = asyncio.run(measure(args.url, args))
    else:
        port = free_port()
        with replica(port):
            runs, agreed, seconds = asyncio.run(measure(f"http://127.0.0.1:{port}", args))
    report = [
        "# Streams continued on another replica, on real vLLM",
        "",
        f"`bench/continuation_vllm.py --prompts {args.prompts} --max-tokens {args.max_tokens} --seed {args.seed}`:"
        f" vllm-cpu 0.32, the tiny test model (`scripts/build_tiny_model.py`), one replica on core 1,"
        f" {cpu_name()}; {seconds:.0f} s.",
        "",
        "Method: per API and prompt, the uninterrupted answer is streamed (`ignore_eos`, so every answer runs to",
        "`max_tokens`), its events are cut at a seeded random index (the bytes the client had when the replica",
        "failed), `dialects.continuation.plan` builds the continuation, the replica answers it, `splice` rewrites",
        "its events, and the stitched stream is compared with the uninterrupted one: the client-visible text, the",
        "shape (one id, one opening, one end, one usage, Responses' sequence numbers), the final completion tokens.",
        "A difference is explained by re-tokenising when `/tokenize` of the partial text is not the prefix of the",
        "token ids the model generated (a greedy `return_token_ids` answer to the same prompt). The control",
        "continues the same answer from its exact token ids (a completions request whose prompt is the token ids",
        "of the rendered prompt plus the first generated ones): where it differs too, the replica itself did not",
        "repeat its greedy answer (requests batched differently on CPU; the random tiny model has many near ties).",
        "The whole-word runs keep the model to tokens whose text re-tokenises to the same ids (`logit_bias`), so",
        "re-tokenising cannot change anything there; re-tokenising that text also counts its true tokens.",
        "Relayed tokens are counted either from the events (one per event, a lower bound: vLLM merges the",
        "tokens of a stream read late and sends no delta for a token ending inside a character), or exactly,",
        "by `/tokenize` of the partial text on the replica (`plan(..., tokens=n)`).",
        "",
    ]
    for (mode, _, title), results in zip(RUNS, runs, strict=True):
        report += [f"## {title}", "", *table(results, mode != "seeded", args.max_tokens), ""]
        if mode == "greedy":
            report += ["Where the streams diverged:", "", *divergence(results), ""]
        if mode == "words":
            report += ["Streams that differ:", "", *(details(results) or ["none"]), ""]
    report += [
        "Messages takes no `logit_bias`; it is continued through chat completions, and its greedy answers equal",
        f"chat's to the same prompt (text and prompt tokens) in {agreed[0]} of {agreed[1]} prompts.",
        "",
    ]
    text = "\n".join(report)
    print(text)
    if not args.no_write:
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
