"""vLLM's other model-addressed endpoints: rerank, score, pooling, classify, tokenize,
detokenize, and audio (transcriptions, translations).

None streams; each is routed by its ``model`` (a multipart form field for audio), passed
through with its body untouched but for the model name, and settled on the usage its answer
reports (rerank and score report prompt tokens; tokenize reports none).
"""

from __future__ import annotations

import re
from typing import Any

from dialects.base import CHARS_PER_TOKEN, Call, Dialect, InvalidBody


class Pooling(Dialect):
    """A JSON endpoint whose prompt sits in the given fields (strings or lists of them)."""

    def __init__(self, name: str, path: str, fields: tuple[str, ...], operation: str = "") -> None:
        self.name, self.path, self.operation = name, path, operation or name
        self.prompt_param = fields[0] if fields else "model"
        self._fields = fields

    def prompt_chars(self, body: dict[str, Any]) -> int:
        return sum(_chars(body.get(name)) for name in self._fields)

    def usage(self, answer: dict[str, Any]) -> dict[str, int] | None:
        """Prompt tokens only (``total_tokens`` where that is all it says)."""
        usage = answer.get("usage")
        if not isinstance(usage, dict):
            return None
        total = usage.get("total_tokens")
        prompt = usage.get("prompt_tokens", total)
        if not isinstance(prompt, int):
            return None
        return {"prompt_tokens": prompt, "completion_tokens": 0, "total_tokens": prompt}


class Detokenize(Pooling):
    """``/detokenize``: token ids in, text out; the ids are the prompt."""

    def prompt_chars(self, body: dict[str, Any]) -> int:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidBody("'tokens' is required: an array of token ids.", param="tokens")
        return len(tokens) * CHARS_PER_TOKEN


class Audio(Dialect):
    """A multipart form (``file`` and ``model`` among its fields), answered with JSON or text.

    The file is forwarded as it came; only the ``model`` field is read (and rewritten when a
    fallback or an alias serves the request). Its size stands in for the prompt's.
    """

    prompt_param = "file"
    multipart = True
    answers_json = False

    def __init__(self, name: str, path: str) -> None:
        self.name, self.path, self.operation = name, path, name

    def parse(self, raw: bytes, content_type: str | None = None) -> Call:
        boundary = _boundary(content_type)
        if boundary is None:
            raise InvalidBody("The request body must be multipart/form-data with a boundary.")
        fields = _form_fields(raw, boundary)
        if "file" not in fields:
            raise InvalidBody("'file' is required: the audio to transcribe.", param="file")
        model = fields.get("model")
        if not model:
            raise InvalidBody("'model' is required and must be a non-empty string.", param="model")
        body = {"model": model}
        # A second of audio is ~32 KB of 16-bit PCM and a few words: bytes say little of
        # tokens, so the estimate is the file's size in KB, enough for a reservation.
        tokens = max(1, len(raw) // 1024)
        return Call(self, body, model, False, False, None, tokens, raw, content_type=str(content_type))

    def upstream_body(self, call: Call, served_model: str) -> bytes:
        if served_model == call.model:
            return call.raw
        boundary = _boundary(call.content_type)
        assert boundary is not None  # parse checked it
        return _replace_field(call.raw, boundary, "model", served_model)

    def usage(self, answer: dict[str, Any]) -> dict[str, int] | None:
        usage = answer.get("usage")
        if not isinstance(usage, dict):
            return None
        prompt = usage.get("prompt_tokens", usage.get("input_tokens", 0))
        completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return None
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _chars(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    if isinstance(value, dict):
        return _chars(value.get("text")) + _chars(value.get("content"))
    return 0


_BOUNDARY = re.compile(r'boundary="?([^";]+)"?', re.IGNORECASE)
_NAME = re.compile(rb'name="([^"]*)"', re.IGNORECASE)


def _boundary(content_type: str | None) -> str | None:
    if not content_type or not content_type.lower().startswith("multipart/form-data"):
        return None
    found = _BOUNDARY.search(content_type)
    return found.group(1) if found else None


def _parts(raw: bytes, boundary: str) -> list[tuple[int, int, int]]:
    """``(start of headers, start of value, end of value)`` of each part of a form."""
    delimiter = b"--" + boundary.encode("latin-1")
    found: list[tuple[int, int, int]] = []
    pos = raw.find(delimiter)
    while pos != -1:
        start = pos + len(delimiter)
        if raw.startswith(b"--", start):
            break
        start = raw.find(b"\r\n", start) + 2
        value = raw.find(b"\r\n\r\n", start)
        end = raw.find(b"\r\n" + delimiter, value)
        if start < 2 or value == -1 or end == -1:
            raise InvalidBody("The multipart body is malformed.")
        found.append((start, value + 4, end))
        pos = end + 2
    return found


def _form_fields(raw: bytes, boundary: str) -> dict[str, str]:
    """The form's field names, with the value of each small text field ("" for files)."""
    fields: dict[str, str] = {}
    for start, value, end in _parts(raw, boundary):
        head = raw[start:value]
        name = _NAME.search(head)
        if name is None:
            continue
        key = name.group(1).decode("utf-8", "replace")
        is_file = b"filename=" in head.lower()
        fields[key] = "" if is_file or end - value > 4096 else raw[value:end].decode("utf-8", "replace").strip()
    return fields


def _replace_field(raw: bytes, boundary: str, field: str, text: str) -> bytes:
    for start, value, end in _parts(raw, boundary):
        name = _NAME.search(raw[start:value])
        if name is not None and name.group(1) == field.encode():
            return raw[:value] + text.encode() + raw[end:]
    return raw


RERANK = (Pooling("rerank", "/v1/rerank", ("query", "documents")), Pooling("rerank", "/rerank", ("query", "documents")))
SCORE = (
    Pooling("score", "/v1/score", ("text_1", "text_2", "queries", "documents")),
    Pooling("score", "/score", ("text_1", "text_2", "queries", "documents")),
)
POOLING = Pooling("pooling", "/pooling", ("input", "messages"))
CLASSIFY = Pooling("classify", "/classify", ("input", "messages"))
TOKENIZE = Pooling("tokenize", "/tokenize", ("prompt", "messages"))
DETOKENIZE = Detokenize("detokenize", "/detokenize", ())
TRANSCRIPTIONS = Audio("transcriptions", "/v1/audio/transcriptions")
TRANSLATIONS = Audio("translations", "/v1/audio/translations")
