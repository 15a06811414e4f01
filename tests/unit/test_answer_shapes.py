"""What an API's answer looks like lives in its dialect only: the literals of the answer and
stream shapes appear in no code of ``gateway``, ``cache`` or ``routing``, read from the
source with ``ast`` (comments and docstrings may name them; code may not).

The cache stores and finds entries whatever the API (``Dialect.answers`` folds, replays and
keys them), and no code there names an API's kind of answer either.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("gateway", "cache", "routing")
# The keys and events of OpenAI's chat chunks, Anthropic's Messages events, the Responses
# text parts and OpenAI's end of stream.
EXACT = frozenset({"choices", "delta"})
WITHIN = ('"choices"', '"delta"', "message_start", "content_block_", "output_text", "[DONE]")
# The kinds of answer the cache keeps: named by the dialects, never by the cache.
KINDS = frozenset({"chat", "completion", "responses", "messages"})


def literals(path: Path) -> Iterator[tuple[int, str]]:
    """Every string or bytes literal of ``path``'s code, with its line; docstrings and other
    bare-string statements left out."""
    tree = ast.parse(path.read_text(), str(path))
    bare = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in bare and isinstance(node.value, str | bytes):
            value = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            yield node.lineno, value


def offending(value: str, package: str) -> bool:
    if value in EXACT or any(needle in value for needle in WITHIN):
        return True
    return package == "cache" and value in KINDS


def test_no_answer_shape_outside_the_dialects() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {value!r}"
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for line, value in literals(path)
        if offending(value, package)
    ]
    assert not found, "an API's answer shape belongs in its dialect (dialects/):\n" + "\n".join(found)


def test_the_check_sees_code_and_skips_docstrings(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        '"""Reads ``choices`` and ``[DONE]``."""\n'
        "def f(x):\n"
        '    """``message_start``."""\n'
        "    # output_text\n"
        '    return x["choices"], b"data: [DONE]", f"{x}content_block_start"\n'
    )
    assert sorted(value for _, value in literals(source) if offending(value, "gateway")) == [
        "choices",
        "content_block_start",
        "data: [DONE]",
    ]
