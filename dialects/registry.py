"""Every dialect the gateway serves, in one place: adding an API is a dialect and a line here."""

from __future__ import annotations

from dialects.anthropic import COUNT_TOKENS, MESSAGES
from dialects.base import Dialect
from dialects.engine import (
    CLASSIFY,
    DETOKENIZE,
    POOLING,
    RERANK,
    SCORE,
    TOKENIZE,
    TRANSCRIPTIONS,
    TRANSLATIONS,
)
from dialects.openai import CHAT, COMPLETIONS, EMBEDDINGS
from dialects.responses import RESPONSES_API

# Each is served at its ``path`` (POST), and forwarded to the same path on a replica.
DIALECTS: tuple[Dialect, ...] = (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    RESPONSES_API,
    MESSAGES,
    COUNT_TOKENS,
    *RERANK,
    *SCORE,
    POOLING,
    CLASSIFY,
    TOKENIZE,
    DETOKENIZE,
    TRANSCRIPTIONS,
    TRANSLATIONS,
)

BY_PATH: dict[str, Dialect] = {d.path: d for d in DIALECTS}
