#!/usr/bin/env bash
# --tp-shares and uneven tps on a lent GPU machine (from the repository root, dist/ carried):
# every fixture with reference logits, f32, at shares 2,1 / 1,3 / 3,1,1,1 / 1,2,3 and at
# tp 3, 5, 6, 7 unevenly, `tpc run --device cuda --dump-logits` checked against transformers
# by scripts/check_logits.py (relative error <= 1e-4 and HF's greedy tokens). Every rank
# shares the one GPU. Prints one line per run and a count; writes them to $OUT/shares.txt.
set -uo pipefail
TPC=${TPC:-dist/tpc}
OUT=${OUT:-target/device-shares}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT" target/device-shares-runs
if [ "$DEVICE" = cuda ]; then
    export LD_LIBRARY_PATH=$(python3 -c 'import glob,nvidia;print(":".join(sorted({d for b in nvidia.__path__ for d in glob.glob(b+"/*/lib")})))')${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
pass=0 fail=0 refused=0
one() {
    local dir=$1 tp=$2 shares=$3 ids=$4 n=$5 base rc=0 tokens verdict
    base=target/device-shares-runs/$(basename "$dir")-tp$tp-${shares//,/_}
    local flags=(--tp "$tp")
    [ -n "$shares" ] && flags+=(--tp-shares "$shares")
    timeout -k 5 60 "$TPC" run "$dir" "${flags[@]}" --device "$DEVICE" --dtype f32 \
        --prompt-ids "$ids" --max-new-tokens "$n" --dump-logits "$base.safetensors" \
        >"$base.stdout" 2>"$base.stderr" || rc=$?
    tokens=$( (grep -m1 '[^[:space:]]' "$base.stdout" || true) | tr -d '[:space:]')
    if [ "$rc" -ne 0 ]; then
        if grep -qE 'fused dimension|divide|not divisible' "$base.stderr"; then
            echo "REFUSED $(basename "$dir") tp=$tp shares=${shares:-even}: $(tail -n1 "$base.stderr" | cut -c1-160)"
            return 2
        fi
        echo "FAIL $(basename "$dir") tp=$tp shares=${shares:-even}: exit $rc: $(tail -n1 "$base.stderr" | cut -c1-200)"
        return 1
    fi
    verdict=$("${PYTHON:-python3}" scripts/check_logits.py "$base.safetensors" "$dir" 1e-4 "$tokens" 2>&1 | grep -E '^(PASS|FAIL) ' | tail -n1)
    echo "${verdict%% *} $(basename "$dir") tp=$tp shares=${shares:-even}: ${verdict#* }"
    [ "${verdict%% *}" = PASS ]
}
{
for dir in tests/fixtures/checkpoints/*/; do
    dir=${dir%/}
    [ -f "$dir/reference.json" ] || continue
    read -r ids n < <("${PYTHON:-python3}" -c 'import json,sys; r=json.load(open(sys.argv[1]));
print(",".join(map(str, r["prompt_ids"])), len(r["greedy_ids"]))' "$dir/reference.json")
    for spec in "2 2,1" "2 1,3" "4 3,1,1,1" "3 1,2,3" "3 " "5 " "6 " "7 "; do
        read -r tp shares <<<"$spec"
        one "$dir" "$tp" "${shares:-}" "$ids" "$n"
        case $? in 0) pass=$((pass + 1)) ;; 2) refused=$((refused + 1)) ;; *) fail=$((fail + 1)) ;; esac
    done
done
echo "shares/uneven on $DEVICE: $pass passed, $fail failed, $refused refused"
} 2>&1 | tee "$OUT/shares.txt"
