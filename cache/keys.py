"""What the exact cache may answer, and under which key: pure functions over the parsed body.

The key is a SHA-256 over a canonical form of everything that can change the answer. The
list is one of exclusions, not inclusions: every body field is part of the key except the
few below that only shape the delivery or label the request. A field this module has never
heard of (a new OpenAI parameter, a vLLM extension such as ``top_k``, ``min_p``,
``guided_json`` or ``chat_template_kwargs``) therefore splits the cache instead of being
ignored; an unknown field costs a miss, never a wrong answer.

Left out of the key (``NOT_IN_KEY``):

    model            hashed separately (the name the client asked for, see ``exact_key``)
    stream           a streamed and a non-streamed request share one entry; replay re-shapes
    stream_options   delivery only (``include_usage`` is honoured at replay)
    user, metadata   labels for the caller's bookkeeping
    store            keep the answer (chat: for distillation; Responses: in the gateway's
                     response store, which a cache hit still does), not a generation parameter
    service_tier     latency class, not content
    priority, request_id   vLLM scheduling and tracing

and whatever the request's dialect adds (``Answers.key_excluded``: a field the gateway has
already folded into others), which leaves every other API's key material unchanged.

Canonical form (``canonical_body``): keys sorted at every depth, no whitespace (orjson
re-serialises the parsed body, so the client's key order and spacing vanish), ``null``
fields dropped (OpenAI treats them as absent), sampling numbers as floats (``0`` and
``0.0`` are one temperature), ``stop: "x"`` as ``["x"]``, ``max_completion_tokens`` folded
into ``max_tokens`` (both mean the same cap), and documented defaults dropped (``n: 1``,
``top_p: 1``, penalties ``0``, ``logprobs: false``, ``echo: false``). Nothing inside
``messages``, ``prompt`` or ``tools`` is rewritten: a chat template may render ``"text"``
and ``[{"type": "text", ...}]`` differently, so they stay different keys.

Which requests (``cacheability``): those of a dialect with ``answers`` (the exact cache
keeps and replays what that object folds), under the same rules: greedy (``temperature`` 0
or ``top_k`` 1) or seeded (where the API takes a ``seed``, ``Answers.takes_seed``) unless
the tenant opts in to sampled ones, one answer per request (one prompt: ``several_prompts``),
no log-probabilities (``wants_logprobs``). Every function here takes the request's
``Dialect``; the API's rules are its ``answers``', the cache's the same for all.

Tenant isolation: the tenant's scope is hashed into the digest *and* prefixes the key
(``<scope>:<sha256 hex>``), so a hit across tenants would need a SHA-256 collision, and a
store can place each tenant's entries under its own Redis hash tag.

The semantic cache (``semantic_query``) splits the same canonical body in two: the text
it compares by meaning (the dialect's ``question``) and everything else, which must match
exactly. That rest (system prompt, earlier turns, tools, sampling parameters, endpoint,
model, tenant) is hashed into a *semantic scope*,
``<tenant>:<sha256 hex>``; only entries of the same scope are ever compared.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from cache.config import CacheSettings
from dialects.answer import Answers
from dialects.base import Dialect

# Bump when the canonical form changes: old entries then simply stop matching.
KEY_VERSION = "fg-exact-1"
SEMANTIC_SCOPE_VERSION = "fg-semantic-1"

NOT_IN_KEY = frozenset(
    {"model", "stream", "stream_options", "user", "metadata", "store", "service_tier", "priority", "request_id"}
)
# Sampling parameters whose integer and float spellings mean the same thing.
FLOAT_FIELDS = frozenset(
    {"temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty"}
)
# OpenAI's documented defaults: sending them is the same request as leaving them out.
DEFAULTS: dict[str, Any] = {
    "n": 1,
    "top_p": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logprobs": False,
    "echo": False,
}

# Escaped in a scope so it cannot forge the ':' separator or a Redis hash tag.
_SCOPE_ESCAPES = str.maketrans({"%": "%25", ":": "%3A", "{": "%7B", "}": "%7D"})


class Cacheability(StrEnum):
    """Whether a request may use the exact cache; every other member is the reason not."""

    CACHEABLE = "cacheable"
    DISABLED = "disabled"  # the tenant turned the exact cache off
    ENDPOINT = "endpoint"  # embeddings and unknown endpoints are not cached here
    NONDETERMINISTIC = "nondeterministic"  # sampling without a seed (and no tenant opt-in)
    MULTIPLE_CHOICES = "multiple_choices"  # n > 1
    BATCH_PROMPT = "batch_prompt"  # several prompts in one completions request
    LOGPROBS = "logprobs"  # the cache keeps text, not log-probabilities
    NO_CACHE = "no_cache"  # Cache-Control: no-cache: no lookup (the answer may still be kept)
    NO_STORE = "no_store"  # Cache-Control: no-store: lookup allowed, the answer is not kept


@dataclass(frozen=True, slots=True)
class CacheDirectives:
    """What a request's ``Cache-Control`` header allows."""

    lookup: bool = True  # False on no-cache (or max-age=0): do not answer from the cache
    store: bool = True  # False on no-store: do not keep this answer


def parse_cache_control(header: str | None) -> CacheDirectives:
    """``Cache-Control`` request directives (RFC 9111 section 5.2.1), case-insensitive."""
    if not header:
        return CacheDirectives()
    lookup, store = True, True
    for part in header.split(","):
        name, _, value = part.strip().partition("=")
        name = name.strip().lower()
        if name == "no-cache" or (name == "max-age" and value.strip().strip('"') == "0"):
            lookup = False
        elif name == "no-store":
            store = False
    return CacheDirectives(lookup=lookup, store=store)


@dataclass(frozen=True, slots=True)
class SemanticQuery:
    """What the semantic cache compares for one request: a scope that must match, and a text."""

    scope: str  # "<escaped tenant>:<sha256 hex>" of everything but the text
    text: str

    @property
    def tenant(self) -> str:
        """The escaped tenant id the scope starts with (``split_key`` works on scopes too)."""
        return split_key(self.scope)[0]


@dataclass(frozen=True, slots=True)
class CachePlan:
    """What the exact cache does for one request; ``key`` is None when it does nothing."""

    key: str | None
    lookup: bool
    store: bool
    # Why the cache is (partly) bypassed, for the bypass metric; CACHEABLE when it is not.
    reason: Cacheability
    # Set when the tenant's semantic cache may also answer (or keep) this request.
    semantic: SemanticQuery | None = None

    @property
    def coalesce(self) -> bool:
        """Share an in-flight answer only when the client allows both reading and keeping one."""
        return self.lookup and self.store


def plan_request(
    scope: str,
    model: str,
    dialect: Dialect,
    body: dict[str, Any],
    settings: CacheSettings,
    cache_control: str | None,
) -> CachePlan:
    """Decide lookup / store / coalesce for one request, and compute its key if any is needed."""
    verdict = cacheability(dialect, body, settings)
    if verdict is not Cacheability.CACHEABLE:
        return CachePlan(key=None, lookup=False, store=False, reason=verdict)
    directives = parse_cache_control(cache_control)
    if not directives.lookup and not directives.store:
        return CachePlan(key=None, lookup=False, store=False, reason=Cacheability.NO_CACHE)
    reason = Cacheability.CACHEABLE
    if not directives.lookup:
        reason = Cacheability.NO_CACHE
    elif not directives.store:
        reason = Cacheability.NO_STORE
    key = exact_key(scope, model, dialect, body)
    return CachePlan(key=key, lookup=directives.lookup, store=directives.store, reason=reason)


def cacheability(dialect: Dialect, body: dict[str, Any], settings: CacheSettings) -> Cacheability:
    """Whether the exact cache may answer (and keep) this request, by the tenant's settings."""
    if not settings.enabled:
        return Cacheability.DISABLED
    answers = dialect.answers
    if answers is None:
        return Cacheability.ENDPOINT
    n = body.get("n")
    if n is not None and n != 1:
        return Cacheability.MULTIPLE_CHOICES
    if answers.several_prompts(body):
        return Cacheability.BATCH_PROMPT
    if answers.wants_logprobs(body):
        return Cacheability.LOGPROBS
    if not settings.cache_nondeterministic and not is_deterministic(body, takes_seed=answers.takes_seed):
        return Cacheability.NONDETERMINISTIC
    return Cacheability.CACHEABLE


def is_deterministic(body: dict[str, Any], *, takes_seed: bool = True) -> bool:
    """Greedy decoding (temperature 0 or top_k 1) or, where the API takes one, a fixed seed.

    An absent temperature is OpenAI's, Anthropic's and vLLM's default of 1: sampling.
    """
    temperature = body.get("temperature")
    if _is_number(temperature) and temperature == 0:
        return True
    top_k = body.get("top_k")
    if _is_number(top_k) and top_k == 1:
        return True
    seed = body.get("seed")
    return takes_seed and isinstance(seed, int) and not isinstance(seed, bool)


def canonical_body(body: dict[str, Any], also_excluded: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The fields that change the answer, in one spelling (see the module docstring);
    ``also_excluded``: the dialect's own exclusions (``Answers.key_excluded``)."""
    out: dict[str, Any] = {}
    for name, value in body.items():
        if name in NOT_IN_KEY or value is None or name in also_excluded:
            continue
        if name in FLOAT_FIELDS and _is_number(value):
            value = float(value)
        elif name == "stop":
            if isinstance(value, str):
                value = [value]
            elif value == []:
                continue
        default = DEFAULTS.get(name, _NO_DEFAULT)
        if default is not _NO_DEFAULT and type(value) is type(default) and value == default:
            continue
        out[name] = value
    cap = out.pop("max_completion_tokens", None)
    if cap is not None:
        out["max_tokens"] = cap
    return out


def exact_key(scope: str, model: str, dialect: Dialect, body: dict[str, Any]) -> str:
    """``<scope>:<sha256 hex>`` for the request ``body`` sent to ``dialect``'s path for ``model``.

    ``scope`` is the tenant id. ``model`` is what decides which weights answer: the name
    the client asked for (so ``"auto"`` requests share entries among themselves, keyed by
    their content, which is what the tier classifier looks at), plus any forced tier, e.g.
    ``"auto@large"``, when a header overrides the classifier.
    """
    material = orjson.dumps(
        [KEY_VERSION, scope, model, dialect.path, canonical_body(body, _excluded(dialect.answers))],
        option=orjson.OPT_SORT_KEYS,
    )
    return f"{escape_scope(scope)}:{hashlib.sha256(material).hexdigest()}"


def semantic_query(scope: str, model: str, dialect: Dialect, body: dict[str, Any]) -> SemanticQuery | None:
    """The text to match by meaning and the exact-match scope around it; None if there is none.

    The text is the dialect's question (``semantic_text``). The scope hashes
    ``canonical_body`` with that text taken out (``Dialect.without_question``: chat's last
    message keeps its other fields), so every other field, known or not, splits the scope
    exactly as it splits the exact key.
    """
    text = semantic_text(dialect, body)
    if text is None:
        return None
    rest = dialect.without_question(body)
    material = orjson.dumps(
        [SEMANTIC_SCOPE_VERSION, scope, model, dialect.path, canonical_body(rest, _excluded(dialect.answers))],
        option=orjson.OPT_SORT_KEYS,
    )
    return SemanticQuery(f"{escape_scope(scope)}:{hashlib.sha256(material).hexdigest()}", text)


def semantic_text(dialect: Dialect, body: dict[str, Any]) -> str | None:
    """The text ``semantic_query`` compares, stripped; None if the request has none.

    The dialect's question (``Dialect.question``), for the dialects whose answers the exact
    cache keeps; a dialect that names no question uses the exact cache only. Known before
    the model is: the classifier embeds the same text.
    """
    if dialect.answers is None:
        return None
    return dialect.question(body)


def escape_scope(scope: str) -> str:
    """The scope as it appears in keys: no ``:``, ``{`` or ``}`` (percent-escaped)."""
    return scope.translate(_SCOPE_ESCAPES)


def split_key(key: str) -> tuple[str, str]:
    """``(escaped scope, digest)`` of a key made by ``exact_key``."""
    scope, sep, digest = key.rpartition(":")
    if not sep or not scope or not digest:
        raise ValueError(f"not a cache key: {key!r}")
    return scope, digest


_NO_DEFAULT = object()


def _excluded(answers: Answers | None) -> frozenset[str]:
    return answers.key_excluded if answers is not None else frozenset()


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
