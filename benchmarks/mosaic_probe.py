"""Mosaic GPU experiment for the verify kernel (``pallas_kernels/README.md`` records the outcome).

Three questions, each answered by lowering (CPU or GPU) and, on a GPU, by running:

1. Can a Mosaic GPU kernel gather canary records with a *vector* of slot indices (what the Triton verify
   kernel does per block of entries)?  ``gather_vector_index`` and ``plgpu_load_vector_index``.
2. Does the uint32-pair splitmix64 lower?  ``splitmix64_pairs``.
3. The only gather form that lowers: a loop of *scalar* dynamic loads (one entry at a time per warpgroup).
   ``verify_none_scalar_loop`` is a NONE-mode verify (slot record + predecessor record + mix3, positions)
   that counts failing entries; on a GPU it is timed against the Triton kernel's count.

Run (from the repository root): ``python -m benchmarks.mosaic_probe [--entries N] [--out FILE]`` (on CPU it
only lowers). Outcome on the H200: ``benchmarks/results/2026-11-30_h200_pallas_run2_mosaic.json``.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from canary_jax.contract import hashing, pairs


def _attempt(name, fn, args, results, run=False):
    try:
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
        del lowered
        results[name] = {"lowers": True}
        if run:
            out = jax.block_until_ready(jax.jit(fn)(*args))
            results[name]["ran"] = True
            return out
    except Exception as e:  # noqa: BLE001 - the point is to record what fails
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        results[name] = {
            "lowers": results.get(name, {}).get("lowers", False),
            "error": f"{type(e).__name__}: {(lines[0] if lines else repr(e))[:400]}",
        }
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1 << 20)
    ap.add_argument("--slots", type=int, default=1 << 22)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    results: dict = {}
    b = 128
    slots_v = jnp.zeros((b,), jnp.int32)
    words_s = jnp.zeros((4096, 8), jnp.uint32)
    params = plgpu.CompilerParams()

    sds = jax.ShapeDtypeStruct

    def k_gather(slot_ref, words_ref, o_ref):  # GMEM refs; a vector of slots, then a gather
        o_ref[...] = words_ref[slot_ref[...], 0]

    f1 = plgpu.kernel(k_gather, out_type=sds((b,), jnp.uint32), compiler_params=params)
    _attempt("gather_vector_index", f1, (slots_v, words_s), results)

    def k_load(slot_ref, words_ref, o_ref):
        o_ref[...] = plgpu.load(words_ref, (slot_ref[...], 0))

    f2 = plgpu.kernel(k_load, out_type=sds((b,), jnp.uint32), compiler_params=params)
    _attempt("plgpu_load_vector_index", f2, (slots_v, words_s), results)

    def k_hash(x_ref, o_ref):
        x = x_ref[...]
        h = hashing.splitmix64(pairs.U64(x, x ^ jnp.uint32(0x9E3779B9)))
        o_ref[...] = h.lo ^ h.hi

    f3 = plgpu.kernel(k_hash, out_type=sds((b,), jnp.uint32), compiler_params=params)
    _attempt("splitmix64_pairs", f3, (jnp.arange(b, dtype=jnp.uint32),), results, run=on_gpu)

    # NONE-mode verify with scalar dynamic loads: one program per block of `per` entries, serial inside.
    n_entries, n_slots = (args.entries, args.slots) if on_gpu else (4096, 8192)
    per = 256
    grid = n_entries // per
    anchor = hashing.ANCHOR_HASH

    def k_verify(slot_ref, pos_ref, prev_ref, words_ref, o_ref):
        pid = jax.lax.axis_index("x")

        def body(j, acc):
            i = pid * per + j
            s = slot_ref[i]
            p = prev_ref[i]
            rec = [words_ref[s, k] for k in range(6)]
            prec = [words_ref[jnp.maximum(p, 0), k] for k in range(6)]
            hsh = hashing.splitmix64_mix3(
                pairs.U64(prec[4], prec[5]), pairs.U64(prec[0], prec[1]), pairs.U64(prec[2], prec[3])
            )
            exp_lo = jnp.where(p < 0, jnp.uint32(anchor & 0xFFFFFFFF), hsh.lo)
            exp_hi = jnp.where(p < 0, jnp.uint32(anchor >> 32), hsh.hi)
            fail = (rec[4] != exp_lo) | (rec[5] != exp_hi) | (rec[2] != pos_ref[i]) | (rec[3] != 0)
            return acc + jnp.where(fail, 1, 0).astype(jnp.int32)

        o_ref[pid] = jax.lax.fori_loop(0, per, body, jnp.int32(0))

    f4 = plgpu.kernel(
        k_verify, out_type=sds((grid,), jnp.int32), compiler_params=params, grid=(grid,), grid_names=("x",)
    )
    rng = np.random.default_rng(0)
    slots = jnp.asarray(rng.permutation(np.arange(1, n_slots))[:n_entries].astype(np.int32))
    prev = jnp.asarray(np.where(np.arange(n_entries) % 1024 == 0, -1, np.roll(np.asarray(slots), 1)).astype(np.int32))
    pos = jnp.asarray((np.arange(n_entries) % 1024).astype(np.uint32))
    words = jnp.asarray(rng.integers(0, 2**32, size=(n_slots, 8), dtype=np.uint32))
    out = _attempt("verify_none_scalar_loop", f4, (slots, pos, prev, words), results, run=on_gpu)
    if on_gpu and out is not None:
        g = jax.jit(f4)
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(g(slots, pos, prev, words))
            ts.append(time.perf_counter() - t)
        results["verify_none_scalar_loop"].update(
            entries=n_entries, us_per_call_median=1e6 * float(np.median(ts)), failing=int(np.asarray(out).sum())
        )
    print(json.dumps(results, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
