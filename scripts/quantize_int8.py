#!/usr/bin/env python3
"""Store a Hugging Face checkpoint's decoder linear weights as INT8 with a scale per output
channel, in the compressed-tensors layout that llm-compressor writes for unpacked integer
weights (``quant_method: "compressed-tensors"``, ``format: "int-quantized"``) or, with
``--packed``, for W8A16 (``format: "pack-quantized"``: four values to an int32 in
``<module>.weight_packed [out, in/4]``, byte ``k`` of word ``p`` input ``4p + k``, each the value
plus 128; ``<module>.weight_shape``), which tpc reads.

Every 2-D projection weight (``*_proj``, each expert's included) gets one float32 scale per
output row, ``amax(|row|) / 127`` (an all-zero row gets scale 1), and is stored as
``round(W / scale)`` clamped to [-127, 127] in int8 under its own name, the scales as
``<name>_scale [out, 1]``. Everything else (embeddings, norms, routers, lm_head) is copied as
it is. The config gets the matching ``quantization_config`` (weights only: activations are
not quantized).

    python3 scripts/quantize_int8.py SRC_DIR DST_DIR [--packed]

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


def pack_biased(q: torch.Tensor) -> torch.Tensor:
    """int8 ``[out, in]`` → int32 ``[out, in/4]``: each value plus 128 as a byte, byte ``k`` of
    word ``p`` (little-endian) holding input ``4p + k`` (compressed-tensors' ``pack_to_int32``)."""
    biased = (q.to(torch.int32) + 128).to(torch.uint8)
    return biased.contiguous().view(torch.int32)


def unpack_biased(words: torch.Tensor) -> torch.Tensor:
    """``pack_biased``'s inverse, from the stored words."""
    return (words.contiguous().view(torch.uint8).to(torch.int32) - 128).to(torch.int8)


def convert_tensors(
    tensors: dict[str, torch.Tensor], packed: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The stored tensors, and the dequantized value of every quantized weight (with
    ``packed``, unpacked from the stored words)."""
    stored, dequantized = {}, {}
    for name, w in tensors.items():
        if is_quantized(name, w.shape):
            q, scale = quantize(w.float())
            if packed:
                stem = name.removesuffix(".weight")
                words = pack_biased(q)
                stored[stem + ".weight_packed"] = words
                stored[stem + ".weight_shape"] = torch.tensor(list(q.shape), dtype=torch.int64)
                q = unpack_biased(words)
            else:
                stored[name] = q
            stored[name + "_scale"] = scale
            dequantized[name] = dequantize(q, scale)
        else:
            stored[name] = w
    return stored, dequantized


def int8_config(config: dict, packed: bool = False) -> dict:
    config = dict(config)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized" if packed else "int-quantized",
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
    ap.add_argument("--packed", action="store_true", help="W8A16's pack-quantized layout")
    a = ap.parse_args()
    convert_checkpoint(
        a.src,
        a.dst,
        lambda tensors: convert_tensors(tensors, a.packed),
        lambda config: int8_config(config, a.packed),
    )


if __name__ == "__main__":
    main()
