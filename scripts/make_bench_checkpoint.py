#!/usr/bin/env python3
"""Write a random bf16 checkpoint with TinyLlama-1.1B's shape using only the standard library.

For load-time benchmarks (`tpc bench-load`) on machines without torch: same tensor names,
shapes, dtype and sharded layout as ``scripts/make_bench_model.py`` (``save_pretrained`` with
``max_shard_size="500MB"``), but not the same values. Linear and embedding weights are drawn
from normal(0, 0.02) (a pool of 2^22 draws, each tensor a run of it from a seeded random
offset); RMSNorm weights are ones. ~2.2 GB.

Default output: ``target/bench-model/tinyllama-1.1b-stdlib`` (git-ignored; never commit it).
An existing directory with every shard is left alone unless ``--force``.

    python3 scripts/make_bench_checkpoint.py
    python3 scripts/make_bench_checkpoint.py --out /tmp/tl --force
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import struct
import sys
import time
from pathlib import Path

SEED = 20240101
DEFAULT_OUT = "target/bench-model/tinyllama-1.1b-stdlib"
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2048, 22, 32, 4, 64
INTERMEDIATE, VOCAB = 5632, 32000
SHARD_BYTES = 500 * 1000 * 1000
POOL = 1 << 22

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "dtype": "bfloat16",
    "eos_token_id": None,
    "head_dim": HEAD_DIM,
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "initializer_range": 0.02,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 2048,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": HEADS,
    "num_hidden_layers": LAYERS,
    "num_key_value_heads": KV_HEADS,
    "pad_token_id": None,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": VOCAB,
}


def tensors() -> list[tuple[str, list[int]]]:
    """(name, shape) in save_pretrained's order."""
    out = [("model.embed_tokens.weight", [VOCAB, HIDDEN])]
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", [HIDDEN]),
            (p + "mlp.down_proj.weight", [HIDDEN, INTERMEDIATE]),
            (p + "mlp.gate_proj.weight", [INTERMEDIATE, HIDDEN]),
            (p + "mlp.up_proj.weight", [INTERMEDIATE, HIDDEN]),
            (p + "post_attention_layernorm.weight", [HIDDEN]),
            (p + "self_attn.k_proj.weight", [kv, HIDDEN]),
            (p + "self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM]),
            (p + "self_attn.q_proj.weight", [HEADS * HEAD_DIM, HIDDEN]),
            (p + "self_attn.v_proj.weight", [kv, HIDDEN]),
        ]
    out += [("model.norm.weight", [HIDDEN]), ("lm_head.weight", [VOCAB, HIDDEN])]
    return out


def bf16_bits(x: float) -> int:
    """Round-to-nearest-even float32 -> bfloat16 bits (finite inputs)."""
    (b,) = struct.unpack("<I", struct.pack("<f", x))
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def write_shard(path: Path, items: list[tuple[str, list[int]]], pool: bytes, rng: random.Random) -> None:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in items:
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    ones = struct.pack("<H", bf16_bits(1.0))
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, shape in items:
            n = 2
            for d in shape:
                n *= d
            if len(shape) == 1:
                f.write(ones * (n // 2))
                continue
            start = rng.randrange(POOL) * 2
            while n > 0:
                run = pool[start : start + n]
                f.write(run)
                n -= len(run)
                start = 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--force", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file() and not a.force:
        shards = set(json.loads(index_path.read_text())["weight_map"].values())
        if all((out / s).is_file() for s in shards):
            print(f"{out}: already there ({len(shards)} shards); --force to rewrite")
            return 0

    t0 = time.time()
    rng = random.Random(SEED)
    pool = b"".join(struct.pack("<H", bf16_bits(rng.gauss(0.0, 0.02))) for _ in range(POOL))

    # Greedy shards of at most SHARD_BYTES, as save_pretrained does.
    shards: list[list[tuple[str, list[int]]]] = [[]]
    size = 0
    for name, shape in tensors():
        n = 2
        for d in shape:
            n *= d
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += n

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weight_map = {}
    total = 0
    for i, items in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(tmp / fname, items, pool, rng)
        total += (tmp / fname).stat().st_size
        weight_map.update({name: fname for name, _ in items})
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (tmp / "config.json").write_text(json.dumps(CONFIG, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"{out}: {len(shards)} shards, {total / 1e9:.2f} GB, {time.time() - t0:.1f} s (seed {SEED})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
