"""What the validation tests share (``tests/test_validation.py``, ``test_int64_inputs.py``,
``test_launch_backends.py``): small launch contexts, plans and token arrays, a snapshot of a context's buffer and
log, and ``RefusalMixin.assertRefused`` (a refused launch raises before anything is traced, mutated or donated).
"""

from __future__ import annotations

import jax
import numpy as np

import canary_jax
from canary_jax.contract import constants

N = 16
T = 4
TAG = constants.CanaryLaunchTag.TAIL_K_FULL
ALL = constants.RealKvHashMode.ALL


def src(tensor, page_size=1, nbpt=16, read_bytes=16):
    return canary_jax.RealKvSource(tensor=tensor, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read_bytes)


def ctx_with(*, sources=(), mode=ALL, buf=None, log=None, kind=TAG):
    return canary_jax.VerifyOrWriteContext(
        canary_buf=canary_jax.allocate_canary_buffer(N) if buf is None else buf,
        kernel_kind=kind,
        log=canary_jax.ViolationLog.allocate(ring_capacity=4) if log is None else log,
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
    )


def vplan(n=1, cap=4):
    return canary_jax.VerifyPlan.from_entries(
        slots=[1] * n, positions=[0] * n, prev_slots=[-1] * n, verify_capacity=cap
    )


def wplan(cap=2):
    return canary_jax.WritePlan.from_requests(counts=[1], seed_slots=[-1], write_req_capacity=cap)


def tok(values=(1, 2, 3, 4)):
    return np.array(values, np.int64)


def snapshot(ctx):
    log = ctx.log
    return [
        np.asarray(x).copy()
        for x in (
            ctx.canary_buf,
            log.ring,
            log.write_index,
            log.slot_run_counters,
            log.kernel_run_counters,
            log.enable_chain_position_assert,
        )
    ]


class RefusalMixin:
    def assertRefused(self, ctx, exc, regex, fn):
        """``fn()`` raises ``exc`` matching ``regex`` and leaves ``ctx``'s buffer and log untouched."""
        before = snapshot(ctx)
        with self.assertRaisesRegex(exc, regex):
            fn()
        for x in (
            ctx.canary_buf,
            ctx.log.ring,
            ctx.log.write_index,
            ctx.log.slot_run_counters,
            ctx.log.kernel_run_counters,
        ):
            if isinstance(x, jax.Array):
                self.assertFalse(x.is_deleted(), "a refused launch must not donate its buffers")
        for a, b in zip(before, snapshot(ctx)):
            np.testing.assert_array_equal(a, b)
