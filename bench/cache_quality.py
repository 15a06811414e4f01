"""How often does the semantic cache answer the wrong question? Measured on held-out pairs.

    .venv/bin/python bench/cache_quality.py [--pairs CSV] [--params JSON] [--model-dir DIR]

Runs the cache's real decision path on the held-out half of ``qqp_val.csv`` (see
``bench.qqp_pairs``; the verifier never saw it): ``SentenceTransformerEmbedder`` ->
``VectorIndex.search`` within one scope -> ``SemanticVerifier.choose``. Two measures:

- *pairwise*: each pair alone, question2 cached and question1 asked; a hit on a
  non-duplicate pair is a false hit. This is the bar: at most 2% false hits.
- *index*: every held-out question2 is cached in one scope (~5,800 entries) and every
  question1 is looked up among all of them, so a query can also hit a distractor. A hit
  counts as right only when the entry is the query itself or linked to it by duplicate
  labels; a hit on any other entry counts as wrong, even unlabelled ones (pessimistic).

Plain cosine thresholds (the previous method) are measured on the same vectors. Writes
``bench/results/cache-quality.md`` and ``cache-quality.png``. Uses one thread.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# One core for everything: numpy's BLAS would otherwise spread the exhaustive scan over
# every core and make it look cheaper than it is on a one-core budget.
for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cache_quality_report import Curve, Report, Timings, write_report  # noqa: E402
from bench.qqp_pairs import SPLIT_SEED, duplicate_clusters, load_pairs, split_pairs  # noqa: E402
from cache.semantic.embedder import SentenceTransformerEmbedder, default_model_dir  # noqa: E402
from cache.semantic.pair_features import FloatArray  # noqa: E402
from cache.semantic.vector_index import VectorIndex  # noqa: E402
from cache.semantic.verifier import Candidate, SemanticVerifier, VerifierParams  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SCOPE = "tenant-a|model-x"
TOP_K = 4
# Lookups are embedded as concurrent single-text calls, as handlers would issue them.
CONCURRENT_LOOKUPS = 32
LATENCY_SAMPLES = 300
INDEX_SIZE_FOR_TIMING = 100_000
# How the embedder runs the model (the report says it next to the model's name).
RUN_AS = "float32, ONNX Runtime"


@dataclass(frozen=True, slots=True)
class IndexOutcome:
    """The best candidate a lookup found: its score and whether answering with it is right."""

    score: float
    right: bool


async def embed_all(
    embedder: SentenceTransformerEmbedder, texts: list[str], progress: object, timings: Timings
) -> FloatArray:
    """Vectors for ``texts``, sent as concurrent one-text calls (the micro-batcher's job)."""
    from rich.progress import Progress

    assert isinstance(progress, Progress)
    task = progress.add_task("embedding held-out questions", total=len(texts))
    out: list[FloatArray] = []
    for start in range(0, len(texts), CONCURRENT_LOOKUPS):
        chunk = texts[start : start + CONCURRENT_LOOKUPS]
        with timings.measure(len(chunk)):
            vectors = await asyncio.gather(*(embedder.embed([text]) for text in chunk))
        out.extend(v[0] for v in vectors)
        progress.advance(task, len(chunk))
    return np.vstack(out)


async def embed_latency(embedder: SentenceTransformerEmbedder, texts: list[str]) -> Timings:
    """One lone ``embed`` call at a time (concurrency 1)."""
    timings = Timings()
    for text in texts:
        with timings.measure():
            await embedder.embed([text])
    return timings


def search_latency(index: VectorIndex, queries: FloatArray) -> Timings:
    timings = Timings()
    for query in queries:
        with timings.measure():
            index.search(SCOPE, query, TOP_K)
    return timings


def run(args: argparse.Namespace) -> Report:
    import torch
    from rich.progress import MofNCompleteColumn, Progress, TimeRemainingColumn

    torch.set_num_threads(1)
    params = VerifierParams.load(args.params)
    verifier = SemanticVerifier(params)
    _, held_out = split_pairs(load_pairs(args.pairs), SPLIT_SEED)
    if args.limit:
        held_out = held_out[: args.limit]  # a quick smoke run; the report is not comparable
    texts = sorted({t for p in held_out for t in (p.question1, p.question2)})
    clusters = duplicate_clusters(held_out)
    labels = np.array([p.duplicate for p in held_out])

    columns = (*Progress.get_default_columns()[:-1], MofNCompleteColumn(), TimeRemainingColumn())
    with Progress(*columns) as progress:

        async def embed_phase() -> tuple[FloatArray, Timings, Timings, FloatArray | None]:
            batched = Timings()
            async with SentenceTransformerEmbedder(args.model_dir, threads=1) as embedder:
                vectors = await embed_all(embedder, texts, progress, batched)
                latency = await embed_latency(embedder, texts[:LATENCY_SAMPLES])
            if args.model_dir is not None:
                return vectors, latency, batched, None
            # The packaged model without the fine-tuned layers, for comparison.
            async with SentenceTransformerEmbedder(default_model_dir(), threads=1) as untuned:
                return vectors, latency, batched, await embed_all(untuned, texts, progress, Timings())

        matrix, embed_seconds, embed_batched, untuned_matrix = asyncio.run(embed_phase())
        vectors = {text: matrix[i] for i, text in enumerate(texts)}
        u = np.vstack([vectors[p.question1] for p in held_out])
        v = np.vstack([vectors[p.question2] for p in held_out])
        cosines = np.einsum("ij,ij->i", u, v)
        untuned_cosine = None
        if untuned_matrix is not None:
            row = {text: i for i, text in enumerate(texts)}
            first = untuned_matrix[[row[p.question1] for p in held_out]]
            second = untuned_matrix[[row[p.question2] for p in held_out]]
            untuned_cosine = Curve("untuned cosine", np.einsum("ij,ij->i", first, second), labels, None)

        task = progress.add_task("pairwise verification", total=len(held_out))
        pair_scores = np.zeros(len(held_out))
        for i, pair in enumerate(held_out):
            verdict = verifier.verify(pair.question1, pair.question2, u[i], v[i], float(cosines[i]))
            pair_scores[i] = verdict.score
            progress.advance(task)

        index = VectorIndex(matrix.shape[1])
        cached = sorted({p.question2 for p in held_out})
        for text in cached:
            index.add(SCOPE, text, vectors[text])
        task = progress.add_task("index lookups", total=len(held_out))
        verified: list[IndexOutcome] = []
        by_cosine: list[IndexOutcome] = []
        choose_seconds = Timings()
        # Threshold 0 makes ``choose`` return its best candidate; the sweep thresholds it.
        best_of = SemanticVerifier(params, threshold=0.0)
        for i, pair in enumerate(held_out):
            hits = index.search(SCOPE, u[i], TOP_K)
            candidates = [Candidate(h.key, h.key, vectors[h.key], h.score) for h in hits]
            with choose_seconds.measure():
                best, verdict = best_of.choose(pair.question1, u[i], candidates)
            verified.append(
                IndexOutcome(verdict.score, best is not None and clusters[best.text] == clusters[pair.question1])
            )
            top = hits[0] if hits else None
            by_cosine.append(
                IndexOutcome(
                    top.score if top else -1.0, top is not None and clusters[top.key] == clusters[pair.question1]
                )
            )
            progress.advance(task)

    rng = np.random.default_rng(0)
    big = VectorIndex(matrix.shape[1])
    # An exhaustive float32 scan of the same entries, for the ratio the sketch pass buys.
    scan = VectorIndex(matrix.shape[1], exact_below=INDEX_SIZE_FOR_TIMING)
    filler = rng.standard_normal((INDEX_SIZE_FOR_TIMING - len(cached), matrix.shape[1])).astype(np.float32)
    for key, row in [*((f"filler-{i}", row) for i, row in enumerate(filler)), *((t, vectors[t]) for t in cached)]:
        big.add(SCOPE, key, row)
        scan.add(SCOPE, key, row)
    search_small = search_latency(index, u[:LATENCY_SAMPLES])
    search_big = search_latency(big, u[:LATENCY_SAMPLES])
    search_scan = search_latency(scan, u[:LATENCY_SAMPLES])
    # Does the shortlist keep the exact top entry? Counted where it matters: lookups whose
    # exact top entry is above the cosine floor, i.e. could become a hit.
    tops = [(big.search(SCOPE, q, 1)[0], scan.search(SCOPE, q, 1)[0]) for q in u[:LATENCY_SAMPLES]]
    eligible = [(a, b) for a, b in tops if b.score >= verifier.min_cosine]
    agree = float(np.mean([a.key == b.key for a, b in eligible])) if eligible else 1.0

    return Report(
        params=params,
        shipped_threshold=verifier.threshold,
        labels=labels,
        pairwise=Curve("verifier", pair_scores, labels, None),
        pairwise_cosine=Curve("plain cosine", cosines, labels, None),
        index=Curve("verifier", np.array([o.score for o in verified]), labels, np.array([o.right for o in verified])),
        index_cosine=Curve(
            "plain cosine", np.array([o.score for o in by_cosine]), labels, np.array([o.right for o in by_cosine])
        ),
        index_entries=len(cached),
        embed_seconds=embed_seconds,
        embed_batched_seconds=embed_batched,
        choose_seconds=choose_seconds,
        search_seconds=search_small,
        search_seconds_100k=search_big,
        scan_seconds_100k=search_scan,
        sketch_agreement=agree,
        sketch_checked=len(eligible),
        untuned_cosine=untuned_cosine,
        embedder_run=RUN_AS,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", help="labelled pairs CSV (default: shared/data/qqp_val.csv)")
    parser.add_argument("--params", help="verifier parameters (default: the shipped cache/semantic/data/verifier.json)")
    parser.add_argument(
        "--model-dir", help="sentence-transformers model directory (default: the packaged MiniLM, fine-tuned layers)"
    )
    parser.add_argument("--out", default=str(RESULTS), help="directory for cache-quality.md and .png")
    parser.add_argument("--limit", type=int, default=0, help="only the first N held-out pairs (smoke test)")
    args = parser.parse_args(argv)
    report = dataclasses.replace(
        run(args), arguments="".join(f" {word}" for word in (sys.argv[1:] if argv is None else argv))
    )
    markdown = write_report(report, Path(args.out))
    print(markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
