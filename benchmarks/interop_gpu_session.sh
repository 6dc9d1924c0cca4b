#!/usr/bin/env bash
# One device call for issue #4 (torch interop on CUDA): the evidence that only a GPU can give, most important
# first, each step under its own `timeout`, everything logged under $OUT. Run from the repository root:
#
#   OUT=/some/dir bash benchmarks/interop_gpu_session.sh
#
# Budget: SESSION_BUDGET_S (default 290) seconds of wall time in all; every step gets min(its cap, what is
# left) and is skipped with less than 15 s left. Every first compile of a new program can take ~24 s on the
# H200 machine, so the steps share one persistent JAX compilation cache ($OUT/jaxcache; seeded from
# $JAXCACHE_SEED when that names a directory, e.g. the jaxcache of an earlier session, carried back).
#
# Steps (logs in $OUT/NN_*.log, pytest junit in $OUT/NN_*.xml, bench results in $OUT/bench*/):
#   1. benchmarks.interop_bench, pallas, tiny launches at 1M and 16M slots: torch-launched vs the same program
#      from JAX, the per-phase / stream-mode / alias-check attribution and the handshake steps alone;
#   2. CUDA tests never run on the GPU: bad input (device mix, dtype, non-contiguous, aliasing outputs,
#      consumed capsule; nothing touched), two GPUs (skips with one), busy-JAX-stream ordering (reference,
#      host-sync mode, pallas), donation stress, side-stream ordering (pallas);
#   3. the torch engine test on CUDA, pallas backend;
#   4. benchmarks.interop_bench, pallas, full-size launches (32768 verify entries, 32 x 8 write tokens) at 1M, 16M;
#   5. if time is left: the engine test with the reference backend, then the reference backend's tiny bench.
set -u
OUT=${OUT:?set OUT to the output directory}
BUDGET=${SESSION_BUDGET_S:-290}
mkdir -p "$OUT/jaxcache"
if [ -n "${JAXCACHE_SEED:-}" ] && [ -d "$JAXCACHE_SEED" ]; then cp -r "$JAXCACHE_SEED/." "$OUT/jaxcache/"; fi
export JAX_COMPILATION_CACHE_DIR="$OUT/jaxcache"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
START=$(date +%s)
STATUS="$OUT/steps.tsv"
printf 'step\trc\tseconds\tcap_s\n' > "$STATUS"

left() { echo $(( BUDGET - ($(date +%s) - START) )); }

# step NAME CAP_S COMMAND...: runs COMMAND under timeout min(CAP_S, left - 5), SIGINT first (pytest then
# prints its summary and writes its junit file), SIGKILL 8 s later; logs to $OUT/NAME.log.
step() {
  local name=$1 cap=$2; shift 2
  local l; l=$(left)
  local t=$(( cap < l - 5 ? cap : l - 5 ))
  if [ "$t" -lt 15 ]; then
    echo "== $name: skipped (${l}s left)" | tee -a "$OUT/session.log"
    printf '%s\tskipped\t0\t%s\n' "$name" "$cap" >> "$STATUS"
    return 0
  fi
  echo "== $name: timeout ${t}s, $(left)s left: $*" | tee -a "$OUT/session.log"
  local s0; s0=$(date +%s)
  timeout -s INT -k 8 "$t" "$@" > >(tee "$OUT/$name.log") 2>&1
  local rc=$?
  wait
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - s0 ))" "$t" >> "$STATUS"
  echo "== $name: rc=$rc after $(( $(date +%s) - s0 ))s" | tee -a "$OUT/session.log"
}

PYTEST=("$PY" -m pytest -p no:cacheprovider -rA -v --tb=short -W ignore::DeprecationWarning)
# per-test caps need pytest-timeout (on the device machine); without it the step's timeout alone applies
to() { if "$PY" -c "import pytest_timeout" 2>/dev/null; then echo "--timeout=$1"; fi; }
# dry run on CPU: INTEROP_BENCH_DEVICE=cpu SESSION_SIZES="4096 8192" SESSION_CAP=2048
read -r -a SIZES <<< "${SESSION_SIZES:-1048576 16777216}"
CAP=${SESSION_CAP:-32768}
T=tests/test_interop_cuda.py

"$PY" - > "$OUT/00_env.log" 2>&1 <<'PYEOF'
import jax, torch
print("jax", jax.__version__, jax.devices(), "torch", torch.__version__, torch.cuda.device_count(), "GPUs")
PYEOF

step 01_bench_tiny_pallas 110 "$PY" -m benchmarks.interop_bench --out "$OUT/bench_tiny" \
  --sizes "${SIZES[@]}" --cap "$CAP" --backends pallas --cases tiny --deadline-s 80

step 02_cuda_tests 95 "${PYTEST[@]}" $(to 60) --junitxml="$OUT/02_cuda_tests.xml" \
  "$T::test_cuda_bad_input_names_the_argument_and_touches_nothing" \
  "$T::test_cuda_tensors_on_two_gpus_are_refused_and_touch_nothing" \
  "$T::test_cuda_torch_sees_results_while_jax_stream_is_busy[reference]" \
  "$T::test_cuda_host_sync_mode_also_orders" \
  "$T::test_cuda_donated_buffers_survive_alloc_free_cycles" \
  "$T::test_cuda_torch_sees_results_while_jax_stream_is_busy[pallas]" \
  "$T::test_cuda_jax_waits_for_a_side_stream_write_the_current_stream_waits_for[pallas]"

step 03_engine_cuda_pallas 75 "${PYTEST[@]}" $(to 70) --junitxml="$OUT/03_engine_cuda_pallas.xml" \
  "tests/test_torch_engine.py::test_engine_clean_run_and_detects_corruption_cuda[pallas]"

step 04_bench_full_pallas 90 "$PY" -m benchmarks.interop_bench --out "$OUT/bench_full" \
  --sizes "${SIZES[@]}" --cap "$CAP" --backends pallas --cases full --no-profile --no-attribution --deadline-s 60

step 05_engine_cuda_reference 60 "${PYTEST[@]}" $(to 55) --junitxml="$OUT/05_engine_cuda_reference.xml" \
  "tests/test_torch_engine.py::test_engine_clean_run_and_detects_corruption_cuda[reference]"

step 06_bench_tiny_reference 60 "$PY" -m benchmarks.interop_bench --out "$OUT/bench_tiny_reference" \
  --sizes "${SIZES[@]}" --cap "$CAP" --backends reference --cases tiny --no-profile --no-attribution --deadline-s 40

# --- summary (printed last) ----------------------------------------------------------------------------------
"$PY" - "$OUT" > "$OUT/summary.txt" 2>&1 <<'PYEOF'
import glob, json, os, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
print("steps (rc 124/137: timed out; 130: interrupted by its timeout's SIGINT):")
print(open(os.path.join(out, "steps.tsv")).read())
print("| test | result | seconds |\n|---|---|---|")
for x in sorted(glob.glob(os.path.join(out, "*.xml"))):
    try:
        root = ET.parse(x).getroot()
    except ET.ParseError as e:
        print(f"| {os.path.basename(x)} | unreadable: {e} | |")
        continue
    for tc in root.iter("testcase"):
        res = "passed"
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                res = f"{tag}: {(el.get('message') or '')[:100]}"
        print(f"| {tc.get('name')} | {res} | {float(tc.get('time') or 0):.1f} |")
for d in ("bench_tiny", "bench_full", "bench_tiny_reference"):
    p = os.path.join(out, d, "interop_gpu.json")
    if not os.path.exists(p):
        print(f"\n{d}: no results")
        continue
    rows = json.load(open(p))["results"]
    print(f"\n{d}: slots backend op case entries | torch us/call | JAX us/call | overhead | aliased/copied")
    for r in rows:
        if "torch_us_per_call" in r:
            print(f"  {r['slots']:>9} {r['backend']} {r['op']:<6} {r['case']:<4} {r['entries']:>5} | "
                  f"{r['torch_us_per_call']:>8} | {r['jax_us_per_call']:>8} | {r['overhead_us']:>8} | "
                  f"{len(r['aliased'])} aliased, {len(r['copied_back'])} copied, {r['violations_during_timing']} viol")
        elif "error" in r:
            err = r["error"].strip().splitlines()[-1][:100]
            print(f"  {r.get('slots')} {r.get('backend')} {r.get('case', '')}: {err}")
        elif "attribution" in r:
            for k, v in r["attribution"].items():
                if "modes" in k:
                    print(f"  {k}: " + ", ".join(f"{m} {t[0]}" for m, t in v.items()))
                else:
                    print(f"  {k}: " + ", ".join(f"{p} {q['us_per_call']}" for p, q in v.items()))
        elif "overhead_steps" in r:
            for k, v in r["overhead_steps"].items():
                print(f"  step alone: {k}: {v['us_per_call']} us/call, latency {v['latency_us']}")
print(f"\njaxcache: {sum(len(f) for _, _, f in os.walk(os.path.join(out, 'jaxcache')))} files")
PYEOF
cat "$OUT/summary.txt"
echo "session total $(( $(date +%s) - START ))s"
