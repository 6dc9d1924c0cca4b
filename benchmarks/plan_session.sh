#!/bin/bash
# One device call for the plan kernel (pallas_kernels/plan.py, issue #25): its tests compiled, the plan build
# against the jnp builder (benchmarks.plan_bench), then the serving step's decode scenarios.
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/plan_session.sh
set -u -o pipefail
OUT=${OUT:-./plan_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SKIP=${SKIP:-}
STEP_DIR="$OUT" STEP_TAIL=${STEP_TAIL:-8}
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" \
  > "$OUT/00_env.log" 2>&1; cat "$OUT/00_env.log"
step 00_lanes_probe_1 "${CAP0:-60}" python3 -m benchmarks.plan_lanes_probe 1
step 00_lanes_probe_32 "${CAP0:-60}" python3 -m benchmarks.plan_lanes_probe 32
step 01_plan_tests "${CAP1:-150}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_pallas_plan.py
step 02_plan_bench "${CAP2:-150}" python3 -m benchmarks.plan_bench --json "$OUT/plan_bench.json"
step 03_serving_step "${CAP3:-240}" python3 -X faulthandler -m benchmarks.serving_step --scenario "${SCN:-decode1,decode128}" \
  --budget-s 210 --json "$OUT/serving_step.json"
# the decode steps again with the one-launch write for sourceless launches of up to 128 tokens (HEAD's writes)
if [ -n "${FUSED:-}" ]; then
  step 04_serving_step_fused "${CAP4:-240}" python3 -X faulthandler -m benchmarks.serving_step --scenario "${SCN:-decode1,decode128}" \
    --budget-s 210 --json "$OUT/serving_step_fused.json" --pallas-config '{"write_fused_max_tokens": 128}'
fi
echo "== summary"; cat "$OUT/steps.tsv"
