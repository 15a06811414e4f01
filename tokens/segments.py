"""A rendered chat prompt's tokens, counted piece by piece between its special tokens, with
the pieces' counts remembered.

The ``tokenizers`` library cuts its input at the added tokens (``<|im_start|>``,
``<|eot_id|>``...) before anything else and tokenises each piece between them on its own,
so a prompt's count is its added tokens plus the sum of its pieces' counts. Chat templates
put added tokens around every message, so the pieces are the messages: a system prompt, the
tool schemas, the conversation so far recur from one request to the next (an agent resends
them every turn) and are encoded once, only the new turn each time.

This holds exactly when every added token is matched as it is written: not normalised,
no ``lstrip``/``rstrip`` taking neighbouring spaces, not ``single_word``. For a tokenizer
with any other added token, ``SegmentCounter.for_tokenizer`` returns None and prompts are
encoded whole.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict

from tokenizers import Tokenizer

# Characters of pieces whose counts are kept (least recently used dropped first): about
# 2 M tokens of prompts, some 8 MB of text, per model.
MAX_CACHED_CHARS = 8_000_000
# What one remembered piece costs beyond its characters (its OrderedDict node, the str
# header, the int), in characters, so that a flood of short pieces is bounded too. Short
# pieces are remembered as well: the role headers and separators between the added tokens
# ("assistant\n", "\n") recur in every prompt, and a dict lookup costs some 50 ns where
# encoding even a short piece costs about 10 µs.
ENTRY_OVERHEAD_CHARS = 128


class SegmentCounter:
    """Counts a text's tokens as the sum over the pieces between its added tokens."""

    def __init__(self, tokenizer: Tokenizer, added: list[str], max_chars: int = MAX_CACHED_CHARS) -> None:
        self._tokenizer = tokenizer
        # Longest first at each position: the tokenizer matches leftmost-longest.
        self._split = re.compile("|".join(re.escape(t) for t in sorted(added, key=len, reverse=True)))
        self._counts: OrderedDict[str, int] = OrderedDict()
        self._chars = 0
        self._max_chars = max_chars
        self._lock = threading.Lock()  # counts run on several worker threads

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer) -> SegmentCounter | None:
        """A counter for ``tokenizer``, or None when its added tokens do not cut text cleanly."""
        added = json.loads(tokenizer.to_str()).get("added_tokens") or []
        plain = all(
            not (t.get("normalized") or t.get("lstrip") or t.get("rstrip") or t.get("single_word")) for t in added
        )
        contents = [t["content"] for t in added if t.get("content")]
        return cls(tokenizer, contents) if plain and contents else None

    def count(self, text: str) -> int:
        """``text``'s tokens (encoded without special tokens added)."""
        pieces = self._split.split(text)
        total = len(pieces) - 1  # one added token between each two pieces
        missing: list[str] = []
        with self._lock:
            for piece in pieces:
                if not piece:
                    continue
                known = self._counts.get(piece)
                if known is None:
                    missing.append(piece)
                else:
                    self._counts.move_to_end(piece)
                    total += known
        if not missing:
            return total
        # encode_batch_fast releases the GIL while it works and skips the offsets.
        counts = [len(e) for e in self._tokenizer.encode_batch_fast(missing, add_special_tokens=False)]
        with self._lock:
            for piece, n in zip(missing, counts, strict=True):
                total += n
                if piece not in self._counts:
                    self._counts[piece] = n
                    self._chars += len(piece) + ENTRY_OVERHEAD_CHARS
            while self._chars > self._max_chars and self._counts:
                dropped, _ = self._counts.popitem(last=False)
                self._chars -= len(dropped) + ENTRY_OVERHEAD_CHARS
        return total
