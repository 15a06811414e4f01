"""Routing configuration as written in the YAML: the ``routing:`` block, and the per-model
(``models[].capacity``) and per-tenant (``tenants[].degrade``) pieces that belong to routing.

Example::

    routing:
      policy: prefix_affinity        # least_outstanding_tokens | least_requests | round_robin
      tiers:                         # score ranges of the complexity classifier, [0, 1] covered
        - {name: small, min_score: 0.0, max_score: 0.45}
        - {name: medium, min_score: 0.45, max_score: 0.5}
        - {name: large, min_score: 0.5, max_score: 1.0}
      classifier: {embedding: auto}  # always | never: when the embedding head scores auto requests
      affinity: {factor: 1.25, margin_requests: 4, anchor_blocks: 4}
      capacity: {max_requests: 256, max_prefill_tokens: 4096}  # per replica, unless models[].capacity says otherwise
      retry_budget: {ratio: 0.2, min_per_s: 1, burst: 10}
      queue: {max_queue_length: 256, max_wait_s: {high: 30, normal: 10, low: 2}}
    bands: [interactive, standard, {name: batch, max_queued: 2048}]   # top level, highest first

``docs/routing.md`` explains each knob; ``gateway.settings`` checks the parts that refer to
other sections (fallback model names, tier names a tenant may force).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from routing.classifier import DEFAULT_TIERS, TierRange, validate_tiers
from routing.kv_index import DEFAULT_MAX_BLOCKS as DEFAULT_KV_BLOCKS
from routing.policies import (
    DEFAULT_BLOCK_CHARS,
    DEFAULT_COARSE_BLOCK_CHARS,
    DEFAULT_MAX_BLOCKS,
    DEFAULT_MAX_PREFIX_CHARS,
)
from routing.prefix_index import DEFAULT_MAX_KEYS

PolicyName = Literal["prefix_affinity", "least_outstanding_tokens", "least_requests", "round_robin"]
Priority = Literal["low", "normal", "high"]
# Lowest first: a request may lower its priority below its tenant's, never raise it.
PRIORITIES: tuple[Priority, ...] = ("low", "normal", "high")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class TierSettings(_Frozen):
    """A tier and its score range: ``min_score <= score < max_score`` (the top tier includes 1.0)."""

    name: str = Field(min_length=1)
    min_score: float = Field(ge=0.0, le=1.0)
    max_score: float = Field(ge=0.0, le=1.0)

    def range(self) -> TierRange:
        return TierRange(self.name, self.min_score, self.max_score)


EmbeddingUse = Literal["auto", "always", "never"]


class ClassifierSettings(_Frozen):
    """Which head classifies ``auto`` requests (docs/routing.md, "Complexity classifier").

    ``embedding``: ``auto`` scores a request with the embedding head when the tenant's
    semantic cache embeds its text anyway (one embedding, shared), else with the static
    head; ``always`` embeds every classified request's text (the embedding model loads at
    start-up, ~5 ms of CPU per request); ``never`` keeps to the static head.
    """

    embedding: EmbeddingUse = "auto"
    # A head trained for the vectors of one's own cache.semantic.model_dir
    # (scripts/train_classifier.py --embedding); default: the shipped head.
    embedding_head_path: str | None = None
    # A static head of one's own (scripts/train_static_head.py --out FILE, on one's own
    # labelled prompts); default: the shipped head.
    static_head_path: str | None = None


class AffinitySettings(_Frozen):
    """How prompts are keyed (``prefix_keys``, ``PrefixIndex``) and when affinity yields to load."""

    # A prefix's home replica takes a request while requests(it) + 1 <=
    # factor * (pool's requests + 1) / replicas + margin_requests; past that, the next
    # replica in the prefix's hash order does (routing.policies.LoadBound).
    factor: float = Field(1.25, ge=1.0)
    margin_requests: int = Field(4, ge=0)
    # Prompts are placed by the hash of their first anchor_blocks blocks (shorter prompts:
    # the least busy replica).
    anchor_blocks: int = Field(4, ge=1)
    # Prefixes placed active_after times, the last within active_window_s, get balanced
    # homes: at most ceil(placement_factor x mean + placement_slack x sqrt(mean)) per
    # replica, the mean being prefixes in use per healthy replica
    # (routing.prefix_placement.AnchorPlacement).
    placement_factor: float = Field(1.0, ge=1.0)
    placement_slack: float = Field(0.0, ge=0.0)
    active_after: int = Field(2, ge=1)
    active_window_s: float = Field(600.0, gt=0)
    # A prefix carrying more than hot_share of one replica's fair share of the pool's
    # traffic is spread over ceil(share x replicas / hot_share) replicas, its share counted
    # over the conversations it opens (first turns), decayed with time constant rate_window_s.
    hot_share: float = Field(0.5, gt=0)
    rate_window_s: float = Field(60.0, gt=0)
    # Where a request's session key comes from, the first present wins: "header:<name>" (a
    # request header), "user" (the body's user field) or "response_chain" (a Responses
    # conversation: the id of its first response). It chooses among a hot prefix's homes
    # and places prompts too short for an anchor; without one, a conversation's opening
    # turn stands for it.
    session_keys: list[str] = Field(default_factory=lambda: ["header:x-session-id", "response_chain"])
    block_chars: int = Field(DEFAULT_BLOCK_CHARS, ge=16)
    max_blocks: int = Field(DEFAULT_MAX_BLOCKS, ge=1)
    # Past max_blocks fine blocks, blocks of this size, up to max_prefix_chars.
    coarse_block_chars: int = Field(DEFAULT_COARSE_BLOCK_CHARS, ge=16)
    max_prefix_chars: int = Field(DEFAULT_MAX_PREFIX_CHARS, ge=16)
    # Prefix keys the prefix index remembers per replica (a memory bound; the KV capacity
    # usually evicts first).
    index_keys: int = Field(DEFAULT_MAX_KEYS, ge=1)

    @field_validator("session_keys")
    @classmethod
    def _known_session_keys(cls, keys: list[str]) -> list[str]:
        for key in keys:
            if key not in ("user", "response_chain") and not (key.startswith("header:") and key[len("header:") :]):
                raise ValueError(f"unknown session key {key!r}: use 'header:<name>', 'user' or 'response_chain'")
        return [f"header:{k[len('header:') :].lower()}" if k.startswith("header:") else k for k in keys]

    @model_validator(mode="after")
    def _anchor_within_fine_blocks(self) -> AffinitySettings:
        if self.anchor_blocks > self.max_blocks:
            raise ValueError("anchor_blocks must not exceed max_blocks")
        return self


class LoadSettings(_Frozen):
    """How scraped vLLM gauges correct this gateway's view of a replica's load (``LoadModel``)."""

    tokens_per_request: int = Field(512, ge=0)
    kv_knee: float = Field(0.8, ge=0.0, lt=1.0)
    kv_full_tokens: int = Field(8192, ge=0)


class CapacitySettings(_Frozen):
    """What one replica takes before new work waits in the gateway's fair queue.

    ``max_requests`` is vLLM's ``--max-num-seqs`` (256 by default on most GPUs): past it a
    replica queues requests itself, first come first served, whoever sent them.
    ``max_outstanding_tokens`` is its KV cache size in tokens (vLLM logs "GPU KV cache
    size: N tokens" at start); unset, it bounds nothing. ``max_prefill_tokens`` bounds the
    prompt tokens a replica still has to prefill (this gateway's streamed requests before
    their first token, cached prefixes excluded, plus the requests it reports waiting):
    a request sent behind that backlog waits for all of it before its own first token, so
    this bound is what keeps a flood waiting in the gateway's fair queue instead of in the
    replica's first-come-first-served one. The default, 4,096, is half a step of vLLM's
    8,192-token chunked prefill; ``null`` turns the bound off. ``kv_cache_tokens`` is the
    size of a replica's prefix cache for the prefix index's eviction; unset, it is read
    from each replica's ``vllm:cache_config_info`` (num_gpu_blocks x block_size).
    """

    max_requests: int | None = Field(256, gt=0)
    max_outstanding_tokens: int | None = Field(None, gt=0)
    max_prefill_tokens: int | None = Field(4096, gt=0)
    kv_cache_tokens: int | None = Field(None, gt=0)


class RetryBudgetSettings(_Frozen):
    """Retries may add at most ``ratio`` of recent requests plus ``min_per_s`` (per model, per process).

    A token bucket: each request deposits ``ratio``, time deposits ``min_per_s``, each retry
    withdraws one; the balance never exceeds ``burst``. A healthy fleet never notices it; a
    sick one gets at most ``ratio`` extra load instead of ``max_attempts`` times its traffic.
    """

    ratio: float = Field(0.2, ge=0.0, le=10.0)
    min_per_s: float = Field(1.0, ge=0.0)
    burst: float = Field(10.0, ge=1.0)


class QueueWaitSettings(_Frozen):
    """Longest wait in the fair queue, by priority; past it the request gets 503 + Retry-After.

    Low priority waits least: under overload batch work is shed first, interactive work keeps
    its place.
    """

    high: float = Field(30.0, gt=0)
    normal: float = Field(10.0, gt=0)
    low: float = Field(2.0, gt=0)

    def for_priority(self, priority: Priority) -> float:
        return self.high if priority == "high" else self.low if priority == "low" else self.normal


class QueueSettings(_Frozen):
    """The fair queue in front of each model's pool (weighted deficit round-robin by tenant)."""

    enabled: bool = True
    # Credit per round per unit of tenant weight, in tokens (prompt estimate + max_tokens).
    quantum_tokens: int = Field(1024, ge=1)
    # Requests one tenant may have waiting for one model; past it 429 + Retry-After.
    max_queue_length: int = Field(256, ge=1)
    retry_after_s: float = Field(1.0, gt=0)
    max_wait_s: QueueWaitSettings = QueueWaitSettings()
    # While requests wait, room is re-checked this often (scraped gauges change without a
    # request of this gateway finishing); a finishing request wakes the next one at once.
    poll_interval_s: float = Field(0.05, gt=0, le=5.0)
    # While two or more tenants are active, hold each at its weighted share of the pool's
    # prefill slots (one per replica, when capacity.max_prefill_tokens is set): a flood's
    # prefill then cannot fill every replica's steps while others wait for their tokens.
    share_prefill: bool = True


class RoutingSettings(_Frozen):
    """The whole ``routing:`` block."""

    policy: PolicyName = "prefix_affinity"
    tiers: list[TierSettings] = Field(default_factory=lambda: [_tier(t) for t in DEFAULT_TIERS])
    classifier: ClassifierSettings = ClassifierSettings()
    # Send x-fleetgate-route (score, head, reasons, tier) on classified requests.
    debug_header: bool = True
    affinity: AffinitySettings = AffinitySettings()
    load: LoadSettings = LoadSettings()
    # Per replica, for models without their own `capacity`.
    capacity: CapacitySettings = CapacitySettings()
    retry_budget: RetryBudgetSettings = RetryBudgetSettings()
    queue: QueueSettings = QueueSettings()
    # KV blocks the exact index (vLLM's KV events, routing.kv_index) keeps per replica: its
    # memory bound (about 150 bytes a block); the least recently stored go past it.
    kv_events_max_blocks: int = Field(DEFAULT_KV_BLOCKS, ge=1)

    @model_validator(mode="after")
    def _tiers_cover(self) -> RoutingSettings:
        names = [t.name for t in self.tiers]
        if len(names) != len(set(names)):
            raise ValueError("tiers: duplicate tier name")
        try:
            validate_tiers(self.tier_ranges())
        except ValueError as exc:
            raise ValueError(f"tiers: {exc}") from exc
        return self

    def tier_ranges(self) -> tuple[TierRange, ...]:
        return tuple(t.range() for t in self.tiers)


def _tier(t: TierRange) -> TierSettings:
    return TierSettings(name=t.name, min_score=t.min_score, max_score=t.max_score)


# The default priority bands, highest first (``bands:``): chat and agents, ordinary API
# traffic, bulk work (the Batch API's items).
DEFAULT_BANDS = ("interactive", "standard", "batch")


# How often one stream of a preemptible band may be moved off a replica for higher-band
# work: each move costs a prefill of its prompt and the text so far on the replica it goes
# to, and a stream under steady higher-band traffic would otherwise move for ever.
DEFAULT_MAX_PREEMPTIONS = 8


class BandSettings(_Frozen):
    """One priority band (``bands:``, highest first; a plain name stands for ``{name: NAME}``).

    ``max_wait_s``: the longest a request of this band waits in a saturated pool's queue
    (unset: its priority's, ``routing.queue.max_wait_s``). ``max_queued``: how many requests
    of this band may wait for one model, all tenants together, before 429 ``band_full``
    (unset: only each tenant's ``routing.queue.max_queue_length``). ``capacity_share``: the
    share of each replica's capacity (``capacity.max_requests``, ``max_outstanding_tokens``,
    ``max_prefill_tokens``) this band's requests may fill, all bands' work counted; the rest
    stays free for higher bands, whose requests then start at once instead of waiting for a
    lower band's to finish (1: the whole capacity). ``preemptible``: a request of a higher,
    non-preemptible band sent to a replica moves this band's streams running there to
    another replica, where each is continued exactly (``gateway.proxy``, docs/routing.md
    "Preemption"); while higher-band work runs on a replica, this band's requests go
    elsewhere if they can. ``max_preemptions``: how often one stream may be moved so;
    after that it stays until it ends, so every preempted stream finishes.
    """

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    max_wait_s: float | None = Field(None, gt=0)
    max_queued: int | None = Field(None, ge=1)
    capacity_share: float = Field(1.0, gt=0, le=1)
    preemptible: bool = False
    max_preemptions: int = Field(DEFAULT_MAX_PREEMPTIONS, ge=1, le=100)


def band_list(value: object) -> object:
    """``bands:`` entries given as plain names, as ``BandSettings`` mappings (a before-validator)."""
    if isinstance(value, list | tuple):
        return [{"name": v} if isinstance(v, str) else v for v in value]
    return value


def default_bands() -> list[BandSettings]:
    return [BandSettings(name=n) for n in DEFAULT_BANDS]


class DegradeSettings(_Frozen):
    """A tenant's graceful degradation while its model's pool is saturated."""

    # A classified (`auto`) request overflows to the nearest smaller tier that has room.
    overflow: bool = False
    # max_tokens is clamped to this (a request without max_tokens gets it too).
    max_tokens: int | None = Field(None, gt=0)
