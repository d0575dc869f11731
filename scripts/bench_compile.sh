#!/usr/bin/env bash
# Compile-time benchmark: the whole `tpc compile` process on Llama 3.1 405B at tp=8, then
# the same preset with 32, 63, 126 and 252 layers to show that time grows linearly with
# depth. Uses hyperfine when installed (apt-get install -y hyperfine), else a bash loop.
#
#   scripts/bench_compile.sh            # RUNS=30 timed runs per command, WARMUP=3
#   RUNS=100 scripts/bench_compile.sh
#   NO_HYPERFINE=1 scripts/bench_compile.sh   # force the bash loop
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-30}
WARMUP=${WARMUP:-3}
TP=${TP:-8}
MODEL=models/llama3.1-405b.ron
BIN=target/release/tpc
LAYERS=(32 63 126 252)

cargo build --release
[ -x "$BIN" ] || { echo "no $BIN after the build" >&2; exit 1; }

TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

use_hyperfine=0
if [ -z "${NO_HYPERFINE:-}" ] && command -v hyperfine >/dev/null 2>&1; then
    use_hyperfine=1
fi

# Prints "median_ms min_ms" for one model file.
time_model() {
    local model=$1
    if [ "$use_hyperfine" = 1 ]; then
        local csv="$TMP/result.csv"
        # -N: no intermediate shell; hyperfine discards the command's stdout itself.
        # Its warnings (outliers) are collected and summarized after the table.
        if ! hyperfine -N --style none --warmup "$WARMUP" --runs "$RUNS" --export-csv "$csv" \
            "$BIN compile $model --tp $TP --json" >/dev/null 2>"$TMP/hyperfine.err"; then
            cat "$TMP/hyperfine.err" >&2
            exit 1
        fi
        if grep -q "outliers" "$TMP/hyperfine.err"; then
            echo "$(basename "$model")" >>"$TMP/outliers"
        fi
        # Columns: command,mean,stddev,median,user,system,min,max (seconds).
        awk -F, 'NR == 2 { printf "%.3f %.3f\n", $4 * 1000, $7 * 1000 }' "$csv"
    else
        local i t0 t1
        local -a times=()
        for ((i = 0; i < WARMUP; i++)); do
            "$BIN" compile "$model" --tp "$TP" --json >/dev/null
        done
        for ((i = 0; i < RUNS; i++)); do
            t0=$(date +%s%N)
            "$BIN" compile "$model" --tp "$TP" --json >/dev/null
            t1=$(date +%s%N)
            times+=($((t1 - t0)))
        done
        printf '%s\n' "${times[@]}" | sort -n | awk '
            { t[NR] = $1 }
            END {
                m = (NR % 2) ? t[(NR + 1) / 2] : (t[NR / 2] + t[NR / 2 + 1]) / 2
                printf "%.3f %.3f\n", m / 1e6, t[1] / 1e6
            }'
    fi
}

# Fail early (with tpc's own message) if the model does not compile.
"$BIN" compile "$MODEL" --tp "$TP" --json >/dev/null

if [ "$use_hyperfine" = 1 ]; then
    timer="hyperfine $(hyperfine --version | awk '{print $2}')"
else
    timer="bash loop (date +%s%N)"
fi
echo
echo "tpc compile --tp $TP --json, whole process; $RUNS runs after $WARMUP warm-up; timer: $timer"
echo

read -r med min < <(time_model "$MODEL")
printf '%s: median %s ms, min %s ms\n\n' "$MODEL" "$med" "$min"

printf '%7s  %10s  %10s  %15s\n' layers "median ms" "min ms" "median ms/layer"
declare -A medians=() mins=()
for n in "${LAYERS[@]}"; do
    f="$TMP/llama3.1-405b-$n-layers.ron"
    sed -E "s/^([[:space:]]*num_hidden_layers:)[[:space:]]*[0-9]+/\1 $n/" "$MODEL" >"$f"
    grep -Eq "num_hidden_layers: $n,?$" "$f" || { echo "could not set $n layers in $f" >&2; exit 1; }
    read -r med min < <(time_model "$f")
    medians[$n]=$med
    mins[$n]=$min
    printf '%7d  %10s  %10s  %15s\n' "$n" "$med" "$min" "$(awk -v m="$med" -v n="$n" 'BEGIN { printf "%.4f", m / n }')"
done
lo=${LAYERS[0]}
hi=${LAYERS[${#LAYERS[@]} - 1]}
echo
for stat in median min; do
    if [ "$stat" = median ]; then a=${medians[$lo]} b=${medians[$hi]}; else a=${mins[$lo]} b=${mins[$hi]}; fi
    awk -v a="$a" -v b="$b" -v lo="$lo" -v hi="$hi" -v stat="$stat" 'BEGIN {
        s = (b - a) / (hi - lo)
        printf "%-6s slope %d→%d layers: %.4f ms per added layer, intercept (startup + fixed work) %.3f ms\n",
            stat, lo, hi, s, a - lo * s
    }'
done
if [ -s "$TMP/outliers" ]; then
    echo "note: hyperfine saw statistical outliers for $(paste -sd' ' "$TMP/outliers");" \
        "the machine was busy, so prefer the min column or rerun with more RUNS"
fi
