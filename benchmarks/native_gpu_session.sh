#!/usr/bin/env bash
# One device call for issue #15 (the native torch path): what only a GPU can show, most important first, each
# step under its own `timeout`, logs under $OUT. Run from the repository root:
#
#   OUT=/some/dir bash benchmarks/native_gpu_session.sh
#
# Steps (logs in $OUT/NN_*.log):
#   1. the Triton kernels compile with torch's triton and launch (test_native_triton.py on CUDA);
#   2. the native path on CUDA: SGLang byte parity of random launches, the SGLang-layout and vLLM-layout
#      engines (native and DLPack paths), the CUDA-graph test (100 replays + a fault);
#   3. the interop CUDA tests of the DLPack path (its mechanics, now selected with $CANARY_JAX_TORCH_PATH);
#   4. benchmarks.native_bench: host time per launch (native, DLPack, JAX-launched), device time native vs
#      the JAX path, and a captured decode step's replay time.
set -u
OUT=${OUT:?set OUT to the output directory}
# compile caches outside $OUT: only 8 files come back from it
CACHE=${CACHE:-/tmp/canary_gpu_cache}
mkdir -p "$OUT" "$CACHE/jax" "$CACHE/triton"
export JAX_COMPILATION_CACHE_DIR="$CACHE/jax"
export CANARY_JAX_TRITON_CACHE="$CACHE/triton"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
# pyproject's addopts asks for two xdist workers; one process here keeps the logs in order.

STEPS=${STEPS:-01 02 03 04}  # which steps to run, by number

step() {  # step NAME CAP_S COMMAND...
  local name=$1 cap=$2
  shift 2
  case " $STEPS " in *" ${name%%_*} "*) ;; *) return 0 ;; esac
  local t0=$(date +%s)
  timeout -s INT -k 8 "$cap" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s"
  tail -n 3 "$OUT/$name.log"
}

$PY -c "import jax, torch, triton; print('jax', jax.__version__, 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$OUT/00_versions.log"
step 01_triton 110 $PY -m pytest -o addopts= -q -x -p no:cacheprovider tests/test_native_triton.py
step 02_native 200 $PY -m pytest -o addopts= -q -p no:cacheprovider \
  tests/test_interop_cuda.py::test_cuda_native_path_random_launches_match_sglang_reference \
  tests/test_native_graphs.py tests/test_native_replay.py tests/test_torch_engine.py tests/test_torch_engine_vllm.py
step 03_dlpack 110 $PY -m pytest -o addopts= -q -p no:cacheprovider tests/test_interop_cuda.py -k "not native"
step 04_bench 160 $PY -m benchmarks.native_bench --out "$OUT/bench"
