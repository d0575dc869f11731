#!/usr/bin/env python3
"""Compare logits that `tpc run --dump-logits` wrote with a fixture's reference.

    check_logits.py LOGITS.safetensors FIXTURE_DIR TOL TOKENS [--tokens-optional]

LOGITS holds tensor `logits` (f32, [prompt_len, vocab]); FIXTURE_DIR is one of
tests/fixtures/checkpoints/*/ (its reference.safetensors has `logits` and `greedy_ids`);
TOKENS is the comma-separated line of generated ids that `tpc run` printed ("" if none).

The metric is the relative error ||a - b||_2 / ||b||_2 over all logits, accumulated in f64.
It passes when that is at most TOL and, unless --tokens-optional, the tokens equal
`greedy_ids`. Prints one line, `PASS ...` or `FAIL ...` with `key=value` fields that
scripts/device_check.sh reads (`rel_err=`, `tokens=match|differ|none`), and exits 0 or 1.

Needs numpy; the `safetensors` package is used when installed, else a small reader below
(the format is an 8-byte header length, a JSON header and raw little-endian data).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

# safetensors dtype names -> numpy, for the fallback reader. BF16 is widened by hand.
_NP_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "U8": np.uint8,
}


def _read_raw(path: str) -> dict[str, np.ndarray]:
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    data = memoryview(blob)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        shape = info["shape"]
        if info["dtype"] == "BF16":
            bits = np.frombuffer(data[lo:hi], dtype="<u2").astype(np.uint32) << 16
            arr = bits.view(np.float32)
        else:
            arr = np.frombuffer(data[lo:hi], dtype=np.dtype(_NP_DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(shape)
    return out


def read_tensors(path: str) -> dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file
    except ImportError:
        return _read_raw(path)
    try:
        return load_file(path)
    except (TypeError, ValueError):
        # numpy has no bfloat16: the package refuses BF16 tensors, the fallback widens them.
        return _read_raw(path)


def parse_tokens(text: str) -> list[int]:
    text = text.strip().strip("[]")
    return [int(t) for t in text.replace(" ", "").split(",") if t != ""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("logits", help="safetensors file that tpc run --dump-logits wrote")
    ap.add_argument("fixture", help="fixture directory with reference.safetensors")
    ap.add_argument("tol", type=float, help="largest relative error that passes")
    ap.add_argument("tokens", help="the comma-separated ids tpc printed ('' for none)")
    ap.add_argument("--tokens-optional", action="store_true", help="report the tokens, do not require them")
    a = ap.parse_args()
    case = os.path.basename(os.path.normpath(a.fixture))

    def verdict(ok: bool, fields: str) -> int:
        print(f"{'PASS' if ok else 'FAIL'} {case} {fields}")
        return 0 if ok else 1

    try:
        ref = read_tensors(os.path.join(a.fixture, "reference.safetensors"))
    except Exception as e:  # any unreadable file is a failed check, said in one line
        return verdict(False, f"rel_err=nan tokens=none error=cannot-read-reference:{type(e).__name__}:{e}")
    try:
        tokens = parse_tokens(a.tokens)
    except ValueError:
        tokens = None
    want_tokens = [int(t) for t in np.asarray(ref["greedy_ids"]).reshape(-1)]

    if tokens is None:
        tok_field, tok_ok = f"tokens=none(unparsable:{a.tokens.strip()[:60]})", False
    elif not tokens:
        tok_field, tok_ok = "tokens=none", False
    elif tokens == want_tokens:
        tok_field, tok_ok = "tokens=match", True
    else:
        first = next((i for i, (x, y) in enumerate(zip(tokens, want_tokens)) if x != y), min(len(tokens), len(want_tokens)))
        got_s = ",".join(map(str, tokens))
        want_s = ",".join(map(str, want_tokens))
        tok_field, tok_ok = f"tokens=differ(from:{first},got:{got_s},want:{want_s})", False

    try:
        got = read_tensors(a.logits)
    except Exception as e:
        return verdict(False, f"rel_err=nan {tok_field} error=cannot-read:{type(e).__name__}:{e}")
    if "logits" not in got:
        return verdict(False, f"rel_err=nan {tok_field} error=no-logits-tensor(has:{','.join(sorted(got))})")
    want = np.asarray(ref["logits"], dtype=np.float64)
    have = np.asarray(got["logits"], dtype=np.float64)
    if have.shape != want.shape:
        return verdict(False, f"rel_err=nan {tok_field} error=shape{list(have.shape)}!=reference{list(want.shape)}")
    if not np.isfinite(have).all():
        bad = int((~np.isfinite(have)).sum())
        return verdict(False, f"rel_err=nan {tok_field} error={bad}-non-finite-logits")

    rel = float(np.linalg.norm((have - want).ravel()) / np.linalg.norm(want.ravel()))
    max_abs = float(np.abs(have - want).max())
    rel_ok = rel <= a.tol and not math.isnan(rel)
    ok = rel_ok and (tok_ok or a.tokens_optional)
    note = "" if rel_ok else " error=rel_err-above-tol"
    if not tok_ok and not a.tokens_optional:
        note += " error=tokens"
    return verdict(ok, f"rel_err={rel:.3e} tol={a.tol:.0e} max_abs={max_abs:.3e} {tok_field}{note}")


if __name__ == "__main__":
    sys.exit(main())
