"""The ``classify`` stage: the model whose pool serves the request, and its ``Route``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from aiohttp import web

from cache.semantic.cache import TextEmbedding
from cache.service import ResponseCache
from gateway.autoscale import PendingTokens
from gateway.errors import BadRequest, NotFound
from gateway.exchange import BAND_HEADER, ROUTE_HEADER, TIER_HEADER, Exchange
from gateway.request import context_overflow
from gateway.settings import Settings, TenantSettings
from gateway.stages import CONTINUE, Reply
from replicas.fleet import Fleet
from routing.adapters import AdapterCatalog
from routing.bands import Bands
from routing.router import Router
from routing.tiers import TierChoice
from tokens.counter import PromptCounter

log = logging.getLogger("fleetgate.routing")


@dataclass(frozen=True, slots=True)
class ModelRules:
    """What classification needs of the configured models and routing."""

    # The model ``auto`` means when no model serves a routing tier.
    default_model: str
    # Each model's context length, where configured.
    max_model_len: Mapping[str, int]
    # Whether the answer says how it was classified (``x-fleetgate-route``).
    debug_header: bool
    # Where a request's session key comes from (``routing.affinity.session_keys``).
    session_keys: tuple[str, ...]
    # The priority bands, highest first (``bands``).
    bands: Bands

    @classmethod
    def from_settings(cls, settings: Settings) -> ModelRules:
        models = settings.models
        return cls(
            settings.default_model or models[0].name,
            {m.name: m.max_model_len for m in models if m.max_model_len is not None},
            settings.routing.debug_header,
            tuple(settings.routing.affinity.session_keys),
            Bands.from_settings(settings.bands),
        )


class Classify:
    """The model whose pool serves the request, and its ``Route``.

    ``auto`` (and the tenant's ``classify_models``) is classified into a tier, served by
    that tier's model; the ``x-fleetgate-tier`` request header forces a tier where the
    tenant allows it. When no model serves a routing tier, ``auto`` is ``default_model``.
    The prompt's tokens are counted with the model's tokenizer, where it has one
    (``tokens``), so the context-length check, admission and routing read the replica's
    count. A prompt that cannot fit the model's ``max_model_len`` stops here. The route's pools
    hear of the request's end (their next waiting request goes), and its tokens leave the
    model's pending gauge, when the path ends. The request's priority band is its tenant's,
    or a lower one its ``x-fleetgate-band`` header asks for (a higher one is clamped to the
    tenant's; an unknown name is a 400): the answer's ``x-fleetgate-band`` says which.
    """

    name = "classify"

    def __init__(
        self,
        rules: ModelRules,
        router: Router,
        fleet: Fleet,
        adapters: AdapterCatalog,
        pending: PendingTokens,
        cache: ResponseCache,
        counter: PromptCounter,
        clock: Callable[[], float],
    ) -> None:
        self.rules = rules
        self.router = router
        self.fleet = fleet
        self.adapters = adapters
        self.pending = pending
        self.cache = cache
        self.counter = counter
        self.clock = clock
        self._warned_mismatch = False

    async def __call__(self, ex: Exchange, request: web.Request) -> Reply:
        call, tenant = ex.call, ex.tenant
        assert tenant is not None
        bands = self.rules.bands
        band = bands.resolve(bands.index(tenant.band), request.headers.get(BAND_HEADER))
        if band is None:
            return BadRequest(
                f"The {BAND_HEADER} header names no priority band; valid bands, highest first: "
                f"{', '.join(bands.names)}.",
                code="invalid_band",
                param=BAND_HEADER,
            )
        ex.band = bands.names[band]
        ex.headers[BAND_HEADER] = ex.band
        name = tenant.model_aliases.get(call.model, call.model)
        choice: TierChoice | None = None
        if (name == "auto" or name in tenant.classify_models) and call.dialect.classifiable:
            choice = await self._choose_tier(ex, request, tenant)
        if choice is not None:
            model = choice.model
            if self.rules.debug_header:
                ex.headers[ROUTE_HEADER] = choice.header()
        elif name == "auto":
            model = self.rules.default_model
        elif name in self.fleet.by_model:
            model = name
        elif (base := self.adapters.base_of(name)) is not None:
            model, ex.adapter = base, name
        else:
            return NotFound(
                f"The model '{name}' does not exist or you do not have access to it.",
                code="model_not_found",
                param="model",
            )
        ex.model, ex.pool = ex.adapter or model, model
        # The model's tokenizer counts the prompt (where it has one) before anything reads it.
        if self.counter.counts(model):
            # The prompt's token ids too where the model's replicas publish KV events (the exact index).
            await self.counter.count(model, call, ids=self.router.wants_token_ids(model))
        limit = self.rules.max_model_len.get(model)
        if limit is not None:
            too_long = context_overflow(call, limit)
            if too_long is not None:
                return too_long
        session = self._session(ex, request)
        route = self.router.route(
            model,
            call.prompt,
            call.prompt_tokens,
            call.max_tokens,
            choice,
            tenant=tenant.id,
            session=session,
            token_ids=call.prompt_token_ids,
        )
        route.adapter = ex.adapter
        route.band = band
        ex.route = route
        cost, pending = route.cost, self.pending
        pending.add(model, cost)

        def release(_: BaseException | None) -> None:
            route.finished()
            pending.remove(model, cost)

        ex.release(release)
        ex.headers[TIER_HEADER] = self.fleet.tiers[model]
        if ex.timeline is not None:
            ex.timeline.mark("parse", self.clock())  # the "parse" span covers classification
        return CONTINUE

    def _session(self, ex: Exchange, request: web.Request) -> str | None:
        """The request's session key, from the first of ``routing.affinity.session_keys`` it has."""
        for source in self.rules.session_keys:
            if source == "user":
                value = ex.call.body.get("user")
            elif source == "response_chain":
                value = ex.chain
            else:
                value = request.headers.get(source[len("header:") :])
            if isinstance(value, str) and value:
                return value
        return None

    async def _choose_tier(self, ex: Exchange, request: web.Request, tenant: TenantSettings) -> TierChoice | None:
        """The classified request's tier: the text embedded first when the embedding head is
        to score it (``Router.text_to_embed``), else the n-gram model alone."""
        call = ex.call
        prompt = call.prompt
        forced = request.headers.get(TIER_HEADER)
        allowed = self._forcible(tenant) if forced else ()
        embedding, fallback, text = None, "", None
        if self.router.head is not None:  # routing.classifier.embedding is not "never"
            cache_control = request.headers.get("Cache-Control")
            shared = self.cache.semantic_text(ex.dialect, call.body, tenant.cache, cache_control)
            text = self.router.text_to_embed(prompt, shared, forced, allowed)
        if text is not None:
            embedding, fallback = await self._embedding(text)
        if embedding is None:
            return self.router.choose_tier(prompt, forced, allowed, None, fallback)
        return self.router.choose_tier(prompt, forced, allowed, embedding.vector, fallback, embedding.window)

    async def _embedding(self, text: str) -> tuple[TextEmbedding | None, str]:
        """``text``'s embedding (vector and window) for the classifier's embedding head, or None and why not.

        It is the semantic cache's embedder, through the cache's memo: the lookup (and the
        store) of the same text afterwards reuses this vector instead of embedding again.
        The wait is bounded by ``cache.semantic.embed_timeout_ms``; past it, or with the
        embedder overloaded or not loaded, the n-gram model classifies.
        """
        semantic, head = self.cache.semantic, self.router.head
        if semantic is None or not semantic.ready or head is None:
            return None, "unavailable"
        embedder = semantic.embedder
        # A head that weighs the window needs an embedder that reports it (the shipped one does).
        windowed = not head.uses_window or semantic.reports_windows
        if embedder is None or not windowed or not head.accepts(semantic.identity, embedder.dimension):
            if not self._warned_mismatch:
                self._warned_mismatch = True
                log.warning(
                    "the classifier's embedding head was trained on another embedder's vectors (or weighs "
                    "the token window, which this embedder does not report); classifying with n-grams "
                    "(set routing.classifier.embedding_head_path)",
                    extra={"embedder": semantic.identity, "head_embedder": head.embedder},
                )
            return None, "mismatch"
        return await semantic.vector(text, semantic.settings.embed_timeout_s)

    def _forcible(self, tenant: TenantSettings) -> tuple[str, ...] | list[str]:
        """Tiers the tenant may force with the request header."""
        allowed = tenant.allow_force_tier
        if allowed is True:
            return self.router.tiers.names
        return allowed or ()
