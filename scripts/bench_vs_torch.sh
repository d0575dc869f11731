#!/usr/bin/env bash
# Side-by-side CPU benchmark: `tpc run` against Hugging Face transformers (torch) on the same
# checkpoint (random weights, TinyLlama-1.1B's shape, bf16, sharded; scripts/make_bench_model.py),
# the same prompt (PROMPT_LEN ids, default 128, (i * 7919) % 32000) and 16 greedy new tokens at
# batch 1.
#
#   scripts/bench_vs_torch.sh                       # ROUNDS=2, REPS=3, THREADS=nproc
#   ROUNDS=3 TPS="1 2" scripts/bench_vs_torch.sh
#   PROMPT_LEN=512 scripts/bench_vs_torch.sh
#   TPC_DTYPES="bf16" TORCH_TIMEOUT=3600 TPC_TIMEOUT=1800 scripts/bench_vs_torch.sh
#   BASELINE_BIN=/path/to/older/tpc scripts/bench_vs_torch.sh   # before/after in one run
#   MODEL=target/bench-model/qwen3-moe-random TPC_MOES="tensor expert" TPS="1 2" \
#       TORCH_DTYPES=bfloat16 scripts/bench_vs_torch.sh   # the mixture of experts (issue 29)
#
# TPC_MOES: for a mixture of experts, each tpc row once per `--moe` word (labels "tpc tp2
# expert"); the bandwidth bound then counts the weights a decoded token reads: every
# non-expert weight and k of each layer's E experts (k/E of the expert weights).
#
# With BASELINE_BIN, every tpc row is followed by the same run of that binary (labelled
# "base ..."), alternating within each round, so a change is measured against its parent
# under the same conditions.
#
# Steps, all in one invocation:
#  1. cargo build --release;
#  2. python3 scripts/make_bench_model.py (skips when the checkpoint is already there);
#  3. memory read bandwidth: a tiny C program (cc -O3 -march=native -mprefer-vector-width=512
#     -ffast-math -fopenmp: one 64-byte load per line where the host has AVX-512, which reads
#     faster than two 32-byte ones)
#     sums a 1 GiB float32 array 20 times in each of two read orders (one stream per thread,
#     and tpc's decode order: 8 parts per 64 KiB block, each prefetched 512 B ahead, which
#     reads faster on the hosts measured), with 1 thread and with THREADS threads, and reports
#     the best pass in GB/s (1 GB = 1e9 bytes) of the faster order; numpy's single-threaded
#     sum of the same array when there is no C compiler. Measured before and after the
#     engines; the bound below uses the highest figure;
#  4. ROUNDS rounds, each running every engine once, alternating: torch bf16, torch f32, then
#     `tpc run --tp T` for T in TPS (and, when `tpc run` has --dtype, for each of TPC_DTYPES).
#     Torch (scripts/bench_torch.py): THREADS threads, sdpa attention, one warm-up generation
#     then the best of REPS, loading not timed. tpc: the same, as `tpc run --warmup 1
#     --repeat REPS --json` reports it (loading not timed), THREADS/T compute threads per
#     rank. Every run is under `timeout` (TORCH_TIMEOUT, TPC_TIMEOUT seconds): a run that fails,
#     runs out of memory or times out is recorded in the table, not fatal;
#  5. a table: best over rounds of prefill and decode tokens/s per engine and config, the ratio
#     to the best torch config in each column, decode as a % of the memory-bandwidth bound
#     (read bandwidth / bytes of weights read per decoded token, for bf16 and f32 weights), and
#     whether the greedy tokens equal torch f32's.
#
# Raw results (one JSON line per run) and the table go to target/bench-results/vs-torch-DATE/.
set -uo pipefail
cd "$(dirname "$0")/.."

ROUNDS=${ROUNDS:-2}
REPS=${REPS:-3}
THREADS=${THREADS:-$(nproc)}
TPS=${TPS:-"1 2 4 8"}
TORCH_DTYPES=${TORCH_DTYPES:-"bfloat16 float32"}
DEFAULT_MODEL=target/bench-model/tinyllama-1.1b-random
MODEL=${MODEL:-$DEFAULT_MODEL} # another checkpoint: used as it is, never (re)written
NEW_TOKENS=16
PROMPT_LEN=${PROMPT_LEN:-128}
TORCH_TIMEOUT=${TORCH_TIMEOUT:-1800}
TPC_TIMEOUT=${TPC_TIMEOUT:-900}
BIN=target/release/tpc
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-target/bench-results/vs-torch-$STAMP}
RAW=$OUT/runs.jsonl
mkdir -p "$OUT"
: >"$RAW"

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
load1() { cut -d' ' -f1 /proc/loadavg; }

# 1. build
log "cargo build --release"
cargo build --release >&2 || { echo "cargo build --release failed" >&2; exit 1; }
[ -x "$BIN" ] || { echo "no $BIN after the build" >&2; exit 1; }

# 2. the model
if [ "$MODEL" = "$DEFAULT_MODEL" ]; then
    python3 scripts/make_bench_model.py --out "$MODEL" >&2 || { echo "make_bench_model.py failed" >&2; exit 1; }
elif [ "$MODEL" = target/bench-model/qwen3-moe-random ]; then
    python3 scripts/make_bench_model.py --shape qwen3-moe >&2 || { echo "make_bench_model.py failed" >&2; exit 1; }
elif [ ! -f "$MODEL/config.json" ]; then
    echo "MODEL=$MODEL has no config.json" >&2
    exit 1
fi

IDS=$(python3 -c "print(','.join(str((i * 7919) % 32000) for i in range($PROMPT_LEN)))")

if [ -z "${TPC_DTYPES+x}" ]; then
    if "$BIN" run --help 2>/dev/null | grep -q -- '--dtype'; then TPC_DTYPES="f32 bf16"; else TPC_DTYPES=""; fi
fi

# 3. memory read bandwidth
BW_SRC=$OUT/readbw.c
BW_BIN=$OUT/readbw
cat >"$BW_SRC" <<'EOF'
/* Read bandwidth: sums a 1 GiB float32 array PASSES times in each of two read orders,
 * alternating: one sequential stream per thread (OpenMP static split), and tpc's decode
 * order (each thread's share in 64 KiB blocks, each block read as 8 parts at once with a
 * prefetch 512 B ahead in each). Prints the best and mean pass of each, and of the better. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#define BLOCK 16384 /* floats: 64 KiB */
#define PARTS 8
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static float one_stream(const float *a, size_t n) {
    float s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
    for (size_t i = 0; i < n; i++) s += a[i];
    return s;
}
static float parts(const float *a, size_t n) {
    size_t blocks = n / BLOCK;
    float s = 0;
#pragma omp parallel for reduction(+ : s) schedule(static)
    for (size_t b = 0; b < blocks; b++) {
        const float *blk = a + b * BLOCK;
        float acc[PARTS][16] = {{0}};
        for (size_t i = 0; i < BLOCK / PARTS; i += 16)
            for (int p = 0; p < PARTS; p++) {
                const float *x = blk + p * (BLOCK / PARTS) + i;
                __builtin_prefetch(x + 128);
                for (int l = 0; l < 16; l++) acc[p][l] += x[l];
            }
        for (int p = 0; p < PARTS; p++)
            for (int l = 0; l < 16; l++) s += acc[p][l];
    }
    return s;
}
int main(int argc, char **argv) {
    size_t bytes = (size_t)1 << 30, n = bytes / sizeof(float);
    int passes = argc > 1 ? atoi(argv[1]) : 10, threads = 1;
    float *a = aligned_alloc(4096, bytes);
    if (!a) { fprintf(stderr, "cannot allocate 1 GiB\n"); return 1; }
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) a[i] = (float)(i & 1023) * 1e-3f;
    double best[2] = {0, 0}, total[2] = {0, 0}, sink = 0;
    for (int p = 0; p < passes; p++)
        for (int m = 0; m < 2; m++) {
            double t0 = now();
            float s = m == 0 ? one_stream(a, n) : parts(a, n);
            double gbs = bytes / (now() - t0) / 1e9;
            sink += s; total[m] += gbs; if (gbs > best[m]) best[m] = gbs;
        }
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int w = best[1] > best[0];
    printf("{\"method\":\"C sum of 1 GiB float32, best of %d passes of each of two read orders "
           "(one stream per thread; 8 parts per 64 KiB block, prefetch 512 B ahead)\",\"threads\":%d,"
           "\"best_gb_per_s\":%.3f,\"mean_gb_per_s\":%.3f,\"best_order\":\"%s\","
           "\"one_stream_best_gb_per_s\":%.3f,\"parts_best_gb_per_s\":%.3f,\"checksum\":%g}\n",
           passes, threads, best[w], total[w] / passes, w ? "parts" : "one stream", best[0], best[1], sink);
    return 0;
}
EOF
if ! cc -O3 -march=native -mprefer-vector-width=512 -ffast-math -fopenmp "$BW_SRC" -o "$BW_BIN" 2>"$OUT/readbw.cc.log"; then
    log "cc failed ($(head -c 200 "$OUT/readbw.cc.log")); measuring with numpy instead"
    BW_BIN=""
fi
measure_bw() { # $1: when (before/after)
    local t line
    for t in 1 "$THREADS"; do
        if [ -n "$BW_BIN" ]; then
            line=$(OMP_NUM_THREADS=$t "$BW_BIN" 20) || continue
        else
            [ "$t" = 1 ] || continue
            line=$(python3 - <<'PY'
import json, time, numpy as np
a = np.ones(1 << 28, dtype=np.float32)  # 1 GiB
best, tot = 0.0, 0.0
for _ in range(10):
    t0 = time.perf_counter(); a.sum(); g = a.nbytes / (time.perf_counter() - t0) / 1e9
    best, tot = max(best, g), tot + g
print(json.dumps({"method": "numpy float32 sum of 1 GiB, best of 10", "threads": 1,
                  "best_gb_per_s": best, "mean_gb_per_s": tot / 10}))
PY
            ) || continue
        fi
        printf '{"kind":"bandwidth","when":"%s","load1":%s,"result":%s}\n' "$1" "$(load1)" "$line" >>"$RAW"
        log "read bandwidth ($1, $t threads): $line"
    done
}

log "uptime: $(uptime)"
printf '{"kind":"meta","start":"%s","uptime_start":"%s","nproc":%s,"threads":%s,"rounds":%s,"reps":%s,"tps":"%s","tpc_dtypes":"%s","model":"%s","cpu":"%s","mem_total_kb":%s}\n' \
    "$(date -u +%FT%TZ)" "$(uptime | sed 's/^ *//')" "$(nproc)" "$THREADS" "$ROUNDS" "$REPS" "$TPS" "$TPC_DTYPES" "$MODEL" \
    "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//')" "$(awk '/MemTotal/ {print $2}' /proc/meminfo)" >>"$RAW"
measure_bw before

# 4. the engines, alternating, ROUNDS times
# record LABEL ROUND RC STDOUT_FILE STDERR_FILE SECONDS: appends one JSON line to $RAW.
record() {
    python3 - "$@" >>"$RAW" <<'PY'
import json, sys
label, rnd, rc, out, err, secs, load = sys.argv[1:8]
rc = int(rc)
rec = {"kind": "run", "label": label, "round": int(rnd), "rc": rc, "wall_seconds": float(secs), "load1": float(load)}
text = open(out).read()
errtext = open(err, errors="replace").read()
try:
    # bench_torch.py prints one JSON line; tpc run --json pretty-prints one object.
    start = text.index("{")
    rec["result"] = json.loads(text[start:])
except ValueError:
    pass
if rc == 124:
    rec["error"] = f"timed out after {secs} s"
elif rc == 137 or rc == -9:
    rec["error"] = "killed (out of memory?)"
elif rc != 0:
    last = [l for l in errtext.strip().splitlines() if l.strip()][-1:] or ["(no stderr)"]
    rec["error"] = f"exit {rc}: {last[0][:160]}"
elif "result" not in rec:
    rec["error"] = "no JSON on stdout"
warns = sorted({l.strip()[:200] for l in errtext.splitlines() if "Warning" in l or "warning:" in l})
if warns:
    rec["warnings"] = warns
print(json.dumps(rec))
PY
}

run_one() { # LABEL ROUND TIMEOUT CMD...
    local label=$1 rnd=$2 limit=$3 rc t0 t1 l
    shift 3
    l=$(load1)
    log "round $rnd: $label (load $l)"
    t0=$(date +%s.%N)
    timeout --kill-after=30 "$limit" "$@" >"$OUT/last.out" 2>"$OUT/last.err" </dev/null
    rc=$?
    t1=$(date +%s.%N)
    cat "$OUT/last.err" >>"$OUT/stderr.log"
    record "$label" "$rnd" "$rc" "$OUT/last.out" "$OUT/last.err" "$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')" "$l"
    tail -n1 "$RAW" | cut -c1-300 >&2
}

for ((r = 1; r <= ROUNDS; r++)); do
    for dt in $TORCH_DTYPES; do
        run_one "torch $dt" "$r" "$TORCH_TIMEOUT" \
            python3 scripts/bench_torch.py "$MODEL" --dtype "$dt" --threads "$THREADS" --reps "$REPS" --new-tokens "$NEW_TOKENS" --prompt-len "$PROMPT_LEN"
    done
    for tp in $TPS; do
        tpr=$((THREADS / tp))
        [ "$tpr" -ge 1 ] || tpr=1
        for dt in ${TPC_DTYPES:-default}; do
          for moe in ${TPC_MOES:-default}; do
            if [ "$dt" = default ]; then flag=(); label="tpc tp$tp"; else flag=(--dtype "$dt"); label="tpc $dt tp$tp"; fi
            if [ "$moe" != default ]; then flag+=(--moe "$moe"); label="$label $moe"; fi
            run_one "$label" "$r" "$TPC_TIMEOUT" \
                "$BIN" run "$MODEL" --tp "$tp" --threads-per-rank "$tpr" "${flag[@]}" \
                --prompt-ids "$IDS" --max-new-tokens "$NEW_TOKENS" --warmup 1 --repeat "$REPS" --json
            if [ -n "${BASELINE_BIN:-}" ]; then
                run_one "base ${label#tpc }" "$r" "$TPC_TIMEOUT" \
                    "$BASELINE_BIN" run "$MODEL" --tp "$tp" --threads-per-rank "$tpr" "${flag[@]}" \
                    --prompt-ids "$IDS" --max-new-tokens "$NEW_TOKENS" --warmup 1 --repeat "$REPS" --json
            fi
          done
        done
    done
done

measure_bw after
printf '{"kind":"meta","end":"%s","uptime_end":"%s"}\n' "$(date -u +%FT%TZ)" "$(uptime | sed 's/^ *//')" >>"$RAW"
rm -f "$OUT/last.out" "$OUT/last.err"

# 5. the table
PROMPT_LEN=$PROMPT_LEN python3 - "$RAW" "$MODEL" "$NEW_TOKENS" <<'PY' | tee "$OUT/table.txt"
import json, os, struct, sys
from pathlib import Path

raw, model, n_new = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
recs = [json.loads(l) for l in open(raw) if l.strip()]
meta = {}
for r in recs:
    if r["kind"] == "meta":
        meta.update(r)
bws = [r for r in recs if r["kind"] == "bandwidth"]
runs = [r for r in recs if r["kind"] == "run"]

# Parameters, from the safetensors headers of the checkpoint's shards.
index = json.loads((model / "model.safetensors.index.json").read_text())
numel = {}
for shard in sorted(set(index["weight_map"].values())):
    with open(model / shard, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    for name, info in header.items():
        if name != "__metadata__":
            c = 1
            for d in info["shape"]:
                c *= d
            numel[name] = c
total = sum(numel.values())
embed = numel.get("model.embed_tokens.weight", 0)
config = json.loads((model / "config.json").read_text())
hidden = config["hidden_size"]
# A decode step reads every weight once, except the embedding table (one row) and, in a
# mixture of experts, the experts the token did not choose (k of each layer's E are read).
experts = sum(n for name, n in numel.items() if ".experts." in name)
n_experts = config.get("num_experts", config.get("num_local_experts"))
unread = experts * (1 - config["num_experts_per_tok"] / n_experts) if n_experts else 0
per_token = int(total - embed + hidden - unread)
read_what = "all but the embedding table" + (
    f" and {n_experts - config['num_experts_per_tok']} of each layer's {n_experts} experts" if n_experts else "")
bw = max((b["result"]["best_gb_per_s"] for b in bws), default=float("nan"))
bound = {"bf16": bw * 1e9 / (2 * per_token), "f32": bw * 1e9 / (4 * per_token)}

# Best over rounds per label (order of first appearance).
labels = list(dict.fromkeys(r["label"] for r in runs))
best = {}
for lab in labels:
    ok = [r for r in runs if r["label"] == lab and "result" in r and "error" not in r]
    errs = [r["error"] for r in runs if r["label"] == lab and "error" in r]
    if not ok:
        best[lab] = {"error": "; ".join(dict.fromkeys(errs)) or "no result"}
        continue
    p = max(r["result"]["prefill_tokens_per_s"] for r in ok)
    d = max(r["result"]["decode_tokens_per_s"] for r in ok)
    gens = [r["result"]["generated"] for r in ok]
    best[lab] = {
        "prefill": p,
        "decode": d,
        "prefill_all": [r["result"]["prefill_tokens_per_s"] for r in ok],
        "decode_all": [r["result"]["decode_tokens_per_s"] for r in ok],
        "load": min(r["result"].get("load_seconds", float("nan")) for r in ok),
        "peak": max((r["result"].get("peak_resident_bytes") or float("nan")) for r in ok),
        "generated": gens[0],
        "stable": all(g == gens[0] for g in gens),
        "errors": errs,
    }
torch_labels = [l for l in labels if l.startswith("torch") and "prefill" in best[l]]
bt_p = max((best[l]["prefill"] for l in torch_labels), default=float("nan"))
bt_d = max((best[l]["decode"] for l in torch_labels), default=float("nan"))
ref = best.get("torch float32", {}).get("generated")


def tokens_note(lab):
    b = best[lab]
    if lab == "torch float32":
        s = "reference"
    elif ref is None:
        s = "(no torch f32)"
    elif b["generated"] == ref:
        s = "= torch f32"
    else:
        same = sum(a == c for a, c in zip(b["generated"], ref))
        first = next((i for i, (a, c) in enumerate(zip(b["generated"], ref)) if a != c), min(len(b["generated"]), len(ref)))
        s = f"DIFFER from {first} ({same}/{len(ref)} equal)"
    if len(b["generated"]) != n_new:
        s += f", {len(b['generated'])} tokens"
    if not b["stable"]:
        s += ", varies by round"
    return s


def weight_dtype(lab):
    if "bfloat16" in lab or " bf16 " in lab:
        return "bf16"
    return "f32"


print()
print(f"tpc run vs transformers/torch, CPU, {meta.get('start', '?')} .. {meta.get('end', '?')}")
print(f"machine: {meta.get('cpu', '?')}, {meta.get('nproc')} cores, {meta.get('mem_total_kb', 0) / 2**20:.1f} GiB; "
      f"torch threads {meta.get('threads')}, tpc threads per rank = {meta.get('threads')}/tp (at least 1)")
print(f"load: start `{meta.get('uptime_start', '?')}`")
print(f"      end   `{meta.get('uptime_end', '?')}`")
loads = [r["load1"] for r in runs]
if loads:
    print(f"      1-min load average at the start of each run: min {min(loads):.2f}, max {max(loads):.2f} "
          f"({meta.get('nproc')} cores; our own runs count for up to {meta.get('threads')})")
print(f"model: {model} ({total:,} parameters; {per_token:,} read per decoded token = {read_what})")
print(f"workload: batch 1, {os.environ.get('PROMPT_LEN', '128')} prompt ids (i*7919)%32000, 16 greedy new tokens; decode tok/s = 15 / time of the 15 steps after the first token")
for b in bws:
    x = b["result"]
    print(f"read bandwidth ({b['when']}, {x['threads']} thr, load {b['load1']}): best {x['best_gb_per_s']:.2f} GB/s, "
          f"mean {x['mean_gb_per_s']:.2f} GB/s  [{x['method']}]")
    if "parts_best_gb_per_s" in x:
        print(f"  by read order: one stream {x['one_stream_best_gb_per_s']:.2f} GB/s, 8 parts per 64 KiB {x['parts_best_gb_per_s']:.2f} GB/s")
print(f"decode bound = {bw:.2f} GB/s / weight bytes per token: bf16 {2 * per_token / 1e9:.2f} GB -> {bound['bf16']:.2f} tok/s, "
      f"f32 {4 * per_token / 1e9:.2f} GB -> {bound['f32']:.2f} tok/s")
print(f"best of {meta.get('rounds')} rounds per row; every row: best of {meta.get('reps')} generations after a warm-up "
      f"within each round (loading not timed)")
print()
hdr = ("engine / config", "prefill tok/s", "x torch", "decode tok/s", "x torch", "% bound", "load s", "peak GB", "greedy tokens")
rows = []
for lab in labels:
    b = best[lab]
    if "error" in b:
        rows.append((lab, "-", "-", "-", "-", "-", "-", "-", b["error"]))
        continue
    wd = weight_dtype(lab)
    rows.append((
        lab,
        f"{b['prefill']:.2f}",
        f"{b['prefill'] / bt_p:.2f}",
        f"{b['decode']:.2f}",
        f"{b['decode'] / bt_d:.2f}",
        f"{100 * b['decode'] / bound[wd]:.0f}% {wd}",
        f"{b['load']:.1f}",
        f"{b['peak'] / 1e9:.2f}",
        tokens_note(lab) + (f" ({len(b['errors'])} failed rounds: {b['errors'][0]})" if b["errors"] else ""),
    ))
w = [max(len(str(r[i])) for r in rows + [hdr]) for i in range(len(hdr))]
fmt = lambda r: "  ".join(str(c).ljust(w[i]) if i in (0, 8) else str(c).rjust(w[i]) for i, c in enumerate(r))
print(fmt(hdr))
print("  ".join("-" * x for x in w))
for r in rows:
    print(fmt(r))
print()
print("x torch: ratio to the best torch row in that column; % bound: decode tok/s as a % of the bandwidth bound for the row's weight dtype")
print("(torch float32 and tpc f32 hold f32 weights; torch bfloat16 and tpc bf16 hold bf16 weights).")
print("per-round values (prefill / decode tok/s):")
for lab in labels:
    b = best[lab]
    if "prefill_all" in b:
        print(f"  {lab}: " + ", ".join(f"{p:.2f} / {d:.2f}" for p, d in zip(b["prefill_all"], b["decode_all"])))
if ref is not None:
    print(f"torch f32 greedy tokens: {ref}")
    tb = best.get("torch bfloat16", {}).get("generated")
    if tb is not None and tb != ref:
        print(f"torch bf16 greedy tokens: {tb} (bf16 activations; may legitimately differ)")
warns = sorted({w for r in runs for w in r.get("warnings", [])})
for x in warns:
    print(f"stderr warning seen: {x}")
PY
log "raw results: $RAW; table: $OUT/table.txt; stderr of every run: $OUT/stderr.log"
