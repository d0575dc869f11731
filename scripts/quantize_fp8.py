#!/usr/bin/env python3
"""Store a Hugging Face checkpoint's decoder linear weights as FP8 e4m3 with block scales:
the ``quant_method: "fp8"`` layout of the Qwen3 and DeepSeek FP8 releases, which tpc reads.

Every weight whose module is a projection (``*_proj``, each expert's included) and 2-D is cut
into blocks of B × B; each block's scale is ``amax(|block|) / 448`` (448: the largest finite
e4m3 value; an all-zero block gets scale 1); the weight is stored as
``(W / scale).to(float8_e4m3fn)`` and the scales as ``<name>_scale_inv`` float32
``[ceil(out/B), ceil(in/B)]``.  Everything else (embeddings, norms, routers, lm_head) is
copied as it is.  The config gets the matching ``quantization_config``.

    python3 scripts/quantize_fp8.py SRC_DIR DST_DIR [--block 128]

Shards are converted one at a time (and the index rewritten), so memory holds one shard.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0


def is_quantized(name: str, shape: torch.Size) -> bool:
    """A decoder linear's weight, as transformers' FP8 loader replaces them."""
    parts = name.split(".")
    return len(shape) == 2 and name.endswith(".weight") and parts[-2].endswith("_proj")


def quantize(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as e4m3 values and one float32 scale per block × block block."""
    out, inp = w.shape
    rows, cols = -(-out // block), -(-inp // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out, :inp] = w
    amax = padded.reshape(rows, block, cols, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / expand(scale, block, out, inp)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale.contiguous()


def expand(scale: torch.Tensor, block: int, out: int, inp: int) -> torch.Tensor:
    """Each block's scale over its elements."""
    return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:out, :inp]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    out, inp = q.shape
    return q.to(torch.float32) * expand(scale, block, out, inp)


def convert_tensors(
    tensors: dict[str, torch.Tensor], block: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The stored tensors, and the dequantized value of every quantized weight."""
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        if is_quantized(name, w.shape):
            q, scale = quantize(w.float(), block)
            stored[name] = q
            stored[name + "_scale_inv"] = scale
            dequantized[name] = dequantize(q, scale, block)
        else:
            stored[name] = w
    return stored, dequantized


def fp8_config(config: dict, block: int) -> dict:
    config = dict(config)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block, block],
    }
    return config


def convert_checkpoint(src: Path, dst: Path, convert, quantized_config) -> None:
    """Writes ``src``'s checkpoint to ``dst`` with ``convert(tensors) -> (stored, _)`` applied
    to each shard (one in memory at a time) and ``quantized_config(config)`` as its config;
    the index and the generation / tokenizer files follow."""
    dst.mkdir(parents=True, exist_ok=True)
    index_path = src / "model.safetensors.index.json"
    shards = (
        sorted(set(json.loads(index_path.read_text())["weight_map"].values()))
        if index_path.exists()
        else ["model.safetensors"]
    )
    weight_map = {}
    for shard in shards:
        stored, _ = convert(load_file(str(src / shard)))
        save_file(stored, str(dst / shard), metadata={"format": "pt"})
        weight_map.update({name: shard for name in stored})
        print(f"{shard}: {len(stored)} tensors")
    if index_path.exists():
        (dst / index_path.name).write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2) + "\n"
        )
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(quantized_config(config), indent=2) + "\n")
    for extra in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / extra).exists():
            shutil.copy(src / extra, dst / extra)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--block", type=int, default=128)
    a = ap.parse_args()
    convert_checkpoint(
        a.src,
        a.dst,
        lambda tensors: convert_tensors(tensors, a.block),
        lambda config: fp8_config(config, a.block),
    )


if __name__ == "__main__":
    main()
