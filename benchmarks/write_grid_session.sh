#!/bin/bash
# One device call for the grid write (issue #25, pallas_kernels/write_grid.py): its tests and the write tests around
# it compiled on the GPU, then the 4096 x 1 decode write with the CUDA peer in each run (benchmarks/bench.py), once per
# PallasConfig variant (the grid as configured by default, other grid sizes, the multi-launch write).
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/write_grid_session.sh; SKIP="NAME ..." skips
# steps; VARIANTS ("name=JSON ...", JSON without spaces; default: grid, multi), CASES (bench.py --only, default
# write_4096x1_none), X64 (bench.py --x64, default off), TESTS, CAP1, CAP2 (per variant).
set -u -o pipefail
STEP_TAIL=${STEP_TAIL:-6}
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
session_begin ./write_grid_out
# shellcheck disable=SC2086  # TESTS is a word list
step 01_tests "${CAP1:-240}" python3 -m pytest -o addopts= -q -p no:cacheprovider -rf \
  ${TESTS:-tests/test_pallas_write_grid.py tests/test_pallas_write_fused.py tests/test_pallas_write_claim.py}
for v in ${VARIANTS:-grid={} multi={\"write_grid_max_tokens\":0}}; do
  name=${v%%=*}
  step "02_bench_$name" "${CAP2:-150}" python3 -X faulthandler -m benchmarks.bench --only "${CASES:-write_4096x1_none}" \
    --x64 "${X64:-off}" --quick --skip-reference --config "${v#*=}" --out "$OUT/b_$name"
  [ -f "$OUT/b_$name/bench.json" ] && mv "$OUT/b_$name/bench.json" "$OUT/bench_$name.json"
  rm -rf "$OUT/b_$name"
done
session_end
