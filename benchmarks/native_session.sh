#!/bin/bash
# Device calls for issue #26 (the native path as kernels only): its CUDA tests, then the native bench on this tree
# and on a baseline tree in one run (BASE, a directory holding the older tree, default ./_baseline), then where an
# eager native launch spends host time (a seen launch key, then every launch unseen), and where a replayed one does
# (this tree and the baseline).
# Usage (repository root, on the GPU machine): OUT=DIR bash benchmarks/native_session.sh; SKIP="NAME ..." skips steps.
set -u -o pipefail
STEP_TAIL=${STEP_TAIL:-6}
. "$(dirname "${BASH_SOURCE[0]}")/session_step.sh"
session_begin ./native_out
BASE=${BASE:-./_baseline}
step 01_tests "${CAP1:-240}" python3 -m pytest -o addopts= -q -p no:cacheprovider -rf -x \
  tests/test_interop_cuda.py::test_cuda_native_path_random_launches_match_sglang_reference tests/test_native_graphs.py \
  tests/test_native_replay.py tests/test_native_plan.py::test_cuda_plan_is_the_triton_kernel_and_matches tests/test_native_path.py \
  tests/test_native_memo.py tests/test_native_keys.py tests/test_torch_engine.py::test_engine_clean_run_and_detects_corruption_cuda \
  tests/test_torch_engine_vllm.py::test_engine_cuda
step 02_native_bench "${CAP2:-170}" python3 -m benchmarks.native_bench --out "$OUT/native"
[ -d "$BASE" ] && step 03_native_bench_base "${CAP3:-170}" bash -c "cd '$BASE' && python3 -m benchmarks.native_bench \
  --out '$OUT/native_base'"
step 04_eager_profile "${CAP4:-90}" python3 -m benchmarks.eager_profile --top 25 --inference
step 05_eager_unseen "${CAP5:-90}" python3 -m benchmarks.eager_profile --top 25 --inference --unseen
step 06_replay_profile "${CAP6:-90}" python3 -m benchmarks.replay_profile --inference --json "$OUT/replay_profile.json"
[ -d "$BASE" ] && step 07_replay_profile_base "${CAP7:-90}" bash -c "cd '$BASE' && python3 -m benchmarks.replay_profile \
  --inference --json '$OUT/replay_profile_base.json'"
session_end
