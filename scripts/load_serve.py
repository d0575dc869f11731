#!/usr/bin/env python3
"""A small load generator for `tpc serve` (standard library only): N completions of
PROMPT_LEN random token ids and MAX_TOKENS new tokens each (greedy, EOS ignored), at most C
in flight, against one server; prints one JSON line: output tokens/s over the wall time and
the requests' latencies. For quick comparisons on machines without vLLM's load generator
(`scripts/bench_serve.sh` is the full benchmark against vLLM):

    python3 scripts/load_serve.py --url http://127.0.0.1:8000 --requests 16 --concurrency 8
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
import urllib.request


def complete(url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[int, float]:
    body = json.dumps(
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
    ).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", data=body, headers={"content-type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as resp:
        answer = json.load(resp)
    return answer["usage"]["completion_tokens"], time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="")
    a = ap.parse_args()
    if min(a.requests, a.concurrency, a.prompt_len, a.max_tokens) < 1:
        print("every count must be at least 1", file=sys.stderr)
        return 2
    with urllib.request.urlopen(f"{a.url}/v1/models", timeout=60) as resp:
        model = json.load(resp)["data"][0]["id"]
    rng = random.Random(a.seed)
    # Ids from 1 to 999: inside any vocabulary the benchmark models have.
    prompts = [[rng.randrange(1, 1000) for _ in range(a.prompt_len)] for _ in range(a.requests)]
    results: list[tuple[int, float]] = []
    errors: list[str] = []
    lock = threading.Lock()
    slots = threading.Semaphore(a.concurrency)

    def one(prompt: list[int]) -> None:
        try:
            r = complete(a.url, model, prompt, a.max_tokens)
            with lock:
                results.append(r)
        except Exception as e:  # noqa: BLE001 - reported, not raised, so the others finish
            with lock:
                errors.append(str(e))
        finally:
            slots.release()

    threads = []
    start = time.perf_counter()
    for p in prompts:
        slots.acquire()
        t = threading.Thread(target=one, args=(p,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies = sorted(s for _, s in results)
    tokens = sum(n for n, _ in results)
    pick = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else None
    print(
        json.dumps(
            {
                "label": a.label,
                "requests": a.requests,
                "concurrency": a.concurrency,
                "prompt_len": a.prompt_len,
                "max_tokens": a.max_tokens,
                "completed": len(results),
                "errors": errors[:3],
                "wall_s": round(wall, 3),
                "output_tokens_per_s": round(tokens / wall, 2),
                "latency_p50_s": pick(0.5),
                "latency_p99_s": pick(0.99),
            }
        )
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
