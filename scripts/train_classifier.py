"""Train the classifier's n-gram model and write routing/data/classifier.json (``--embedding``:
the embedding head). The static head, which classifies when no embedding is at hand, is
``scripts/train_static_head.py``'s; it shares this module's folds, weights and calibration.

    .venv/bin/python -m scripts.train_classifier            # needs ../shared/data and scikit-learn

It writes the n-gram model, and with ``--embedding`` (also) the embedding head,
``routing/data/classifier-embedding.json`` (needs the ``semantic`` extra). What each step
does (features, model, calibration against ``DEFAULT_TIERS``; vectors, head) is said once,
in ``bench.classifier_training``'s docstring.

The recipe (the vocabulary, folds, weights, calibration and the head's fit) is
``bench.classifier_training``'s, where ``bench/classifier.py`` takes it to report the
out-of-source figures; this script runs it and writes the files.
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
    CALIBRATION_PROTOCOL,
    EASY_QUANTILE,
    HARD_QUANTILE,
    HEAD_C,
    HEAD_CALIBRATION_PROTOCOL,
    HEAD_EASY_QUANTILE,
    HEAD_HARD_QUANTILE,
    HEAD_NGRAM_WEIGHT,
    MAX_FEATURES,
    MIN_DF,
    MIN_GROUPS,
    SHORT_ASK_CHARS,
    C,
    PromptVectors,
    calibration,
    embed,
    head_out_of_fold,
    labelled,
    out_of_fold,
    short_real_user_ask,
    train_final,
    train_final_head,
)
from routing.classifier import MODEL_FORMAT, features
from routing.embedding_head import DEFAULT_HEAD, HEAD_FORMAT

OUT = Path(__file__).resolve().parent.parent / "routing" / "data" / "classifier.json"
# The embedding head (``--embedding``).
HEAD_OUT = OUT.with_name(DEFAULT_HEAD)
# What the heads' files say their large boundary was placed on.
HARD_ON = f"short_real_user_ask: arena-hard hard asks under {SHORT_ASK_CHARS} characters, Latin alphabet"


def train_head(prompts: Sequence[Prompt], feats: Sequence[set[str]], vectors: PromptVectors) -> dict[str, Any]:
    """The head file's content: trained on every labelled prompt, calibrated out of fold."""
    ngram = out_of_fold(prompts, feats, HEAD_CALIBRATION_PROTOCOL) if HEAD_NGRAM_WEIGHT else np.zeros(len(prompts))
    logits = head_out_of_fold(prompts, vectors, ngram, HEAD_CALIBRATION_PROTOCOL)
    scale, shift, t_small, t_large = calibration(
        logits, prompts, HEAD_EASY_QUANTILE, HEAD_HARD_QUANTILE, short_real_user_ask
    )
    idx = [i for i, p in enumerate(prompts) if p.trained]
    final = train_final_head(prompts, vectors)
    info: dict[str, Any] = {
        "trained_on": dict(sorted(Counter(f"{prompts[i].group}:{prompts[i].label}" for i in idx).items())),
        "boundary_logits": {"small_top": round(t_small, 4), "large_bottom": round(t_large, 4)},
        "quantiles": {
            "easy": HEAD_EASY_QUANTILE,
            "hard": HEAD_HARD_QUANTILE,
            "hard_on": HARD_ON,
            "folds": HEAD_CALIBRATION_PROTOCOL,
        },
        "C": HEAD_C,
    }
    return {
        "format": HEAD_FORMAT,
        "embedder": vectors.identity,
        "bias": round(final.bias, 6),
        "ngram_weight": final.ngram_weight,
        "length_weight": round(final.length_weight, 6),
        "chars_per_token_weight": round(final.chars_per_token_weight, 6),
        "word_zipf_weight": round(final.word_zipf_weight, 6),
        "scale": round(scale, 6),
        "shift": round(shift, 6),
        "info": info,
        "weights": [round(float(w), 6) for w in final.weights],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--embedding", action="store_true", help="write the embedding head (only)")
    parser.add_argument("--head-out", type=Path, default=HEAD_OUT)
    parser.add_argument("--model-dir", type=Path, default=None, help="the embedder's model (default: the shipped one)")
    args = parser.parse_args()
    prompts = load()
    feats = [features(p.text) for p in prompts]
    if args.embedding:
        vectors = embed(prompts, args.model_dir)
        head = train_head(prompts, feats, vectors)
        args.head_out.parent.mkdir(parents=True, exist_ok=True)
        args.head_out.write_text(json.dumps(head, separators=(",", ":")) + "\n")
        print(f"wrote {args.head_out} ({args.head_out.stat().st_size // 1024} KiB, embedder {vectors.identity})")
        print(json.dumps(head["info"], indent=1))
        return
    logits = out_of_fold(prompts, feats, CALIBRATION_PROTOCOL)
    scale, shift, t_small, t_large = calibration(logits, prompts)
    final = train_final(prompts, feats)
    train = labelled(prompts)
    info: dict[str, Any] = {
        "trained_on": dict(sorted(Counter(f"{p.group}:{p.label}" for p in train).items())),
        "boundary_logits": {"small_top": round(t_small, 4), "large_bottom": round(t_large, 4)},
        "quantiles": {"easy": EASY_QUANTILE, "hard": HARD_QUANTILE, "folds": CALIBRATION_PROTOCOL},
        "vocabulary": {"min_df": MIN_DF, "min_groups": MIN_GROUPS, "max_features": MAX_FEATURES, "C": C},
    }
    model = {
        "format": MODEL_FORMAT,
        "bias": round(final.bias, 5),
        "scale": round(scale, 5),
        "shift": round(shift, 5),
        "info": info,
        "weights": {k: round(v, 4) for k, v in sorted(final.weights.items())},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(model, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({args.out.stat().st_size // 1024} KiB, {len(model['weights'])} features)")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
