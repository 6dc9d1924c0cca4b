"""One variant of the verify sweep (``benchmarks.sweep_verify``), measured on one mode's scenario.

:func:`measure`: compile + first call on the corrupted input (its log checked byte for byte against the
reference's), the timed loop on the clean data (its final log checked the same way), GB/s and % of HBM, and with
``--ptx`` the PTX report. :func:`measure_single`: ``--single``'s plain launches (for Nsight Compute). Both return
the record that ``OUT/sweep_verify.json`` keeps.
"""

from __future__ import annotations

import dataclasses
import re
import time
import traceback

import jax
import numpy as np

import canary_jax
from benchmarks import harness, ptx_inspect, sweep_scenario
from pallas_kernels.config import PallasConfig

HBM = harness.HBM_BYTES_PER_S


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


def measure_single(sc: sweep_scenario.Scenario, name: str, kw: dict, a, cap: ptx_inspect.PtxCapture) -> dict:
    """``--single``: ``a.launches`` plain launches of one variant on the clean data (no timing loop), the kernels
    the PTX capture saw, and with ``a.check`` the corrupted input's log against the reference's."""
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
        "mode": sc.name,
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
    return rec
