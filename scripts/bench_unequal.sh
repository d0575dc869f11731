#!/usr/bin/env bash
# Two unequal devices on one 2-core host, as README's "Unequal devices" table measures them:
# two MPI processes, rank 0 on core 0 with the default kernels, rank 1 on core 1 with the
# portable ones (each one pinned thread). Prints each rank alone at tp 1, then prefill and
# decode tokens/s of the even split and of each shares list given, best of 3.
#
#   scripts/bench_unequal.sh [MODEL] [SHARES ...]    (needs `cargo build --release --features mpi`)
set -euo pipefail
cd "$(dirname "$0")/.."
tpc=${TPC:-target/release/tpc}
model=${1:-models/tinyllama-1.1b.ron}
shift || true
shares=("$@")
[ ${#shares[@]} -gt 0 ] || shares=(2,1 3,1 5,1 8,1)
common=(--prompt-len 64 --max-new-tokens 32 --repeat 3 --warmup 1 --threads-per-rank 1 --pin)
figures() { python3 -c 'import json,sys
v=json.loads(sys.stdin.read().strip().splitlines()[-1])
print("%.1f %.2f" % (v["prefill_tokens_per_s"], v["decode_tokens_per_s"]))'; }
echo "host: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores"
echo "alone tp 1 (prefill decode): default $(taskset -c 0 "$tpc" bench "$model" "${common[@]}" | figures)," \
    "portable $(taskset -c 1 "$tpc" bench "$model" "${common[@]}" --isa portable | figures)"
pair() {
    mpirun --allow-run-as-root --oversubscribe \
        -np 1 taskset -c 0 "$tpc" bench "$model" --tp 2 "${common[@]}" "$@" \
        : -np 1 taskset -c 1 "$tpc" bench "$model" --tp 2 "${common[@]}" --isa portable "$@" |
        figures
}
echo "even: $(pair)"
for s in "${shares[@]}"; do
    echo "$s: $(pair --tp-shares "$s")"
done
