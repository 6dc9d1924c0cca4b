"""The plan build on the GPU: the one-launch plan kernel (``pallas_kernels/plan.py``) against the jnp builder, in one
process, at the serving benchmark's decode shapes and a prefill shape.

Each case is a jitted ``fori_loop`` of plan builds (``harness.time_jax``: the loop minus an empty program, per
build) whose carry is the plans themselves (each build reads the previous plan's ``enable``, so XLA can neither
hoist nor drop it), then the same loop once under the profiler for kernel time and launches per build. Every case
first checks that both builders give the same plans.

Usage: ``python -m benchmarks.plan_bench [--small] [--json PATH]`` (GPU; ``--small`` runs tiny shapes anywhere).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import harness
from benchmarks.serving_step.profiles import profile_launches
from benchmarks.serving_step.programs import loop_of
from canary_jax.ops.plan_launch import build_plans
from canary_jax.planning.slot_tables import BlockTable

# name: (request rows, prefix per request, tokens written per request, verify capacity, page size)
CASES = {
    "decode1": (1, 4095, 1, 4096, 16),
    "decode128": (128, 4095, 1, 128 * 4096, 16),
    "prefill32": (32, 8192, 8192, 32 * 16384, 16),
}
SMALL = {"decode1": (1, 63, 1, 64, 4), "decode8": (8, 63, 1, 512, 4)}


def case_inputs(bs, prefix, extend, cap, page, table_kind):
    rng = np.random.default_rng(0)
    max_seq = prefix + extend + page
    pages = -(-max_seq // page)
    rows = bs + 1
    blocks = rng.permutation(rows * pages).reshape(rows, pages).astype(np.int32) + 1
    if table_kind == "block":
        table = BlockTable(block_table=blocks[1:], block_size=page)
    else:
        slots = blocks[:, :, None] * page + np.arange(page)[None, None, :]
        table = jnp.asarray(slots.reshape(rows, pages * page).astype(np.int32))
    batch = dict(
        req_pool_indices=jnp.arange(1, bs + 1, dtype=jnp.int32),
        prefix_lens=jnp.full((bs,), prefix, jnp.int32),
        extend_seq_lens=jnp.full((bs,), extend, jnp.int32),
    )
    return table, batch, cap, max(bs, 8)


def time_case(backend, table, batch, cap, cw, n, reps, trace_dir):
    def build(prev, c):
        tab, b = c
        bump = prev[0].enable[0] - 1  # 0 unless the plan overflowed: a data dependence on the last build
        return build_plans(
            req_pool_indices=b["req_pool_indices"],
            prefix_lens=b["prefix_lens"] + bump,
            extend_seq_lens=b["extend_seq_lens"],
            req_to_token=tab,
            verify_capacity=cap,
            write_req_capacity=cw,
            backend=backend,
        )

    consts = (table, batch)
    first = build_plans(**_fresh(batch, table, cap, cw, backend))
    sec, state, info = harness.time_jax(build, first, consts, n=n, reps=reps)
    rec = {"us": 1e6 * sec, "compile_s": info["compile_s"], "n": n}
    try:
        prog = loop_of(build, n).lower(state, consts).compile()
        rec.update(profile_launches(prog, state, consts, trace_dir, n))
    except Exception as e:  # noqa: BLE001
        rec["profile_error"] = f"{type(e).__name__}: {e}"
    return rec


def _fresh(batch, table, cap, cw, backend):
    return dict(**batch, req_to_token=table, verify_capacity=cap, write_req_capacity=cw, backend=backend)


def _line(rec) -> str:
    launches = sum(k["launches"] for k in rec.get("kernels", []))
    return f"{rec['us']:8.2f} us ({rec.get('kernel_sum_us', float('nan')):7.2f} us kernels, {launches:.1f} launches)"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    out = {"environment": harness.environment(), "command": harness.command_line(), "cases": {}}
    trace_root = tempfile.mkdtemp(prefix="plan_bench_")
    for name, shape in (SMALL if a.small else CASES).items():
        for kind in ("req_to_token", "block"):
            table, batch, cap, cw = case_inputs(*shape, kind)
            ref = jax.tree_util.tree_map(np.asarray, build_plans(**_fresh(batch, table, cap, cw, "reference")))
            ker = jax.tree_util.tree_map(np.asarray, build_plans(**_fresh(batch, table, cap, cw, "pallas")))
            same = all(
                np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(ref), jax.tree_util.tree_leaves(ker))
            )
            recs = {"same_plans": same}
            for backend in ("reference", "pallas"):
                n = 20 if a.small else 200
                recs[backend] = time_case(
                    backend, table, batch, cap, cw, n, a.reps, os.path.join(trace_root, f"{name}_{kind}_{backend}")
                )
            r, p = recs["reference"], recs["pallas"]
            print(f"{name:10s} {kind:12s} same={same} jnp {_line(r)} | kernel {_line(p)}", flush=True)
            out["cases"][f"{name}/{kind}"] = recs
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()
