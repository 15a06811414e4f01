"""The embedding model as files: its layout, its fine-tuned layers, and how a batch is grouped.

PyTorch and sentence-transformers appear here only to load the model (``load_sentence_transformer``,
with a layers file applied) for ``cache.semantic.embed_onnx`` to export, and for the training
scripts and the references that check the export (benchmarks, tests). Nothing here runs on the
request path: ``cache.semantic.embed_onnx`` does, on ONNX Runtime.

``supported_pooling`` reads which models the export covers from the files sentence-transformers
builds them from: a Hugging Face transformer, then mean or CLS pooling, then optionally
Normalize. Any other layout (a dense layer, max pooling, ...) would need
``SentenceTransformer.encode`` and PyTorch at run time, which the gateway does not carry: the
embedder refuses it at start-up, with the reason.

``length_groups`` runs a batch in groups of similar length instead of padding every text to the
longest one. ``TokenWindow`` is what the model read of a text (its first word pieces, up to the
model's ``max_seq_length``): the complexity classifier's embedding head weighs how many characters
each of those word pieces covers (``routing.embedding_head``).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

Embeddings = npt.NDArray[np.float32]


class TokenWindow(NamedTuple):
    """What the model read of one text: ``pieces`` word pieces (the special ones included, at
    most the model's ``max_seq_length``), covering the text's first ``chars`` characters (the
    whole text unless it was truncated)."""

    pieces: int
    chars: int


@dataclass(frozen=True, slots=True)
class Embedded:
    """Unit vectors, one row per text, and each text's ``TokenWindow`` in the same order (None
    from an embedder that does not say)."""

    vectors: Embeddings
    windows: tuple[TokenWindow, ...] | None


# A group of texts (sorted by length) closes when padding would add more than 30% to its
# real tokens, but not before it holds 128 tokens: below that the matrix products slow down
# per row more than the padding saved. Measured on QQP questions (5-60 word pieces), where a
# batch of 32 padded to its longest text is 57% padding: the cost per text fell by ~40%.
GROUP_PADDING_SLACK = 1.3
GROUP_MIN_TOKENS = 128
# The shipped default's transformer layers, fine-tuned on question pairs by
# scripts/train_semantic_embedder.py (float16); the base model supplies the embeddings.
DEFAULT_LAYERS = Path(__file__).resolve().parent / "data" / "embedder-layers.safetensors"
LAYER_PREFIX = "encoder."


def layer_state(model: Any) -> dict[str, Any]:
    """The transformer layers' tensors of a BERT-like ``model`` (what a layers file holds)."""
    return {name: tensor for name, tensor in model.state_dict().items() if name.startswith(LAYER_PREFIX)}


def apply_layers(model: Any, path: Path) -> None:
    """Replace ``model``'s transformer layers with those of the layers file ``path``.

    The file must hold exactly the model's layer tensors, shape for shape (a file written
    for another model or another depth is refused with ValueError, never half-applied).
    """
    from safetensors.torch import load_file

    tuned = load_file(str(path))
    own = layer_state(model)
    if tuned.keys() != own.keys():
        missing, extra = sorted(own.keys() - tuned.keys()), sorted(tuned.keys() - own.keys())
        raise ValueError(f"{path} does not fit this model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in tuned.items():
        if tensor.shape != own[name].shape:
            raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model {tuple(own[name].shape)}")
    model.load_state_dict({name: t.to(own[name].dtype) for name, t in tuned.items()}, strict=False)


def load_sentence_transformer(model_dir: Path, layers: Path | None = None) -> Any:
    """The ``SentenceTransformer`` in ``model_dir`` on the CPU, with the layers file
    ``layers`` applied if given: the model as the embedder runs it, for it and for the
    references that check it (benchmarks, tests)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    if layers is not None:
        apply_layers(model[0].auto_model, layers)
    return model


def mean_pool(hidden: Any, attention_mask: Any) -> Any:
    """The mean of ``hidden`` over each row's real tokens, in float32."""
    import torch

    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    summed = (hidden * mask).sum(dim=1, dtype=torch.float32)
    return summed / mask.sum(dim=1, dtype=torch.float32).clamp(min=1e-9)


def length_groups(
    lengths: Sequence[int], slack: float = GROUP_PADDING_SLACK, min_tokens: int = GROUP_MIN_TOKENS
) -> list[list[int]]:
    """Indices of ``lengths`` in groups of similar length, shortest first, every index once.

    A batch padded to its longest text spends the model's time on pad tokens. Taken in
    order of length, a group closes when the next text would make its padded size exceed
    ``slack`` times its real tokens, once it holds at least ``min_tokens`` real tokens.
    """
    groups: list[list[int]] = []
    group: list[int] = []
    tokens = 0
    for index in sorted(range(len(lengths)), key=lengths.__getitem__):
        length = lengths[index]
        if group and tokens >= min_tokens and (len(group) + 1) * length > slack * (tokens + length):
            groups.append(group)
            group, tokens = [], 0
        group.append(index)
        tokens += length
    if group:
        groups.append(group)
    return groups


# The older, boolean form of the pooling module's config.json.
_LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SUPPORTED_POOLING = ("mean", "cls")


def supported_pooling(model_dir: Path) -> str | None:
    """``"mean"`` or ``"cls"`` if the model is a transformer, that pooling and maybe Normalize.

    Read from the files sentence-transformers builds the model from (``modules.json``, the
    pooling module's ``config.json``, old boolean or new ``pooling_mode`` form). Anything else
    (dense layers, other poolings, a bare transformer directory) returns None: the embedder
    does not run it.
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
    return only if only in SUPPORTED_POOLING else None
