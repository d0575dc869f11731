#!/usr/bin/env python3
"""Make FP8 block-scaled copies of two fixtures (``quant_method: "fp8"``, the layout of the
Qwen3 and DeepSeek FP8 releases), with transformers' own reference outputs for them:
``llama-gqa-fp8`` (blocks of 8) and ``qwen3-moe-fp8`` (blocks of 16, experts included).

The conversion is ``scripts/quantize_fp8.py``'s: every decoder linear weight (q/k/v/o and
gate/up/down projections, each expert's too) in blocks of B × B, one float32 scale each;
embeddings, norms, routers and lm_head stay float32, as transformers leaves them.  B is a
head's width (8 and 16), as in real releases (128).

The reference is transformers loading that directory on the CPU, where it dequantizes FP8
weights (``weight.to(float32) * scale_inv`` per block) and computes in float32 with eager
attention: the prompt's prefill logits and the greedy continuation, for llama-gqa's prompt,
saved as ``reference.safetensors`` / ``reference.json`` in make_fixtures.py's format.  The
prompt is llama-gqa's unless quantization brings a greedy step within MIN_GREEDY_MARGIN of a
tie; then it is the first seeded random prompt of that length without one (seed recorded).

Regenerate (from the repository root, with torch, transformers and safetensors installed):

    python3 scripts/make_fp8_fixture.py                  # both
    python3 scripts/make_fp8_fixture.py qwen3-moe-fp8    # one
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
import quantize_fp8  # noqa: E402  (the conversion, shared with users' checkpoints)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "checkpoints"
# case → (the fixture it quantizes, block size)
CASES = {"llama-gqa-fp8": ("llama-gqa", 8), "qwen3-moe-fp8": ("qwen3-moe", 16)}
MIN_GREEDY_MARGIN = 0.1  # as make_fixtures.py: no near-tie at any greedy step
MAX_PROMPT_TRIES = 50


def write_checkpoint(SRC: Path, OUT: Path, BLOCK: int) -> dict[str, torch.Tensor]:
    """Writes the FP8 checkpoint; returns the dequantized weights it stands for."""
    OUT.mkdir(parents=True, exist_ok=True)
    stored, dequantized = quantize_fp8.convert_tensors(load_file(str(SRC / "model.safetensors")), BLOCK)
    save_file(stored, str(OUT / "model.safetensors"), metadata={"format": "pt"})
    config = quantize_fp8.fp8_config(json.loads((SRC / "config.json").read_text()), BLOCK)
    (OUT / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(SRC / "generation_config.json", OUT / "generation_config.json")
    return dequantized


@torch.no_grad()
def make(case: str) -> None:
    source, BLOCK = CASES[case]
    SRC, OUT = FIXTURES / source, FIXTURES / case
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dequantized = write_checkpoint(SRC, OUT, BLOCK)
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_fixtures  # the reference computations, shared with the other fixtures

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(OUT), dtype=torch.float32, **make_fixtures.impl_kwargs(model_config(OUT))
    ).eval()
    # transformers must hold exactly the weights this script dequantized (on a CPU it
    # dequantizes FP8 checkpoints as it loads them).
    held = held_weights(model)
    weight_diff = max(
        float((held[name].float() - w).abs().max()) for name, w in dequantized.items()
    )
    assert weight_diff == 0.0, f"transformers' dequantized weights differ by {weight_diff}"

    base = load_file(str(SRC / "reference.safetensors"))
    n_new = int(base["greedy_ids"].numel())
    prompt_seed, ids, new_ids, step_logits, margin = pick_prompt(model, base, n_new)
    logits = make_fixtures.prefill_logits(model, ids)
    assert torch.equal(new_ids, make_fixtures.greedy_no_cache(model, ids, n_new))
    # The f32 model on the same prompt, to show what quantization moved.
    f32 = transformers.AutoModelForCausalLM.from_pretrained(
        str(SRC), dtype=torch.float32, **make_fixtures.impl_kwargs(model_config(SRC))
    ).eval()
    f32_logits = make_fixtures.prefill_logits(f32, ids)
    f32_greedy, _ = make_fixtures.greedy(f32, ids, n_new)
    save_file(
        {
            "prompt_ids": ids,
            "logits": logits.contiguous(),
            "greedy_ids": new_ids.contiguous(),
            "greedy_logits": step_logits.contiguous(),
        },
        str(OUT / "reference.safetensors"),
        metadata={"format": "pt"},
    )
    info = {
        "case": case,
        "description": f"{source}'s weights as an FP8 e4m3 checkpoint with {BLOCK}x{BLOCK} block "
        "scales (quant_method fp8); reference: transformers dequantizing it on the CPU, f32 math",
        "command": "python3 scripts/make_fp8_fixture.py",
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "safetensors_version": safetensors.__version__,
        "python_version": platform.python_version(),
        "weight_block_size": [BLOCK, BLOCK],
        "attn_implementation": "eager",
        "math_dtype": "float32",
        "prompt_seed": prompt_seed,
        "prompt_ids": ids.tolist(),
        "n_new": n_new,
        "greedy_ids": new_ids.tolist(),
        "stats": {
            "max_abs_weight_diff_transformers_vs_ours": weight_diff,
            "max_abs_logit_diff_vs_the_f32_fixture": float((logits - f32_logits).abs().max()),
            "rel_logit_change_vs_the_f32_fixture": make_fixtures.rel_change(logits, f32_logits),
            "greedy_equals_the_f32_fixture": bool(torch.equal(new_ids, f32_greedy)),
            "min_greedy_margin": margin,
        },
    }
    (OUT / "reference.json").write_text(json.dumps(info, indent=2) + "\n")
    print(case, json.dumps(info["stats"], indent=2))


def pick_prompt(model, base: dict[str, torch.Tensor], n_new: int):
    """The source fixture's prompt, unless quantization brought a greedy step to a near-tie
    (which rounding could flip); then the first seeded prompt of its length without one.
    Returns (seed, prompt ids, greedy ids, their step logits, the smallest margin)."""
    import make_fixtures

    vocab = int(model.config.vocab_size)
    for prompt_seed in range(MAX_PROMPT_TRIES):
        if prompt_seed == 0:
            ids = base["prompt_ids"]
        else:
            gen = torch.Generator().manual_seed(prompt_seed)
            ids = torch.randint(0, vocab, base["prompt_ids"].shape, generator=gen)
        new_ids, step_logits = make_fixtures.greedy(model, ids, n_new)
        top2 = step_logits.topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        if margin >= MIN_GREEDY_MARGIN:
            return prompt_seed, ids, new_ids, step_logits, margin
    raise SystemExit(f"no prompt without a greedy near-tie in {MAX_PROMPT_TRIES} tries")


def model_config(path: Path):
    return transformers.AutoConfig.from_pretrained(str(path))


def held_weights(model) -> dict[str, torch.Tensor]:
    """The weights transformers holds, under the checkpoint's names: a model that holds its
    experts fused (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``) is
    taken apart into the per-expert tensors it was loaded from."""
    held = dict(model.state_dict())
    for name in [n for n in held if n.endswith("experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = held.pop(name), held.pop(prefix + "down_proj")
        inter = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            held[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter]
            held[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:]
            held[f"{prefix}{e}.down_proj.weight"] = down[e]
    return held


if __name__ == "__main__":
    for name in sys.argv[1:] or list(CASES):
        make(name)
