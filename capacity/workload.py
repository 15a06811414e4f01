"""Workload profiles for ``fleetgate bench``: who the users are and what they send.

A profile (YAML, see ``bench/profiles/``) lists user classes with their share of users; each
class draws, per session, a number of turns, and per turn a new message, an answer length
and a think time. The conversation grows turn by turn (earlier answers are sent back as
history), which is what makes multi-turn load heavier than single requests. A class may
open every session with a shared part (a system prompt, a repository's context) that a
prefix cache can reuse, with per-user data before it (every user cold) or after it.

    workload = load_workload("capacity/profiles/chat-assistant.yaml")
    session = Session(workload, workload.pick_class(rng), rng, tag="u3s1")
    while (request := session.next_request()) is not None:
        ...send it...; session.record_answer(answer_text)

Profiles are validated once, with ``extra="forbid"``; a bad one raises ``WorkloadError``
naming the key path (``classes[1].prompt_tokens.max: ...``). Token counts are approximate:
text is built at ``CHARS_PER_TOKEN`` characters per token, the real counts come back in the
responses' usage.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

PROFILES_DIR = Path(__file__).resolve().parent / "profiles"
# ~4 characters per token: what BPE tokenizers average on English, and exactly what the
# simulator counts, so a requested length is met there and approximated on real models.
CHARS_PER_TOKEN = 4
# Shares are fractions written by hand: allow rounding (0.33 + 0.33 + 0.34).
SHARE_TOLERANCE = 0.01
# Filler text is cut from one pseudo-random corpus: building a 100k-token context word by
# word would cost more client CPU than sending it. 2**20 characters hold ~260k tokens.
CORPUS_CHARS = 1 << 20
CORPUS_SEED = 20240601
_SYLLABLES = "ka lo mi ne ru sa te vo zi da fe gu ha ji ko lu ma no pi re so tu va wi xe yo ze".split()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Fixed(_Strict):
    """Always ``value``."""

    dist: Literal["fixed"] = "fixed"
    value: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.value


class Uniform(_Strict):
    """Uniform between ``min`` and ``max``."""

    dist: Literal["uniform"]
    min: float = Field(ge=0)
    max: float = Field(ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.max < self.min:
            raise ValueError(f"max ({self.max}) is below min ({self.min})")
        return self

    def sample(self, rng: random.Random) -> float:
        return rng.uniform(self.min, self.max)


class _Clipped(_Strict):
    min: float = Field(default=0.0, ge=0)
    max: float | None = Field(default=None, ge=0)

    def clip(self, x: float) -> float:
        x = max(self.min, x)
        return x if self.max is None else min(self.max, x)


class Normal(_Clipped):
    """Normal, clipped to ``[min, max]``."""

    dist: Literal["normal"]
    mean: float = Field(ge=0)
    sd: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.clip(rng.gauss(self.mean, self.sd))


class LogNormal(_Clipped):
    """Log-normal with the given ``median`` and log-space ``sigma`` (long right tail), clipped."""

    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)

    def sample(self, rng: random.Random) -> float:
        return self.clip(rng.lognormvariate(math.log(self.median), self.sigma))


class Exponential(_Clipped):
    """Exponential with the given ``mean`` (think times, memoryless arrivals), clipped."""

    dist: Literal["exponential"]
    mean: float = Field(gt=0)

    def sample(self, rng: random.Random) -> float:
        return self.clip(rng.expovariate(1.0 / self.mean))


def _number_is_fixed(value: Any) -> Any:
    # A bare number is the common case ("output_tokens: 200"): read it as a fixed distribution.
    if isinstance(value, int | float) and not isinstance(value, bool):
        return {"dist": "fixed", "value": value}
    return value


Distribution = Annotated[
    Fixed | Uniform | Normal | LogNormal | Exponential,
    Field(discriminator="dist"),
    BeforeValidator(_number_is_fixed),
]
DISTRIBUTION_KINDS = frozenset({"fixed", "uniform", "normal", "lognormal", "exponential"})


class SharedPrefix(_Strict):
    """A part many sessions open with: a system prompt, a repository's context."""

    tokens: int = Field(gt=0)
    variants: int = Field(default=1, ge=1)  # distinct copies (three repositories, two prompts)


class PrefixUse(_Strict):
    """How a class opens its sessions with a shared prefix."""

    name: str  # a key of the workload's ``prefixes``
    share: float = Field(default=1.0, ge=0, le=1)  # the others get a unique text of the same size
    user_data_tokens: Distribution = Field(default_factory=lambda: Fixed(value=0))
    user_data: Literal["before", "after"] = "after"  # before the shared part, every user is cold


class UserClass(_Strict):
    """One kind of user, and what each of its sessions looks like."""

    name: str
    share: float = Field(gt=0, le=1)
    turns: Distribution = Field(default_factory=lambda: Fixed(value=1))
    context_tokens: Distribution = Field(default_factory=lambda: Fixed(value=0))  # first turn only
    prompt_tokens: Distribution  # the new message of each turn
    output_tokens: Distribution
    fixed_output: bool = False  # generate exactly output_tokens (vLLM's ignore_eos)
    think_time_s: Distribution = Field(default_factory=lambda: Fixed(value=0))
    prefix: PrefixUse | None = None


class Reference(_Strict):
    """Published figures (load level -> metric name -> value), printed beside the measured ones."""

    source: str
    points: dict[float, dict[str, float]]


class Workload(_Strict):
    """A validated profile."""

    name: str
    description: str = ""
    api: Literal["chat", "completions"] = "chat"
    # History beyond this is cut (oldest turns first, the shared opening kept), as clients do.
    context_limit_tokens: int | None = Field(default=None, gt=0)
    prefixes: dict[str, SharedPrefix] = Field(default_factory=dict)
    classes: list[UserClass] = Field(min_length=1)
    reference: Reference | None = None

    @model_validator(mode="after")
    def _consistent(self) -> Workload:
        total = sum(c.share for c in self.classes)
        if abs(total - 1.0) > SHARE_TOLERANCE:
            raise ValueError(f"classes: shares add up to {total:g}, not 1")
        for i, c in enumerate(self.classes):
            if c.prefix is not None and c.prefix.name not in self.prefixes:
                known = ", ".join(sorted(self.prefixes)) or "none defined"
                raise ValueError(f"classes[{i}].prefix.name: unknown prefix {c.prefix.name!r} (known: {known})")
        return self

    def pick_class(self, rng: random.Random) -> UserClass:
        return rng.choices(self.classes, weights=[c.share for c in self.classes])[0]


class WorkloadError(ValueError):
    """A profile that cannot be used; the message names the file and the key path."""


def _key_path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part not in DISTRIBUTION_KINDS:  # the union's tag adds nothing for a reader
            out += f".{part}" if out else part
    return out


def parse_workload(data: Any, source: str = "<profile>") -> Workload:
    """Validate a profile already loaded from YAML."""
    if not isinstance(data, dict):
        raise WorkloadError(f"{source}: a profile is a mapping of keys, got {type(data).__name__}")
    try:
        return Workload.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            path = _key_path(tuple(err["loc"]))
            lines.append(f"{path}: {err['msg']}" if path else str(err["msg"]))
        raise WorkloadError(f"{source}: " + "; ".join(lines)) from None


def load_workload(name_or_path: str | Path) -> Workload:
    """A shipped profile by name (``chat-assistant``) or a YAML file by path."""
    path = Path(name_or_path)
    if not path.exists() and not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        shipped = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yaml")))
        raise WorkloadError(f"no profile {str(name_or_path)!r} (shipped: {shipped})")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise WorkloadError(f"{path}: not valid YAML: {exc}") from exc
    return parse_workload(data, str(path))


@lru_cache(maxsize=1)
def _corpus() -> str:
    rng = random.Random(CORPUS_SEED)
    words: list[str] = []
    size = 0
    while size < CORPUS_CHARS:
        word = "".join(rng.choices(_SYLLABLES, k=rng.randint(1, 4)))
        if rng.random() < 0.1:
            word += str(rng.randrange(1000))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)


def make_text(tokens: int, rng: random.Random, tag: str = "") -> str:
    """About ``tokens`` tokens of varied words, opening with ``tag`` (which makes the text unique)."""
    chars = tokens * CHARS_PER_TOKEN
    if chars <= 0:
        return ""
    corpus = _corpus()
    pieces = [f"[{tag}] " if tag else ""]
    need = chars - len(pieces[0])
    start = rng.randrange(len(corpus))
    while need > 0:  # wraps around the corpus for texts longer than its tail
        piece = corpus[start : start + need]
        pieces.append(piece)
        need -= len(piece)
        start = 0
    return "".join(pieces)[:chars]


def estimate_tokens(text: str) -> int:
    return -(-len(text) // CHARS_PER_TOKEN)


@dataclass(frozen=True)
class RequestSpec:
    """One request a session wants sent."""

    messages: list[dict[str, str]]
    max_tokens: int
    ignore_eos: bool
    turn: int
    # A first turn of a class with a shared opening: the sender labels its TTFT cold or warm.
    opens_with_prefix: bool
    # Which shared copy it opens with; None when its opening is unique (cold by design).
    prefix_key: str | None
    estimated_prompt_tokens: int


@dataclass
class Session:
    """One user's conversation: pure state, the caller sends the requests and feeds back answers."""

    workload: Workload
    user_class: UserClass
    rng: random.Random
    tag: str  # unique per session: opens its own texts, so no two sessions share them by chance
    namespace: str = ""  # a run's id: shared copies are shared within a run, cold in the next one
    turns: int = 0
    turn: int = 0
    prefix_key: str | None = None
    _system: str = ""
    _history: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        c, rng = self.user_class, self.rng
        self.turns = max(1, round(c.turns.sample(rng)))
        if c.prefix is not None:
            shared = self.workload.prefixes[c.prefix.name]
            if rng.random() < c.prefix.share:
                variant = rng.randrange(shared.variants)
                self.prefix_key = f"{c.prefix.name}#{variant}"
                # Every session of the run draws the same text for the same copy: seeded by its name.
                key = f"{self.namespace}/{self.prefix_key}"
                body = make_text(shared.tokens, random.Random(key), tag=key)
            else:
                body = make_text(shared.tokens, rng, tag=f"{self.tag}-own")
            user_data = make_text(round(c.prefix.user_data_tokens.sample(rng)), rng, tag=f"user {self.tag}")
            if user_data:
                self.prefix_key = None if c.prefix.user_data == "before" else self.prefix_key
                body = f"{user_data}\n{body}" if c.prefix.user_data == "before" else f"{body}\n{user_data}"
            self._system = body

    def next_request(self) -> RequestSpec | None:
        """The next turn's request, or None when the session is over."""
        if self.turn >= self.turns:
            return None
        c, rng = self.user_class, self.rng
        text = make_text(round(c.prompt_tokens.sample(rng)), rng, tag=f"{self.tag} t{self.turn}")
        if self.turn == 0:
            context = make_text(round(c.context_tokens.sample(rng)), rng, tag=f"{self.tag} ctx")
            text = f"{context}\n{text}" if context else text
        self._history.append({"role": "user", "content": text})
        max_tokens = max(1, round(c.output_tokens.sample(rng)))
        self._fit(max_tokens)
        messages = ([{"role": "system", "content": self._system}] if self._system else []) + list(self._history)
        return RequestSpec(
            messages=messages,
            max_tokens=max_tokens,
            ignore_eos=c.fixed_output,
            turn=self.turn,
            opens_with_prefix=self.turn == 0 and c.prefix is not None,
            prefix_key=self.prefix_key,
            estimated_prompt_tokens=sum(estimate_tokens(m["content"]) for m in messages),
        )

    def record_answer(self, text: str) -> None:
        """The assistant's answer to the last request: it becomes history, the next turn may start."""
        self._history.append({"role": "assistant", "content": text})
        self.turn += 1

    def abandon(self) -> None:
        """The last request failed: the user gives up on this conversation."""
        self.turn = self.turns

    def think_time_s(self) -> float:
        return self.user_class.think_time_s.sample(self.rng)

    def _fit(self, max_tokens: int) -> None:
        # Cut the oldest history first, from its front (the shared opening stays, so it stays
        # cacheable; an assistant that compacts its context keeps the newest turns), until
        # prompt and answer fit the context limit. Emptied exchanges are dropped in pairs so
        # user and assistant turns keep alternating, as strict chat templates require.
        limit = self.workload.context_limit_tokens
        if limit is None:
            return
        budget_chars = max(0, limit - max_tokens - estimate_tokens(self._system)) * CHARS_PER_TOKEN
        excess = sum(len(m["content"]) for m in self._history) - budget_chars
        for i, message in enumerate(self._history):
            if excess <= 0:
                break
            cut = min(len(message["content"]), excess)
            self._history[i] = {"role": message["role"], "content": message["content"][cut:]}
            excess -= cut
        while len(self._history) > 2 and not self._history[0]["content"] and not self._history[1]["content"]:
            del self._history[:2]


def request_sizes(workload: Workload, sessions: int, rng: random.Random) -> dict[str, list[int]]:
    """Estimated prompt tokens of every request of ``sessions`` sampled sessions, by class.

    Offline (answers are filler of the sampled length): what ``--dry-run`` prints, to check a
    profile's request sizes before sending anything.
    """
    sizes: dict[str, list[int]] = {c.name: [] for c in workload.classes}
    for number in range(sessions):
        session = Session(workload, workload.pick_class(rng), rng, tag=f"dry{number}")
        while (spec := session.next_request()) is not None:
            sizes[session.user_class.name].append(spec.estimated_prompt_tokens)
            session.record_answer(make_text(spec.max_tokens, rng))
    return sizes
