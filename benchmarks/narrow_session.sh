#!/bin/bash
# One device call for the narrow batch fields (issue #25): their tests compiled on the GPU, then the step's canary
# with the fields narrow against widened and the Pallas decode attention against XLA's (benchmarks/launch_probe.py),
# then the serving step's decode scenarios with both, in one run.
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/narrow_session.sh; SKIP="NAME ..." skips
# steps; SCN (scenarios, default decode1,decode128), PSCN (the probe's, default SCN), ASCN (more
# scenarios for the decode attention alone, none by default; cap CAP2B), TESTS (the test files, default the
# narrow and phase tests), PROBE_ARGS (more launch_probe arguments, e.g. --variants / --variant-config, JSON
# without spaces), BUDGET (the serving step's --budget-s, default 120), CAP1..CAP3.
set -u -o pipefail
STEP_TAIL=${STEP_TAIL:-6}
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
session_begin ./narrow_out
# shellcheck disable=SC2086  # TESTS and PROBE_ARGS are word lists
step 01_tests "${CAP1:-150}" python3 -m pytest -o addopts= -q -p no:cacheprovider -rf \
  ${TESTS:-tests/test_pallas_narrow.py tests/test_pallas_phase.py}
step 02_launch_probe "${CAP2:-240}" python3 -X faulthandler -m benchmarks.launch_probe --scenario "${PSCN:-${SCN:-decode1,decode128}}" \
  --json "$OUT/launch_probe.json" ${PROBE_ARGS:-}
[ -n "${ASCN:-}" ] && step 02b_attention "${CAP2B:-90}" python3 -X faulthandler -m benchmarks.launch_probe --parts attention \
  --scenario "$ASCN" --json "$OUT/attention_probe.json"
step 03_serving_step "${CAP3:-300}" python3 -X faulthandler -m benchmarks.serving_step --scenario "${SCN:-decode1,decode128}" \
  --pool-for chosen --budget-s "${BUDGET:-120}" --json "$OUT/serving_step.json"
session_end
