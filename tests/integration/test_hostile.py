"""A hostile client against a real ``fleetgate serve`` process (managed simulated replicas).

The gateway has two tiers, so ``model: auto`` runs the classifier, and the fuzzed tenant's
exact cache is on for every request (``cache_nondeterministic``), so cache keys and
request coalescing see the fuzzed bodies too.

Every answer must be a 2xx or an OpenAI-shaped 4xx: never a 5xx, never a traceback in the
gateway's log, never a hang. Hypothesis generates request bodies, headers (unicode included)
and raw HTTP framing; the fixed cases are the defects found by hand (deep JSON, a unicode
request id, malformed HTTP answered in plain text with the API key logged, slowloris).
The three fuzzing tests run 5,000 cases between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.harness import API_KEY, GatewayProcess, gateway_process, tenants

MODEL = "m"
HEADER_TIMEOUT_S = 2.0
BODY_TIMEOUT_S = 4.0
ENDPOINTS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/rerank",
    "/v1/score",
    "/tokenize",
    "/detokenize",
    "/v1/audio/transcriptions",
]
# Where errors come in Anthropic's envelope instead of OpenAI's.
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
# Every fuzzing test shares these settings: a real process answers each case; the cases
# themselves are random (a failure prints the example that reproduces it).
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large],
)
# How long one raw exchange may take before it counts as a hang.
EXCHANGE_TIMEOUT_S = 15.0


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    sim = {"engine": "sim", "sim": {"ttft_ms": 1, "tokens_per_s": 20000}}
    fuzzed, other = tenants()
    fuzzed["cache"] = {"enabled": True, "cache_nondeterministic": True}
    config = {
        "models": [
            {"name": MODEL, "tier": "small", "replicas": [sim]},
            {"name": "large-m", "tier": "large", "replicas": [sim]},
        ],
        "tenants": [fuzzed, other],
        "server": {
            "header_timeout_s": HEADER_TIMEOUT_S,
            "body_timeout_s": BODY_TIMEOUT_S,
            "max_body_bytes": 256 * 1024,
        },
        "upstream": {"first_byte_timeout_s": 10, "request_timeout_s": 20},
    }
    with gateway_process(config, tmp_path_factory.mktemp("hostile")) as gw:
        yield gw


class LogWatch:
    """The gateway's logs since the test began: no traceback, no error line, no 5xx."""

    def __init__(self, gw: GatewayProcess) -> None:
        self.gw = gw
        self.err_from = gw.stderr_path.stat().st_size
        self.out_from = gw.stdout_path.stat().st_size

    def new_stderr(self) -> str:
        return self.gw.stderr_path.read_bytes()[self.err_from :].decode("utf-8", "replace")

    def check(self) -> None:
        time.sleep(0.3)  # the access log is flushed within 0.1 s
        err = self.new_stderr()
        assert "Traceback" not in err, err[-4000:]
        for line in err.splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                assert orjson.loads(line).get("level") not in ("error", "critical"), line
        out = self.gw.stdout_path.read_bytes()[self.out_from :]
        for line in out.splitlines():
            entry = orjson.loads(line)
            # A 504 is the answer to a deadline the client set itself (x-fleetgate-timeout-ms).
            assert entry["status"] < 500 or entry.get("error") == "deadline_exceeded", entry


@pytest.fixture
def logs(gateway: GatewayProcess) -> Iterator[LogWatch]:
    watch = LogWatch(gateway)
    yield watch
    watch.check()


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes


def assert_acceptable(
    reply: Reply, *, head: bool = False, deadline_sent: bool = False, anthropic: bool = False
) -> None:
    """A 2xx, or a 4xx with OpenAI's error body (Anthropic's on its endpoints), or a 504 for
    a deadline the client set."""
    if deadline_sent and reply.status == 504:
        assert orjson.loads(reply.body)["error"]["code"] == "deadline_exceeded"
        return
    assert reply.status < 500, reply
    if 200 <= reply.status < 300 or head:
        return
    assert 400 <= reply.status < 500, reply
    assert reply.headers.get("content-type", "").startswith("application/json"), reply
    body = orjson.loads(reply.body)
    if anthropic and body.get("type") == "error":  # a 405 or 404 before any route is OpenAI's
        assert isinstance(body["error"]["type"], str) and body["error"]["message"], reply
        return
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and "code" in error and "param" in error


def exchange(gw: GatewayProcess, raw: bytes, *, timeout: float = EXCHANGE_TIMEOUT_S) -> Reply | None:
    """Send ``raw`` on a fresh connection, read until the gateway closes it; the first
    response, or None when it closed without one."""
    with socket.create_connection(("127.0.0.1", gw.port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(raw)
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                data += chunk
    return parse_reply(data)


def parse_reply(data: bytes) -> Reply | None:
    if not data:
        return None
    head, _, rest = data.partition(b"\r\n\r\n")
    while head.startswith(b"HTTP/1.1 100 "):  # Expect: 100-continue's interim answer
        head, _, rest = rest.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while rest:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                break
            body, rest = body + rest[:size], rest[size + 2 :]
    elif "content-length" in headers:
        body = rest[: int(headers["content-length"])]
    else:
        body = rest
    return Reply(status, headers, body)


def request_bytes(
    path: str, body: bytes, headers: list[tuple[bytes, bytes]] | None = None, method: bytes = b"POST"
) -> bytes:
    lines = [method + b" " + path.encode() + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    lines += [name + b": " + value for name, value in headers or []]
    lines.append(b"Content-Length: " + str(len(body)).encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


AUTH = (b"Authorization", b"Bearer " + API_KEY.encode())


def chat(**extra: Any) -> bytes:
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra})


# -- the defects found by hand ----------------------------------------------------------------


@pytest.mark.parametrize("depth", [200, 256, 300, 1000, 1024, 1025, 5000])
def test_deeply_nested_json_is_a_400(gateway: GatewayProcess, logs: LogWatch, depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    for body in (nested, chat()[:-1] + b',"metadata":' + nested + b"}"):
        reply = exchange(gateway, request_bytes("/v1/chat/completions", body, [AUTH]))
        assert reply is not None
        assert_acceptable(reply)
        assert reply.status == 400 or (depth <= 200 and reply.status == 200)


def test_a_unicode_request_id_is_replaced_not_a_500(gateway: GatewayProcess, logs: LogWatch) -> None:
    for sent in ("中文".encode(), "naïve-id".encode(), b"\xff\xfe"):
        reply = exchange(gateway, request_bytes("/v1/chat/completions", chat(), [AUTH, (b"x-request-id", sent)]))
        assert reply is not None and reply.status == 200, reply
        assert reply.headers["x-request-id"].isascii() and reply.headers["x-request-id"].encode() != sent
    reply = exchange(gateway, request_bytes("/v1/chat/completions", chat(), [AUTH, (b"x-request-id", b"my-id-1")]))
    assert reply is not None and reply.headers["x-request-id"] == "my-id-1"


SECRET = "sk-never-in-a-log-0123456789"


@pytest.mark.parametrize(
    "case",
    ["long_authorization", "long_header_name", "long_request_line", "too_many_headers", "bad_chunk", "cl_and_te"],
)
def test_malformed_http_gets_an_openai_error_and_no_logged_header(
    gateway: GatewayProcess, logs: LogWatch, case: str
) -> None:
    body = chat()
    start = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
    if case == "long_authorization":
        raw = start + b"Authorization: Bearer " + SECRET.encode() * 400 + b"\r\n\r\n"
    elif case == "long_header_name":
        raw = start + b"X-" + SECRET.encode() * 400 + b": 1\r\n\r\n"
    elif case == "long_request_line":
        raw = b"POST /v1/" + SECRET.encode() * 400 + b" HTTP/1.1\r\nHost: x\r\n\r\n"
    elif case == "too_many_headers":
        raw = start + b"".join(b"X-H%d: %s\r\n" % (i, SECRET.encode()) for i in range(300)) + b"\r\n"
    elif case == "bad_chunk":
        raw = start + b"Authorization: Bearer " + API_KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        raw += b"zz\r\n" + body + b"\r\n0\r\n\r\n"
    else:
        raw = start + b"Transfer-Encoding: chunked\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    reply = exchange(gateway, raw)
    assert reply is not None
    assert_acceptable(reply)
    assert reply.status == (431 if case.startswith(("long", "too_many")) else 400)
    time.sleep(0.3)
    assert SECRET not in logs.new_stderr()


@pytest.mark.parametrize("target", [b"*", b"nowhere", b"http://127.0.0.1/v1/x"])
def test_a_request_target_no_route_matches_gets_an_openai_error(
    gateway: GatewayProcess, logs: LogWatch, target: bytes
) -> None:
    # "OPTIONS * HTTP/1.1" got aiohttp's plain-text 404 (found by the framing fuzz).
    reply = exchange(gateway, b"OPTIONS " + target + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply is not None and 400 <= reply.status < 500
    assert_acceptable(reply)


async def test_slowloris_connections_are_cut_at_the_header_timeout(gateway: GatewayProcess, logs: LogWatch) -> None:
    """Twenty connections trickle their headers a byte at a time, and five send nothing:
    each is answered 408 and closed after ``server.header_timeout_s``."""
    request = request_bytes("/v1/chat/completions", chat(), [AUTH])

    async def trickle(send: bool) -> tuple[float, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
        started = time.monotonic()
        received = b""
        try:
            for byte in request if send else b"":
                writer.write(bytes([byte]))
                with contextlib.suppress(TimeoutError):
                    received += await asyncio.wait_for(reader.read(65536), timeout=0.2)
                if reader.at_eof():
                    break
            received += await asyncio.wait_for(reader.read(), timeout=EXCHANGE_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
        return time.monotonic() - started, received

    outcomes = await asyncio.wait_for(
        asyncio.gather(*(trickle(True) for _ in range(20)), *(trickle(False) for _ in range(5))),
        timeout=4 * EXCHANGE_TIMEOUT_S,
    )
    for elapsed, received in outcomes:
        reply = parse_reply(received)
        assert reply is not None, "the connection was never answered"
        assert reply.status == 408 and orjson.loads(reply.body)["error"]["code"] == "header_timeout"
        # Cut at the timeout, not after the 100-odd bytes x 0.2 s the trickle would take.
        assert HEADER_TIMEOUT_S * 0.9 <= elapsed < EXCHANGE_TIMEOUT_S


def test_a_slow_body_after_fast_headers_is_not_cut_by_the_header_timeout(
    gateway: GatewayProcess, logs: LogWatch
) -> None:
    body = chat()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=EXCHANGE_TIMEOUT_S) as sock:
        head = request_bytes("/v1/chat/completions", body, [AUTH])[: -len(body)]
        sock.sendall(head)
        time.sleep(HEADER_TIMEOUT_S * 0.75)  # all within body_timeout_s, past header_timeout_s in all
        sock.sendall(body[:10])
        time.sleep(HEADER_TIMEOUT_S * 0.5)
        sock.sendall(body[10:])
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    reply = parse_reply(data)
    assert reply is not None and reply.status == 200, reply


def test_a_body_that_never_ends_is_a_408_at_the_body_timeout(gateway: GatewayProcess, logs: LogWatch) -> None:
    body = chat()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=EXCHANGE_TIMEOUT_S) as sock:
        sock.sendall(request_bytes("/v1/chat/completions", body, [AUTH])[:-5])
        started = time.monotonic()
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        elapsed = time.monotonic() - started
    reply = parse_reply(data)
    assert reply is not None and reply.status == 408, reply
    assert orjson.loads(reply.body)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT_S * 0.9 <= elapsed < EXCHANGE_TIMEOUT_S


def test_an_idle_keepalive_connection_outlives_the_header_timeout(gateway: GatewayProcess, logs: LogWatch) -> None:
    """The header timeout starts at a request's first byte, not when the last one ended."""
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        body = orjson.loads(chat())
        first = http.post("/v1/chat/completions", json=body)
        time.sleep(HEADER_TIMEOUT_S * 1.5)
        second = http.post("/v1/chat/completions", json=body)
        assert first.status_code == second.status_code == 200
        assert first.extensions["network_stream"] is second.extensions["network_stream"]


# -- fuzzing ------------------------------------------------------------------------------------


def dumps(value: Any) -> bytes:
    """JSON as a client might send it: integers past 64 bits, Infinity and all."""
    return json.dumps(value).encode()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
small_tokens = st.one_of(st.integers(-3, 4), json_values)
messages = st.one_of(
    st.just([{"role": "user", "content": "hi"}]),
    st.lists(
        st.fixed_dictionaries(
            {},
            optional={
                "role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), json_values),
                "content": st.one_of(st.text(max_size=40), json_values),
                "name": json_values,
                "tool_calls": json_values,
            },
        ),
        max_size=3,
    ),
    json_values,
)
request_like = st.fixed_dictionaries(
    {"model": st.one_of(st.just(MODEL), st.just("auto"), st.text(max_size=10), json_values)},
    optional={
        "messages": messages,
        "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(0, 100), max_size=5), json_values),
        "input": st.one_of(st.text(max_size=40), json_values),
        "max_tokens": small_tokens,
        "max_completion_tokens": small_tokens,
        "stream": st.one_of(st.booleans(), json_values),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "top_p": json_values,
        "n": st.one_of(st.integers(-1, 2), json_values),
        "stop": json_values,
        "seed": json_values,
        "tools": json_values,
        "metadata": json_values,
        # Responses, Messages and vLLM's own endpoints.
        "instructions": st.one_of(st.text(max_size=20), json_values),
        "max_output_tokens": small_tokens,
        "previous_response_id": st.one_of(st.text(max_size=12), json_values),
        "store": json_values,
        "background": json_values,
        "system": st.one_of(st.text(max_size=20), json_values),
        "stop_sequences": json_values,
        "top_k": json_values,
        "query": st.one_of(st.text(max_size=20), json_values),
        "documents": st.one_of(st.lists(st.text(max_size=10), max_size=3), json_values),
        "text_1": st.one_of(st.text(max_size=20), json_values),
        "text_2": st.one_of(st.text(max_size=20), st.lists(st.text(max_size=10), max_size=3), json_values),
        "tokens": st.one_of(st.lists(st.integers(-5, 70000), max_size=6), json_values),
    },
).map(dumps)
bodies = st.one_of(
    request_like,
    json_values.map(dumps),
    st.binary(max_size=200),
    st.integers(1, 3000).map(lambda d: b"[" * d + b"]" * d),
    st.text(max_size=100).map(str.encode),
)


@settings(FUZZ, max_examples=2000)
@given(endpoint=st.sampled_from(ENDPOINTS), body=bodies, stream_read=st.booleans())
def test_fuzzed_bodies(
    gateway: GatewayProcess, logs: LogWatch, http: httpx.Client, endpoint: str, body: bytes, stream_read: bool
) -> None:
    with http.stream("POST", endpoint, content=body, headers={"Content-Type": "application/json"}) as response:
        data = response.read()
    reply = Reply(response.status_code, dict(response.headers), data)
    assert_acceptable(reply, anthropic=endpoint in ANTHROPIC_PATHS)


@pytest.fixture(scope="module")
def http(gateway: GatewayProcess) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=gateway.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=EXCHANGE_TIMEOUT_S
    ) as client:
        yield client


header_names = st.one_of(
    st.sampled_from(
        [
            "x-request-id",
            "x-fleetgate-timeout-ms",
            "x-fleetgate-tier",
            "x-fleetgate-priority",
            "cache-control",
            "authorization",
            "content-type",
            "accept",
            "traceparent",
            "expect",
            "connection",
        ]
    ),
    st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"), min_size=1, max_size=20),
    st.text(min_size=1, max_size=10).filter(lambda s: ":" not in s and "\r" not in s and "\n" not in s),
)
header_values = st.one_of(
    st.text(max_size=60),
    st.sampled_from(["0", "-1", "1", "999999999999999999999", "soon", "low", "high", "large", "no-cache", "no-store"]),
    st.binary(max_size=40),
    st.integers().map(str),
)


def header_line(name: str, value: str | bytes) -> tuple[bytes, bytes]:
    raw = value if isinstance(value, bytes) else value.encode("utf-8", "surrogatepass")
    return name.encode("utf-8", "surrogatepass"), raw.replace(b"\r", b"").replace(b"\n", b"")


@settings(FUZZ, max_examples=1500)
@given(
    endpoint=st.sampled_from([*ENDPOINTS, "/v1/models", "/healthz", "/nowhere"]),
    headers=st.lists(st.tuples(header_names, header_values), max_size=6),
    authorised=st.booleans(),
)
def test_fuzzed_headers(
    gateway: GatewayProcess,
    logs: LogWatch,
    endpoint: str,
    headers: list[tuple[str, str | bytes]],
    authorised: bool,
) -> None:
    lines = [header_line(name, value) for name, value in headers if name.lower() not in ("connection",)]
    lines = [(n, v) for n, v in lines if n.lower() not in (b"content-length", b"transfer-encoding", b"host")]
    if authorised:
        lines.append(AUTH)
    method = b"GET" if endpoint in ("/v1/models", "/healthz") else b"POST"
    reply = exchange(gateway, request_bytes(endpoint, chat(), lines, method))
    assert reply is not None, "closed without an answer"
    deadline_sent = any(n.lower() == b"x-fleetgate-timeout-ms" for n, _ in lines)
    assert_acceptable(reply, deadline_sent=deadline_sent, anthropic=endpoint in ANTHROPIC_PATHS)


token = st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12).map(str.encode)
chunk_sizes = st.one_of(
    st.just(None),  # the right size
    st.sampled_from([b"zz", b"-1", b"", b"ffffffffffffffffff", b"1;ext=1", b" 5", b"0x5"]),
    st.integers(0, 64).map(lambda n: b"%x" % n),
)


@st.composite
def framed_requests(draw: st.DrawFn) -> bytes:
    """One HTTP/1.1 exchange as bytes, framing and all (always complete from the sender's side)."""
    method = draw(st.one_of(st.sampled_from([b"POST", b"GET", b"PUT", b"HEAD", b"OPTIONS", b"DELETE"]), token))
    path = draw(
        st.one_of(
            st.sampled_from([e.encode() for e in ENDPOINTS] + [b"/v1/models", b"/healthz", b"/metrics", b"*"]),
            st.text(max_size=30).map(lambda p: ("/" + p).encode("utf-8", "surrogatepass")),
        )
    )
    version = draw(st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b"HTTP/9.9", b"", b"ICE/1.0"]))
    body = draw(st.one_of(st.just(chat()), st.binary(max_size=64)))
    framing = draw(st.sampled_from(["length", "short_length", "chunked", "both", "te_unknown", "none", "bad_length"]))
    lines = [method + b" " + path + (b" " + version if version else b""), b"Host: 127.0.0.1", b"Connection: close"]
    if draw(st.booleans()):
        lines.append(AUTH[0] + b": " + AUTH[1])
    for name, value in draw(st.lists(st.tuples(header_names, header_values), max_size=3)):
        n, v = header_line(name, value)
        if n.lower() not in (b"content-length", b"transfer-encoding", b"connection", b"expect"):
            lines.append(n + b": " + v)
    if framing in ("length", "both"):
        lines.append(b"Content-Length: %d" % len(body))
    elif framing == "short_length":
        lines.append(b"Content-Length: %d" % draw(st.integers(0, len(body))))
    elif framing == "bad_length":
        lines.append(b"Content-Length: " + draw(st.sampled_from([b"-1", b"abc", b"1e3", b"", b"+5", b"5, 5"])))
    if framing in ("chunked", "both"):
        lines.append(b"Transfer-Encoding: chunked")
    elif framing == "te_unknown":
        lines.append(b"Transfer-Encoding: " + draw(st.sampled_from([b"gzip", b"identity", b"chunked, gzip", b"x"])))
    raw = b"\r\n".join(lines) + b"\r\n\r\n"
    if framing in ("chunked", "both", "te_unknown"):
        size = draw(chunk_sizes)
        raw += (b"%x" % len(body) if size is None else size) + b"\r\n" + body + b"\r\n0\r\n\r\n"
    elif framing != "none":
        raw += body
    return raw


@settings(FUZZ, max_examples=1500)
@given(raw=framed_requests())
def test_fuzzed_framing(gateway: GatewayProcess, logs: LogWatch, raw: bytes) -> None:
    reply = exchange(gateway, raw)
    if reply is None:
        return  # closed without an answer (checked below: only for what is not HTTP at all)
    assert_acceptable(
        reply,
        head=raw.startswith(b"HEAD "),
        deadline_sent=b"x-fleetgate-timeout-ms" in raw.lower(),
        anthropic=b" /v1/messages" in raw,
    )


def test_the_gateway_still_serves_after_the_abuse(gateway: GatewayProcess, logs: LogWatch) -> None:
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        reply = http.post("/v1/chat/completions", json=orjson.loads(chat()))
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 2
    assert gateway.proc is not None and gateway.proc.poll() is None


def test_log_watch_sees_a_5xx(tmp_path: Path) -> None:
    """The check every test above ends with can fail: it sees a 5xx in an access log."""
    gw = GatewayProcess({"models": [{"name": MODEL, "replicas": [{"url": "http://127.0.0.1:9"}]}]}, tmp_path)
    gw.stderr_path.write_text("")
    gw.stdout_path.write_text("")
    watch = LogWatch(gw)
    gw.stdout_path.write_text('{"status": 502}\n')
    with pytest.raises(AssertionError):
        watch.check()
    gw.stdout_path.write_text("")
    gw.stderr_path.write_text('{"level": "error", "msg": "unexpected error"}\n')
    with pytest.raises(AssertionError):
        watch.check()
