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

Usage (GPU, from the repository root): ``python -m benchmarks.sweep_verify --budget-s 150 --ptx ptx_scratch
--out $OUT``.
Dry run (CPU, interpret mode): ``python -m benchmarks.sweep_verify --pool 16384 --entries 4096 --n 2
--reps 1 --variants default,b128w4 --out sweep_out``.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse
import dataclasses
import json
import re
import shutil
import time
import traceback

import jax
import numpy as np

import canary_jax
from benchmarks import harness, ptx_inspect, sweep_scenario, sweep_variants
from pallas_kernels.config import PallasConfig

HBM = harness.HBM_BYTES_PER_S


# --- one variant ------------------------------------------------------------------------------------------------
def measure(sc: sweep_scenario.Scenario, name: str, kw: dict, a, cap: ptx_inspect.PtxCapture) -> dict:
    rec: dict = {"variant": name, "mode": sc.name, "overrides": kw}
    t_var = time.perf_counter()
    try:
        cfg = PallasConfig(**kw)
        rec["config"] = dataclasses.asdict(cfg)
        step_pallas, _ = sweep_scenario.steps(sc, cfg)
        captured: list = []
        cap.sink = captured
        try:
            t0 = time.perf_counter()
            bad_log = canary_jax.ViolationLog.allocate(ring_capacity=sweep_scenario.CORRUPT_RING)
            out = jax.block_until_ready(step_pallas(bad_log, (sc.bad_buf, sc.plan, sc.bad_tensors)))
            rec["first_call_s"] = time.perf_counter() - t0
        finally:
            cap.sink = None
        bad = sweep_scenario.log_arrays(out)
        rec["violations_corrupt"] = int(bad["write_index"][0])
        if sc.ref_bad is not None:
            d = sweep_scenario.log_diff(bad, sc.ref_bad)
            rec["equal_corrupt"], rec["diff_corrupt"] = not d, d
        t, log, info = harness.time_jax(
            step_pallas,
            canary_jax.ViolationLog.allocate(ring_capacity=1024),
            (sc.buf, sc.plan, sc.tensors),
            n=a.n,
            reps=a.reps,
        )
        launches = info["n"] * (2 + len(info["wall_s"]))
        rec.update(
            us_per_call=t * 1e6,
            loop_compile_s=info["compile_s"],
            launches=launches,
            wall_s=info["wall_s"],
            empty_s=info["empty_s"],
            n=info["n"],
        )
        rec["ns_per_entry"] = t * 1e9 / a.entries
        rec["gb_s"] = sc.needed_bytes / t / 1e9 if t > 0 else float("inf")
        rec["hbm_pct"] = 100 * rec["gb_s"] * 1e9 / HBM
        clean = sweep_scenario.log_arrays(log)
        rec["violations_clean"] = int(clean["write_index"][0])
        if sc.ref_clean is not None and sc.ref_clean_launches == launches:
            d = sweep_scenario.log_diff(clean, sc.ref_clean)
            rec["equal_clean"], rec["diff_clean"] = not d, d
        elif sc.ref_clean is not None:
            rec["diff_clean"] = [f"launch count {launches} != reference's {sc.ref_clean_launches}"]
        if a.ptx:
            t0 = time.perf_counter()
            rec["ptx"] = ptx_inspect.ptx_report(captured, a.ptx, f"{sc.name}_{name}")
            if cap.error:
                rec["ptx_capture_error"] = cap.error
            rec["ptx_s"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001
        rec["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
        rec["traceback"] = traceback.format_exc()[-3000:]
        print(f"  {name} [{sc.name}] FAILED: {rec['error'][:400]}", flush=True)
    rec["elapsed_s"] = time.perf_counter() - t_var
    return rec


# --- report -----------------------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def table(records: list[dict]) -> str:
    base = {r["mode"]: r.get("us_per_call") for r in records if r["variant"] == "default"}
    lines = [
        "| mode | variant | us/call | GB/s | % HBM | default/this | first call s | loop compile s | regs | "
        "spill st/ld B | stack B | occ (limit) | ld.global v2/v4/all | shared st/ld, bar | equal clean/corrupt "
        "| note |",
        "|" + "---|" * 16,
    ]
    for r in records:
        k = (r.get("ptx") or {}).get("canary_verify", {})
        b = base.get(r["mode"])
        us = r.get("us_per_call")
        eq = f"{r.get('equal_clean', '-')}/{r.get('equal_corrupt', '-')}"
        note = r.get("error") or r.get("skipped") or (r.get("ptx") or {}).get("error") or k.get("ptxas_error") or ""
        lines.append(
            "| "
            + " | ".join(
                [
                    r["mode"],
                    r["variant"],
                    _f(us),
                    _f(r.get("gb_s"), "{:.0f}"),
                    _f(r.get("hbm_pct")),
                    _f(b / us if b and us else None, "{:.2f}x"),
                    _f(r.get("first_call_s")),
                    _f(r.get("loop_compile_s")),
                    _f(k.get("registers"), "{}"),
                    f"{k['spill_store_bytes']}/{k['spill_load_bytes']}" if "spill_store_bytes" in k else "-",
                    _f(k.get("stack_bytes"), "{}"),
                    f"{k['occupancy']:.2f} ({k['limit']})" if "occupancy" in k else "-",
                    f"{k['ld_global_v2']}/{k['ld_global_v4']}/{k['ld_global']}" if "ld_global" in k else "-",
                    f"{k['st_shared']}/{k['ld_shared']}, {k['bar_sync']}" if "st_shared" in k else "-",
                    eq,
                    note.replace("|", "/").replace("\n", " ")[:120],
                ]
            )
            + " |"
        )
    return "\n".join(lines)


def best_of(records: list[dict]) -> dict:
    out = {}
    for r in records:
        if r.get("us_per_call") is None or r.get("equal_clean") is False or r.get("equal_corrupt") is False:
            continue
        if r["mode"] not in out or r["us_per_call"] < out[r["mode"]]["us_per_call"]:
            out[r["mode"]] = {"variant": r["variant"], "us_per_call": r["us_per_call"], "overrides": r["overrides"]}
    return out


NCU_SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis")


def ncu_command(variant: str, out: str = "$OUT") -> str:
    rep = f"{out}/ncu_{variant}"
    sec = " ".join(f"--section {s}" for s in NCU_SECTIONS)
    return (
        f"ncu --target-processes all --kernel-name regex:'^canary_verify$' --launch-skip 1 --launch-count 1 "
        f"--clock-control none {sec} --export {rep} --force-overwrite "
        f"python -m benchmarks.sweep_verify --single {variant} --launches 3 --populate none --out {out}/single "
        f"&& ncu --import {rep}.ncu-rep --page details > {rep}.txt"
    )


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
                cfg = PallasConfig(**kw)
                step_pallas, _ = sweep_scenario.steps(sc, cfg)
                captured: list = []
                cap.sink = captured
                log = canary_jax.ViolationLog.allocate(ring_capacity=1024)
                walls = []
                for _ in range(a.launches):
                    t = time.perf_counter()
                    log = jax.block_until_ready(step_pallas(log, (sc.buf, sc.plan, sc.tensors)))
                    walls.append(time.perf_counter() - t)
                    cap.sink = None
                entries = sorted({(re.search(r"\.entry\s+(\w+)", c["asm"]) or [None, "?"])[1] for c in captured})
                rec = {
                    "variant": name,
                    "mode": mode_name,
                    "overrides": kw,
                    "single_wall_s": walls,
                    "kernels": entries,
                    "violations_clean": int(np.asarray(log.write_index)[0]),
                }
                if a.check:
                    bad = step_pallas(
                        canary_jax.ViolationLog.allocate(ring_capacity=sweep_scenario.CORRUPT_RING),
                        (sc.bad_buf, sc.plan, sc.bad_tensors),
                    )
                    rec["diff_corrupt"] = sweep_scenario.log_diff(sweep_scenario.log_arrays(bad), sc.ref_bad)
                    rec["equal_corrupt"] = not rec["diff_corrupt"]
                records.append(rec)
                print(
                    f"{stamp()} single {name} [{mode_name}]: kernels {entries}, wall per launch "
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
    md = [
        f"# Pallas verify config sweep ({env['date']})",
        "",
        "```",
        json.dumps(env, indent=1),
        "```",
        "",
        f"pool {a.pool}, entries {a.entries}, n {a.n}, reps {a.reps}, budget {a.budget_s:.0f}s; total "
        f"{time.perf_counter() - t_start:.1f}s. `default/this` > 1 means faster than the default. Registers, "
        "spills, occupancy and PTX counts are for `canary_verify` (ptxas -v on the captured PTX).",
        "",
        tab,
        "",
        "best: " + json.dumps(best),
    ]
    with open(os.path.join(a.out, "sweep_verify.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print(f"total {time.perf_counter() - t_start:.1f}s")
    print("best: " + json.dumps(best))
    print(tab)


if __name__ == "__main__":
    main()
