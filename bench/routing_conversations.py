"""The multi-turn workload of ``bench/routing_vllm.py``: chats behind Zipf-popular system prompts.

Pure: seeded text and plain data, no I/O. A conversation opens with one of a few long
system prompts, drawn with Zipf popularity (the first prompt the most popular), and runs
several turns; each turn resends the whole history, the replica's own earlier answers
included, and adds a new user message. That is how chat clients talk to an engine, and
where prefix-aware routing meets skew: following the prefix keeps a conversation's history
cached, while the few hot prompts pull most of the traffic towards the replicas that hold
them.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

Message = dict[str, str]


@dataclass(frozen=True)
class ConversationSpec:
    """What to build: the system prompts, their popularity and the conversations."""

    prompts: int = 16
    prompt_tokens: int = 1400
    user_words: int = 12
    conversations: int = 480
    min_turns: int = 4
    max_turns: int = 6
    # Zipf's exponent: prompt k (from 1) is drawn with weight k ** -s. Around 1, as measured
    # for the popularity of shared content (web objects, prompts of a hosted assistant).
    zipf_s: float = 1.1


@dataclass(frozen=True)
class Conversation:
    """One chat: its id, its system prompt (an index) and its user messages, one per turn."""

    id: str
    system: int
    users: tuple[str, ...]


@dataclass(frozen=True)
class Conversations:
    """The system prompts and the conversations, in the order clients take them up."""

    systems: tuple[str, ...]
    conversations: tuple[Conversation, ...]
    tokens: int  # the system prompts' tokens, all together

    @property
    def requests(self) -> int:
        return sum(len(c.users) for c in self.conversations)


def zipf_weights(n: int, s: float) -> list[float]:
    """Zipf popularity of ``n`` items (rank 1 first), normalised to sum to 1."""
    raw = [k**-s for k in range(1, n + 1)]
    total = sum(raw)
    return [w / total for w in raw]


def build_conversations(
    spec: ConversationSpec, seed: int, words: Sequence[str], cut: Callable[[list[str]], tuple[list[str], int]]
) -> Conversations:
    """Seeded system prompts (each cut to ``prompt_tokens`` by ``cut``, the engine's tokenizer) and conversations."""
    rng = random.Random(f"routing-vllm-multiturn:{seed}")
    drafts = [
        f"System prompt {i} of conversation set {seed}. " + " ".join(rng.choices(words, k=spec.prompt_tokens * 2))
        for i in range(spec.prompts)
    ]
    systems, tokens = cut(drafts)
    weights = zipf_weights(spec.prompts, spec.zipf_s)
    conversations = []
    for n in range(spec.conversations):
        system = rng.choices(range(spec.prompts), weights=weights)[0]
        turns = rng.randint(spec.min_turns, spec.max_turns)
        users = tuple(
            f"Conversation {n}, turn {t}: " + " ".join(rng.choices(words, k=spec.user_words)) + "?"
            for t in range(turns)
        )
        conversations.append(Conversation(f"s{seed}-c{n}", system, users))
    return Conversations(tuple(systems), tuple(conversations), tokens)


def turn_messages(system: str, users: Sequence[str], replies: Sequence[str]) -> list[Message]:
    """Turn ``len(replies)``'s messages: the system prompt, every earlier exchange, the next user message."""
    messages: list[Message] = [{"role": "system", "content": system}]
    for user, reply in zip(users, replies, strict=False):
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    messages.append({"role": "user", "content": users[len(replies)]})
    return messages


def stable_hash(text: str, buckets: int) -> int:
    """An MD5 of ``text`` modulo ``buckets``: the same choice in every process and every run."""
    return int.from_bytes(hashlib.md5(text.encode()).digest()[:8], "little") % buckets
