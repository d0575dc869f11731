#!/usr/bin/env python3
"""Store a Hugging Face checkpoint's decoder linear weights as INT8 with a scale per output
channel, in the compressed-tensors layout that llm-compressor writes for unpacked integer
weights (``quant_method: "compressed-tensors"``, ``format: "int-quantized"``), which tpc
reads.

Every 2-D projection weight (``*_proj``, each expert's included) gets one float32 scale per
output row, ``amax(|row|) / 127`` (an all-zero row gets scale 1), and is stored as
``round(W / scale)`` clamped to [-127, 127] in int8 under its own name, the scales as
``<name>_scale [out, 1]``. Everything else (embeddings, norms, routers, lm_head) is copied as
it is. The config gets the matching ``quantization_config`` (weights only: activations are
not quantized).

    python3 scripts/quantize_int8.py SRC_DIR DST_DIR

Shards are converted one at a time (and the index rewritten), so memory holds one shard.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

# The same weights (every decoder projection) and the same shard-by-shard conversion.
from quantize_fp8 import convert_checkpoint, is_quantized

INT8_MAX = 127.0


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` as int8 values and one float32 scale per output row (``[out, 1]``)."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.to(torch.float32) * scale


def convert_tensors(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The stored tensors, and the dequantized value of every quantized weight."""
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        if is_quantized(name, w.shape):
            q, scale = quantize(w.float())
            stored[name] = q
            stored[name + "_scale"] = scale
            dequantized[name] = dequantize(q, scale)
        else:
            stored[name] = w
    return stored, dequantized


def int8_config(config: dict) -> dict:
    config = dict(config)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "channel",
                    "group_size": None,
                    "dynamic": False,
                    "actorder": None,
                    "observer": "minmax",
                },
                "input_activations": None,
                "output_activations": None,
            }
        },
    }
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    a = ap.parse_args()
    convert_checkpoint(a.src, a.dst, convert_tensors, int8_config)


if __name__ == "__main__":
    main()
