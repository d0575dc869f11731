#!/usr/bin/env bash
# Check the CUDA backend on a lent GPU machine (no Rust toolchain there): run what
# scripts/build_device_bundle.sh put in dist/, from the repository root.
#
#   OUT=/some/empty/dir scripts/device_check.sh                    # on the GPU machine
#   DEVICE=cpu TPC=target/release/tpc OUT=/tmp/devcheck scripts/device_check.sh   # dry run here
#
# Steps (raw output of each under $OUT):
#  1. tests: every executable in dist/tests/ with TPC_REQUIRE_GPU=1 (skipped with DEVICE=cpu),
#     among them --numerics invariant: every fixture the same bits at tp 1, 2, 4 and in a batch;
#  2. parity: every tests/fixtures/checkpoints/*/ x tp in TPS x dtype f32, bf16 on one device,
#     `tpc run --dump-logits` checked by scripts/check_logits.py against transformers'
#     logits: f32 relative error <= 1e-4 and the greedy tokens equal, bf16 <= 3e-2 (tokens
#     shown, not required); tp=2 must give tp=1's tokens. A tp that tpc refuses (it does not
#     divide the heads) is reported, not failed. The fixtures' prompts are short, so the
#     backend would pick the one-pass attention kernel for every segment: the f32 runs are
#     repeated with TPC_CUDA_ATTENTION=tiled and =split (rows "f32/tiled", "f32/split"), so
#     each attention kernel meets transformers' logits;
#  3. speed: `tpc bench` (tp 1, bf16) against transformers (scripts/bench_torch_gpu.py) for
#     each model in SPEED_MODELS at each batch in BATCHES, and tpc's decode as a % of the
#     memory-bandwidth bound (batch x copy bandwidth / weight bytes: every decode step reads
#     the weights once for the whole batch). Reported, never failed on;
#  4. one markdown report, printed and written to $OUT/device_check.md.
# Exit status: 0 when every test executable and parity check passed, 1 otherwise.
#
# Every tpc / python call runs under `timeout`, cut so the whole run ends within BUDGET_S;
# what the budget leaves no time for is reported as not run.
#
# Environment: DEVICE (cuda), TPC (dist/tpc), OUT (target/device-check), PYTHON (python3),
# BUDGET_S (330), TPS ("1 2 4 8"), PARITY_JOBS (4: parity runs at once, they are tiny),
# RUN_TIMEOUT (60), TEST_TIMEOUT (120), BENCH_TIMEOUT (150), SPEED_MODELS, BATCHES ("1 16"),
# PROMPT_LEN, NEW_TOKENS, REPEAT, TORCH_CPU (1: run the torch side on the CPU in a dry run),
# CPU_TESTS (1: run dist/tests in a dry run too, without TPC_REQUIRE_GPU).
set -euo pipefail

START_DIR=$PWD
cd "$(dirname "$0")/.."
ROOT=$PWD

DEVICE=${DEVICE:-cuda}
TPC=${TPC:-dist/tpc}
OUT=${OUT:-target/device-check}
PYTHON=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-330}
TPS=${TPS:-"1 2 4 8"}
# Compute dtypes, then f32 with each forced attention way (dtype/way).
DTYPES="f32 bf16 f32/tiled f32/split"
PARITY_JOBS=${PARITY_JOBS:-4}
RUN_TIMEOUT=${RUN_TIMEOUT:-60}
TEST_TIMEOUT=${TEST_TIMEOUT:-120}
BATCHES=${BATCHES:-"1 16"}
TORCH_CPU=${TORCH_CPU:-0}
CPU_TESTS=${CPU_TESTS:-0}
if [ "$DEVICE" = cpu ]; then
    # A dry run: the same steps at toy sizes.
    SPEED_MODELS=${SPEED_MODELS:-models/tiny-llama.ron}
    PROMPT_LEN=${PROMPT_LEN:-16}
    NEW_TOKENS=${NEW_TOKENS:-4}
    REPEAT=${REPEAT:-1}
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-60}
else
    SPEED_MODELS=${SPEED_MODELS:-"models/tinyllama-1.1b.ron models/llama3-8b.ron"}
    PROMPT_LEN=${PROMPT_LEN:-512}
    NEW_TOKENS=${NEW_TOKENS:-128}
    REPEAT=${REPEAT:-3}
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-150}
fi
WARMUP=1

# Paths given relative to where the script was started from, as a user would type them.
abs_from_start() { case $1 in /*) echo "$1" ;; *) if [ -e "$START_DIR/$1" ]; then echo "$START_DIR/$1"; else echo "$ROOT/$1"; fi ;; esac; }
TPC=$(abs_from_start "$TPC")
case $OUT in /*) ;; *) OUT=$START_DIR/$OUT ;; esac
mkdir -p "$OUT"/tests "$OUT"/parity "$OUT"/speed

log() { printf '[device_check %3ds] %s\n' "$SECONDS" "$*" >&2; }
die() { log "$*"; exit 2; }
# Seconds a call may take: its own limit, cut so that the whole run ends within BUDGET_S.
limit() {
    local left=$((BUDGET_S - SECONDS))
    if [ "$left" -lt "$1" ]; then echo "$left"; else echo "$1"; fi
}
# Tabs and newlines would break the TSV records the report is made from.
clean() { tr '\t\n' '  ' | sed 's/ *$//' | cut -c1-200; }
last_line() { grep '[^[:space:]]' "$1" 2>/dev/null | tail -n1 || true; }

[ -x "$TPC" ] || die "no tpc binary at $TPC (build it: scripts/build_device_bundle.sh, or set TPC)"

# --- environment -----------------------------------------------------------------------
if [ "$DEVICE" != cpu ]; then
    # The CUDA libraries (cuBLAS, NCCL, NVRTC, ...) come inside torch's pip packages.
    nvlibs=$("$PYTHON" - <<'EOF' || true
import glob, os
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
dirs = []
for base in nvidia.__path__:
    for d in sorted(glob.glob(os.path.join(base, "*", "lib"))) + [os.path.join(base, "cu13", "lib")]:
        if os.path.isdir(d) and d not in dirs:
            dirs.append(d)
print(":".join(dirs))
EOF
)
    if [ -n "$nvlibs" ]; then
        export LD_LIBRARY_PATH="$nvlibs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    else
        log "warning: found no nvidia/*/lib folders with $PYTHON; relying on LD_LIBRARY_PATH as it is"
    fi
fi
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "device: $DEVICE"
    echo "tpc: $TPC ($("$TPC" --version 2>&1 || true))"
    # Where the build came from, when it is the bundle's binary that runs.
    if [ "$TPC" -ef dist/tpc ] && [ -f dist/build-info.txt ]; then sed 's/^/build /' dist/build-info.txt; fi
    if command -v nvidia-smi >/dev/null; then
        echo "gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n1)"
    fi
    echo "LD_LIBRARY_PATH: ${LD_LIBRARY_PATH:-}"
} >"$OUT/env.txt"
log "$(tr '\n' ';' <"$OUT/env.txt")"

# tpc grew --device with the CUDA backend; an older CPU-only binary has no such flag.
run_help=$("$TPC" run --help 2>&1 || true)
bench_help=$("$TPC" bench --help 2>&1 || true)
RUN_DEV=()
BENCH_DEV=()
if [ "$DEVICE" != cpu ] || [[ $run_help == *--device* ]]; then RUN_DEV=(--device "$DEVICE"); fi
if [ "$DEVICE" != cpu ] || [[ $bench_help == *--device* ]]; then BENCH_DEV=(--device "$DEVICE"); fi

# --- 1. test executables -----------------------------------------------------------------
# The test executables have the build machine's repository path compiled in
# (CARGO_MANIFEST_DIR for fixtures and models, CARGO_BIN_EXE_tpc for the CLI tests): make
# that path lead here, and give it a target/release/tpc.
link_build_root() {
    local br
    if [ -f dist/build-root.txt ]; then
        br=$(cat dist/build-root.txt)
        if [ "$br" -ef "$ROOT" ]; then
            :
        elif [ -e "$br" ] || [ -L "$br" ]; then
            log "warning: $br (the build's repository path) exists here and is not this copy"
        elif ! { mkdir -p "$(dirname "$br")" && ln -s "$ROOT" "$br"; }; then
            log "warning: could not link $br to $ROOT; tests that use compiled-in paths will fail"
        fi
    fi
    if [ -L target/release/tpc ] || [ ! -e target/release/tpc ]; then
        mkdir -p target/release
        ln -sfn "$ROOT/dist/tpc" target/release/tpc
    fi
}

: >"$OUT/tests.tsv"
# On the GPU machine a test that finds no GPU or no NVRTC must fail, not skip.
require_gpu=()
[ "$DEVICE" = cpu ] || require_gpu=(TPC_REQUIRE_GPU=1 TPC_REQUIRE_NVRTC=1)
tests_dir=dist/tests
if [ "$DEVICE" = cpu ] && [ "$CPU_TESTS" != 1 ]; then
    log "1. tests: skipped (DEVICE=cpu)"
    tests_dir=""
elif [ -f dist/tests.tar.xz ]; then
    # build_device_bundle.sh packs the executables when they would not fit the carry.
    tests_dir=target/device-tests/tests
    rm -rf target/device-tests
    mkdir -p target/device-tests
    "$PYTHON" - dist/tests.tar.xz target/device-tests <<'EOF' || log "   could not unpack dist/tests.tar.xz"
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    try:
        t.extractall(sys.argv[2], filter="data")
    except TypeError:  # Python before 3.11.4 has no extraction filters
        t.extractall(sys.argv[2])
EOF
fi
if [ -z "$tests_dir" ]; then
    :
elif ! compgen -G "$tests_dir/*" >/dev/null; then
    log "1. tests: no test executables in dist/"
    printf 'dist/tests\tMISSING\t0\t0\t0\t0\tno test executables (run scripts/build_device_bundle.sh)\n' >>"$OUT/tests.tsv"
else
    log "1. tests: $(find "$tests_dir" -maxdepth 1 -type f | wc -l) executables from $tests_dir"
    link_build_root
    for exe in "$tests_dir"/*; do
        name=$(basename "$exe")
        t=$(limit "$TEST_TIMEOUT")
        if [ "$t" -lt 5 ]; then
            printf '%s\tNOT RUN\t0\t0\t0\t0\ttime budget spent\n' "$name" >>"$OUT/tests.tsv"
            continue
        fi
        t0=$SECONDS
        rc=0
        env ${require_gpu[@]+"${require_gpu[@]}"} timeout -k 5 "$t" "$exe" >"$OUT/tests/$name.log" 2>&1 || rc=$?
        # libtest prints one "test result: ok. 12 passed; 0 failed; 1 ignored; ..." per binary.
        read -r passed failed ignored < <(awk '/^test result:/ { for (i = 1; i <= NF; i++) {
                if ($(i + 1) ~ /^passed/) p += $i; if ($(i + 1) ~ /^failed/) f += $i; if ($(i + 1) ~ /^ignored/) g += $i } }
            END { print p + 0, f + 0, g + 0 }' "$OUT/tests/$name.log")
        case $rc in
            0) status=PASS note="" ;;
            124 | 137) status=TIMEOUT note="killed after ${t}s" ;;
            *) status=FAIL note="exit $rc; $(grep -E '^test .* FAILED$|panicked at' "$OUT/tests/$name.log" | head -n3 | clean || true)" ;;
        esac
        printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" "$passed" "$failed" "$ignored" "$note" >>"$OUT/tests.tsv"
        log "   $name: $status ($passed passed, $failed failed, $((SECONDS - t0)) s)"
    done
fi

# --- 2. parity -----------------------------------------------------------------------------
# One tpc run and its check; writes one TSV record to $OUT/parity/TAG.row:
# case, tp, dtype, status, rel_err, tokens state, tokens, note.
parity_one() {
    local dir=$1 tp=$2 label=$3 ids=$4 n=$5
    local name tag base t rc=0 tokens verdict status rel tokstate note tol dtype way
    local extra=()
    # label: a dtype, or dtype/way with the attention kernel forced (src/runtime/cuda/backend.rs)
    dtype=${label%%/*}
    way=""
    [ "$label" = "$dtype" ] || way=${label#*/}
    name=$(basename "$dir")
    tag=$name-tp$tp-${label//\//-}
    base=$OUT/parity/$tag
    t=$(limit "$RUN_TIMEOUT")
    if [ "$t" -lt 5 ]; then
        printf '%s\t%s\t%s\tNOT RUN\t\t\t\ttime budget spent\n' "$name" "$tp" "$label" >"$base.row"
        return
    fi
    TPC_CUDA_ATTENTION=$way timeout -k 5 "$t" "$TPC" run "$dir" --tp "$tp" ${RUN_DEV[@]+"${RUN_DEV[@]}"} --dtype "$dtype" \
        --prompt-ids "$ids" --max-new-tokens "$n" --dump-logits "$base.safetensors" \
        >"$base.stdout" 2>"$base.stderr" || rc=$?
    # The generated ids are the first non-empty stdout line.
    tokens=$( (grep -m1 '[^[:space:]]' "$base.stdout" || true) | tr -d '[:space:]')
    rel="" tokstate="" note=""
    if [ "$rc" -eq 0 ]; then
        # bf16 rounding may flip a near-tie argmax: its tokens are shown, not required.
        if [ "$dtype" = f32 ]; then tol=1e-4; else tol=3e-2 extra=(--tokens-optional); fi
        verdict=$(timeout -k 5 60 "$PYTHON" scripts/check_logits.py "$base.safetensors" "$dir" "$tol" "$tokens" \
            ${extra[@]+"${extra[@]}"} 2>&1) || true
        printf '%s\n' "$verdict" >"$base.verdict"
        verdict=$(printf '%s\n' "$verdict" | grep -E '^(PASS|FAIL) ' | tail -n1 || true)
        case $verdict in
            PASS*) status=PASS ;;
            FAIL*) status=FAIL ;;
            *) status=FAIL note="check_logits.py gave no verdict: $(last_line "$base.verdict" | clean)" ;;
        esac
        rel=$(sed -n 's/.* rel_err=\([^ ]*\).*/\1/p' <<<"$verdict")
        tokstate=$(sed -n 's/.* tokens=\([a-z]*\).*/\1/p' <<<"$verdict")
        [ -n "$note" ] || note=$(grep -o 'error=.*' <<<"$verdict" | clean || true)
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        status=TIMEOUT note="killed after ${t}s"
    elif grep -qiE 'divide|not divisible' "$base.stderr"; then
        status=REFUSED note=$(last_line "$base.stderr" | clean)
    else
        status=ERROR note="exit $rc: $(last_line "$base.stderr" | clean)"
    fi
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$tp" "$label" "$status" "$rel" "$tokstate" "$tokens" "$note" >"$base.row"
}

fixtures=()
for d in tests/fixtures/checkpoints/*/; do
    [ -f "$d/reference.json" ] && [ -f "$d/reference.safetensors" ] && fixtures+=("${d%/}")
done
log "2. parity: ${#fixtures[@]} fixtures x tp {$TPS} x {$DTYPES}, $PARITY_JOBS at a time"
rm -f "$OUT"/parity/*.row
for dir in "${fixtures[@]}"; do
    # prompt ids and the number of reference greedy tokens, from reference.json
    if ! read -r ids n < <("$PYTHON" -c 'import json, sys; r = json.load(open(sys.argv[1]))
print(",".join(map(str, r["prompt_ids"])), len(r["greedy_ids"]))' "$dir/reference.json"); then
        log "   cannot read $dir/reference.json; its runs are reported as errors"
        continue
    fi
    for tp in $TPS; do
        for dtype in $DTYPES; do
            while [ "$(jobs -rp | wc -l)" -ge "$PARITY_JOBS" ]; do wait -n || true; done
            parity_one "$dir" "$tp" "$dtype" "$ids" "$n" &
        done
    done
done
wait
: >"$OUT/parity.tsv"
for dir in "${fixtures[@]}"; do
    for tp in $TPS; do
        for dtype in $DTYPES; do
            row=$OUT/parity/$(basename "$dir")-tp$tp-${dtype//\//-}.row
            if [ -s "$row" ]; then
                cat "$row" >>"$OUT/parity.tsv"
            else
                printf '%s\t%s\t%s\tERROR\t\t\t\tno result (reference.json unreadable or the run script died)\n' "$(basename "$dir")" "$tp" "$dtype" >>"$OUT/parity.tsv"
            fi
        done
    done
done
log "   parity: $(cut -f4 "$OUT/parity.tsv" | sort | uniq -c | tr -s ' \n' ' ')"

# --- 3. speed ------------------------------------------------------------------------------
# Records: engine, model, batch (or "all" for torch, one JSON line per batch), status, file.
: >"$OUT/speed.tsv"
torch_device=""
if [ "$DEVICE" != cpu ]; then torch_device=$DEVICE; elif [ "$TORCH_CPU" = 1 ]; then torch_device=cpu; fi
log "3. speed: {$SPEED_MODELS} x batch {$BATCHES}, prompt $PROMPT_LEN, $NEW_TOKENS new tokens, best of $REPEAT"
for model in $SPEED_MODELS; do
    m=$(basename "$model" .ron)
    for b in $BATCHES; do
        base=$OUT/speed/tpc-$m-b$b
        t=$(limit "$BENCH_TIMEOUT")
        if [ "$t" -lt 10 ]; then
            printf 'tpc\t%s\t%s\tNOT RUN\t\n' "$m" "$b" >>"$OUT/speed.tsv"
            continue
        fi
        rc=0
        timeout -k 5 "$t" "$TPC" bench "$model" ${BENCH_DEV[@]+"${BENCH_DEV[@]}"} --dtype bf16 --tp 1 --batch "$b" \
            --prompt-len "$PROMPT_LEN" --max-new-tokens "$NEW_TOKENS" --warmup "$WARMUP" --repeat "$REPEAT" \
            >"$base.stdout" 2>"$base.stderr" || rc=$?
        last_line "$base.stdout" >"$base.json"
        case $rc in
            0) status=OK ;;
            124 | 137) status="TIMEOUT after ${t}s" ;;
            *) status="ERROR exit $rc: $(last_line "$base.stderr" | clean)" ;;
        esac
        printf 'tpc\t%s\t%s\t%s\t%s\n' "$m" "$b" "$status" "$base.json" >>"$OUT/speed.tsv"
        log "   tpc $m batch $b: $status"
    done
    base=$OUT/speed/torch-$m
    if [ -z "$torch_device" ]; then
        printf 'torch\t%s\tall\tSKIPPED (DEVICE=cpu; TORCH_CPU=1 runs it)\t\n' "$m" >>"$OUT/speed.tsv"
        continue
    fi
    t=$(limit "$BENCH_TIMEOUT")
    if [ "$t" -lt 10 ]; then
        printf 'torch\t%s\tall\tNOT RUN\t\n' "$m" >>"$OUT/speed.tsv"
        continue
    fi
    rc=0
    # shellcheck disable=SC2086 # BATCHES is a list of words on purpose
    timeout -k 5 "$t" "$PYTHON" scripts/bench_torch_gpu.py "$model" --device "$torch_device" --batch $BATCHES \
        --prompt-len "$PROMPT_LEN" --max-new-tokens "$NEW_TOKENS" --warmup "$WARMUP" --repeat "$REPEAT" \
        >"$base.jsonl" 2>"$base.stderr" || rc=$?
    case $rc in
        0) status=OK ;;
        124 | 137) status="TIMEOUT after ${t}s" ;;
        *) status="ERROR exit $rc: $(last_line "$base.stderr" | clean)" ;;
    esac
    printf 'torch\t%s\tall\t%s\t%s\n' "$m" "$status" "$base.jsonl" >>"$OUT/speed.tsv"
    log "   torch $m: $status"
done

# --- 4. report -----------------------------------------------------------------------------
rc=0
rm -f "$OUT/device_check.md"
"$PYTHON" - "$OUT" "$DEVICE" "$SECONDS" "$TPS" "$BATCHES" "$PROMPT_LEN" "$NEW_TOKENS" "$REPEAT" <<'EOF' || rc=$?
import json, os, sys

out, device, elapsed, tps, batches, prompt_len, new_tokens, repeat = sys.argv[1:]
tps = tps.split()
batches = [int(b) for b in batches.split()]


def tsv(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return []
    return [line.rstrip("\n").split("\t") for line in open(path) if line.strip()]


def fmt(x, digits=0):
    if x is None:
        return "n/a"
    return f"{x:,.{digits}f}"


def ratio(a, b):
    return f"{a / b:.2f}x" if a and b else "n/a"


lines = []
w = lines.append
env = open(os.path.join(out, "env.txt")).read().splitlines() if os.path.exists(os.path.join(out, "env.txt")) else []
title = "tpc device check" + (" (DRY RUN on the CPU)" if device == "cpu" else f" ({device})")
w(f"# {title}\n")
for e in env:
    if e.startswith(("gpu:", "build ", "tpc:")):
        w(f"- {e}")
w(f"- elapsed: {elapsed} s\n")
failures = []

# 1. tests
w("## 1. Test executables" + ("" if device == "cpu" else " (TPC_REQUIRE_GPU=1)") + "\n")
tests = tsv("tests.tsv")
if not tests:
    w("skipped (DEVICE=cpu)\n" if device == "cpu" else "none run\n")
else:
    w("| executable | result | passed | failed | ignored | s | note |")
    w("|---|---|---:|---:|---:|---:|---|")
    for name, status, secs, p, f, g, note in tests:
        w(f"| {name} | {status} | {p} | {f} | {g} | {secs} | {note} |")
        if status != "PASS":
            failures.append(f"test executable {name}: {status} {note}")
    ok = sum(r[1] == "PASS" for r in tests)
    w(f"\n{ok}/{len(tests)} executables passed, {sum(int(r[3]) for r in tests)} tests passed, "
      f"{sum(int(r[4]) for r in tests)} failed\n")

# 2. parity: one row per case and dtype, one column per tp
w("## 2. Parity with transformers (f32: rel err <= 1e-4 and greedy tokens; bf16: <= 3e-2)\n")
runs = {(r[0], r[1], r[2]): r for r in tsv("parity.tsv")}
cases = list(dict.fromkeys(r[0] for r in runs.values()))
w("| case | dtype | " + " | ".join(f"tp={tp}" for tp in tps) + " | tp=2 tokens = tp=1 |")
w("|---|---|" + "---|" * len(tps) + "---|")
details = []
for case in cases:
    for dtype in dict.fromkeys(r[2] for r in runs.values()):
        cells = []
        for tp in tps:
            r = runs.get((case, tp, dtype))
            if r is None:
                cells.append("-")
                continue
            _, _, _, status, rel, tokstate, tokens, note = (r + [""] * 8)[:8]
            if status in ("PASS", "FAIL"):
                tag = "ok" if status == "PASS" else "**FAIL**"
                tok = "" if tokstate == "match" else f" (tokens {tokstate})"
                cells.append(f"{tag} {rel}{tok}")
            else:
                cells.append(status.lower() if status == "REFUSED" else f"**{status}**")
            if status not in ("PASS", "REFUSED"):
                failures.append(f"parity {case} tp={tp} {dtype}: {status} {note}")
                details.append(f"- {case} tp={tp} {dtype}: {status}; rel_err {rel or 'n/a'}; tokens [{tokens}]; {note}")
        one, two = runs.get((case, "1", dtype)), runs.get((case, "2", dtype))
        if one and two and one[3] not in ("REFUSED",) and two[3] not in ("REFUSED",) and one[6] and two[6]:
            same = one[6] == two[6]
            cells.append("yes" if same else "**NO**")
            if not same:
                failures.append(f"parity {case} {dtype}: tp=2 tokens {two[6]} != tp=1 tokens {one[6]}")
        else:
            cells.append("n/a")
        w(f"| {case} | {dtype} | " + " | ".join(cells) + " |")
n_pass = sum(r[3] == "PASS" for r in runs.values())
n_ref = sum(r[3] == "REFUSED" for r in runs.values())
w(f"\n{n_pass}/{len(runs)} runs passed, {n_ref} refused (tp does not divide the heads)\n")
if details:
    w("Failed runs:\n")
    lines.extend(details)
    w("")

# 3. speed
w("## 3. Speed: tpc bench (tp 1, bf16) vs transformers (sdpa, bf16)\n")
w(f"prompt {prompt_len} tokens, {new_tokens} new tokens ({int(new_tokens) - 1} decode steps timed), "
  f"best of {repeat} after 1 warm-up; tokens/s over the whole batch\n")
tpc_res, torch_res, notes = {}, {}, []
bandwidth = None
for engine, model, batch, status, path, *_ in [r + [""] for r in tsv("speed.tsv")]:
    if engine == "tpc":
        if status == "OK":
            try:
                tpc_res[(model, int(batch))] = json.loads(open(path).read())
            except (OSError, ValueError) as e:
                notes.append(f"tpc {model} batch {batch}: unreadable JSON ({e})")
        else:
            notes.append(f"tpc {model} batch {batch}: {status}")
    else:
        if status != "OK":
            notes.append(f"torch {model}: {status}")
            continue
        for line in open(path):
            try:
                j = json.loads(line)
            except ValueError:
                continue
            torch_res[(model, int(j["batch"]))] = j
            bandwidth = bandwidth or j.get("copy_bandwidth_bytes_per_s")
models = list(dict.fromkeys(r[1] for r in tsv("speed.tsv")))
if bandwidth:
    w(f"copy bandwidth (torch `dst.copy_(src)`, bytes read + written): **{bandwidth / 1e9:,.0f} GB/s**\n")
else:
    w("copy bandwidth: not measured (no torch run), so no bound\n")
w("| model | batch | prefill tpc | prefill torch | tpc/torch | decode tpc | decode torch | tpc/torch "
  "| decode bound | tpc % of bound | torch % of bound | weights GB |")
w("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for model in models:
    for b in batches:
        t, h = tpc_res.get((model, b), {}), torch_res.get((model, b), {})
        tp_, tq = t.get("prefill_tokens_per_s"), h.get("prefill_tokens_per_s")
        dp, dq = t.get("decode_tokens_per_s"), h.get("decode_tokens_per_s")
        wbytes = t.get("weight_bytes_rank0") or h.get("weight_bytes")
        bound = b * bandwidth / wbytes if bandwidth and wbytes else None
        pct = lambda x: f"{100 * x / bound:.0f}%" if x and bound else "n/a"
        gb = f"{wbytes / 1e9:.3g}" if wbytes else "n/a"
        w(f"| {model} | {b} | {fmt(tp_)} | {fmt(tq)} | {ratio(tp_, tq)} | {fmt(dp, 1)} | {fmt(dq, 1)} | "
          f"{ratio(dp, dq)} | {fmt(bound, 1)} | {pct(dp)} | {pct(dq)} | {gb} |")
w("\nbound = batch x copy bandwidth / tpc's weight_bytes_rank0 (each decode step reads the weights "
  "once for the whole batch; KV-cache reads are not counted)\n")
for n in notes:
    w(f"- {n}")
if notes:
    w("")

w("## Verdict\n")
if failures:
    w(f"**FAIL**: {len(failures)} problem(s)\n")
    for f in failures[:40]:
        w(f"- {f}")
else:
    w("**PASS**: every test executable and parity check passed (speed is reported, not judged)")
report = "\n".join(lines) + "\n"
open(os.path.join(out, "device_check.md"), "w").write(report)
sys.stdout.write(report)
sys.exit(1 if failures else 0)
EOF
if [ ! -s "$OUT/device_check.md" ]; then
    # The report script itself failed: show the raw records rather than nothing.
    log "the report could not be made; raw records follow"
    for f in tests parity speed; do echo "== $f.tsv"; cat "$OUT/$f.tsv"; done
    rc=1
fi
log "report: $OUT/device_check.md (exit $rc)"
exit "$rc"
