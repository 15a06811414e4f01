"""The embedding model's forward passes, for ``cache.semantic.embedder`` to choose from at start-up.

- ``Encode``: ``SentenceTransformer.encode``, normalised; works for any model.
- ``Direct``: the tokenizer, the transformer, mean or CLS pooling and the L2 norm called
  directly under ``torch.inference_mode``, which skips encode's per-call bookkeeping (~1-2
  ms of a lone question). A batch runs in groups of similar length (``length_groups``)
  instead of padding every text to the longest one. A lone text (the lookup of a quiet
  gateway) needs no padding, and for a plain BERT encoder skips ``BertModel.forward``'s
  per-call machinery too (``LeanBert``: the same modules and operations, the same bits;
  ~30% less CPU for a lone question with transformers 5).
- bfloat16: ``store_linear_weights_in_bfloat16`` rounds the linear layers once instead of
  autocast rounding them on every call; ``pack_linear_weights`` prepacks them for oneDNN's
  kernel instead of having it reorder them on every product (the same bits).

Each is a plain callable from texts to unit vectors, run on the embedder's one thread. None
of them checks itself: ``cache.semantic.embedder`` compares each against ``encode`` (or against the
path without it) on probe texts at start-up and falls back when a vector moves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from cache.config import Precision, PrecisionSetting

Embeddings = npt.NDArray[np.float32]

log = logging.getLogger("fleetgate.cache")

# A group of texts (sorted by length) closes when padding would add more than 30% to its
# real tokens, but not before it holds 128 tokens: below that the matrix products slow down
# per row more than the padding saved. Measured on QQP questions (5-60 word pieces), where a
# batch of 32 padded to its longest text is 57% padding: the cost per text fell by ~40%.
GROUP_PADDING_SLACK = 1.3
GROUP_MIN_TOKENS = 128
# The row count oneDNN is told to expect when packing weights; it picks the packed layout.
# With 64 (and 16, 128) the products gave the plain layers' bits for lone texts and batches
# of 2-64 texts, and 64 was the cheapest of them in batches (3.6 against 4.5 ms of CPU per
# text, one interleaved run); with 1 the layout changes the sums' rounding (a probe moved
# by 5e-5), which the start-up check catches.
PACK_BATCH_HINT = 64
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


def autocast(precision: Precision) -> contextlib.AbstractContextManager[Any]:
    """The numeric context the model runs in: nothing for float32, CPU autocast for bfloat16."""
    if precision == "float32":
        return contextlib.nullcontext()
    import torch

    return torch.autocast("cpu", dtype=torch.bfloat16)


def native_bfloat16() -> bool | None:
    """Whether this x86 CPU has bfloat16 instructions (AVX512-BF16 or AMX); None if unknown.

    Without them bfloat16 is emulated and slower than float32 (measured with oneDNN held to
    AVX512 without BF16: 2x the CPU per text in batches, to AVX2: 4x). Only x86 is checked,
    through torch's own CPU probes; elsewhere the answer is None, not a guess.
    """
    import platform

    import torch

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if not all(callable(probe) for probe in probes):
        return None
    return any(probe() for probe in probes if callable(probe))


def resolve_precision(setting: PrecisionSetting) -> Precision:
    """``setting`` as a numeric format: "auto" is bfloat16 where this CPU has bfloat16
    instructions (``native_bfloat16``), float32 elsewhere and where that is unknown."""
    if setting == "auto":
        return "bfloat16" if native_bfloat16() else "float32"
    return setting


def store_linear_weights_in_bfloat16(model: Any) -> None:
    """Round ``model``'s linear layers to bfloat16 once instead of on every autocast call.

    Under autocast a linear layer takes bfloat16 weights as they are and rounds float32 ones
    to bfloat16 (the same rounding) on each call: for a lone question that copy was ~2 ms of
    ~15. Only ``nn.Linear`` modules change: autocast covers their operation.
    """
    import torch

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.to(torch.bfloat16)


def pack_linear_weights(model: Any) -> bool:
    """Run ``model``'s bfloat16 linear layers on weights prepacked for oneDNN; False if not possible.

    A plain bfloat16 linear layer has oneDNN reorder its weight matrix into the kernel's
    blocked layout on every call: for a lone question (~15 tokens) that is a third to half of
    each of the model's matrix products (16 rows: 54 against 34 us for 384 x 384, 144 against
    67 us for 1536 x 384, one core). Packed once here, the products give the same
    bits (``torch.equal`` on every layer here, the probes' vectors in ``_pack_checked``) for
    ~15-20% less CPU per question.
    Each layer keeps its module and weights (``encode`` still works); only its ``forward``
    is replaced by one that casts the input to bfloat16 as autocast would, and calls the
    prepacked kernel. ``unpack_linear_weights`` undoes it.
    """
    import torch

    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight
    except (AttributeError, RuntimeError):  # a PyTorch without the op
        return False
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16]
    if not linears:
        return False
    try:
        for linear in linears:
            packed = reorder(linear.weight.detach(), PACK_BATCH_HINT)
            bias = None if linear.bias is None else linear.bias.detach()
            forward = functools.partial(packed_forward, packed, bias)
            sample = torch.randn(3, linear.in_features, generator=torch.Generator().manual_seed(0))
            with torch.inference_mode():
                if not torch.equal(forward(sample), linear(sample.to(torch.bfloat16))):
                    raise ValueError(f"packed {linear} differs from the plain layer")
            linear.forward = forward  # type: ignore[method-assign]
    except Exception:
        log.warning("prepacked bfloat16 weights unavailable; plain linear layers", exc_info=True)
        unpack_linear_weights(model)
        return False
    return True


def packed_forward(weight: Any, bias: Any, x: Any) -> Any:
    import torch

    return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), weight, bias, "none", [], "")


def unpack_linear_weights(model: Any) -> None:
    """Give every linear layer of ``model`` its class's own ``forward`` back."""
    for module in model.modules():
        if isinstance(module.__dict__.get("forward"), functools.partial):
            del module.forward


class Encode:
    """``SentenceTransformer.encode``, normalised, for models the direct path does not cover."""

    def __init__(self, model: Any, batch_size: int, precision: Precision) -> None:
        self._model = model
        self._batch_size = batch_size
        self._precision = precision

    def __call__(self, texts: Sequence[str]) -> Embeddings:
        with autocast(self._precision):
            vectors = self._model.encode(
                list(texts),
                batch_size=self._batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vectors, dtype=np.float32)


class LeanBert:
    """A BERT encoder's forward pass for one unpadded text, without ``BertModel.forward``'s bookkeeping.

    ``BertModel.forward`` (transformers 5) wraps the layers in per-call machinery (output
    capture, config defaults, building an attention mask): for a lone question it cost ~30%
    of the model's CPU time. A single text has no padding, so no mask is needed, and the
    same modules and operations run here in the same order: the embeddings module, then per
    layer the query/key/value projections, ``scaled_dot_product_attention`` as transformers'
    ``sdpa`` attention calls it, and the layer's own output, intermediate and output modules.
    The vectors are the same bits (checked at start-up on the probes). ``of`` returns None
    for any model where that reasoning does not hold.

    With ``packed`` (the weights prepacked in bfloat16, ``pack_linear_weights``) the query,
    key and value projections run as one product over their stacked weights: each output
    column is the same sum as in its own product (the same bits, measured on QQP questions
    and checked on the probes), one kernel call instead of three (~6-8% less CPU for a lone text, one interleaved run).
    """

    def __init__(self, model: Any, packed: bool = False) -> None:
        self._embeddings = model.embeddings
        self._layers = [
            (layer.attention.self, layer.attention.output, layer.intermediate, layer.output)
            for layer in model.encoder.layer
        ]
        self._qkv = [_stacked_projections(attention) if packed else None for attention, *_ in self._layers]

    @classmethod
    def of(cls, model: Any, packed: bool = False) -> LeanBert | None:
        """The lean forward of ``model`` if it is a plain BERT encoder run with sdpa attention."""
        config = getattr(model, "config", None)
        if type(model).__name__ != "BertModel" or config is None or model.training:
            return None
        plain = (
            not getattr(config, "is_decoder", True)
            and not getattr(config, "add_cross_attention", True)
            and getattr(config, "position_embedding_type", "absolute") == "absolute"
            and getattr(config, "chunk_size_feed_forward", 1) == 0
            and getattr(config, "_attn_implementation", None) == "sdpa"
        )
        try:
            return cls(model, packed) if plain else None
        except (AttributeError, RuntimeError):
            return None

    def __call__(self, features: Any) -> Any:
        """The last hidden state, ``(1, tokens, hidden)``, of one text's tokenizer output."""
        import torch

        hidden = self._embeddings(input_ids=features["input_ids"], token_type_ids=features.get("token_type_ids"))
        batch, tokens = hidden.shape[:2]
        for (attention, attention_output, intermediate, output), qkv in zip(self._layers, self._qkv, strict=True):
            heads = (batch, tokens, -1, attention.attention_head_size)
            if qkv is not None:
                query, key, value = (
                    part.view(heads).transpose(1, 2) for part in qkv(hidden).split(attention.all_head_size, dim=-1)
                )
            else:
                query = attention.query(hidden).view(heads).transpose(1, 2)
                key = attention.key(hidden).view(heads).transpose(1, 2)
                value = attention.value(hidden).view(heads).transpose(1, 2)
            mixed = torch.nn.functional.scaled_dot_product_attention(query, key, value, scale=attention.scaling)
            hidden = attention_output(mixed.transpose(1, 2).reshape(batch, tokens, -1), hidden)
            hidden = output(intermediate(hidden), hidden)
        return hidden


def _stacked_projections(attention: Any) -> Callable[[Any], Any]:
    """One prepacked bfloat16 product computing ``attention``'s query, key and value side by side."""
    import torch

    projections = (attention.query, attention.key, attention.value)
    weight = torch.cat([p.weight.detach() for p in projections]).to(torch.bfloat16)
    bias = torch.cat([p.bias.detach() for p in projections]).to(torch.bfloat16)
    return functools.partial(packed_forward, torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT), bias)


class Direct:
    """Tokenizer, transformer, mean or CLS pooling and L2 norm, called without ``encode``.

    The same modules ``encode`` runs (``SentenceTransformer[0]``'s tokenizer and model, its
    ``max_seq_length``), without its per-call bookkeeping, and in groups of similar length.
    Needs right padding (CLS is then the first column, and trimming a group's pad columns
    leaves every real token where it was).
    """

    def __init__(self, tokenizer: Any, transformer: Any, max_length: int, pooling: str, precision: Precision) -> None:
        self._tokenizer = tokenizer
        self._transformer = transformer
        self._max_length = max_length
        self.pooling = pooling
        self._precision = precision
        # Set once start-up has checked it gives the transformer's own vectors (``LeanBert``).
        self.lean: LeanBert | None = None

    def __call__(self, texts: Sequence[str]) -> Embeddings:
        import torch

        if len(texts) == 1:
            return self._alone(texts[0])
        features = self._tokenizer(
            list(texts), padding=True, truncation=True, max_length=self._max_length, return_tensors="pt"
        )
        lengths = features["attention_mask"].sum(dim=1).tolist()
        groups = length_groups(lengths)
        with torch.inference_mode(), autocast(self._precision):
            parts = [self._group(features, group, max(lengths[i] for i in group)) for group in groups]
            pooled = torch.cat(parts) if len(parts) > 1 else parts[0]
            vectors = torch.empty_like(pooled)
            vectors[torch.tensor([i for group in groups for i in group])] = pooled
            unit = torch.nn.functional.normalize(vectors, p=2, dim=1)
        return np.ascontiguousarray(unit.numpy(), dtype=np.float32)

    def _alone(self, text: str) -> Embeddings:
        """One text: no padding, so no length groups and no gathering of rows (the lone lookup)."""
        import torch

        features = self._tokenizer([text], truncation=True, max_length=self._max_length, return_tensors="pt")
        with torch.inference_mode(), autocast(self._precision):
            hidden = self.lean(features) if self.lean is not None else None
            unit = torch.nn.functional.normalize(self._pool(features, hidden), p=2, dim=1)
        return np.ascontiguousarray(unit.numpy(), dtype=np.float32)

    def _group(self, features: Any, group: list[int], width: int) -> Any:
        """Pooled float32 vectors of the rows ``group``, pad columns past ``width`` dropped."""
        import torch

        rows = torch.tensor(group)
        return self._pool({key: value[rows, :width] for key, value in features.items()})

    def _pool(self, inputs: Any, hidden: Any = None) -> Any:
        """Pooled float32 vectors of a padded batch of token ids (and its attention mask).

        ``hidden``: the transformer's last hidden state of ``inputs`` if already computed.
        """
        if hidden is None:
            hidden = self._transformer(**inputs)[0]
        if self.pooling == "cls":
            return hidden[:, 0].float()
        return mean_pool(hidden, inputs["attention_mask"])
