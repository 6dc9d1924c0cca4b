"""The decode write microbenchmark: one canary write launch of 4096 requests x 1 token, NONE mode."""

from __future__ import annotations

import os

import numpy as np

import canary_jax as cj
from benchmarks import harness
from benchmarks.serving_step.profiles import profile_launches
from benchmarks.serving_step.programs import loop_of
from benchmarks.serving_step.shapes import WRITE_TARGET_US
from benchmarks.serving_step.timing import log
from canary_jax.contract.constants import RealKvHashMode


def write_bench(args, t0) -> dict:
    """One write launch of 4096 requests x 1 token (each seeded by its previous token), NONE mode, timed with
    ``harness.time_jax`` (a donating fori_loop of launches minus an empty program)."""
    reqs = 64 if args.small else 4096
    n_slots = 2 * reqs + 16
    buf = cj.allocate_canary_buffer(n_slots)
    lg = cj.ViolationLog.allocate(ring_capacity=64)
    first = np.arange(1, reqs + 1)
    second = first + reqs
    ids = np.random.default_rng(3).integers(0, 1 << 30, 2 * reqs)
    ctx = harness.make_context(buf, lg, (), RealKvHashMode.NONE)
    plan0 = cj.WritePlan.from_requests(counts=[1] * reqs, seed_slots=[-1] * reqs)
    ctx = cj.write(ctx, plan0, ids[:reqs], np.zeros(reqs, np.int64), first, backend=args.backend)
    plan1 = cj.WritePlan.from_requests(counts=[1] * reqs, seed_slots=first)
    consts = (plan1, harness.int64_pairs(ids[reqs:]), harness.int64_pairs(np.ones(reqs)), harness.int64_pairs(second))

    def step(state, c):
        plan, i, p, loc = c
        out = cj.write(
            harness.make_context(state[0], state[1], (), RealKvHashMode.NONE), plan, i, p, loc, backend=args.backend
        )
        return out.canary_buf, out.log

    n = 20 if args.small else 200
    sec, state, info = harness.time_jax(step, (ctx.canary_buf, ctx.log), consts, n=n, reps=args.rounds)
    res = {
        "requests": reqs,
        "us": 1e6 * sec,
        "n": n,
        "compile_s": info["compile_s"],
        "violations": int(state[1].write_index[0]),
        "target_us": WRITE_TARGET_US,
    }
    if args.profile:
        try:  # the same loop again under the profiler: which kernels the launch is made of
            prog = loop_of(step, n).lower(state, consts).compile()
            res.update(profile_launches(prog, state, consts, os.path.join(args.trace_dir, "write4096"), n))
        except Exception as e:  # noqa: BLE001
            res["profile_error"] = f"{type(e).__name__}: {e}"
    log(f"write {reqs}x1 NONE: {res['us']:.2f} us", t0)
    return res
