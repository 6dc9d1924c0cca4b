#!/bin/bash
# One device call for the one-launch write (pallas_kernels/write_fused.py, issue #25): its compiled tests, then
# bench.py's decode-write cases beside the CUDA peer with the fused program's warp counts and the multi-launch
# write as probe variants, then the serving step (decode1, decode128, write4096).
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/write_fused_session.sh
set -u -o pipefail
OUT=${OUT:-./write_fused_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SKIP=${SKIP:-}
STEP_DIR="$OUT" STEP_TAIL=4
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" \
  > "$OUT/00_env.log" 2>&1; cat "$OUT/00_env.log"
step 01_fused_tests "${CAP1:-170}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_pallas_write_fused.py \
  -k FusedWrite
step 03_gpu_pallas_write "${CAP3:-100}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_pallas.py -k write
PROBE=${PROBE:-'{"write": [{"write_fused_num_warps": 8}, {"write_fused_num_warps": 32}, {"write_fused_max_tokens": 0, "write_fused_max_hashed": 0}]}'}
step 05_bench_write "${CAP5:-120}" python3 -m benchmarks.bench --quick --only write_4096x1 --x64 off --skip-reference \
  --probe mini --probe-json "$PROBE" --probe-cases write_4096x1_none --out "$OUT/bench_write"
for R in ${REQS:-}; do  # the crossover: fused vs multi-launch at R one-token requests (NONE, PARTIAL x4)
  step "07_bench_write_$R" "${CAP7:-90}" python3 -m benchmarks.bench --quick --decode-reqs "$R" --only "write_${R}x1_n,write_${R}x1_p" \
    --x64 off --skip-reference --probe mini --probe-cases "write_${R}x1_none,write_${R}x1_partial_x4" --out "$OUT/bench_$R" \
    --probe-json '{"write": [{"write_fused_max_tokens": 0, "write_fused_max_hashed": 0}, {"write_fused_max_tokens": 4096, "write_fused_max_hashed": 4096}]}'
done
step 06_serving_step "${CAP6:-200}" python3 -X faulthandler -m benchmarks.serving_step --scenario "${SCN:-decode1,decode128,write4096}" \
  --budget-s 170 --json "$OUT/serving_step.json"
echo "== summary"; cat "$OUT/steps.tsv"
