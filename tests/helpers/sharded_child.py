"""Child process of ``tests/test_sharded.py`` and ``tests/test_multiprocess.py``: the sharded canary on forced
CPU devices (the parent keeps one device).

``python -m tests.helpers.sharded_child mesh OUT.npz [--x64]``: one process, 4 forced devices, a 2x2 (dp, tp)
mesh. Runs a small serving workload on the sharded canary (:mod:`canary_jax.runtime.sharded`) and the same
workload on the single-device canary once per shard (that shard's requests and heads), injects a KV flip into
shard (1, 0) and a canary token flip into shard (0, 1), and saves both runs' canary buffers, rings and counters,
the report, the stats, the consistency check and the compiled HLO's collectives for the parent to assert on.

``python -m tests.helpers.sharded_child multi OUT.npz PROCESS_ID PORT``: one of 2 processes
(``jax.distributed``, 2 forced CPU devices each, localhost coordinator, gloo collectives), a 2x2 global mesh with
dp row ``PROCESS_ID`` on this process; a KV flip into shard (1, 1) (process 1). Saves this process's report.

``python -m tests.helpers.sharded_child errors OUT.npz``: 4 forced devices; the programs' refusals (mis-sharded
pools, unsharded states and batches, bad live token counts), saved as ``{case: [error type, text] or None}``.

This module forces the CPU devices and starts ``jax.distributed`` before JAX is first used, then runs the mode:
the world (sizes, requests, the model's KV write) is :mod:`tests.helpers.sharded_world`, the ``mesh`` and
``multi`` runs :mod:`tests.helpers.sharded_runs`, the ``errors`` run :mod:`tests.helpers.sharded_refusals`.
"""

from __future__ import annotations

import os
import sys

MODE = sys.argv[1]
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={2 if MODE == 'multi' else 4}"
)

import jax  # noqa: E402

if "--x64" in sys.argv:
    jax.config.update("jax_enable_x64", True)
if MODE == "multi":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{sys.argv[4]}",
        num_processes=2,
        process_id=int(sys.argv[3]),
        initialization_timeout=60,
    )

from tests.helpers.sharded_refusals import run_errors  # noqa: E402
from tests.helpers.sharded_runs import run_mesh, run_multi  # noqa: E402

if __name__ == "__main__":
    if MODE == "mesh":
        run_mesh(sys.argv[2])
    elif MODE == "errors":
        run_errors(sys.argv[2])
    else:
        run_multi(sys.argv[2], int(sys.argv[3]))
