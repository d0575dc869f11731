#!/usr/bin/env python3
"""Prefill and decode speed of Hugging Face transformers on a GPU, the workload of `tpc bench`.

    python3 scripts/bench_torch_gpu.py models/llama3-8b.ron --batch 1 16
    python3 scripts/bench_torch_gpu.py models/tiny-llama.ron --device cpu --batch 1 \\
        --prompt-len 16 --max-new-tokens 4 --repeat 1

The model is a `LlamaForCausalLM` with random bf16 weights built on the device from the
shape in a tpc preset (.ron, family Llama only), with ``attn_implementation="sdpa"``.
For each batch size B it times what `tpc bench` times:

* prefill: one forward of B prompts of --prompt-len ids with ``use_cache=True`` and
  ``logits_to_keep=1``; prefill tokens/s = B * prompt_len / time. The ids are tpc bench's,
  ``(i * 7919 + b * 104729) % vocab`` for sequence b (sequence 0 is ``(i * 7919) % vocab``);
* decode: the greedy single-token steps after the first new token (picked from the prefill
  logits), i.e. max_new_tokens - 1 steps; decode tokens/s = B * steps / time.

``torch.cuda.synchronize()`` brackets each timed part. The argmax stays on the device
between steps (no per-step copy to the host), which is the fastest a plain Python loop
over transformers gets. --warmup untimed generations, then --repeat timed ones; each column
is the best repetition. Loading (building the random model) is not timed.

It also measures device copy bandwidth first: ``dst.copy_(src)`` of a --copy-gib GiB
buffer, best of several, (bytes read + bytes written) / time, which is the bandwidth the
device check uses for the decode bound.

Prints one JSON line per batch size.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

# transformers 5.2x renamed forward's `past_key_values` to `cache`; use whichever exists.
_FWD = inspect.signature(LlamaForCausalLM.forward).parameters
CACHE_ARG = "cache" if "cache" in _FWD else "past_key_values"
# `logits_to_keep` was `num_logits_to_keep` before transformers 4.50.
KEEP_ARG = "logits_to_keep" if "logits_to_keep" in _FWD else "num_logits_to_keep"


def read_preset(path: str) -> dict:
    """The scalar fields of a tpc `Preset(...)` file, plus its llama3 rope scaling if any.

    Only what a Llama needs; tpc's own parser is the authority, this only has to agree on
    the shapes, which the caller prints so a mismatch is visible.
    """
    text = re.sub(r"//[^\n]*", "", open(path).read())
    fields = {}
    for key, value in re.findall(r"^\s*(\w+)\s*:\s*([^,(\[\n]+?)\s*,?\s*$", text, re.M):
        value = value.strip().strip('"')
        if re.fullmatch(r"-?\d+", value):
            fields[key] = int(value)
        elif re.fullmatch(r"-?[\d.]+(e-?\d+)?", value):
            fields[key] = float(value)
        elif value in ("true", "false"):
            fields[key] = value == "true"
        else:
            fields[key] = value
    m = re.search(r"rope_scaling\s*:\s*Llama3\s*\(([^)]*)\)", text)
    if m:
        fields["rope_scaling"] = {
            "rope_type": "llama3",
            **{k: float(v) for k, v in re.findall(r"(\w+)\s*:\s*([\d.e-]+)", m.group(1))},
        }
        ompe = fields["rope_scaling"].get("original_max_position_embeddings")
        if ompe is not None:
            fields["rope_scaling"]["original_max_position_embeddings"] = int(ompe)
    elif re.search(r"rope_scaling\s*:", text):
        raise SystemExit(f"{path}: only Llama3 rope scaling is supported here")
    if fields.get("family") != "Llama":
        raise SystemExit(f"{path}: family {fields.get('family')!r}; this script builds Llama only")
    return fields


def llama_config(p: dict) -> LlamaConfig:
    heads = p["num_attention_heads"]
    kw = dict(
        vocab_size=p["vocab_size"],
        hidden_size=p["hidden_size"],
        intermediate_size=p["intermediate_size"],
        num_hidden_layers=p["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=p.get("num_key_value_heads", heads),
        head_dim=p.get("head_dim", p["hidden_size"] // heads),
        max_position_embeddings=p["max_position_embeddings"],
        rms_norm_eps=p.get("norm_eps", 1e-5),
        tie_word_embeddings=p.get("tie_word_embeddings", False),
        attention_bias=p.get("attention_bias", False),
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    theta = float(p.get("rope_theta", 10000.0))
    rope = {"rope_type": "default", **p.get("rope_scaling", {}), "rope_theta": theta}
    # transformers 5.x keeps rope_theta inside rope_parameters; 4.x took rope_theta and rope_scaling.
    if "rope_parameters" in inspect.signature(LlamaConfig.__init__).parameters:
        cfg = LlamaConfig(**kw, rope_parameters=rope)
    else:
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        cfg = LlamaConfig(**kw, rope_theta=theta, rope_scaling=None if scaling["rope_type"] == "default" else scaling)
    return cfg


def build_model(cfg: LlamaConfig, device: torch.device, dtype: torch.dtype):
    # Built directly on the device so 16 GB of weights never pass through host memory.
    with warnings.catch_warnings(), torch.device(device):
        warnings.simplefilter("ignore")
        try:
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype)
        except TypeError:  # transformers 4.x spells it torch_dtype
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", torch_dtype=dtype)
    model = model.to(device=device, dtype=dtype).eval()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        print(f"bench_torch_gpu.py: attention implementation is {impl!r}, not sdpa", file=sys.stderr)
    return model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, gib: float, reps: int) -> float:
    """Best (bytes read + bytes written) / s of one dst.copy_(src) over `reps` tries."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    src.fill_(7)
    dst = torch.empty_like(src)
    best = float("inf")
    for i in range(reps + 2):  # the first two are warm-up
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        dt = time.perf_counter() - t0
        if i >= 2:
            best = min(best, dt)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * n / best


@torch.inference_mode()
def generate(model, ids: torch.Tensor, n_new: int, device: torch.device):
    """Greedy generation of a batch; returns (tokens of sequence 0, prefill s, decode s)."""
    sync(device)
    t0 = time.perf_counter()
    out = model(input_ids=ids, use_cache=True, **{KEEP_ARG: 1})
    sync(device)
    t1 = time.perf_counter()
    past = getattr(out, CACHE_ARG)
    tok = out.logits[:, -1].argmax(-1, keepdim=True)
    new = [tok]
    sync(device)
    t2 = time.perf_counter()
    for _ in range(n_new - 1):
        out = model(input_ids=tok, use_cache=True, **{CACHE_ARG: past})
        past = getattr(out, CACHE_ARG)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        new.append(tok)
    sync(device)
    t3 = time.perf_counter()
    first_seq = torch.cat(new, dim=1)[0].tolist() if n_new > 0 else []
    return first_seq, t1 - t0, t3 - t2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="tpc preset (.ron), family Llama")
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="batch sizes, one JSON line each")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--copy-gib", type=float, default=None, help="copy-bandwidth buffer (default 4 GiB on a GPU, 0.25 on the CPU; 0 skips)")
    ap.add_argument("--copy-reps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_torch_gpu.py: torch sees no CUDA device")
    dtype = getattr(torch, a.dtype)
    torch.manual_seed(a.seed)

    gib = a.copy_gib if a.copy_gib is not None else (4.0 if device.type == "cuda" else 0.25)
    bandwidth = copy_bandwidth(device, gib, a.copy_reps) if gib > 0 else None
    if bandwidth:
        print(f"bench_torch_gpu.py: copy bandwidth {bandwidth / 1e9:.1f} GB/s ({gib} GiB buffer)", file=sys.stderr)

    preset = read_preset(a.model)
    cfg = llama_config(preset)
    t0 = time.perf_counter()
    model = build_model(cfg, device, dtype)
    sync(device)
    load_s = time.perf_counter() - t0
    params = {id(p): p for p in model.parameters()}.values()  # a tied weight once
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    shape = {k: preset.get(k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size", "rope_theta", "max_position_embeddings",
                                        "tie_word_embeddings")}
    print(f"bench_torch_gpu.py: {preset.get('name')} {shape}, {weight_bytes / 1e9:.3f} GB of weights, built in {load_s:.1f} s",
          file=sys.stderr)

    vocab = cfg.vocab_size
    n_decode = max(a.max_new_tokens - 1, 0)
    for batch in a.batch:
        ids = torch.tensor(
            [[(i * 7919 + b * 104_729) % vocab for i in range(a.prompt_len)] for b in range(batch)],
            dtype=torch.long, device=device,
        )
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(a.warmup):
            generate(model, ids, a.max_new_tokens, device)
        prefill, decode, gen = [], [], []
        for _ in range(a.repeat):
            gen, p, d = generate(model, ids, a.max_new_tokens, device)
            prefill.append(batch * a.prompt_len / p)
            decode.append(batch * n_decode / d if n_decode > 0 else 0.0)
        record = {
            "engine": "torch",
            "model": preset.get("name"),
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": a.dtype,
            "attn": getattr(model.config, "_attn_implementation", None),
            "batch": batch,
            "prompt_len": a.prompt_len,
            "max_new_tokens": a.max_new_tokens,
            "prefill_tokens_per_s": max(prefill),
            "decode_tokens_per_s": max(decode),
            "stat": f"best of {a.repeat} after {a.warmup} warm-up",
            "prefill_all": prefill,
            "decode_all": decode,
            "weight_bytes": weight_bytes,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "copy_gib": gib,
            "generated_seq0": gen,
            "load_seconds": load_s,
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
        print(json.dumps(record), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
