#!/usr/bin/env python3
"""Store a Hugging Face checkpoint's decoder linear weights as INT4 with a scale and a zero
point per output per group of inputs, packed as GPTQ (``quant_method: "gptq"``, the ``gptq``
checkpoint format, ``desc_act`` false or true), AWQ (``quant_method: "awq"``, the GEMM
packing) or compressed-tensors (``quant_method: "compressed-tensors"``, ``format:
"pack-quantized"``, llm-compressor's W4A16: symmetric, or with ``--zero-points``; ``actorder:
"group"`` with ``--desc-act``) publish them, which tpc reads.

The codes come from round-to-nearest over each group (no calibration: the layout, not the
quantization algorithm, is what a reader must get right). GPTQ is symmetric (zero 8, scale
``amax / 7.5`` in f16, as GPTQ's ``sym: true``); AWQ is asymmetric (scale ``(max - min) /
15`` in f16, zero ``round(-min / scale)`` in 0..15); compressed-tensors is symmetric as GPTQ,
or with ``--zero-points`` asymmetric as AWQ, its scales in the checkpoint's float type. With
``--desc-act`` the inputs are put in order of decreasing mean |weight| (standing in for GPTQ's activation order) and the groups
are taken in that order, so that ``g_idx`` scatters each group along the inputs; ``qweight``
keeps the inputs in their own order, as GPTQ stores it.

Layouts (all int32 little-endian, four bits a field, field ``k`` at bits ``4k``):

- GPTQ: ``qweight [in/8, out]``, word ``(p, o)`` field ``k`` = code of input ``8p + k``;
  ``qzeros [groups, out/8]``, field ``k`` of word ``(g, j)`` = zero of output ``8j + k``,
  minus one; ``scales [groups, out]`` f16; ``g_idx [in]`` int32.
- AWQ: ``qweight [in, out/8]``, field ``k`` of word ``(i, j)`` = code of output
  ``8j + ORDER[k]``, ORDER = 0 2 4 6 1 3 5 7; ``qzeros [groups, out/8]`` likewise, as is;
  ``scales [groups, out]`` f16.
- compressed-tensors: ``weight_packed [out, in/8]``, word ``(o, p)`` field ``k`` = code of
  input ``8p + k`` (a code is the signed value plus 8); ``weight_scale [out, groups]``;
  ``weight_zero_point [out/8, groups]`` (with ``--zero-points``), field ``k`` of word ``(j,
  g)`` = zero of output ``8j + k`` (plus 8, as the codes); ``weight_g_idx [in]`` int32 (act
  order); ``weight_shape`` int64 ``[out, in]``.

    python3 scripts/quantize_int4.py SRC_DIR DST_DIR --method gptq|awq|compressed [--group 128]
        [--desc-act] [--zero-points]

Shards are converted one at a time (and the index rewritten), so memory holds one shard.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

# The same weights (every decoder projection) and the same shard-by-shard conversion.
from quantize_fp8 import convert_checkpoint, is_quantized

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def groups_of(importance: torch.Tensor, group: int, desc_act: bool) -> torch.Tensor:
    """Each input's group (``g_idx``): consecutive runs of ``group`` inputs, or with
    ``desc_act`` runs of the inputs in order of decreasing ``importance`` (standing in for
    the diagonal of the input's Hessian by which GPTQ orders them, so that the projections
    that read one input share ``g_idx``, as GPTQ's do)."""
    n_in = importance.shape[0]
    if not desc_act:
        return torch.arange(n_in, dtype=torch.int32) // group
    order = torch.argsort(importance, descending=True, stable=True)
    g_idx = torch.empty(n_in, dtype=torch.int32)
    g_idx[order] = torch.arange(n_in, dtype=torch.int32) // group
    return g_idx


def quantize(w: torch.Tensor, g_idx: torch.Tensor, sym: bool, scale_dtype=torch.float16):
    """Codes ``[out, in]`` (0..15), zeros and scales ``[groups, out]`` (``scale_dtype``)."""
    n_out = w.shape[0]
    n_groups = int(g_idx.max()) + 1
    scales = torch.empty(n_groups, n_out, dtype=scale_dtype)
    zeros = torch.empty(n_groups, n_out, dtype=torch.int32)
    codes = torch.empty(w.shape, dtype=torch.int32)
    for g in range(n_groups):
        cols = (g_idx == g).nonzero().flatten()
        part = w[:, cols]
        if sym:
            amax = part.abs().amax(dim=1)
            scale = (amax / 7.5).clamp(min=1e-8).to(scale_dtype)
            zero = torch.full((n_out,), 8, dtype=torch.int32)
        else:
            lo = part.amin(dim=1).clamp(max=0)
            hi = part.amax(dim=1).clamp(min=0)
            scale = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype)
            zero = torch.round(-lo / scale.float()).clamp(0, 15).to(torch.int32)
        q = torch.round(part / scale.float()[:, None]) + zero[:, None]
        codes[:, cols] = q.clamp(0, 15).to(torch.int32)
        scales[g], zeros[g] = scale, zero
    return codes, zeros, scales


def pack(fields: torch.Tensor) -> torch.Tensor:
    """``[..., 8]`` fields of four bits → int32 words, field ``k`` at bits ``4k``."""
    word = torch.zeros(fields.shape[:-1], dtype=torch.int64)
    for k in range(8):
        word |= (fields[..., k].to(torch.int64) & 0xF) << (4 * k)
    # The same 32 bits as a signed int32 (two's complement).
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def unpack(words: torch.Tensor) -> torch.Tensor:
    """int32 words → ``[..., 8]`` fields."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return torch.stack([(w >> (4 * k)) & 0xF for k in range(8)], dim=-1).to(torch.int32)


def pack_gptq(codes, zeros, scales, g_idx):
    n_out, n_in = codes.shape
    qweight = pack(codes.T.reshape(n_in // 8, 8, n_out).permute(0, 2, 1))
    qzeros = pack((zeros - 1).reshape(zeros.shape[0], n_out // 8, 8))
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}


def pack_awq(codes, zeros, scales):
    n_out, n_in = codes.shape
    order = torch.tensor(AWQ_ORDER)
    qweight = pack(codes.T.reshape(n_in, n_out // 8, 8)[..., order])
    qzeros = pack(zeros.reshape(zeros.shape[0], n_out // 8, 8)[..., order])
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales}


def pack_compressed(codes, zeros, scales, g_idx, zero_points: bool, desc_act: bool):
    n_out, n_in = codes.shape
    packed = {
        "weight_packed": pack(codes.reshape(n_out, n_in // 8, 8)),
        "weight_scale": scales.T.contiguous(),
        "weight_shape": torch.tensor([n_out, n_in], dtype=torch.int64),
    }
    if zero_points:
        by_output = zeros.T.reshape(n_out // 8, 8, zeros.shape[0]).permute(0, 2, 1)
        packed["weight_zero_point"] = pack(by_output)
    if desc_act:
        packed["weight_g_idx"] = g_idx
    return packed


def dequantize(stored: dict[str, torch.Tensor], method: str, group: int) -> torch.Tensor:
    """The weight ``[out, in]`` a module's packed tensors stand for, unpacked from them (not
    from the codes that made them): ``(code - zero) * scale`` of each input's group."""
    if method == "compressed":
        codes = unpack(stored["weight_packed"]).flatten(1)  # [out, in]
        scales = stored["weight_scale"].T.float()  # [groups, out]
        if "weight_zero_point" in stored:
            zeros = unpack(stored["weight_zero_point"]).permute(0, 2, 1).flatten(0, 1).T
        else:
            zeros = torch.full(scales.shape, 8, dtype=torch.int32)
        g_idx = stored.get("weight_g_idx")
        g_idx = g_idx.long() if g_idx is not None else torch.arange(codes.shape[1]) // group
        return (codes.float() - zeros[g_idx].T.float()) * scales[g_idx].T
    if method == "gptq":
        fields = unpack(stored["qweight"])  # [in/8, out, 8]
        codes = fields.permute(0, 2, 1).reshape(-1, fields.shape[1]).T  # [out, in]
        zeros = unpack(stored["qzeros"]).flatten(1) + 1  # [groups, out]
        g_idx = stored["g_idx"].long()
    else:
        inverse = torch.argsort(torch.tensor(AWQ_ORDER))
        fields = unpack(stored["qweight"])[..., inverse]  # [in, out/8, 8]
        codes = fields.flatten(1).T
        zeros = unpack(stored["qzeros"])[..., inverse].flatten(1)
        g_idx = torch.arange(codes.shape[1]) // group
    scales = stored["scales"].float()
    return (codes.float() - zeros[g_idx].T.float()) * scales[g_idx].T


def same_input(name: str) -> str:
    """A key shared by the projections that read one input (q/k/v, gate/up)."""
    for siblings, key in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "gate_up")):
        for s in siblings:
            if f".{s}." in name:
                return name.replace(f".{s}.", f".{key}.")
    return name


def importance_of(tensors) -> dict:
    """Per input read by quantized projections (``same_input``): the sum over those
    projections' rows of |weight| for each input, and the number of rows."""
    sums = {}
    for name, w in tensors.items():
        if is_quantized(name, w.shape):
            total, rows = sums.get(same_input(name), (0.0, 0))
            sums[same_input(name)] = (total + w.float().abs().sum(dim=0), rows + w.shape[0])
    return sums


def convert_tensors(
    tensors, method: str, group: int, desc_act: bool, importance=None, zero_points=False
):
    """The stored tensors, and the dequantized value of every quantized weight; in act order
    the inputs ranked by ``importance`` (``importance_of`` over the whole checkpoint; this
    shard's when ``None``). ``zero_points``: compressed-tensors' asymmetric scheme."""
    stored, dequantized = {}, {}
    importance = importance or importance_of(tensors)
    for name, w in tensors.items():
        if not is_quantized(name, w.shape):
            stored[name] = w
            continue
        w = w.float()
        g = group if group > 0 else w.shape[1]
        total, rows = importance[same_input(name)]
        g_idx = groups_of(total / rows, g, desc_act)
        if method == "compressed":
            # Scales in the checkpoint's own float type, as llm-compressor stores them.
            codes, zeros, scales = quantize(w, g_idx, not zero_points, tensors[name].dtype)
            packed = pack_compressed(codes, zeros, scales, g_idx, zero_points, desc_act)
        elif method == "gptq":
            codes, zeros, scales = quantize(w, g_idx, sym=True)
            packed = pack_gptq(codes, zeros, scales, g_idx)
        else:
            codes, zeros, scales = quantize(w, g_idx, sym=False)
            packed = pack_awq(codes, zeros, scales)
        stem = name.removesuffix(".weight")
        stored.update({f"{stem}.{k}": v.contiguous() for k, v in packed.items()})
        dequantized[name] = dequantize(packed, method, g)
    return stored, dequantized


def int4_config(
    config: dict, method: str, group: int, desc_act: bool, zero_points=False, weight_order=False
) -> dict:
    """``weight_order``: compressed-tensors' ``actorder: "weight"`` (the quantization's order
    only; groups stay consecutive and no ``weight_g_idx`` is stored)."""
    config = dict(config)
    if method == "compressed":
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "input_activations": None,
                    "output_activations": None,
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": not zero_points,
                        "strategy": "group" if group > 0 else "channel",
                        "group_size": group if group > 0 else None,
                        "dynamic": False,
                        "actorder": "group" if desc_act else ("weight" if weight_order else None),
                        "observer": "minmax",
                        "observer_kwargs": {},
                        "block_structure": None,
                    },
                }
            },
            "ignore": ["lm_head"],
            "kv_cache_scheme": None,
            "sparsity_config": {},
        }
    elif method == "gptq":
        config["quantization_config"] = {
            "quant_method": "gptq",
            "bits": 4,
            "group_size": group,
            "desc_act": desc_act,
            "sym": True,
            "true_sequential": True,
            "checkpoint_format": "gptq",
            "static_groups": False,
            "lm_head": False,
        }
    else:
        config["quantization_config"] = {
            "quant_method": "awq",
            "bits": 4,
            "group_size": group,
            "zero_point": True,
            "version": "gemm",
        }
    return config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--method", choices=["gptq", "awq", "compressed"], required=True)
    ap.add_argument("--group", type=int, default=128, help="inputs a group; -1 for one group")
    ap.add_argument("--desc-act", action="store_true", help="act order (GPTQ, compressed)")
    ap.add_argument(
        "--zero-points", action="store_true", help="compressed-tensors' asymmetric scheme"
    )
    a = ap.parse_args()
    if a.desc_act and a.method == "awq":
        ap.error("--desc-act is GPTQ's and compressed-tensors'")
    if a.zero_points and a.method != "compressed":
        ap.error("--zero-points is compressed-tensors' (GPTQ is symmetric, AWQ has zero points)")
    # Act order ranks each input over every shard (projections of one input may be in two).
    importance = {}
    index = a.src / "model.safetensors.index.json"
    shards = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    for shard in shards if a.desc_act else []:
        for key, (total, rows) in importance_of(load_file(str(a.src / shard))).items():
            old_total, old_rows = importance.get(key, (0.0, 0))
            importance[key] = (old_total + total, old_rows + rows)
    convert_checkpoint(
        a.src,
        a.dst,
        lambda tensors: convert_tensors(
            tensors, a.method, a.group, a.desc_act, importance, a.zero_points
        ),
        lambda config: int4_config(config, a.method, a.group, a.desc_act, a.zero_points),
    )


if __name__ == "__main__":
    main()
