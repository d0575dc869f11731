#!/usr/bin/env python3
"""Make ``llama-gqa-int8``: llama-gqa's weights as an INT8 checkpoint with a scale per output
channel in the compressed-tensors layout (``scripts/quantize_int8.py``), with a reference run
of transformers on the weights it stands for; and ``llama-gqa-w8a16``, the same as
llm-compressor's W8A16 (``format: "pack-quantized"``: four values to an int32, each plus 128).
Where the ``compressed-tensors`` package is installed, transformers also loads
``llama-gqa-w8a16`` itself (``check_transformers_own_load``).

The reference is transformers' float32 Llama (eager attention) holding the dequantized
weights (``int8 × scale`` per row, computed here): the prompt's prefill logits and the greedy
continuation, saved as ``reference.safetensors`` / ``reference.json`` in make_fixtures.py's
format. (transformers loads compressed-tensors checkpoints only with the
``compressed-tensors`` package, which this script does not need.) The prompt is llama-gqa's
unless quantization brings a greedy step near a tie; then it is the first seeded random prompt
of that length without one (seed recorded; ``make_fp8_fixture.pick_prompt``).

Regenerate (from the repository root, with torch, transformers and safetensors installed):

    python3 scripts/make_int8_fixture.py
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

import safetensors
import torch
import transformers
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_fixtures  # noqa: E402  (the reference computations, shared with the other fixtures)
import make_fp8_fixture  # noqa: E402  (the choice of prompt, shared with the FP8 fixtures)
import quantize_int8  # noqa: E402  (the conversion, shared with users' checkpoints)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
SOURCE, CASE, PACKED_CASE = "llama-gqa", "llama-gqa-int8", "llama-gqa-w8a16"


@torch.no_grad()
def save_quantized_fixture(
    src: Path, out: Path, stored, dequantized, config: dict, case: str, what: str, command: str
) -> None:
    """Writes the quantized checkpoint (``stored`` tensors, ``config``; ``what`` it is, for the
    description) to ``out`` and its reference: transformers' f32 model from ``src`` holding the
    ``dequantized`` weights, on the prompt ``make_fp8_fixture.pick_prompt`` chooses (shared
    with make_int4_fixtures.py)."""
    description = (
        f"{src.name}'s weights as {what}; reference: transformers' f32 model holding the "
        "dequantized weights"
    )
    out.mkdir(parents=True, exist_ok=True)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(src / "generation_config.json", out / "generation_config.json")

    kwargs = make_fixtures.impl_kwargs(transformers.AutoConfig.from_pretrained(str(src)))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(src), dtype=torch.float32, **kwargs
    ).eval()
    f32_state = {k: v.clone() for k, v in model.state_dict().items()}
    missing = set(dequantized) - set(f32_state)
    assert not missing, f"weights transformers does not hold: {missing}"
    model.load_state_dict({**f32_state, **dequantized})

    base = load_file(str(src / "reference.safetensors"))
    n_new = int(base["greedy_ids"].numel())
    prompt_seed, ids, new_ids, step_logits, margin = make_fp8_fixture.pick_prompt(
        model, base, n_new
    )
    logits = make_fixtures.prefill_logits(model, ids)
    assert torch.equal(new_ids, make_fixtures.greedy_no_cache(model, ids, n_new))
    model.load_state_dict(f32_state)
    f32_logits = make_fixtures.prefill_logits(model, ids)
    f32_greedy, _ = make_fixtures.greedy(model, ids, n_new)
    save_file(
        {
            "prompt_ids": ids,
            "logits": logits.contiguous(),
            "greedy_ids": new_ids.contiguous(),
            "greedy_logits": step_logits.contiguous(),
        },
        str(out / "reference.safetensors"),
        metadata={"format": "pt"},
    )
    info = {
        "case": case,
        "description": description,
        "command": command,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "python_version": platform.python_version(),
        "attn_implementation": "eager",
        "math_dtype": "float32",
        "prompt_seed": prompt_seed,
        "prompt_ids": ids.tolist(),
        "n_new": n_new,
        "greedy_ids": new_ids.tolist(),
        "stats": {
            "max_abs_logit_diff_vs_the_f32_fixture": float((logits - f32_logits).abs().max()),
            "rel_logit_change_vs_the_f32_fixture": make_fixtures.rel_change(logits, f32_logits),
            "greedy_equals_the_f32_fixture": bool(torch.equal(new_ids, f32_greedy)),
            "min_greedy_margin": margin,
        },
    }
    (out / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    print(case, json.dumps(info["stats"], indent=2))


@torch.no_grad()
def check_transformers_own_load(out: Path) -> None:
    """Loads the fixture in ``out`` with transformers itself (through the compressed-tensors
    package, decompressed) and records the largest difference of its prefill logits from the
    reference's."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        print(out.name, "compressed-tensors is not installed: transformers' own load not checked")
        return
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out),
        dtype=torch.float32,
        quantization_config=transformers.CompressedTensorsConfig(run_compressed=False),
        **make_fixtures.impl_kwargs(transformers.AutoConfig.from_pretrained(str(out))),
    ).eval()
    ref = load_file(str(out / "reference.safetensors"))
    logits = make_fixtures.prefill_logits(model, ref["prompt_ids"])
    diff = float((logits - ref["logits"]).abs().max())
    info = json.loads((out / "reference.json").read_text())
    info["stats"]["max_abs_logit_diff_transformers_own_load"] = diff
    info["compressed_tensors_version"] = compressed_tensors.__version__
    (out / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    print(out.name, "transformers' own load: max |logit diff|", diff)
    assert diff < 1e-4, f"transformers' own load differs by {diff}"


def main() -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    only = set(sys.argv[1:])
    for case, packed, fmt in [(CASE, False, "int-quantized"), (PACKED_CASE, True, "pack-quantized")]:
        if only and case not in only:
            continue
        SRC, OUT = FIXTURES / SOURCE, FIXTURES / case
        torch.manual_seed(0)
        stored, dequantized = quantize_int8.convert_tensors(
            load_file(str(SRC / "model.safetensors")), packed
        )
        config = quantize_int8.int8_config(json.loads((SRC / "config.json").read_text()), packed)
        save_quantized_fixture(
            SRC,
            OUT,
            stored,
            dequantized,
            config,
            case,
            f"an INT8 checkpoint with a scale per output channel (compressed-tensors, {fmt})",
            "python3 scripts/make_int8_fixture.py" + (f" {case}" if packed else ""),
        )
        if packed:
            check_transformers_own_load(OUT)


if __name__ == "__main__":
    main()
