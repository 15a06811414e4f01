"""Tier choice for a classified request: which text to embed, which head scores, which model.

A request for ``auto`` (or a model its tenant classifies) is asked about in two steps, since
the embedding between them is awaited at the edge: ``TierChooser.text_to_embed`` says which
text the classifier wants embedded (None: the static head will score, nothing to await),
then ``TierChooser.choose_tier`` scores the prompt with whichever head has its input,
resolves a forced tier against the tenant's allowance (``resolve_tier``) and names the
tier's model (``TierMap``). Both are synchronous and read no clock.

With ``routing.classifier.embedding: auto`` the embedding is one the tenant's semantic cache
computes anyway (the same text, so one embedding serves both); ``always`` embeds every
classified request's text, ``never`` keeps to the static head.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dialects.base import PromptView
from routing.classifier import Classification, classify, resolve_tier
from routing.config import EmbeddingUse
from routing.embedding_head import EmbeddingHead, embedding_text
from routing.metrics import RoutingMetrics
from routing.static_head import StaticHead, default_static_head
from routing.tier_map import TierMap
from routing.word_frequency import default_word_frequency


@dataclass(frozen=True, slots=True)
class TierChoice:
    """The tier of a classified request, why (``classified``, ``forced``, ``force_denied``), and its model."""

    model: str
    tier: str
    reason: str
    classification: Classification

    def header(self) -> str:
        """The ``x-fleetgate-route`` debug header: ``score=0.62; reasoning,long_prompt; tier=large; classified``."""
        return f"{self.classification.header()}; tier={self.tier}; {self.reason}"


class TierChooser:
    """The tier map, the classifier's heads and when the embedding head is asked for.

    The static head and the word-frequency table both heads weigh are read here, at start,
    when there are tiers to classify into: reading them lazily would block the event loop
    on the first classified request.
    """

    __slots__ = ("embedding_use", "head", "metrics", "static", "tiers")

    def __init__(
        self,
        tiers: TierMap,
        metrics: RoutingMetrics,
        head: EmbeddingHead | None = None,
        embedding_use: EmbeddingUse = "never",
        static: StaticHead | None = None,
    ) -> None:
        """``head``: the embedding head (None: the static head only); ``static``: the shipped one unless given."""
        self.tiers = tiers
        self.metrics = metrics
        self.head = head
        self.embedding_use = embedding_use
        self.static = (static or default_static_head()) if tiers.active else None
        if tiers.active:
            default_word_frequency()

    def text_to_embed(
        self, prompt: PromptView, shared: str | None, forced: str | None, allowed: Collection[str]
    ) -> str | None:
        """The text whose embedding the classifier wants for ``prompt``, or None (the static head scores).

        ``shared``: the text the tenant's semantic cache will embed for this request, if it
        will (``ResponseCache.semantic_text``); the same text as ``embedding_text`` gives
        then, so one embedding serves both. ``always`` asks for one anyway; nothing does
        when no tier is active or a forced tier is allowed (the score would not matter).
        """
        use = self.embedding_use
        if use == "never" or self.head is None or not self.tiers.active or (forced and forced in allowed):
            return None
        if shared is not None:
            return shared
        if use == "always":
            return embedding_text(prompt.instruction) or None
        return None

    def choose_tier(
        self,
        prompt: PromptView,
        forced: str | None,
        allowed: Collection[str],
        vector: npt.NDArray[np.floating] | None = None,
        fallback: str = "",
        window: tuple[int, int] | None = None,
    ) -> TierChoice | None:
        """Classify ``prompt`` and pick the tier's model; None when no tier has a model.

        ``vector``: the embedding of ``text_to_embed``'s text, when it was asked for and came
        (the embedding head scores it), and ``window`` the (word pieces, characters) the model
        read of that text; ``fallback``: why the vector did not come.
        """
        tiers = self.tiers
        if not tiers.active:
            return None
        if vector is not None and self.head is not None and window is None and self.head.uses_window:
            # An embedder that did not say what its model read (a tokenizer without offsets):
            # the head cannot score without it.
            vector, fallback = None, "mismatch"
        if vector is not None and self.head is not None:
            classification = classify(prompt, tiers.ranges, vector=vector, window=window, head=self.head)
        else:
            classification = classify(prompt, tiers.ranges, static=self.static, fallback=fallback)
        rm = self.metrics
        rm.series(rm.classifier_heads, classification.head, fallback or "none").inc()
        tier, reason = resolve_tier(classification, forced, allowed)
        model = tiers.model_for(tier)
        if model is None:  # only a forced name outside the tier list gets here
            tier, reason = classification.tier, "force_denied"
            model = tiers.model_for(tier)
            assert model is not None
        rm.series(rm.tiers, tier, reason).inc()
        return TierChoice(model, tier, reason, classification)
