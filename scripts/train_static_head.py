"""Train the classifier's static head and write routing/data/classifier-static.json.

    .venv/bin/python -m scripts.train_static_head   # needs ../shared/data, scikit-learn and the semantic extra
    .venv/bin/python -m scripts.train_static_head --table-from routing/data/classifier-static.json
        # the shipped table and vocabulary, not distilled again (only scikit-learn needed)

What it does (the labels, folds, weights and calibration are ``bench.classifier_training``'s,
the regression ``bench.static_head_training``'s):

1. Table: every word piece of all-MiniLM-L6-v2's vocabulary run through the model alone
   (``[CLS] piece [SEP]``), the piece's own output vector kept; the vocabulary's vectors,
   less their mean, projected on their ``DIMENSIONS`` leading principal directions, in
   float16 (``routing.static_head``). The model is the semantic extra's stock one.
2. Inputs: each prompt's word pieces (``StaticHead.pieces`` of its ``window``), the unit
   sum of their vectors, ``log1p`` of its length, ``chars_per_piece`` and the mean Zipf
   frequency of its words (``routing.word_frequency``).
3. Head: the weighted logistic regression of ``fit_head`` at ``C``.
4. Calibration: the embedding head's (``HEAD_CALIBRATION_PROTOCOL`` folds,
   ``HEAD_EASY_QUANTILE`` of the easy prompts, ``HEAD_HARD_QUANTILE`` of real users' short
   hard asks), so the same default tiers hold.

The recipe (float16 table of 32 dimensions, unit sum, C = 0.1) was picked among 25 variants
(11 tables and inputs, C from 0.1 to 3) on the `sources` folds and the both-sides-held-out pairs of
``bench/classifier.py``: a selection on the figures reported (bench/results/classifier.md).
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.classifier_data import Prompt, load
from bench.classifier_training import (
    HEAD_CALIBRATION_PROTOCOL,
    HEAD_EASY_QUANTILE,
    HEAD_HARD_QUANTILE,
    calibration,
    short_real_user_ask,
)
from bench.static_head_training import C, StaticInputs, fit, out_of_fold
from routing.static_head import DEFAULT_STATIC, FORMAT, StaticHead, encode_table, load_static_head
from scripts.train_classifier import HARD_ON, OUT

STATIC_OUT = OUT.with_name(DEFAULT_STATIC)
DIMENSIONS = 32
BATCH = 2048


def distil(model_dir: Path | None = None) -> tuple[list[str], np.ndarray, str]:
    """The vocabulary, each piece's vector (float16-rounded, as the file keeps it) and the
    identity of the model they came from."""
    import torch

    from cache.semantic.embed_model import load_sentence_transformer
    from cache.semantic.embedder import default_model_dir, model_identity

    directory = model_dir or default_model_dir()
    model = load_sentence_transformer(directory)
    tokenizer, transformer = model.tokenizer, model[0].auto_model.eval()
    tokens = [t for t, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]
    rows = []
    with torch.no_grad():
        for start in range(0, len(tokens), BATCH):
            ids = torch.arange(start, min(len(tokens), start + BATCH))[:, None]
            cls, sep = torch.full_like(ids, tokenizer.cls_token_id), torch.full_like(ids, tokenizer.sep_token_id)
            inputs = torch.cat([cls, ids, sep], dim=1)
            hidden = transformer(input_ids=inputs, attention_mask=torch.ones_like(inputs))[0]
            rows.append(hidden[:, 1].float().numpy())
    vectors = np.concatenate(rows).astype(np.float64)
    centred = vectors - vectors.mean(axis=0)
    _, _, directions = np.linalg.svd(centred, full_matrices=False)
    table = (centred @ directions[:DIMENSIONS].T).astype(np.float16).astype(np.float32)
    return tokens, table, model_identity(directory, None)


def untrained(tokens: list[str], table: np.ndarray) -> StaticHead:
    """A head with the table and no weights: what tokenises the prompts for training."""
    return StaticHead(tokens, table, np.zeros(table.shape[1]), 0.0, 0.0, 0.0, 1.0, 0.0)


def train(prompts: Sequence[Prompt], tokens: list[str], table: np.ndarray, source: str) -> dict[str, Any]:
    """The static head file's content: trained on every labelled prompt, calibrated out of fold."""
    inputs = StaticInputs.of(untrained(tokens, table), prompts)
    logits = out_of_fold(inputs, prompts, HEAD_CALIBRATION_PROTOCOL)
    scale, shift, t_small, t_large = calibration(
        logits, prompts, HEAD_EASY_QUANTILE, HEAD_HARD_QUANTILE, short_real_user_ask
    )
    idx = [i for i, p in enumerate(prompts) if p.trained]
    coef, bias = fit(inputs, prompts, idx)
    return {
        "format": FORMAT,
        "source": source,
        "bias": round(bias, 6),
        "length_weight": round(float(coef[DIMENSIONS]), 6),
        "chars_per_piece_weight": round(float(coef[DIMENSIONS + 1]), 6),
        "word_zipf_weight": round(float(coef[DIMENSIONS + 2]), 6),
        "scale": round(scale, 6),
        "shift": round(shift, 6),
        "info": {
            "trained_on": dict(sorted(Counter(f"{prompts[i].group}:{prompts[i].label}" for i in idx).items())),
            "boundary_logits": {"small_top": round(t_small, 4), "large_bottom": round(t_large, 4)},
            "quantiles": {
                "easy": HEAD_EASY_QUANTILE,
                "hard": HEAD_HARD_QUANTILE,
                "hard_on": HARD_ON,
                "folds": HEAD_CALIBRATION_PROTOCOL,
            },
            "C": C,
            "dimensions": DIMENSIONS,
        },
        "weights": [round(float(w), 6) for w in coef[:DIMENSIONS]],
        "tokens": tokens,
        "table": encode_table(table),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=STATIC_OUT)
    parser.add_argument("--model-dir", type=Path, default=None, help="the model to distil (default: the stock one)")
    parser.add_argument(
        "--table-from",
        type=Path,
        default=None,
        help="take the table and vocabulary of this head file instead of distilling them: the same head "
        "retrained and recalibrated (a distillation on another machine may differ in the last bit)",
    )
    args = parser.parse_args()
    prompts = load()
    if args.table_from is not None:
        given = load_static_head(args.table_from)
        tokens, table, source = given.tokens, given.table, given.source
    else:
        tokens, table, source = distil(args.model_dir)
    head = train(prompts, tokens, table, source)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(head, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB, {len(tokens)} pieces x {DIMENSIONS})")
    print(json.dumps(head["info"], indent=1))


if __name__ == "__main__":
    main()
