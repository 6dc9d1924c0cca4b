"""The serving-step runtime around the kernels (SGLang ``python/sglang/srt/kv_canary/``).

Everything a serving step needs is importable from here (``from canary_jax.runtime import CanaryState,
canary_head, ...``): the buffer groups, the step's config / batch / state types, the plan / HEAD / TAIL /
step / sweep functions, sweep plans, reporting, the guard and its capacities and step inputs, and the
real-KV source and hash-mode types the calls take. The submodules keep their names importable too.

Modules:

* :mod:`~canary_jax.runtime.groups`: canary buffer groups (HEAD / TAIL buffers and LUT of one pool; never KV
  data) and :class:`~canary_jax.runtime.groups.PoolKind`.
* :mod:`~canary_jax.runtime.endpoints`: HEAD / TAIL / SWEEP endpoints built from a group, and their dispatch.
* :mod:`~canary_jax.runtime.state`: the per-forward step's types (config, batch, state, plans, summary).
* :mod:`~canary_jax.runtime.prepare`: the one place that checks, widens and pads a step batch (every entry
  point below calls it once); :mod:`~canary_jax.runtime.shapes` holds the bucket padding it uses.
* :mod:`~canary_jax.runtime.step`: the per-forward step API (plan, HEAD, TAIL, step, sweep): validate, prepare
  the batch, then run :mod:`~canary_jax.runtime.phases` (the traced bodies and jitted programs).
* :mod:`~canary_jax.runtime.sweep`: sweep plans over cached prefixes.
* :mod:`~canary_jax.runtime.report`: violation reporting, stats, health checks (host side).
* :mod:`~canary_jax.runtime.guard`: :class:`~canary_jax.runtime.guard.CanaryGuard`, the one-call guard
  (also :mod:`canary_jax.integration`), with its jitted program (:mod:`~canary_jax.runtime.guarded`), host
  pump (:mod:`~canary_jax.runtime.guard_reports`) and what it is sized by and hands ``step_fn``
  (:mod:`~canary_jax.runtime.step_inputs`).

The runtime builds on the contract modules of :mod:`canary_jax` only: it never imports the command-line
tools (:mod:`canary_jax.cli`), the Pallas kernels, :mod:`interop` or torch at import time (the Pallas
backend is loaded by :func:`canary_jax.ops.launch.verify` / :func:`canary_jax.ops.launch.write` when chosen).
"""

from canary_jax.contract.constants import RealKvHashMode
from canary_jax.contract.sources import RealKvSource
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.guard import CanaryGuard
from canary_jax.runtime.report import (
    CanaryStats,
    CanaryViolationError,
    HealthChecker,
    StatsLogger,
    ViolationMonitor,
    ViolationReporter,
    canary_stats,
)
from canary_jax.runtime.state import (
    CanaryBatch,
    CanaryPlans,
    CanaryState,
    CanaryStepConfig,
    StepSummary,
    active_tags,
)
from canary_jax.runtime.step import (
    canary_head,
    canary_plan,
    canary_step,
    canary_sweep,
    canary_tail,
    check_batch_values,
)
from canary_jax.runtime.step_inputs import (
    VERIFY_CAPACITY_POOL_FACTOR,
    CanaryCapacities,
    StepInputs,
    normalize_sources,
    parse_real_kv_hash_mode,
)
from canary_jax.runtime.sweep import (
    RadixNode,
    SweepEntries,
    SweepSchedule,
    build_sweep_plan_from_radix,
    build_sweep_plan_from_requests,
    sweep_entries_to_plan,
    walk_radix_tree,
)

__all__ = [
    "VERIFY_CAPACITY_POOL_FACTOR",
    "CanaryBatch",
    "CanaryBufferGroup",
    "CanaryCapacities",
    "CanaryGuard",
    "CanaryPlans",
    "CanaryState",
    "CanaryStats",
    "CanaryStepConfig",
    "CanaryViolationError",
    "ExpectedInputs",
    "HealthChecker",
    "PoolKind",
    "RadixNode",
    "RealKvHashMode",
    "RealKvSource",
    "StatsLogger",
    "StepInputs",
    "StepSummary",
    "SweepEntries",
    "SweepSchedule",
    "ViolationMonitor",
    "ViolationReporter",
    "active_tags",
    "build_sweep_plan_from_radix",
    "build_sweep_plan_from_requests",
    "canary_head",
    "canary_plan",
    "canary_stats",
    "canary_step",
    "canary_sweep",
    "canary_tail",
    "check_batch_values",
    "normalize_sources",
    "parse_real_kv_hash_mode",
    "sweep_entries_to_plan",
    "walk_radix_tree",
]
