#!/bin/bash
# The step runner the GPU session scripts source, with their shared start and end (session_begin, session_end).
# step NAME CAP_SECONDS COMMAND...: runs COMMAND under `timeout` (SIGINT at the cap, SIGKILL 10 s later) with its
# output in $STEP_DIR/NAME.log, prints the log's last $STEP_TAIL lines (default 4) and appends "NAME rc=RC Ns" to
# $STEP_DIR/steps.tsv; a NAME listed in $SKIP (space-separated) is skipped.
step() {  # step NAME CAP_SECONDS COMMAND...
  local name=$1 cap=$2
  shift 2
  case " ${SKIP:-} " in *" $name "*) echo "== $name: skipped"; return;; esac
  echo "== $name (cap ${cap}s): $*"
  local t0=$SECONDS
  timeout -s INT -k 10 "$cap" "$@" > "$STEP_DIR/$name.log" 2>&1
  local rc=$?
  tail -n "${STEP_TAIL:-4}" "$STEP_DIR/$name.log"
  printf '%s\trc=%s\t%ss\n' "$name" "$rc" "$((SECONDS - t0))" >> "$STEP_DIR/steps.tsv"
}

# session_begin DEFAULT_OUT: $OUT (DEFAULT_OUT when unset) made, the compile caches under $CACHE
# (default /tmp/canary_gpu_cache: a second run on a warm machine compiles nothing), the exports every step needs,
# STEP_DIR, and the versions in $OUT/00_env.log.
session_begin() {
  OUT=${OUT:-$1}
  mkdir -p "$OUT"
  CACHE=${CACHE:-/tmp/canary_gpu_cache}
  mkdir -p "$CACHE/jax" "$CACHE/triton"
  export JAX_COMPILATION_CACHE_DIR="$CACHE/jax" CANARY_JAX_TRITON_CACHE="$CACHE/triton"
  export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
  SKIP=${SKIP:-}
  STEP_DIR="$OUT"
  python3 -c "import jax, torch, triton; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, \
'triton', triton.__version__)" > "$OUT/00_env.log" 2>&1
  cat "$OUT/00_env.log"
}

# session_end: the steps' summary, then every log gathered into $OUT/logs.txt (the device returns at most 8 files).
session_end() {
  echo "== summary"
  cat "$OUT/steps.tsv"
  for f in "$OUT"/*.log; do echo "=== $(basename "$f")"; cat "$f"; done > "$OUT/logs.txt" && rm -f "$OUT"/*.log
}
