#!/usr/bin/env python3
"""Make the INT4 fixtures: llama-gqa's weights packed as GPTQ (groups of 32, ``desc_act``
false), GPTQ in act order (``desc_act`` true: ``g_idx`` scatters each group along the
inputs), AWQ (GEMM packing, groups of 32) and compressed-tensors ``pack-quantized`` (W4A16,
groups of 32: symmetric; with zero points, ``actorder: "weight"``; with zero points in group
act order, ``weight_g_idx``) by
``scripts/quantize_int4.py``, each with a reference run of transformers on the weights it
stands for.

The reference is transformers' float32 Llama (eager attention) holding the dequantized
weights, unpacked from the stored tensors by quantize_int4.dequantize: the prompt's prefill
logits and the greedy continuation, saved as ``reference.safetensors`` / ``reference.json`` in
make_fixtures.py's format (``make_int8_fixture.save_quantized_fixture``). (transformers loads GPTQ and AWQ checkpoints only through the
gptqmodel / autoawq packages, which this script does not need.) Where the
``compressed-tensors`` package is installed, transformers also loads each compressed-tensors
fixture itself (decompressed, ``run_compressed=False``) and its prefill logits are compared
with the reference; the largest difference is recorded in ``reference.json``. (compressed-tensors
0.20 refuses ``actorder: "group"``, which earlier releases wrote and published checkpoints
carry, so the act-order fixture is checked against the reference only.) The prompt is llama-gqa's
unless quantization brings a greedy step near a tie; then it is the first seeded random prompt
of that length without one (seed recorded; ``make_fp8_fixture.pick_prompt``).

Regenerate (from the repository root, with torch, transformers and safetensors installed):

    python3 scripts/make_int4_fixtures.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_int8_fixture  # noqa: E402  (the checkpoint and reference writer, shared)
import quantize_int4  # noqa: E402  (the conversion, shared with users' checkpoints)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
SOURCE = "llama-gqa"
# (case, method, group, desc_act, zero_points, weight_order, what it is); compressed-tensors'
# actorder is "group" with desc_act, "weight" with weight_order.
CASES = [
    ("llama-gqa-gptq", "gptq", 32, False, False, False, "GPTQ, groups of 32 inputs, desc_act false"),
    ("llama-gqa-gptq-act", "gptq", 32, True, False, False, "GPTQ, groups of 32 inputs, desc_act true"),
    ("llama-gqa-awq", "awq", 32, False, False, False, "AWQ (GEMM packing), groups of 32 inputs"),
    (
        "llama-gqa-w4a16",
        "compressed",
        32,
        False,
        False,
        False,
        "compressed-tensors pack-quantized W4A16, symmetric, groups of 32 inputs",
    ),
    (
        "llama-gqa-w4a16-asym",
        "compressed",
        32,
        False,
        True,
        True,
        "compressed-tensors pack-quantized W4A16 with zero points, groups of 32 inputs, "
        "actorder weight",
    ),
    (
        "llama-gqa-w4a16-asym-act",
        "compressed",
        32,
        True,
        True,
        False,
        "compressed-tensors pack-quantized W4A16 with zero points, groups of 32 inputs in "
        "group act order",
    ),
]


def make(
    case: str,
    method: str,
    group: int,
    desc_act: bool,
    zero_points: bool,
    weight_order: bool,
    what: str,
) -> None:
    SRC, OUT = FIXTURES / SOURCE, FIXTURES / case
    torch.manual_seed(0)
    stored, dequantized = quantize_int4.convert_tensors(
        load_file(str(SRC / "model.safetensors")), method, group, desc_act, None, zero_points
    )
    config = quantize_int4.int4_config(
        json.loads((SRC / "config.json").read_text()),
        method,
        group,
        desc_act,
        zero_points,
        weight_order=weight_order,
    )
    make_int8_fixture.save_quantized_fixture(
        SRC,
        OUT,
        stored,
        dequantized,
        config,
        case,
        f"an INT4 checkpoint ({what})",
        "python3 scripts/make_int4_fixtures.py",
    )
    if method == "compressed" and not desc_act:
        make_int8_fixture.check_transformers_own_load(OUT)


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    only = set(sys.argv[1:])
    for case in CASES:
        if not only or case[0] in only:
            make(*case)


if __name__ == "__main__":
    main()
