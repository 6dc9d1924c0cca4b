#!/bin/bash
# One device call (about 9 minutes on the H200) that re-measures the kernels' targets and runs the GPU-only
# tests (benchmarks/results/2026-11-30_h200_pallas.md, session 3): the targeted writes and the verify cases
# with sources, with the peer and the reference check; the long role with 32-entry chunks; the GPU-only
# write tests (duplicates, x64 modes) and the long-role suite, compiled.
#
# Usage (from the repository root, on the GPU machine):  bash benchmarks/pallas_gpu_session.sh
# Environment: OUT (default ./pallas_gpu_out), LONG_TOKENS (32768), DECODE_REQS (4096), BENCH_EXTRA (extra
# benchmarks.bench arguments, e.g. "--pool 4096 --entries 1024" for a CPU dry run), SKIP (step names to skip).
# Every step runs under its own timeout; the logs end up in $OUT/session.tgz (the device returns at most 8
# files) and a summary is printed last.
set -u -o pipefail
OUT=${OUT:-./pallas_gpu_out}
LONG=${LONG_TOKENS:-32768}
DECODE=${DECODE_REQS:-4096}
EXTRA=${BENCH_EXTRA:-}
SKIP=${SKIP:-}
WORK="$OUT/session"
mkdir -p "$WORK"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-$WORK/jaxcache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0

STEP_DIR="$WORK" STEP_TAIL=12
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"

# 1. Targeted writes with the peer and the reference check (the long request takes the long-request role).
step 01_write_targets 150 python3 -m benchmarks.bench $EXTRA --long-tokens "$LONG" --decode-reqs "$DECODE" \
  --only "write_1x${LONG}_none,write_1x${LONG}_all_x4,write_${DECODE}x1_all_x4,write_${DECODE}x1_none" \
  --x64 off --out "$WORK/bench_write"
# 2. The verify cases with sources that the second call did not reach or that changed (32-word tiles).
step 02_verify 100 python3 -m benchmarks.bench $EXTRA --only "verify_all_x1,verify_all_x4,verify_partial_x1" \
  --x64 off --out "$WORK/bench_verify"
# 3. The long role with chunks of 32 entries (default 16; never timed).
step 03_long_chunk32 60 python3 -m benchmarks.bench $EXTRA --long-tokens "$LONG" --decode-reqs "$DECODE" \
  --only "write_1x${LONG}_none" --x64 off --no-peer --skip-reference --config '{"write_long_chunk": 32}' \
  --out "$WORK/bench_long_chunk32"
# 4. GPU-only write tests (duplicates, x64 modes) and the long-role suite, compiled.
step 04_gpu_tests 170 python3 -m pytest -q -p no:cacheprovider -rA tests/test_gpu_pallas.py \
  -k "duplicates or x64"
step 05_long_suite 60 python3 -m pytest -q -p no:cacheprovider -rA tests/test_pallas_long_chain.py \
  -k "long_requests or bad_slots or fuzz_long or several_long or off_the_chunk or x64_on"

echo "== summary"
cat "$WORK/steps.tsv"
for f in "$WORK"/bench_*/bench.md; do [ -f "$f" ] && grep '^|' "$f"; done
grep -h -E '^(PASSED|FAILED|ERROR)|passed|failed' "$WORK"/04_gpu_tests.log "$WORK"/05_long_suite.log 2>/dev/null \
  | tail -n 20
tar czf "$OUT/session.tgz" -C "$WORK" --exclude jaxcache . && rm -rf "$WORK"
