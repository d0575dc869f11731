#!/usr/bin/env python3
"""Check the INT4 fixtures' packing against the formats' own libraries: every quantized
weight of ``llama-gqa-gptq`` and ``llama-gqa-gptq-act`` dequantized by AutoGPTQ's
``QuantLinear`` (``qlinear_cuda``'s torch path, which honours ``g_idx``), and of
``llama-gqa-awq`` by AutoAWQ's ``dequantize_gemm``, against ``quantize_int4.dequantize``, which
made the fixtures' references (and so against what tpc reads, which matches them).

Neither library is needed by the tests; this loads their modules from their distributions,
unpacked into a folder (their package ``__init__``s pull in transformers versions they predate,
so the two modules are loaded by path):

    pip download --no-deps auto-gptq==0.7.1 autoawq==0.2.9 -d /tmp/q
    (cd /tmp/q && unzip -q auto_gptq-*.whl -d agptq && tar xzf autoawq-0.2.9.tar.gz)
    python3 scripts/check_int4_packing.py /tmp/q

Checked 2026-12-05 with torch 2.13: GPTQ within f16 rounding (max relative difference
3.8e-4: AutoGPTQ multiplies in f16), AWQ exactly (0).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quantize_int4  # noqa: E402

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "checkpoints"


def module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def modules(t: dict) -> list[str]:
    return [n.removesuffix(".qweight") for n in t if n.endswith(".qweight")]


@torch.no_grad()
def main() -> None:
    root = Path(sys.argv[1])
    gptq = module(root / "agptq/auto_gptq/nn_modules/qlinear/qlinear_cuda.py")
    awq = module(root / "autoawq-0.2.9/awq/utils/packing_utils.py")
    worst = {}
    for case in ["llama-gqa-gptq", "llama-gqa-gptq-act"]:
        t = load_file(str(FIXTURES / case / "model.safetensors"))
        for stem in modules(t):
            parts = {k: t[f"{stem}.{k}"] for k in ["qweight", "qzeros", "scales", "g_idx"]}
            n_in, n_out = parts["qweight"].shape[0] * 8, parts["qweight"].shape[1]
            lin = gptq.QuantLinear(4, 32, n_in, n_out, bias=False)
            for k, v in parts.items():
                setattr(lin, k, v)
            theirs = lin(torch.eye(n_in, dtype=torch.float16)).float().T
            ours = quantize_int4.dequantize(parts, "gptq", 32)
            rel = float((theirs - ours).abs().max() / ours.abs().max())
            worst[case] = max(worst.get(case, 0.0), rel)
    t = load_file(str(FIXTURES / "llama-gqa-awq" / "model.safetensors"))
    for stem in modules(t):
        parts = {k: t[f"{stem}.{k}"] for k in ["qweight", "qzeros", "scales"]}
        theirs = awq.dequantize_gemm(
            parts["qweight"], parts["qzeros"], parts["scales"].float(), 4, 32
        ).T
        ours = quantize_int4.dequantize(parts, "awq", 32)
        worst["llama-gqa-awq"] = max(worst.get("llama-gqa-awq", 0.0), float((theirs - ours).abs().max()))
    for case, diff in worst.items():
        print(f"{case}: max difference {diff:.3g}")
    assert worst["llama-gqa-gptq"] < 1e-3 and worst["llama-gqa-gptq-act"] < 1e-3
    assert worst["llama-gqa-awq"] == 0.0


if __name__ == "__main__":
    main()
