#!/bin/bash
# One device call that runs the compiled GPU tests: the shared backend suites with the Pallas kernels compiled
# (tests/test_pallas_interpret.py), the interop CUDA tests, the GPU-only Pallas tests, and a long-role subset.
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/gpu_tests_session.sh
# Each step has its own cap (seconds); logs land in $OUT/NN_name.log and a summary is printed last.
set -u -o pipefail
OUT=${OUT:-./gpu_tests_out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SKIP=${SKIP:-}
STEP_DIR="$OUT" STEP_TAIL=4
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
python3 -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" \
  > "$OUT/00_env.log" 2>&1; cat "$OUT/00_env.log"
step 01_shared_suites_compiled "${CAP1:-200}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_pallas_interpret.py
step 02_interop_cuda "${CAP2:-130}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_interop_cuda.py
step 03_gpu_pallas "${CAP3:-150}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_gpu_pallas.py
step 04_long_chain_subset "${CAP4:-60}" python3 -m pytest -q -p no:cacheprovider -rf tests/test_pallas_long_chain.py \
  -k "long_requests or several_long or x64_on"
echo "== summary"; cat "$OUT/steps.tsv"
