"""The embedding model on ONNX Runtime: the one runtime the semantic cache's embedder has.

PyTorch runs a lone ~15-token question through some hundred small operations, each with its
dispatch overhead; the matrix products themselves are a small part of the time. ONNX Runtime
runs the same graph with fused kernels and little per-operation cost, in float32, so its
vectors are the ones the verifier was trained on (to float rounding), and it needs no private
PyTorch operations to get there.

``OnnxModel.export`` traces the loaded transformer (with whatever layers were applied to it)
together with its pooling and L2 norm into an ONNX graph at start-up (PyTorch's exporter, in a
temporary directory removed once the runtime has loaded it); PyTorch is not called after that.
The session serves a lone text unpadded (the lookup of a quiet gateway) and a batch in groups
of similar length (``cache.semantic.embed_model.length_groups``). ``cache.semantic.embedder``
checks its vectors against ``SentenceTransformer.encode`` on probe texts before using it.
"""

from __future__ import annotations

import importlib.util
import tempfile
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from cache.semantic.embed_model import Embedded, Embeddings, TokenWindow, length_groups, mean_pool

# The ONNX operator set the graph is written in: 17 has LayerNormalization, which keeps
# BERT's layer norms one fused kernel; ONNX Runtime 1.20 and later run it.
OPSET = 17
# The packages this runtime needs: ONNX Runtime, and onnx for PyTorch's exporter.
REQUIRED_MODULES = ("onnxruntime", "onnx")


def missing_modules() -> list[str]:
    """Those of ``REQUIRED_MODULES`` that are not installed."""
    return [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]


def _pooled_model(transformer: Any, pooling: str, input_names: Sequence[str]) -> Any:
    """A torch module from token ids (positional, in ``input_names`` order) to unit vectors."""
    import torch

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, *inputs: Any) -> Any:
            features = dict(zip(input_names, inputs, strict=True))
            hidden = self.transformer(**features)[0]
            pooled = hidden[:, 0] if pooling == "cls" else mean_pool(hidden, features["attention_mask"])
            return torch.nn.functional.normalize(pooled, p=2, dim=1)

    return Pooled().eval()


class OnnxModel:
    """Tokenizer, then the transformer, pooling and L2 norm as one ONNX Runtime session.

    Built by ``export``; a plain callable from texts to unit float32 vectors, run on the
    embedder's one thread. Needs right padding (trimming a group's pad columns leaves every real token in place).
    """

    def __init__(self, tokenizer: Any, session: Any, max_length: int) -> None:
        self._tokenizer = tokenizer
        self._session = session
        self._max_length = max_length
        self._inputs = [node.name for node in session.get_inputs()]

    @classmethod
    def export(cls, tokenizer: Any, transformer: Any, max_length: int, pooling: str, threads: int) -> OnnxModel:
        """Trace ``transformer`` (a loaded Hugging Face model) with ``pooling`` into a session.

        Raises whatever the exporter or the runtime raise for a model they cannot handle.
        """
        import onnxruntime  # type: ignore[import-untyped]
        import torch

        sample = tokenizer(["a sample text", "a"], padding=True, return_tensors="pt")
        names = [name for name in ("input_ids", "attention_mask", "token_type_ids") if name in sample]
        if "attention_mask" not in names:
            raise ValueError("the tokenizer gives no attention mask")
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = onnxruntime.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle worker threads must not spin on the core the event loop needs.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        with tempfile.TemporaryDirectory(prefix="fleetgate-onnx-") as directory:
            graph = f"{directory}/model.onnx"
            with warnings.catch_warnings(), torch.no_grad():
                # The TorchScript exporter: ~1.5 s here against ~6 s for the dynamo one, and the
                # same graph for this model. Its deprecation and tracer warnings are not the user's.
                warnings.simplefilter("ignore")
                torch.onnx.export(
                    _pooled_model(transformer, pooling, names),
                    tuple(sample[name] for name in names),
                    graph,
                    input_names=names,
                    output_names=["vectors"],
                    dynamic_axes={**{name: {0: "texts", 1: "tokens"} for name in names}, "vectors": {0: "texts"}},
                    opset_version=OPSET,
                    dynamo=False,
                )
            # The session holds the weights in memory from here: the files may go.
            session = onnxruntime.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        return cls(tokenizer, session, max_length)

    def __call__(self, texts: Sequence[str]) -> Embeddings:
        return self.embed(texts).vectors

    def embed(self, texts: Sequence[str]) -> Embedded:
        """The unit vectors of ``texts`` and the window of each that the model read."""
        if len(texts) == 1:
            features, windows = self._features(texts, padding=False)
            return Embedded(self._run(features), windows)
        features, windows = self._features(texts, padding=True)
        lengths = features["attention_mask"].sum(axis=1).tolist()
        out: Embeddings | None = None
        for group in length_groups(lengths):
            width = max(lengths[i] for i in group)
            vectors = self._run({name: value[group, :width] for name, value in features.items()})
            if out is None:
                out = np.empty((len(texts), vectors.shape[1]), dtype=np.float32)
            out[group] = vectors
        assert out is not None  # texts is not empty: ``embed`` returns early otherwise
        return Embedded(out, windows)

    def _features(
        self, texts: Sequence[str], *, padding: bool
    ) -> tuple[dict[str, Any], tuple[TokenWindow, ...] | None]:
        """The model's inputs, and each text's window, from the one tokenisation."""
        encoded = self._tokenizer(
            list(texts), padding=padding, truncation=True, max_length=self._max_length, return_tensors="np"
        )
        features = {name: np.asarray(encoded[name], dtype=np.int64) for name in self._inputs}
        return features, self._windows(texts, encoded)

    def _windows(self, texts: Sequence[str], encoded: Any) -> tuple[TokenWindow, ...] | None:
        """Each text's window: its real word pieces, and the characters they cover (the whole
        text unless it filled the window; then the end of its last piece, from the fast
        tokenizer's offsets). None from a tokenizer that keeps no offsets (not a fast one)."""
        if encoded.encodings is None:
            return None
        pieces: list[int] = np.asarray(encoded["attention_mask"]).sum(axis=1).tolist()
        return tuple(
            TokenWindow(n, len(text) if n < self._max_length else _covered(encoded.encodings[row], n))
            for row, (text, n) in enumerate(zip(texts, pieces, strict=True))
        )

    def _run(self, features: dict[str, Any]) -> Embeddings:
        (vectors,) = self._session.run(None, features)
        return np.ascontiguousarray(vectors, dtype=np.float32)


def _covered(encoding: Any, pieces: int) -> int:
    """Characters a truncated text's window covers: where its last word piece ends (the end
    marker after it has no characters). Walked back one piece at a time: building the whole
    offsets list would cost some forty times as much."""
    for index in range(pieces - 1, -1, -1):
        span = encoding.token_to_chars(index)
        if span is not None:
            return int(span[1])
    return 0
