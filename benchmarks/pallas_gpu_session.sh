#!/bin/bash
# One device call (about 9 minutes on the H200) that measures what issue #3 still lacks after session 2
# (benchmarks/results/2026-11-30_h200_pallas.md): the restructured write chain's run time and compile time,
# the untimed verify tile variants, the GPU-only tests, the shared suite compiled on the GPU, and the write
# modes never timed.
#
# Usage (from the repository root, on the GPU machine):  bash benchmarks/pallas_gpu_session.sh
# Environment: OUT (default ./pallas_gpu_out), LONG_TOKENS (32768), DECODE_REQS (4096), BENCH_EXTRA (extra
# bench.py arguments, e.g. "--pool 4096 --entries 1024" for a CPU dry run), SKIP (step names to skip).
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

step() {  # step NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2
  shift 2
  case " $SKIP " in *" $name "*) echo "== $name: skipped"; return;; esac
  echo "== $name (cap ${cap}s): $*"
  local t0=$SECONDS
  timeout -s INT -k 10 "$cap" "$@" > "$WORK/$name.log" 2>&1
  local rc=$?
  tail -n 12 "$WORK/$name.log"
  printf '%s\trc=%s\t%ss\n' "$name" "$rc" "$((SECONDS - t0))" >> "$WORK/steps.tsv"
}

# 1. The restructured chain (one load / store per chunk): run time of the targeted writes and their compile
#    time (bench.json: compile_s), with the peer and the reference check.
step 01_write_targets 150 python3 benchmarks/bench.py $EXTRA --long-tokens "$LONG" --decode-reqs "$DECODE" \
  --only "write_1x${LONG}_none,write_1x${LONG}_all_x4,write_${DECODE}x1_all_x4,write_${DECODE}x1_none" \
  --x64 off --out "$WORK/bench_write"
# 2. Verify with sources: the tile variants not yet timed (16-byte loads, 32-word tiles) against the default.
step 02_verify_tiles 100 python3 benchmarks/sweep_verify.py $EXTRA --budget-s 85 --modes all_x4,partial_x4 \
  --variants default,tile_contiguous,tile32,tile_contiguous32 --out "$WORK/sweep_verify"
# 3. The GPU-only tests (million entries, duplicates, 2**31 offsets, page sizes, multipliers, x64 modes).
step 03_gpu_tests 130 python3 -m pytest -q -p no:cacheprovider -rA tests/test_gpu_pallas.py
# 4. The shared suite, compiled on the GPU.
step 04_shared_suite 130 python3 -m pytest -q -p no:cacheprovider -rA tests/test_pallas_interpret.py
# 5. The write modes never timed.
step 05_write_modes 60 python3 benchmarks/bench.py $EXTRA --long-tokens "$LONG" --decode-reqs "$DECODE" \
  --only "write_1x${LONG}_partial_x4,write_1x${LONG}_all_x1,write_${DECODE}x1_partial_x4,write_${DECODE}x1_all_x1" \
  --x64 off --no-peer --skip-reference --out "$WORK/bench_write_modes"

echo "== summary"
cat "$WORK/steps.tsv"
for f in "$WORK"/bench_*/bench.md "$WORK"/sweep_verify/sweep_verify.md; do [ -f "$f" ] && grep '^|' "$f"; done
grep -h -E '^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed' "$WORK"/03_gpu_tests.log "$WORK"/04_shared_suite.log 2>/dev/null \
  | tail -n 20
tar czf "$OUT/session.tgz" -C "$WORK" --exclude jaxcache . && rm -rf "$WORK"
