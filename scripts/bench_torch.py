#!/usr/bin/env python3
"""Prefill and decode speed of Hugging Face transformers (torch, CPU) on one checkpoint.

The workload is the one `scripts/bench_vs_torch.sh` gives `tpc run`: batch 1, a fixed
prompt of --prompt-len token ids (default 128), ``(i * 7919) % 32000``, then NEW_TOKENS greedy
new tokens (argmax, no eos).

* prefill tokens/s = prompt length / wall time of one forward of the prompt with
  ``use_cache=True`` and ``logits_to_keep=1`` (the last position's logits only, as HF's
  ``generate`` and `tpc run` compute them);
* decode tokens/s = 15 / wall time of the 15 single-token forwards (each with
  the KV cache, followed by the argmax) after the first new token, which is picked
  from the prefill logits. `tpc run` times exactly these steps.

Loading is not timed. One untimed warm-up generation runs first, then REPS timed ones; each
column reports the best (fastest) repetition, and the per-repetition numbers are in
``prefill_all``/``decode_all``. Prints one JSON line.

The model is loaded with ``dtype`` = bfloat16 or float32 (the checkpoint's bf16 weights
upcast) and ``attn_implementation`` = sdpa (default) or eager. sdpa is the default because it
was the faster one here: on the 2-core AMD EPYC (Zen 3, AVX2, no AVX-512/AMX) this was
written on, float32, best of 3, alternating runs on a busy machine, eager gave 10.9 / 12.0
prefill and 0.64 / 0.86 decode tokens/s, sdpa 12.3 / 51.5 prefill and 1.23 / 4.08 decode
(the spread is the machine's other load; sdpa won every pairing, decode by about 2x).

    python3 scripts/bench_torch.py target/bench-model/tinyllama-1.1b-random --dtype float32
    python3 scripts/bench_torch.py DIR --dtype bfloat16 --threads 2 --reps 3 --attn eager
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaForCausalLM

PROMPT_LEN = 128
NEW_TOKENS = 16
VOCAB = 32000


def prompt_ids() -> list[int]:
    return [(i * 7919) % VOCAB for i in range(PROMPT_LEN)]


# transformers 5.2x renamed forward's `past_key_values` argument and output to `cache`
# (the old name still works, with a FutureWarning); use whichever this version has.
CACHE_ARG = (
    "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
)


def cache_of(out):
    return getattr(out, CACHE_ARG)


@torch.inference_mode()
def generate(model, ids: list[int], n_new: int) -> tuple[list[int], float, float]:
    """Greedy generation; returns (tokens, prefill seconds, decode seconds)."""
    x = torch.tensor([ids], dtype=torch.long)
    t0 = time.perf_counter()
    out = model(input_ids=x, use_cache=True, logits_to_keep=1)
    t1 = time.perf_counter()
    past = cache_of(out)
    tok = out.logits[0, -1].argmax()
    generated = [int(tok)]
    t2 = time.perf_counter()
    while len(generated) < n_new:
        out = model(input_ids=tok.view(1, 1), use_cache=True, **{CACHE_ARG: past})
        past = cache_of(out)
        tok = out.logits[0, -1].argmax()
        generated.append(int(tok))
    t3 = time.perf_counter()
    return generated, t1 - t0, t3 - t2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="HF checkpoint directory")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt ids (default 128)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (default 3)")
    ap.add_argument("--attn", choices=["sdpa", "eager"], default="sdpa")
    ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    a = ap.parse_args()
    global PROMPT_LEN
    PROMPT_LEN = a.prompt_len

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    t0 = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = AutoModelForCausalLM.from_pretrained(
            a.model, dtype=dtype, attn_implementation=a.attn
        ).eval()
    load_s = time.perf_counter() - t0
    for w in caught:
        print(f"bench_torch.py: warning while loading: {w.message}", file=sys.stderr)
    assert next(model.parameters()).dtype == dtype, next(model.parameters()).dtype

    ids = prompt_ids()
    n_decode = a.new_tokens - 1
    warm, _, _ = generate(model, ids, a.new_tokens)
    prefill, decode = [], []
    for _ in range(a.reps):
        gen, p, d = generate(model, ids, a.new_tokens)
        if gen != warm:
            print(f"bench_torch.py: repetition generated {gen}, warm-up {warm}", file=sys.stderr)
        prefill.append(PROMPT_LEN / p)
        decode.append(n_decode / d if n_decode > 0 else 0.0)
    print(
        json.dumps(
            {
                "engine": "torch",
                "dtype": a.dtype,
                "threads": a.threads,
                "attn": a.attn,
                "prefill_tokens_per_s": max(prefill),
                "decode_tokens_per_s": max(decode),
                "generated": warm,
                "stat": f"best of {a.reps} after 1 warm-up",
                "prefill_all": prefill,
                "decode_all": decode,
                "load_seconds": load_s,
                # Peak resident size of the whole process (ru_maxrss is KiB on Linux).
                "peak_resident_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
