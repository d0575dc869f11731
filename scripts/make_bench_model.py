#!/usr/bin/env python3
"""Write a random-weight checkpoint with TinyLlama-1.1B's (or a Qwen3-MoE) shape, for speed benchmarks.

``--shape qwen3-moe`` writes a mixture of experts instead (issue 29's benchmark):
Qwen3MoeConfig with Qwen3-30B-A3B's attention (hidden 2048, 32 heads of 128, 4 kv heads) and
expert width (768), but 8 layers and 64 experts, 8 per token (renormalised), vocab 32000:
2,699,071,488 parameters (5.4 GB). Default output
``target/bench-model/qwen3-moe-random``.

The shape is TinyLlama/TinyLlama-1.1B-Chat-v1.0's published ``config.json``: LlamaConfig
with hidden 2048, 22 layers, 32 attention heads (head_dim 64), 4 kv heads, intermediate
5632, vocab 32000, max_position_embeddings 2048, rms_norm_eps 1e-5, rope_theta 10000,
untied embeddings, silu. 1,100,048,384 parameters.

The weights are random (transformers' default init: normal std 0.02 for linear and
embedding weights, ones for the RMSNorm weights), drawn after ``torch.manual_seed(SEED)``,
so reruns write the same tensors. They are stored in bfloat16 (~2.2 GB) as a real HF
checkpoint with a *sharded* index: ``save_pretrained(dir, max_shard_size="500MB")`` writes
``model-0000x-of-0000y.safetensors`` and ``model.safetensors.index.json``.

``eos_token_id`` is null (TinyLlama's is 2): the benchmark always generates a fixed number
of tokens, and ``tpc run`` stops at an eos id from config.json.

Default output: ``target/bench-model/tinyllama-1.1b-random`` (target/ is git-ignored; never
commit this). If the directory already holds a checkpoint with a matching config, nothing
is done; ``--force`` rewrites it.

    python3 scripts/make_bench_model.py
    python3 scripts/make_bench_model.py --out /tmp/tl --force
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

SEED = 20240101
DEFAULT_OUT = {
    "tinyllama": "target/bench-model/tinyllama-1.1b-random",
    "qwen3-moe": "target/bench-model/qwen3-moe-random",
}

# TinyLlama-1.1B's shape. Checked against the written config.json to decide whether an
# existing directory can be reused.
SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
ROPE_THETA = 10000.0

# The mixture of experts (see the module docs); rope_theta as Qwen3-30B-A3B.
MOE_SHAPE = {
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 64,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
MOE_ROPE_THETA = 1000000.0


def shape_of(kind: str) -> tuple[dict, float]:
    return (MOE_SHAPE, MOE_ROPE_THETA) if kind == "qwen3-moe" else (SHAPE, ROPE_THETA)


def make_moe_config() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **MOE_SHAPE,
        rope_parameters={"rope_type": "default", "rope_theta": MOE_ROPE_THETA},
        decoder_sparse_step=1,
        mlp_only_layers=[],
        attention_bias=False,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=None,
        dtype="bfloat16",
    )


def make_config() -> LlamaConfig:
    return LlamaConfig(
        **SHAPE,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        attention_bias=False,
        mlp_bias=False,
        initializer_range=0.02,
        bos_token_id=1,
        eos_token_id=None,
        pad_token_id=None,
        dtype="bfloat16",
    )


def rope_theta_of(cfg: dict) -> float | None:
    for key in ("rope_parameters", "rope_scaling"):
        block = cfg.get(key)
        if isinstance(block, dict) and "rope_theta" in block:
            return float(block["rope_theta"])
    return cfg.get("rope_theta")


def existing_matches(out: Path, kind: str) -> tuple[bool, str]:
    """Whether `out` holds a complete checkpoint of the wanted shape (and why not)."""
    shape, rope_theta = shape_of(kind)
    cfg_path = out / "config.json"
    index_path = out / "model.safetensors.index.json"
    if not cfg_path.is_file() or not index_path.is_file():
        return False, "no config.json or model.safetensors.index.json"
    try:
        cfg = json.loads(cfg_path.read_text())
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        return False, f"unreadable: {e}"
    for key, want in shape.items():
        # transformers 5.x writes Qwen3-MoE's expert count as num_local_experts.
        got = cfg.get(key, cfg.get("num_local_experts") if key == "num_experts" else None)
        if got != want:
            return False, f"config {key} = {got!r}, want {want!r}"
    if rope_theta_of(cfg) != rope_theta:
        return False, f"rope_theta = {rope_theta_of(cfg)!r}, want {rope_theta}"
    if cfg.get("dtype", cfg.get("torch_dtype")) != "bfloat16":
        return False, "not a bfloat16 checkpoint"
    shards = sorted(set(index.get("weight_map", {}).values()))
    if not shards:
        return False, "empty weight_map"
    missing = [s for s in shards if not (out / s).is_file()]
    if missing:
        return False, f"missing shards {missing}"
    return True, f"{len(shards)} shards"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(DEFAULT_OUT), default="tinyllama")
    ap.add_argument("--out", help="output directory (default: per shape, under target/bench-model/)")
    ap.add_argument("--force", action="store_true", help="rewrite even if a matching checkpoint exists")
    ap.add_argument("--max-shard-size", default="500MB")
    a = ap.parse_args()
    out = Path(a.out or DEFAULT_OUT[a.shape])

    ok, why = existing_matches(out, a.shape)
    if ok and not a.force:
        print(f"{out}: matching checkpoint already there ({why}); --force to rewrite")
        return 0
    if out.exists():
        print(f"{out}: rewriting ({'--force' if ok else why})")

    t0 = time.time()
    torch.manual_seed(SEED)
    if a.shape == "qwen3-moe":
        # Built in bfloat16 directly: 2.7 B parameters in float32 would take 11 GB.
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen3MoeForCausalLM(make_moe_config()).eval()
        torch.set_default_dtype(torch.float32)
    else:
        # Built in float32 (the default init's statistics), then stored in bfloat16.
        model = LlamaForCausalLM(make_config()).to(torch.bfloat16).eval()
    n_params = sum(p.numel() for p in model.parameters())
    t1 = time.time()

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, max_shard_size=a.max_shard_size)
    del model
    if not (tmp / "model.safetensors.index.json").is_file():
        print(f"save_pretrained wrote no sharded index in {tmp}", file=sys.stderr)
        return 1
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    ok, why = existing_matches(out, a.shape)
    if not ok:
        print(f"{out}: written checkpoint does not check out: {why}", file=sys.stderr)
        return 1
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(
        f"{out}: {n_params:,} parameters, bfloat16, {why}, {size / 1e9:.2f} GB "
        f"(seed {SEED}, init {t1 - t0:.1f} s, save {time.time() - t1:.1f} s; "
        f"transformers {transformers.__version__}, torch {torch.__version__})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
