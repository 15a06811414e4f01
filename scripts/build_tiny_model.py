"""Build a tiny random Llama model that vLLM can serve on CPU, for the end-to-end tests.

No weights can be downloaded where the tests run, so they make their own: a byte-level BPE
tokenizer trained on local licence texts, saved with a ChatML chat template, and a randomly
initialised ``LlamaForCausalLM`` (~0.8 M parameters, safetensors). It writes gibberish,
which is all a gateway test needs. Every run with the same inputs yields byte-identical
files, so replicas, caches and test expectations agree across runs and machines.

Run it with the vLLM environment's interpreter (it has torch, transformers, tokenizers)::

    .venv-vllm/bin/python scripts/build_tiny_model.py --out .cache/tiny-llama

A directory already holding a complete model from this builder version is left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Bump when anything below changes what is written: old directories are then rebuilt.
BUILDER_VERSION = 1
MARKER_NAME = "fleetgate-tiny-model.json"
SEED = 20240601

DEFAULT_CORPUS_DIR = Path("/usr/share/common-licenses")  # Debian's base-files ships it.
VOCAB_SIZE = 2000
HIDDEN_SIZE = 128
# vLLM's CPU attention kernels reject head_dim 16; 64 works (128 / 2 heads).
NUM_ATTENTION_HEADS = 2
NUM_KEY_VALUE_HEADS = 1
HEAD_DIM = HIDDEN_SIZE // NUM_ATTENTION_HEADS
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
# Above the 2048 the tests pass as --max-model-len, so they can also try longer contexts.
MAX_POSITION_EMBEDDINGS = 4096

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = [BOS_TOKEN, "<|end_of_text|>", PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
# ChatML: what many served models use, and what vLLM's chat endpoint renders with.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def log(message: str) -> None:
    print(f"[build_tiny_model] {message}", file=sys.stderr, flush=True)


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def corpus_files(paths: Sequence[Path]) -> list[Path]:
    """Regular files under ``paths``, in a fixed order so training sees the same stream."""
    found: set[Path] = set()
    for path in paths:
        if path.is_dir():
            found.update(p for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            found.add(path)
    return sorted(found)


def corpus_digest(files: Sequence[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def corpus_lines(files: Sequence[Path]) -> Iterator[str]:
    for path in files:
        yield from path.read_text(encoding="utf-8", errors="replace").splitlines()


def expected_marker(corpus: str) -> dict[str, Any]:
    """What a complete directory's marker says, less the file digests."""
    return {"builder_version": BUILDER_VERSION, "seed": SEED, "corpus_sha256": corpus}


def is_complete(out: Path, corpus: str) -> bool:
    """True when ``out`` holds every file this builder version wrote, unchanged."""
    try:
        marker = json.loads((out / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if {k: marker.get(k) for k in expected_marker(corpus)} != expected_marker(corpus):
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    return all((out / name).is_file() and sha256_of(out / name) == digest for name, digest in files.items())


def train_tokenizer(files: Sequence[Path]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(files), trainer=trainer)
    size = tokenizer.get_vocab_size()
    if size != VOCAB_SIZE:
        raise SystemExit(
            f"the corpus yielded a vocabulary of {size} tokens, not {VOCAB_SIZE}: give more text with --corpus"
        )
    return tokenizer


def build(out: Path, files: Sequence[Path]) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(SEED)
    torch.set_num_threads(1)

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(files),
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        model_max_length=MAX_POSITION_EMBEDDINGS,
    )
    hf_tokenizer.chat_template = CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_ATTENTION_HEADS,
        num_key_value_heads=NUM_KEY_VALUE_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def write_marker(out: Path, corpus: str) -> None:
    for path in out.iterdir():
        path.chmod(0o644)  # save_pretrained leaves the weights private to their writer.
    files = {p.name: sha256_of(p) for p in sorted(out.iterdir()) if p.is_file() and p.name != MARKER_NAME}
    marker = {**expected_marker(corpus), "files": files}
    (out / MARKER_NAME).write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the model to")
    parser.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        default=[DEFAULT_CORPUS_DIR],
        help=f"files or directories of text to train the tokenizer on (default: {DEFAULT_CORPUS_DIR})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if --out already holds the model")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out: Path = args.out.resolve()
    files = corpus_files(args.corpus)
    if not files:
        raise SystemExit(f"no text found in {', '.join(map(str, args.corpus))}: pass --corpus")
    corpus = corpus_digest(files)

    if not args.force and is_complete(out, corpus):
        log(f"{out} already holds the tiny model (builder version {BUILDER_VERSION})")
        print(out)
        return 0
    if out.exists() and not out.is_dir():
        raise SystemExit(f"{out} exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (out / MARKER_NAME).exists():
        raise SystemExit(f"{out} is not empty and was not written by this script; refusing to touch it")

    # Nothing may load from a model hub here; fail rather than hang on a network call.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and move it in whole, so a killed build or a concurrent one
    # never leaves a half-written model where vLLM would load it.
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the model is not a secret.
    try:
        log(f"building into {out} from {len(files)} corpus files")
        build(staging, files)
        write_marker(staging, corpus)
        if is_complete(out, corpus):  # a concurrent build finished first
            log(f"done by another build: {out}")
            print(out)
            return 0
        if out.exists():
            shutil.rmtree(out)
        try:
            staging.rename(out)
        except OSError:
            if not is_complete(out, corpus):  # a concurrent build won the race
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"done: {out}")
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
