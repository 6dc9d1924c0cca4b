"""The launches' real-KV coverage check (:mod:`canary_jax.contract.coverage`): every slot a verify or write hashes
lies inside every source, read on the host outside ``jit`` (:func:`check_coverage`), with the plans' hashed
entries and slots (:func:`verify_plan_hashed`, :func:`write_plan_hashed`). Used by :mod:`canary_jax.ops.launch`
and :mod:`canary_jax.runtime.slot_coverage`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from canary_jax.contract import constants, coverage, ints, sources
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan


def check_coverage(
    context: VerifyOrWriteContext,
    *,
    tracing: bool,
    op: str,
    name: str,
    hashed: Callable[[int], tuple[np.ndarray, np.ndarray]],
) -> None:
    """Every slot the launch hashes lies inside every real-KV source (:mod:`canary_jax.contract.coverage`).

    Nothing to check when the launch hashes nothing or every source covers the canary buffer. Otherwise, outside
    ``jit`` ``hashed(num_slots)`` gives the ``(entries, slots)`` the launch hashes (read on the host), and a slot
    past a source is refused; while tracing, the whole-buffer rule applies unless the caller checked the slots on
    the host (:func:`canary_jax.contract.coverage.checked_on_host`).

    Raises:
      ValueError: naming the slot, its entry, the source and its coverage; or, while tracing, the source and the
        canary buffer's slots.
    """
    if context.real_kv_hash_mode == constants.RealKvHashMode.NONE or not context.real_kv_sources:
        return
    covs = sources.coverages(context.real_kv_sources)
    n = int(context.canary_buf.shape[0])
    if not coverage.short(covs, n):
        return
    if tracing:
        if not coverage.host_checked():
            coverage.check_whole_buffer(covs, n, why=coverage.TRACED)
        return
    entries, slots = hashed(n)
    coverage.check_slots(covs, entries, slots, op=op, name=name)


def verify_plan_hashed(plan: VerifyPlan, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(entries, slots)`` a verify of ``plan`` hashes (:func:`canary_jax.contract.coverage.verify_hashed`), read
    from the plan's concrete arrays on the host (a device copy)."""
    return coverage.verify_hashed(
        ints.pairs_to_int64_np(plan.verify_slot_indices),
        int(np.asarray(plan.verify_num_valid)[0]),
        int(np.asarray(plan.enable)[0]),
        num_slots,
    )


def write_plan_hashed(plan: WritePlan, out_cache_loc: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """``(entries, slots)`` a write of ``plan`` over host ``int64`` ``out_cache_loc`` hashes
    (:func:`canary_jax.contract.coverage.write_hashed`), the plan read on the host."""
    return coverage.write_hashed(
        ints.pairs_to_int64_np(plan.write_offsets),
        int(np.asarray(plan.write_num_valid_reqs)[0]),
        out_cache_loc,
        num_slots,
    )
