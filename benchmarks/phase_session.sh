#!/bin/bash
# One device call for the one-launch phase (pallas_kernels/phase.py, issue #25): its tests compiled on the GPU
# (tests/test_pallas_phase.py, the fused write's), then the serving step's decode scenarios with the phase as one
# `canary_phase` kernel (the default) and as separate verify and write launches (`phase_one_launch: false`), in
# one run.
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/phase_session.sh; SKIP="NAME ..." skips
# steps; SCN (scenarios, default decode1,decode128) and BUDGET (the serving step's --budget-s, default 150).
set -u -o pipefail
STEP_TAIL=${STEP_TAIL:-6}
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
session_begin ./phase_out
step 01_tests "${CAP1:-170}" python3 -m pytest -o addopts= -q -p no:cacheprovider -rf tests/test_pallas_phase.py \
  tests/test_pallas_write_fused.py::FusedWriteTest
serving() {  # serving NAME CAP [--pallas-config JSON]
  local name=$1 cap=$2
  shift 2
  step "$name" "$cap" python3 -X faulthandler -m benchmarks.serving_step --scenario "${SCN:-decode1,decode128}" \
    --pool-for chosen --budget-s "${BUDGET:-150}" --json "$OUT/$name.json" "$@"
}
serving 02_serving_step "${CAP2:-200}"
serving 03_serving_step_apart "${CAP3:-200}" --pallas-config '{"phase_one_launch": false}'
session_end
