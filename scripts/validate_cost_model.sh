#!/usr/bin/env bash
# Compares `tpc simulate` with a fresh `tpc calibrate` profile against `tpc bench` on this
# host, in interleaved rounds (calibrate, then bench and simulate at tp 1 and 2), and prints
# per cell the median predicted and measured tokens/s over the rounds and their ratio.
# Medians on both sides: one round's burst (this host's GEMM rate moves by ±30 % from one
# second to the next when other guests run) must not decide the comparison.
#
#   scripts/validate_cost_model.sh [MODEL.ron] [ROUNDS] [NEW_TOKENS]
# Needs a release build (cargo build --release) and python3.
set -euo pipefail
cd "$(dirname "$0")/.."
model=${1:-models/tinyllama-1.1b.ron}
rounds=${2:-5}
gen=${3:-16}
tpc=target/release/tpc
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs), $(nproc) cores;" \
    "flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|avx512f|avx512_bf16|amx_bf16)$' | xargs)"
echo "model: $model, prompt 128, $gen new tokens, batch 1, $rounds rounds; load: $(cut -d' ' -f1-3 /proc/loadavg)"
for r in $(seq 1 "$rounds"); do
    "$tpc" calibrate -o "$work/host-$r.ron" >/dev/null
    for tp in 1 2; do
        "$tpc" bench "$model" --tp "$tp" --prompt-len 128 --max-new-tokens "$gen" \
            --warmup 1 --repeat 1 2>/dev/null | tail -1 >"$work/bench-$r-$tp.json"
        "$tpc" simulate "$model" --tp "$tp" --hw "$work/host-$r.ron" --prompt-len 128 \
            --gen "$gen" --sequence-parallel=off --json >"$work/sim-$r-$tp.json"
    done
done
python3 - "$work" "$rounds" <<'PY'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
print(f"{'tp':>2}  {'prefill pred':>12} {'meas':>9} {'ratio':>6}   {'decode pred':>11} {'meas':>9} {'ratio':>6}")
for tp in (1, 2):
    cells = {}
    for phase, key in (("prefill", "prefill_tokens_per_s"), ("decode", "decode_tokens_per_s")):
        pred = [json.load(open(f"{work}/sim-{r}-{tp}.json"))["tokens_per_s"][phase] for r in range(1, rounds + 1)]
        meas = [json.load(open(f"{work}/bench-{r}-{tp}.json"))[key] for r in range(1, rounds + 1)]
        p, m = statistics.median(pred), statistics.median(meas)
        cells[phase] = (p, m, p / m, min(meas), max(meas))
    pf, dc = cells["prefill"], cells["decode"]
    print(f"{tp:>2}  {pf[0]:>12.1f} {pf[1]:>9.1f} {pf[2]:>6.2f}   {dc[0]:>11.2f} {dc[1]:>9.2f} {dc[2]:>6.2f}"
          f"   (measured range: prefill {pf[3]:.1f}..{pf[4]:.1f}, decode {dc[3]:.2f}..{dc[4]:.2f})")
PY
