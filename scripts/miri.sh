#!/usr/bin/env bash
# Miri over the tests of the runtime's unsafe-heavy code that Miri can interpret: the team
# (helper threads, the job pointer, SyncPtr), attention and the packed products writing
# through SyncPtr (portable kernels: Miri reports no AVX features, so the SIMD kernels and
# the AVX-512 attention blocks are skipped by the code itself), and gemm_f32's checks.
# Under cfg(miri) those tests use small shapes and the products split even tiny work over
# the team, so that the shared writes are exercised. Fails when Miri reports undefined
# behaviour (or a test fails); prints a skip line and succeeds where `cargo +nightly miri`
# is not installed.
#
#   scripts/miri.sh                 # both runs below (a first build takes ~8 min on 2 cores)
#   MIRI_EXTRA="-Zmiri-seed=7" scripts/miri.sh   # another thread schedule
#
# Two runs, because rayon (used by PackedMatrix::pack and the gemm crate) goes through
# crossbeam-epoch, which violates Stacked Borrows (crossbeam-rs/crossbeam#545, #878; its own
# CI runs Miri with Tree Borrows), and leaves its pool threads running at exit:
#   1. Stacked Borrows (Miri's default, the stricter model) for the code without rayon;
#   2. Tree Borrows, leaks (rayon's idle threads) ignored, for the tests that pack weights.
# No isolation is disabled: nothing here reads the clock or the file system for real.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! cargo +nightly miri --version >/dev/null 2>&1; then
    echo "miri.sh: SKIP: \`cargo +nightly miri\` is not available (rustup component add miri --toolchain nightly)"
    exit 0
fi

extra=${MIRI_EXTRA:-}
start=$SECONDS

echo "== Miri 1/2 (Stacked Borrows): team, attention, gemm_f32's checks"
MIRIFLAGS="$extra" cargo +nightly miri test --lib -- \
    runtime::cpu::team::tests:: \
    runtime::cpu::attention::tests:: \
    runtime::cpu::backend::tests::gemm_refuses \
    runtime::cpu::backend::tests::gemm_over_an_empty_sum

echo "== Miri 2/2 (Tree Borrows, rayon's threads may outlive main): packed products, CPU backend"
MIRIFLAGS="-Zmiri-tree-borrows -Zmiri-ignore-leaks -Zmiri-permissive-provenance $extra" \
    cargo +nightly miri test --lib -- \
    runtime::cpu::packed::tests:: \
    runtime::cpu::backend::tests::

echo "miri.sh: no undefined behaviour found ($((SECONDS - start)) s)"
