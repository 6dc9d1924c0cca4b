#!/bin/bash
# Device calls for issues #25 / #26 (stop 34): the fused decode write's tests and the replay-key tests on CUDA, the
# serving step's decode scenarios with the default configuration and with the one-launch write for launches with
# real-KV sources too, where a replayed native launch spends host time, and the native bench.
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/glue_session.sh; SKIP="NAME ..." skips steps;
# SCN (scenarios, default decode1), BUDGET (the serving step's --budget-s, default 90) and HASHED (write_fused_max_hashed
# of step 03, default 128) pick the serving-step runs.
# Logs are gathered into $OUT/logs.txt at the end (the device returns at most 8 files).
set -u -o pipefail
STEP_TAIL=${STEP_TAIL:-6}
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
session_begin ./glue_out
HASHED=${HASHED:-128}
step 01_tests "${CAP1:-130}" bash -c 'python3 -m pytest -o addopts= -q -p no:cacheprovider -rf tests/test_native_triton.py \
  -k "sm90 or every_pallas_call"; python3 -m pytest -o addopts= -q -p no:cacheprovider -rf tests/test_native_replay.py \
  tests/test_interop_cuda.py::test_cuda_native_path_random_launches_match_sglang_reference'
step 02_serving_step "${CAP2:-110}" python3 -X faulthandler -m benchmarks.serving_step --scenario "${SCN:-decode1}" \
  --pool-for chosen --budget-s "${BUDGET:-90}" --json "$OUT/serving_step.json"
step 03_serving_step_hashed "${CAP3:-110}" python3 -X faulthandler -m benchmarks.serving_step \
  --scenario "${SCN:-decode1}" --pool-for chosen --budget-s "${BUDGET:-90}" --json "$OUT/serving_step_hashed.json" \
  --pallas-config "{\"write_fused_max_hashed\": $HASHED}"
step 04_replay_profile "${CAP4:-90}" python3 -m benchmarks.replay_profile --inference --json "$OUT/replay_profile.json"
step 05_native_bench "${CAP5:-170}" python3 -m benchmarks.native_bench --out "$OUT/native"
step 06_native_bench_hashed "${CAP6:-170}" python3 -m benchmarks.native_bench --out "$OUT/native_hashed" \
  --pallas-config "{\"write_fused_max_hashed\": 256}"
# the decode write alone (JAX path, same process): the default against the one-launch write with sources
step 07_bench_write "${CAP7:-100}" python3 -m benchmarks.bench --quick --decode-reqs 128 --only write_128x1 --x64 off \
  --skip-reference --no-peer --out "$OUT/bench" --probe mini --probe-cases write_128x1_partial_x4,write_128x1_all_x1 \
  --probe-json "{\"write\": [{\"write_fused_max_hashed\": 128}]}"
session_end
for f in "$OUT"/bench/*.json; do [ -f "$f" ] && mv "$f" "$OUT/bench_$(basename "$f")"; done; rm -rf "${OUT:?}/bench"
for d in native native_hashed; do
  [ -f "$OUT/$d/native_bench.json" ] && mv "$OUT/$d/native_bench.json" "$OUT/${d}_bench.json"; rm -rf "${OUT:?}/$d"
done
