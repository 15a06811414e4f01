"""Build a tiny LoRA adapter for the tiny test Llama (``build_tiny_model.py``), for the e2e tests.

vLLM loads PEFT's adapter format: ``adapter_config.json`` and ``adapter_model.safetensors``
whose tensors are named ``base_model.model.<module>.lora_A.weight`` (rank x in) and
``...lora_B.weight`` (out x rank). PEFT is not in the vLLM environment and is not needed to
write two files, so they are written here with torch and safetensors, which are. The
weights are random (a fixed seed per adapter name, so every run writes the same bytes) and
``lora_B`` is not zero, so the adapter really changes what the model writes.

Run it with the vLLM environment's interpreter::

    .venv-vllm/bin/python scripts/build_tiny_lora.py --model .cache/tiny-llama --out .cache/tiny-lora

It prints the adapter's directory; the files are rewritten on every run (~16 KiB, the same bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RANK = 8
ALPHA = 16
# The projections adapted, with their (out, in) shapes read from the base model's config.
TARGET_MODULES = ("q_proj", "v_proj")


def adapter_config(model_dir: Path) -> dict[str, Any]:
    """PEFT's config, as ``LoraConfig(...).save_pretrained`` writes it (the keys vLLM reads)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(model_dir),
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "target_modules": list(TARGET_MODULES),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
    }


def shapes(model_config: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(out, in) of each adapted projection."""
    hidden = int(model_config["hidden_size"])
    heads = int(model_config["num_attention_heads"])
    head_dim = int(model_config.get("head_dim") or hidden // heads)
    kv_heads = int(model_config.get("num_key_value_heads") or heads)
    return {"q_proj": (heads * head_dim, hidden), "v_proj": (kv_heads * head_dim, hidden)}


def build(model_dir: Path, out: Path, name: str) -> None:
    import torch
    from safetensors.torch import save_file

    model_config = json.loads((model_dir / "config.json").read_text())
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(model_config["num_hidden_layers"])):
        for module, (rows, cols) in shapes(model_config).items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, cols, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(rows, RANK, generator=generator) * 0.1
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    save_file(weights, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(model_dir), indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors leaves the file private to its writer.


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="the tiny model's directory")
    parser.add_argument("--out", type=Path, required=True, help="directory to write the adapter to")
    parser.add_argument("--name", default="tiny-lora", help="the adapter's name (seeds its weights)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir: Path = args.model.resolve()
    if not (model_dir / "config.json").is_file():
        raise SystemExit(f"{model_dir} holds no model: build it with scripts/build_tiny_model.py first")
    out: Path = args.out.resolve()
    build(model_dir, out, args.name)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
