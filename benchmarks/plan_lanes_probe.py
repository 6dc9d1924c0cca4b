"""Probe: does the plan kernel compile for one request row with its vectors ``MIN_LANES`` wide?

``python -m benchmarks.plan_lanes_probe LANES`` builds a one-row plan with ``pallas_kernels.plan.MIN_LANES = LANES``
(the default 32; 1 gives one-element Triton tensors). On the GPU a crash inside XLA's compile ends the process
(run it in a subprocess); the line ``MIN_LANES=.. ok`` says it compiled and matched the jnp builder.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels.plan as plan_kernel
from canary_jax.ops.plan_launch import build_plans
from canary_jax.planning.plan_builder import build_plans as build_plans_jnp


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    plan_kernel.MIN_LANES = int(argv[0]) if argv else plan_kernel.MIN_LANES
    r2t = jnp.asarray(np.arange(1, 97, dtype=np.int32).reshape(4, 24))
    kw = dict(
        req_pool_indices=np.array([2]),
        prefix_lens=np.array([5]),
        extend_seq_lens=np.array([1]),
        req_to_token=r2t,
        verify_capacity=64,
        write_req_capacity=1,
    )
    got = jax.tree_util.tree_leaves(build_plans(**kw, backend="pallas"))
    want = jax.tree_util.tree_leaves(build_plans_jnp(**kw))
    same = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want))
    print(f"MIN_LANES={plan_kernel.MIN_LANES} ok same={same}", flush=True)


if __name__ == "__main__":
    main()
