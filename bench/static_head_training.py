"""How the classifier's static head is fitted and scored out of fold.

The regression ``scripts/train_static_head.py`` ships and ``bench/classifier.py`` evaluates
(its folds, group weights and calibration are ``bench.classifier_training``'s): each
prompt's word pieces (``StaticHead.pieces`` of its ``window``), the unit sum of their
vectors, ``log1p`` of its length, ``chars_per_piece`` and the mean Zipf frequency of its
words, in a weighted logistic regression at ``C``. In ``bench``, with the rest of the recipe,
so that the benchmark never imports a script.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from bench.classifier_data import HARD, Prompt
from bench.classifier_training import group_weights, logits_out_of_fold, word_zipf_of
from routing.static_head import StaticHead, chars_per_piece, window

# Picked among 25 variants (scripts/train_static_head.py says how).
C = 0.1


@dataclass(frozen=True, slots=True)
class StaticInputs:
    """The regression's inputs of every prompt: the unit vector, log length, characters per
    piece, the words' frequency (``WordFrequency.offset``)."""

    x: np.ndarray

    @classmethod
    def of(cls, head: StaticHead, prompts: Sequence[Prompt]) -> StaticInputs:
        rows = []
        for p, zipf in zip(prompts, word_zipf_of(prompts), strict=True):
            read = window(p.text)
            ids = head.pieces(read)
            rows.append([*head.vector(ids), np.log1p(len(p.text)), chars_per_piece(len(ids), len(read)), zipf])
        return cls(np.asarray(rows, dtype=np.float64))


def fit(inputs: StaticInputs, prompts: Sequence[Prompt], idx: Sequence[int]) -> tuple[np.ndarray, float]:
    """The regression's coefficients (vector, length, characters per piece, words' frequency)
    and intercept."""
    from sklearn.linear_model import LogisticRegression

    y = [int(prompts[i].label == HARD) for i in idx]
    clf = LogisticRegression(C=C, max_iter=5000)
    clf.fit(inputs.x[idx], np.asarray(y), sample_weight=group_weights(y, [prompts[i].group for i in idx]))
    return clf.coef_[0].copy(), float(clf.intercept_[0])


def out_of_fold(inputs: StaticInputs, prompts: Sequence[Prompt], protocol: str) -> np.ndarray:
    """The static head's ``logits_out_of_fold``."""

    def train_and_score(rest: list[int], held: list[int]) -> np.ndarray:
        coef, bias = fit(inputs, prompts, rest)
        return inputs.x[held] @ coef + bias

    return logits_out_of_fold(prompts, protocol, train_and_score)
