#!/usr/bin/env python3
"""Sweeps PallasConfig variants of the Pallas verify kernel on bench's verify scenario, in one process.

Why: verify with real-KV sources (ALL x4 over 1M entries) was slower on the H200 than the CUDA peer in
session 1 (``benchmarks/results/2026-11-30_h200_pallas.md``). This script times block shapes, warps,
gathers and the real-KV loop unroll on the same data, checks every variant against the jnp reference, and
(``--ptx``) records registers, spills and stack of the Triton kernels with ``ptxas -v``.

Scenario (``benchmarks.sweep_scenario``, built once per mode with ``harness.Data`` / ``harness.populate``):
``--pool`` slots (default 4M), ``--entries`` verify entries (default 1M, a multiple of 1024) in
request-major chains of 1024 random slots, sources of 256-byte rows; ``--modes`` any of ``all_x4``
(default), ``partial_x4``, ``all_x1``.

Per variant and mode:

* ``first_call_s``: compile + first call of ``verify_pallas`` (jit, this config), on a *corrupted* copy of
  the scenario (flipped token / position / real-KV-field bytes in the canary and flipped source bytes, so
  about 1.25 rows per corruption overflow a 256-row ring). Its log (ring, write_index, both counters) must
  equal the reference's on the same input byte for byte (``equal_corrupt``).
* ``us_per_call`` from ``harness.time_jax`` (jitted ``fori_loop`` of ``--n`` donated launches, minus an empty
  program, median over ``--reps``; ``loop_compile_s`` is its compile + first run) on the clean data; the
  final log of all those launches must equal the reference's after the same number of launches
  (``equal_clean``). GB/s of bench's needed bytes and % of 4.8 TB/s.
* ``--ptx DIR`` (``benchmarks.ptx_inspect``): the PTX of ``canary_verify`` and ``canary_verify_rows`` as the
  Pallas Triton lowering produced it (captured by wrapping ``jax._src.lib.triton.compile``), written to
  ``DIR/<variant>/``, and ``ptxas -v`` on it (registers, spill bytes, stack, smem), ``cuobjdump -sass`` of
  the cubin, static PTX counts (global loads by width, shared-memory traffic, barriers) and a theoretical
  occupancy. Done for every measured variant (it is cheap), so it covers the default and the best one.
  ``DIR`` can be scratch space: the PTX, ptxas and SASS text (no cubins) are also packed into
  ``OUT/sweep_verify_ptx.tar.gz``.

Variants (``benchmarks.sweep_variants``): ``--variants`` takes preset names (comma-separated) or JSON: a list
of preset names and/or override dicts, or a dict ``{name: overrides}``. ``--budget-s`` bounds the whole
process (setup included): no new variant starts when the mean cost of the finished ones would exceed it. A
variant that raises is recorded and skipped. Results: ``OUT/sweep_verify.json`` (rewritten after every
variant) and ``OUT/sweep_verify.md``; the table is printed last.

``--single NAMES``: runs only those variants, ``--launches`` plain launches each on the clean data, no
timing loop, no reference (unless ``--check``): the mode to run under Nsight Compute. ``--ncu`` prints the
ncu command for it.

The persistent compile cache is used when ``JAX_COMPILATION_CACHE_DIR`` is set (compile times then reflect
cache hits; the JSON records the directory's presence).

This module is the command line and the run over modes and variants; one variant is measured in
``benchmarks.sweep_measure`` and the table, best-of and page are ``benchmarks.sweep_report``'s (their names stay
importable from here).

Usage (GPU, from the repository root): ``python -m benchmarks.sweep_verify --budget-s 150 --ptx ptx_scratch
--out $OUT``.
Dry run (CPU, interpret mode): ``python -m benchmarks.sweep_verify --pool 16384 --entries 4096 --n 2
--reps 1 --variants default,b128w4 --out sweep_out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import json
import shutil
import time
import traceback

import jax
import numpy as np

from benchmarks import harness, ptx_inspect, sweep_scenario, sweep_variants
from benchmarks.sweep_measure import HBM, measure, measure_single
from benchmarks.sweep_report import NCU_SECTIONS, _f, best_of, markdown, ncu_command, table

__all__ = [  # the measuring and the report live in sweep_measure / sweep_report; importable from here as before
    "HBM",
    "NCU_SECTIONS",
    "best_of",
    "main",
    "markdown",
    "measure",
    "measure_single",
    "ncu_command",
    "table",
]


# --- main -------------------------------------------------------------------------------------------------------
def main():
    t_start = time.perf_counter()
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument(
        "--variants",
        default="",
        help="preset names (comma-separated) or JSON; presets: "
        + ", ".join(sweep_variants.PRESETS)
        + "; default: "
        + ",".join(sweep_variants.DEFAULT_VARIANTS),
    )
    ap.add_argument("--modes", default="all_x4", help="comma-separated: " + ", ".join(sweep_scenario.MODES))
    ap.add_argument("--budget-s", type=float, default=150.0, help="whole-process budget, setup included")
    ap.add_argument("--pool", type=int, default=1 << 22)
    ap.add_argument("--entries", type=int, default=1 << 20, help="a multiple of 1024")
    ap.add_argument("--n", type=int, default=20, help="launches per timed program")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--corruptions", type=int, default=256, help="corrupted entries of the equality check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--ptx",
        default="",
        metavar="DIR",
        help="write PTX / ptxas -v / SASS of each variant here (scratch; also archived into OUT)",
    )
    ap.add_argument("--ncu", action="store_true", help="print the ncu command for --single and exit")
    ap.add_argument("--single", default="", metavar="NAMES", help="only these variants, plain launches (for ncu)")
    ap.add_argument("--launches", type=int, default=3, help="plain launches per variant in --single")
    ap.add_argument("--check", action="store_true", help="--single: also check against the reference")
    ap.add_argument(
        "--populate",
        choices=("pallas", "reference", "none"),
        default="pallas",
        help="how the clean chains are written: harness.populate (Pallas write; falls back to the "
        "reference if it raises), the jnp reference write, or not at all (saves the write "
        "compile; canary_verify does the same loads and hashing either way, but every entry then "
        "fails and the rows kernel works)",
    )
    a = ap.parse_args()
    if a.entries % 1024 or a.entries <= 0:
        raise SystemExit("--entries must be a positive multiple of 1024")
    if a.entries >= a.pool:
        raise SystemExit("--entries must be below --pool")
    if a.ncu:
        names = [n for n, _ in sweep_variants.parse_variants(a.single or "default,b128w4")]
        for n in names:
            print(ncu_command(n))
        return
    os.makedirs(a.out, exist_ok=True)
    if a.ptx:
        os.makedirs(a.ptx, exist_ok=True)
    env = harness.environment()
    env["compile_cache_dir_set"] = bool(os.environ.get("JAX_COMPILATION_CACHE_DIR"))
    env["backend"] = jax.default_backend()
    env["tools"] = {t: bool(shutil.which(t)) for t in ("ptxas", "cuobjdump", "ncu", "nvcc")}
    print(json.dumps(env), flush=True)
    cap = ptx_inspect.PtxCapture()
    single = bool(a.single)
    variants = sweep_variants.parse_variants(a.single if single else a.variants)
    bargs = harness.Args(
        pool=a.pool,
        entries=a.entries,
        long_tokens=0,
        decode_reqs=0,
        reps=a.reps,
        n_verify=a.n,
        n_write=0,
        n_ref=0,
        n_peer=0,
        seed=a.seed,
        only="",
        ref_x64_on=False,
        skip_reference=False,
    )
    results: dict = {
        "environment": env,
        "args": vars(a),
        "variants": variants,
        "records": [],
        "capture_error": cap.error,
    }
    records = results["records"]
    out_json = os.path.join(a.out, "sweep_verify.json")

    def dump():
        results["best"] = best_of(records)
        results["total_s"] = time.perf_counter() - t_start
        with open(out_json, "w") as f:
            json.dump(results, f, indent=1, default=str)

    def stamp():
        return f"[{time.perf_counter() - t_start:6.1f}s]"

    data = harness.Data(bargs)
    print(f"{stamp()} data ready", flush=True)
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in sweep_scenario.MODES:
            raise SystemExit(f"unknown mode {m!r}; modes: {', '.join(sweep_scenario.MODES)}")
    done_s: list[float] = []
    stopped = False
    for mode_name in modes:
        t0 = time.perf_counter()
        est = float(np.mean(done_s)) if done_s else 0.0
        if not single and (stopped or (done_s and t0 - t_start + est > a.budget_s)):
            stopped = True
            records.extend(
                {
                    "variant": name,
                    "mode": mode_name,
                    "overrides": kw,
                    "skipped": f"budget: {t0 - t_start:.0f}s elapsed before this mode's setup",
                }
                for name, kw in variants
            )
            continue
        try:
            sc = sweep_scenario.build(mode_name, data, bargs, populate=a.populate, corruptions=a.corruptions)
            if not single or a.check:
                sweep_scenario.reference_logs(sc, a.n * (2 + a.reps))
        except Exception as e:  # noqa: BLE001
            results.setdefault("setup_errors", {})[mode_name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            dump()
            continue
        results.setdefault("setup_s", {})[mode_name] = time.perf_counter() - t0
        results.setdefault("populated", {})[mode_name] = sc.populated
        print(f"{stamp()} {mode_name}: scenario + reference ready ({time.perf_counter() - t0:.1f}s)", flush=True)
        if single:
            for name, kw in variants:
                rec = measure_single(sc, name, kw, a, cap)
                records.append(rec)
                walls = rec["single_wall_s"]
                print(
                    f"{stamp()} single {name} [{mode_name}]: kernels {rec['kernels']}, wall per launch "
                    f"{', '.join(f'{w * 1e3:.2f} ms' for w in walls)}",
                    flush=True,
                )
            dump()
            continue
        for name, kw in variants:
            elapsed = time.perf_counter() - t_start
            est = float(np.mean(done_s)) if done_s else 0.0
            if stopped or (done_s and elapsed + est > a.budget_s):
                stopped = True
                records.append(
                    {
                        "variant": name,
                        "mode": mode_name,
                        "overrides": kw,
                        "skipped": f"budget: {elapsed:.0f}s elapsed + ~{est:.0f}s > {a.budget_s:.0f}s",
                    }
                )
                continue
            print(f"{stamp()} {mode_name} {name} {kw}", flush=True)
            rec = measure(sc, name, kw, a, cap)
            if "error" not in rec:
                done_s.append(rec["elapsed_s"])
            records.append(rec)
            k = (rec.get("ptx") or {}).get("canary_verify", {})
            print(
                f"{stamp()}   -> {_f(rec.get('us_per_call'))} us, {_f(rec.get('gb_s'), '{:.0f}')} GB/s, first "
                f"call {_f(rec.get('first_call_s'))} s, loop compile {_f(rec.get('loop_compile_s'))} s, equal "
                f"clean/corrupt {rec.get('equal_clean')}/{rec.get('equal_corrupt')} "
                f"(violations {rec.get('violations_corrupt')}), regs {k.get('registers', '-')}, spills "
                f"{k.get('spill_store_bytes', '-')}",
                flush=True,
            )
            dump()
        del sc
    dump()
    if single:
        print(f"total {time.perf_counter() - t_start:.1f}s")
        return
    if a.ptx:
        results["ptx_archive"] = ptx_inspect.archive_ptx(a.ptx, os.path.join(a.out, "sweep_verify_ptx.tar.gz"))
        dump()
    tab = table(records)
    best = best_of(records)
    md = markdown(env, a, time.perf_counter() - t_start, tab, best)
    with open(os.path.join(a.out, "sweep_verify.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"total {time.perf_counter() - t_start:.1f}s")
    print("best: " + json.dumps(best))
    print(tab)


if __name__ == "__main__":
    main()
