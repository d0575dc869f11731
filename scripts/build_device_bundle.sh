#!/usr/bin/env bash
# Build what scripts/device_check.sh runs on a lent GPU machine, which has no Rust
# toolchain: the CUDA-enabled tpc and every test executable, stripped, in dist/ (git-ignored,
# carried there next to the working tree).
#
#   scripts/build_device_bundle.sh          # then: run scripts/device_check.sh there
#
# dist/tpc                 target/release/tpc built with --features cuda
# dist/tests/KIND-NAME     each test executable cargo reports (lib-tpc, bin-tpc, test-batch, ...);
#                          when dist/ would pass LIMIT_MIB, packed instead as dist/tests.tar.xz
# dist/build-root.txt      the repository path at build time: test executables have it compiled
#                          in (CARGO_MANIFEST_DIR, CARGO_BIN_EXE_tpc), and the device script
#                          links it to wherever the copy lands there
# dist/build-info.txt      commit, dirty state, toolchain, date
#
# dist/ must stay under LIMIT_MIB (default 60) because the carry to the device is capped.
set -euo pipefail
cd "$(dirname "$0")/.."

LIMIT_MIB=${LIMIT_MIB:-60}
DIST=dist
log() { printf '[build_device_bundle] %s\n' "$*" >&2; }

log "cargo build --release --features cuda"
cargo build --release --features cuda

# The test executables: cargo names them in its JSON messages; the human output is not stable.
log "cargo test --release --features cuda --no-run"
messages=$(mktemp)
trap 'rm -f "$messages"' EXIT
cargo test --release --features cuda --no-run --message-format=json >"$messages"

rm -rf "$DIST"
mkdir -p "$DIST/tests"
cp target/release/tpc "$DIST/tpc"
strip "$DIST/tpc"

# One "KIND-NAME<TAB>PATH" per test executable (kind lib, bin or test, the cargo target kind).
python3 - "$messages" >"$DIST/tests.list" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") == "compiler-artifact" and m.get("profile", {}).get("test") and m.get("executable"):
        # The kernels on the CPU emulator need g++ and test nothing of the GPU: CI runs them.
        if m["target"]["name"].startswith("cuda_emulated"):
            continue
        kind = m["target"]["kind"][0]
        print(f"{kind}-{m['target']['name']}\t{m['executable']}")
EOF
n=0
while IFS=$'\t' read -r name exe; do
    cp "$exe" "$DIST/tests/$name"
    strip "$DIST/tests/$name"
    n=$((n + 1))
done <"$DIST/tests.list"
rm "$DIST/tests.list"
[ "$n" -gt 0 ] || { log "cargo reported no test executables"; exit 1; }

pwd >"$DIST/build-root.txt"
{
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    # The other engineer's edits are usually uncommitted: say so, the binary contains them.
    echo "dirty files: $(git status --porcelain 2>/dev/null | grep -c . || true)"
    echo "rustc: $(rustc --version)"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
} >"$DIST/build-info.txt"

size_kib=$(du -sk "$DIST" | cut -f1)
log "dist/: tpc + $n test executables, $((size_kib / 1024)) MiB"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    # The test executables share most of their code (each links all of tpc): one solid xz
    # archive of them is several times smaller than the files. device_check.sh unpacks it.
    log "over $LIMIT_MIB MiB: packing dist/tests/ into dist/tests.tar.xz"
    tar -C "$DIST" -cf - tests | xz -T0 -6 >"$DIST/tests.tar.xz"
    rm -rf "$DIST/tests"
    size_kib=$(du -sk "$DIST" | cut -f1)
fi
ls -lR "$DIST" >&2
log "dist/: $((size_kib / 1024)) MiB (limit $LIMIT_MIB MiB)"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    log "dist/ is larger than $LIMIT_MIB MiB"
    exit 1
fi
