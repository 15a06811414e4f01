"""The semantic cache of one gateway process: embed, search the local index, verify; and store.

``ResponseCache`` calls it after an exact miss (``lookup``) and after an upstream answer was
kept under its exact key (``store``). The answer itself stays in the exact cache; a semantic
entry points at it (see ``cache.semantic.store``). One lookup::

    text ──embed (batched, off the loop, bounded)──► vector
         ──SemanticIndex.candidates(scope, k=4, cosine floor)──► candidates
         ──SemanticVerifier.choose──► the entry whose answer to fetch | a miss (reason)

Bounded waits: a lookup waits at most ``embed_timeout_ms`` for its vector, and skips the
embedder altogether (``unavailable``) when ``max_pending`` texts are already queued or
when the store's breaker is open (an answer could not be fetched anyway). A timed-out
embedding is not wasted: it finishes in the background and the store after the upstream
answer reuses it (vectors are remembered by text for a while, ``MEMO_SIZE``). The complexity
classifier asks for the same vector first (``vector``), with the window of the text the model
read (``TextEmbedding``), which costs nothing more: the embedding's tokenisation counts it.

Lifecycle: nothing is loaded until ``start`` (the gateway starts it when a tenant enables
the semantic cache, at start-up or on the first request after a reload enabled it). With
Redis, ``start`` also loads the shared entries and keeps following them
(``cache.semantic.sync``), waiting at most ``load_timeout_s`` for the first load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any, NamedTuple

from cache.config import CacheSettings, SemanticServiceSettings
from cache.keys import SemanticQuery, split_key
from cache.metrics import CacheMetrics
from cache.semantic.embed_model import TokenWindow
from cache.semantic.embedder import Embedder, SentenceTransformerEmbedder, WindowedEmbedder
from cache.semantic.index import SemanticEntry, SemanticIndex, round_vector
from cache.semantic.redis_store import SemanticLog
from cache.semantic.store import SemanticStore
from cache.semantic.sync import SemanticSync
from cache.semantic.vector_index import Vector
from cache.semantic.verifier import SemanticVerifier, VerifierParams
from cache.store import CacheUnavailable

log = logging.getLogger("fleetgate.cache")

SEMANTIC = "semantic"
# Candidates the verifier weighs (its training and benchmark used 4).
TOP_K = 4
# Vectors remembered by text: a miss's store finds the vector its lookup computed, and a
# text asked again (another tenant, other parameters) is not embedded twice. ~1.6 KB each.
MEMO_SIZE = 4096
# A store runs after the upstream answer, seconds after its lookup: its vector is long done
# unless the embedder is badly backlogged, and then the store is not worth waiting for.
STORE_EMBED_TIMEOUT_S = 5.0
# Background deletes and touches: dropped rather than awaited at shutdown past this.
CLOSE_TIMEOUT_S = 1.0


class State(StrEnum):
    IDLE = "idle"  # no tenant asked for it yet: no model loaded
    STARTING = "starting"
    READY = "ready"
    FAILED = "failed"  # the model or the verifier could not be loaded (logged)
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class Probe:
    """A lookup's outcome: a metrics result, and the entry whose answer to fetch on a hit."""

    result: str  # hit, miss, timeout, unavailable
    entry: SemanticEntry | None = None


class TextEmbedding(NamedTuple):
    """One text's vector, and what the model read of it (None: the embedder does not say)."""

    vector: Vector
    window: TokenWindow | None


class _Overloaded(Exception):
    """``max_pending`` texts are already waiting for the embedder."""


def entry_scope(scope: str, identity: str) -> str:
    """The scope an entry is stored and searched under: the request's scope and the identity
    of the embedder that made its vector, so entries of another model are never compared."""
    return f"{scope}@{identity}"


class SemanticCache:
    """Embedder, verifier, local index and shared store of the semantic cache."""

    def __init__(
        self,
        settings: SemanticServiceSettings,
        store: SemanticStore,
        metrics: CacheMetrics,
        *,
        embedder: Embedder | None = None,
        verifier: SemanticVerifier | None = None,
        log_source: Callable[[int], SemanticLog] | None = None,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.settings = settings
        self.store_backend = store
        self.metrics = metrics
        self._embedder_given = embedder
        self._verifier_given = verifier
        self._log_source = log_source
        self._wall = wall_clock
        self._clock = clock
        self.state = State.IDLE
        self._starting: asyncio.Task[None] | None = None
        self._stack = contextlib.AsyncExitStack()
        self._embedder: Embedder | None = None
        # The same embedder when it reports token windows (``WindowedEmbedder``), decided once
        # at start: a runtime-checkable Protocol costs ~10 µs per isinstance.
        self._windowed: WindowedEmbedder | None = None
        self._verifier: SemanticVerifier | None = None
        self.index: SemanticIndex | None = None
        self.sync: SemanticSync | None = None
        # The running embedder's identity, part of every entry's scope (``entry_scope``).
        self._identity = ""
        self._memo: OrderedDict[str, asyncio.Future[TextEmbedding]] = OrderedDict()
        self._pending = 0
        self._background: set[asyncio.Task[Any]] = set()

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def embedder(self) -> Embedder | None:
        """The running embedder (None until started)."""
        return self._embedder

    @property
    def reports_windows(self) -> bool:
        """Whether the running embedder says what its model read of each text (``TokenWindow``)."""
        return self._windowed is not None

    @property
    def identity(self) -> str:
        """The running embedder's identity ("" until started)."""
        return self._identity

    @property
    def verifier(self) -> SemanticVerifier | None:
        """The verifier in use (None until started)."""
        return self._verifier

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the embedder and verifier, and the shared entries; raise if they cannot load."""
        if self.state is State.READY:
            return
        if self.state is State.CLOSED:
            raise RuntimeError("the semantic cache is closed")
        if self._starting is None or self.state is State.FAILED:
            self.state = State.STARTING
            self._starting = asyncio.create_task(self._start(), name="semantic-start")
        await asyncio.shield(self._starting)

    def start_soon(self) -> None:
        """Start in the background (a tenant was enabled by a reload); lookups skip it meanwhile."""
        if self.state is not State.IDLE:
            return
        log.info("a tenant enabled the semantic cache: loading the embedding model")
        self._spawn(self._start_logged(), "semantic-start-soon")

    async def _start_logged(self) -> None:
        try:
            await self.start()
        except Exception:
            log.exception("the semantic cache could not start; it stays off until a restart")

    async def _start(self) -> None:
        try:
            embedder = self._embedder_given or SentenceTransformerEmbedder(
                self.settings.model_dir,
                max_batch_size=self.settings.batch_size,
                max_wait_s=self.settings.batch_wait_ms / 1000,
            )
            if isinstance(embedder, contextlib.AbstractAsyncContextManager):
                await self._stack.enter_async_context(embedder)
            verifier = self._verifier_given or SemanticVerifier(
                VerifierParams.load(self.settings.verifier_path), threshold=self.settings.threshold
            )
            dimension = embedder.dimension
            trained = int(verifier.params.projection.shape[1])
            if trained != dimension:
                raise ValueError(
                    f"cache.semantic: the embedder gives {dimension}-d vectors but the verifier was trained "
                    f"on {trained}-d ones; set cache.semantic.verifier_path to parameters trained for this model"
                )
            index = SemanticIndex(dimension)
            if self._log_source is not None:
                sync = SemanticSync(
                    self._log_source(dimension), index, self.metrics, block_ms=self.settings.sync_block_ms
                )
                self._stack.push_async_callback(sync.close)
                if not await sync.start(self.settings.load_timeout_s):
                    log.warning(
                        "semantic cache entries not loaded (Redis unreachable or slow); loading in the background"
                    )
                self.sync = sync
        except BaseException:
            self.state = State.FAILED
            await self._stack.aclose()
            raise
        self._embedder, self._verifier, self.index = embedder, verifier, index
        self._windowed = embedder if isinstance(embedder, WindowedEmbedder) else None
        self._identity = embedder.identity
        if isinstance(embedder, SentenceTransformerEmbedder):
            self.metrics.watch_embedder(lambda: (embedder.stats.batches, embedder.stats.texts))
            embedder.on_batch = self.metrics.record_embed_batch
        self.metrics.entries.labels(SEMANTIC).set_function(lambda: float(len(index)))
        self.state = State.READY

    async def close(self) -> None:
        """Stop following, drop background work (bounded), release the embedder and the store."""
        if self.state is State.CLOSED:
            return
        self.state = State.CLOSED
        if self._background:
            _, late = await asyncio.wait(set(self._background), timeout=CLOSE_TIMEOUT_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        for future in self._memo.values():
            future.cancel()
        self._memo.clear()
        await self._stack.aclose()
        await self.store_backend.close()

    # -- the request path -----------------------------------------------------------------

    async def lookup(self, query: SemanticQuery) -> Probe:
        """The entry that may answer ``query``, or why there is none (bounded by the embed timeout)."""
        if not self.ready or not self.store_backend.available:
            return Probe("unavailable")
        try:
            vector = await self._vector(query.text, self.settings.embed_timeout_s)
        except _Overloaded:
            return Probe("unavailable")
        except TimeoutError:
            return Probe("timeout")
        index, verifier = self.index, self._verifier
        assert index is not None and verifier is not None
        now = self._wall()
        index.expire(now)
        candidates = index.candidates(
            entry_scope(query.scope, self._identity), vector, k=TOP_K, min_score=verifier.min_cosine, now=now
        )
        chosen, verdict = verifier.choose(query.text, vector, candidates)
        self.metrics.semantic_verdicts.labels(verdict.reason).inc()
        entry = index.get(chosen.key) if chosen is not None else None
        return Probe("hit", entry) if entry is not None else Probe("miss")

    def forget(self, entry: SemanticEntry) -> None:
        """``entry``'s answer is gone: drop the entry here and, in the background, everywhere."""
        self.metrics.semantic_verdicts.labels("answer_gone").inc()
        if self.index is not None:
            self.index.remove(entry.id)
        self._spawn(self._quietly(self.store_backend.delete(entry)), "semantic-delete")

    def touch_later(self, entry: SemanticEntry) -> None:
        """``entry`` answered a request: keep it from being the next one evicted."""
        self._spawn(self._quietly(self.store_backend.touch(entry)), "semantic-touch")

    async def store(self, query: SemanticQuery, answer_key: str, settings: CacheSettings) -> bool:
        """Index ``query`` for the answer stored under ``answer_key``; False if it was not kept."""
        result = await self._store(query, answer_key, settings)
        self.metrics.stores.labels(SEMANTIC, result).inc()
        return result == "stored"

    async def _store(self, query: SemanticQuery, answer_key: str, settings: CacheSettings) -> str:
        if not self.ready or not self.store_backend.available:
            return "unavailable"
        try:
            vector = await self._vector(query.text, STORE_EMBED_TIMEOUT_S)
        except _Overloaded:
            return "unavailable"
        except TimeoutError:
            return "timeout"
        scope = entry_scope(query.scope, self._identity)
        entry = SemanticEntry(split_key(answer_key)[1], scope, query.text, round_vector(vector), answer_key)
        try:
            put = await self.store_backend.put(entry, ttl_s=settings.ttl_s, max_entries=settings.max_entries)
        except CacheUnavailable as exc:
            return "timeout" if exc.reason == "timeout" else "unavailable"
        index = self.index
        if index is None or self.state is not State.READY:
            return "stored"
        for gone in put.evicted:
            index.remove(gone)
        if put.evicted_live:
            self.metrics.evictions.labels(SEMANTIC).inc(put.evicted_live)
        # Already past this event in the shared log: a later one may have removed the entry.
        if self.sync is None or put.seq is None or self.sync.seq < put.seq:
            index.add(replace(entry, expires_at=put.expires_at))
        return "stored"

    # -- embedding --------------------------------------------------------------------------

    async def vector(self, text: str, timeout_s: float) -> tuple[TextEmbedding | None, str]:
        """``text``'s vector and window for another reader (the complexity classifier), or None
        and why (``unavailable``: not started or ``max_pending`` reached; ``timeout``;
        ``error``: the embedder raised, logged here, as a lookup turns it into a miss).

        It goes through the same memo as ``lookup`` and ``store``: a lookup or store of the
        same text afterwards (or meanwhile) gets this vector, embedded once.
        """
        if not self.ready:
            return None, "unavailable"
        try:
            return await self._embedding(text, timeout_s), ""
        except _Overloaded:
            return None, "unavailable"
        except TimeoutError:
            return None, "timeout"
        except Exception:
            log.exception("embedding a text for the classifier failed")
            return None, "error"

    async def _vector(self, text: str, timeout_s: float) -> Vector:
        """``text``'s unit vector, shared with concurrent and recent asks for the same text."""
        return (await self._embedding(text, timeout_s)).vector

    async def _embedding(self, text: str, timeout_s: float) -> TextEmbedding:
        """``text``'s vector and window, shared with concurrent and recent asks for the same text."""
        future = self._memo.get(text)
        if future is not None:
            self._memo.move_to_end(text)
        else:
            if self._pending >= self.settings.max_pending:
                raise _Overloaded
            future = asyncio.ensure_future(self._embed(text))
            self._memo[text] = future
            future.add_done_callback(lambda done: self._settled(text, done))
            if len(self._memo) > MEMO_SIZE:
                self._memo.popitem(last=False)
        # shield: a caller that gives up leaves the embedding running for the store to reuse.
        async with asyncio.timeout(timeout_s):
            return await asyncio.shield(future)

    async def _embed(self, text: str) -> TextEmbedding:
        embedder = self._embedder
        assert embedder is not None
        self._pending += 1
        self.metrics.embed_pending.inc()
        started = self._clock()
        try:
            if self._windowed is not None:
                embedded = await self._windowed.embed_windowed([text])
                rows, window = embedded.vectors, embedded.windows[0] if embedded.windows else None
            else:
                rows, window = await embedder.embed([text]), None
        finally:
            self._pending -= 1
            self.metrics.embed_pending.dec()
        self.metrics.embed_latency.observe(self._clock() - started)
        return TextEmbedding(rows[0], window)

    def _settled(self, text: str, future: asyncio.Future[TextEmbedding]) -> None:
        # A failed embedding must not be remembered; reading the exception marks it handled.
        if future.cancelled() or future.exception() is not None:
            if self._memo.get(text) is future:
                del self._memo[text]

    # -- background work ------------------------------------------------------------------

    def _spawn(self, work: Coroutine[Any, Any, Any], name: str) -> None:
        if self.state is State.CLOSED:
            work.close()
            return
        task = asyncio.create_task(work, name=name)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    @staticmethod
    async def _quietly(work: Coroutine[Any, Any, None]) -> None:
        # Touches and deletes only tidy up: the breaker already counts and logs store trouble.
        with contextlib.suppress(CacheUnavailable, RuntimeError):
            await work
