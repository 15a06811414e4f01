"""The incremental SSE scanner: boundaries, token counts, usage handling."""

from __future__ import annotations

import orjson
import pytest

from dialects.envelopes import OPENAI
from dialects.stream import MAX_EVENT_BYTES, SseError, SseScanner


def ev(payload: object) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


TOKEN = ev({"choices": [{"delta": {"content": "a"}}]})
USAGE = ev({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
DONE = b"data: [DONE]\n\n"


def test_complete_events_pass_through_untouched() -> None:
    s = SseScanner(drop_usage=False)
    out, n = s.feed(TOKEN + TOKEN)
    assert out == TOKEN + TOKEN
    assert n == 2
    assert s.events == 2


def test_partial_event_is_held_until_complete() -> None:
    s = SseScanner(drop_usage=False)
    out, n = s.feed(TOKEN[:10])
    assert (out, n) == (b"", 0)
    assert s.pending == TOKEN[:10]
    out, n = s.feed(TOKEN[10:] + TOKEN[:5])
    assert (out, n) == (TOKEN, 1)
    assert s.pending == TOKEN[:5]


def test_usage_kept_when_client_asked() -> None:
    s = SseScanner(drop_usage=False)
    out, n = s.feed(TOKEN + USAGE + DONE)
    assert out == TOKEN + USAGE + DONE
    # one token; the usage-only event and [DONE] are not tokens
    assert n == 1
    assert s.done
    assert s.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_usage_dropped_when_client_did_not_ask() -> None:
    s = SseScanner(drop_usage=True)
    out, _ = s.feed(TOKEN + USAGE + DONE)
    assert out == TOKEN + DONE
    assert s.usage is not None and s.usage["completion_tokens"] == 2


def test_usage_split_across_chunks() -> None:
    s = SseScanner(drop_usage=True)
    block = TOKEN + USAGE + DONE
    cut = len(TOKEN) + 20
    first, _ = s.feed(block[:cut])
    second, _ = s.feed(block[cut:])
    assert first + second == TOKEN + DONE
    assert s.usage is not None


def test_null_usage_fields_are_not_parsed_or_dropped() -> None:
    chunk = ev({"choices": [{"delta": {"content": "a"}}], "usage": None})
    s = SseScanner(drop_usage=True)
    out, n = s.feed(chunk)
    assert out == chunk
    assert n == 1
    assert s.usage is None


def test_usage_on_a_token_event_is_read_but_not_dropped() -> None:
    chunk = ev({"choices": [{"delta": {"content": "a"}}], "usage": {"completion_tokens": 1}})
    s = SseScanner(drop_usage=True)
    out, n = s.feed(chunk)
    assert out == chunk
    assert n == 1
    assert s.usage == {"completion_tokens": 1}


def test_error_event_shape() -> None:
    raw = OPENAI.event("boom", "upstream_stream_error")
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert orjson.loads(raw[6:]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": "upstream_stream_error"}
    }


def crlf(block: bytes) -> bytes:
    return block.replace(b"\n", b"\r\n")


def test_crlf_events_are_relayed_as_they_complete_with_lf_line_ends() -> None:
    """sse-starlette's framing (llama-cpp-python's server): CRLF line ends. Each event goes
    out as soon as it is whole, in the LF form every other part of the gateway reads."""
    s = SseScanner(drop_usage=True)
    assert s.feed(crlf(TOKEN)) == (TOKEN, 1)
    assert s.feed(crlf(USAGE + DONE)) == (DONE, 0)
    assert s.done and s.usage == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_every_split_of_a_crlf_or_cr_stream_gives_the_lf_stream() -> None:
    stream = TOKEN + TOKEN + USAGE + DONE
    for framed in (crlf(stream), stream.replace(b"\n", b"\r")):
        for cut in range(1, len(framed)):
            for second_cut in (cut, (cut + len(framed)) // 2):
                s = SseScanner(drop_usage=False)
                parts = (framed[:cut], framed[cut:second_cut], framed[second_cut:])
                out = b"".join(s.feed(part)[0] for part in parts)
                assert out == stream, (cut, second_cut)
                assert s.done and s.events == 2 and s.usage is not None


def test_an_event_that_never_ends_is_an_error_not_a_growing_buffer() -> None:
    s = SseScanner(drop_usage=False)
    piece = b"data: " + b"x" * 65536
    with pytest.raises(SseError):
        for _ in range(MAX_EVENT_BYTES // len(piece) + 2):
            assert s.feed(piece) == (b"", 0)


def test_a_finished_stream_without_done_is_ended_as_openai_ends_it() -> None:
    """Servers that omit ``[DONE]``: once their body has ended cleanly, a stream whose last
    event stopped its choice (or that sent usage) is finished; one that stopped mid-way is not."""
    stop = ev({"choices": [{"delta": {"content": "b"}, "finish_reason": "stop"}]})
    spaced = b'data: {"choices": [{"delta": {}, "finish_reason": "length"}]}\n\n'
    for last in (stop, spaced):
        s = SseScanner(drop_usage=False)
        s.feed(TOKEN + last)
        assert not s.done
        assert s.finish() == DONE and s.done
        assert s.finish() == b""  # once
    s = SseScanner(drop_usage=True)
    s.feed(TOKEN)
    s.feed(USAGE)
    assert s.finish() == DONE
    cut = SseScanner(drop_usage=False)
    cut.feed(TOKEN + TOKEN)
    assert cut.finish() == b"" and not cut.done
    whole = SseScanner(drop_usage=False)
    whole.feed(TOKEN + stop + DONE)
    assert whole.done and whole.finish() == b""
