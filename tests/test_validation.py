"""Validation error paths of the core contract (SPEC 3, 4, 10) and lossless int64 input handling.

Every refused launch must raise before anything is traced or mutated: the tests compare the canary buffer
and the whole log before and after, and check the arrays were not donated.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants, ints
from canary_jax.contract.sources import SourceDescriptor, check_real_kv_sources
from helpers import oracle

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


class RealKvSourceTest(absltest.TestCase):
    def test_post_init_order_and_messages(self):
        t = np.zeros((4, 32), np.uint8)
        cases = [
            # (kwargs, message); each case also breaks every later rule, so the order is pinned.
            (
                dict(tensor=np.zeros(3, np.uint8), page_size=0, num_bytes_per_token=24, read_bytes=0),
                r"^kv-canary: RealKvSource\.page_size must be >= 1, got 0$",
            ),
            (
                dict(tensor=np.zeros(3, np.uint8), page_size=1, num_bytes_per_token=24, read_bytes=0),
                r"^kv-canary: RealKvSource\.num_bytes_per_token must be a positive multiple of 16, got 24$",
            ),
            (
                dict(tensor=np.zeros(3, np.uint8), page_size=1, num_bytes_per_token=0, read_bytes=0),
                r"^kv-canary: RealKvSource\.num_bytes_per_token must be a positive multiple of 16, got 0$",
            ),
            (
                dict(tensor=np.zeros(3, np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=0),
                re.escape(
                    "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
                    "(0, num_bytes_per_token=32], got 0"
                ),
            ),
            (
                dict(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=48),
                re.escape("(0, num_bytes_per_token=32], got 48"),
            ),
            (
                dict(tensor=t, page_size=1, num_bytes_per_token=32, read_bytes=24),
                re.escape("(0, num_bytes_per_token=32], got 24"),
            ),
            (
                dict(tensor=np.zeros(48, np.uint8), page_size=1, num_bytes_per_token=32, read_bytes=16),
                re.escape("kv-canary: RealKvSource.tensor must be at least 2-D, got shape (48,)"),
            ),
            (
                dict(tensor=np.zeros((4, 24), np.uint8), page_size=1, num_bytes_per_token=16, read_bytes=16),
                re.escape(
                    "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, got 24 bytes "
                    "(shape=(4, 24), strides=(24, 1), dtype=uint8)"
                ),
            ),
            (
                dict(tensor=jnp.zeros((4, 6), jnp.int16), page_size=1, num_bytes_per_token=16, read_bytes=16),
                r"row stride must be a multiple of 16 bytes, got 12 bytes",
            ),
            (
                dict(tensor=np.zeros((4, 16), np.uint8), page_size=-2, num_bytes_per_token=16, read_bytes=16),
                r"page_size must be >= 1, got -2",
            ),
        ]
        for kw, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                canary_jax.RealKvSource(**kw)

    def test_strided_numpy_row_stride(self):
        base = np.zeros((4, 40), np.uint8)
        with self.assertRaisesRegex(ValueError, r"got 40 bytes \(shape=\(4, 32\), strides=\(40, 1\)"):
            src(base[:, :32])
        # stride(0) = 48 (a multiple of 16): accepted here, refused at launch as non-contiguous.
        s = src(np.zeros((4, 48), np.uint8)[:, :32])
        with self.assertRaisesRegex(ValueError, r"^kv-canary: real_kv_sources\[0\]\.tensor must be contiguous$"):
            check_real_kv_sources([s], ALL)

    def test_valid_sources(self):
        for tensor in (
            np.zeros((4, 16), np.uint8),
            jnp.zeros((4, 8), jnp.bfloat16),
            np.zeros((2, 4), np.float32),
            np.zeros((2, 3, 16), np.uint8),
        ):
            s = src(tensor)
            self.assertEqual((s.page_size, s.num_bytes_per_token, s.read_bytes), (1, 16, 16))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            s.page_size = 2  # frozen

    def test_launch_abi_checks(self):
        three_d = src(np.zeros((N, 2, 16), np.uint8))
        with self.assertRaisesRegex(
            ValueError,
            r"^kv-canary: real_kv_sources\[1\]\.tensor \(viewed as uint8\) must be 2-D, got 3-D "
            r"\(shape \(16, 2, 16\), dtype uint8\); view the pool as \[rows, row_elems\]",
        ):
            check_real_kv_sources([src(np.zeros((N, 16), np.uint8)), three_d], ALL)
        narrow = src(np.zeros((N, 32), np.uint8), page_size=4, nbpt=16)
        with self.assertRaisesRegex(
            ValueError,
            re.escape(
                "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is 32 bytes but page_size=4 "
                "x num_bytes_per_token=16 needs 64"
            ),
        ):
            check_real_kv_sources([narrow], ALL)
        with self.assertRaisesRegex(TypeError, r"real_kv_sources\[0\] must be a RealKvSource, got tuple"):
            check_real_kv_sources([(np.zeros((N, 16)), 1, 16, 16)], ALL)

    def test_source_shorter_than_the_pool(self):
        # Issue #12: 24 rows x page_size 4 = 96 slots < 128; the slots past 96 would be hashed as zero bytes.
        # Issue #28: a launch that hashes only slots below 96 is SGLang's well-defined call and is accepted.
        short = src(np.zeros((24, 64), np.uint8), page_size=4, nbpt=16)
        whole = re.escape(
            "kv-canary: real_kv_sources[1] covers 96 slots (24 rows x page_size 4) but canary_buf has 128 slots"
        )
        covers = re.escape("but real_kv_sources[1] covers 96 slots (24 rows x page_size 4)")
        full = src(np.zeros((128, 16), np.uint8))
        past = canary_jax.VerifyPlan.from_entries(slots=[1, 100], positions=[0, 0], prev_slots=[-1, -1])
        for mode in (constants.RealKvHashMode.PARTIAL, ALL):
            ctx = ctx_with(sources=(full, short), mode=mode, buf=canary_jax.allocate_canary_buffer(128))
            before = snapshot(ctx)
            with self.assertRaisesRegex(
                ValueError, r"verify hashes slot 100 \(plan.verify_slot_indices\[1\]\) " + covers
            ):
                canary_jax.verify(ctx, past, backend="reference")
            with self.assertRaisesRegex(ValueError, r"write hashes slot 96 \(out_cache_loc\[0\]\) " + covers):
                canary_jax.write(ctx, wplan(), tok((7,)), tok((0,)), tok((96,)), backend="reference")
            for a, b in zip(before, snapshot(ctx)):
                np.testing.assert_array_equal(a, b)
            with self.assertRaisesRegex(ValueError, whole):
                check_real_kv_sources([full, short], mode, num_slots=128)
            ctx = canary_jax.write(ctx, wplan(), tok((7,)), tok((0,)), tok((95,)), backend="reference")
            self.assertEqual(canary_jax.verify(ctx, vplan(), backend="reference").log.num_violations(), 1)
        # NONE never reads the sources (like the row-width check); 96 slots cover a 96-slot buffer.
        check_real_kv_sources([full, short], constants.RealKvHashMode.NONE, num_slots=128)
        check_real_kv_sources([short], ALL, num_slots=96)

    def test_more_than_four_sources_first_in_every_mode(self):
        ok = src(np.zeros((N, 16), np.uint8))
        bad = src(np.zeros((N, 2, 16), np.uint8))  # would fail the 2-D check; the count check comes first
        for mode in constants.RealKvHashMode:
            with self.assertRaisesRegex(
                ValueError, r"^kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5$"
            ):
                check_real_kv_sources([bad, ok, ok, ok, ok], mode)
        self.assertEqual(check_real_kv_sources([ok] * 4, constants.RealKvHashMode.NONE), ())
        self.assertEqual(check_real_kv_sources([], ALL), ())

    def test_descriptors(self):
        d = check_real_kv_sources(
            [
                src(np.zeros((8, 96), np.uint8), page_size=2, nbpt=32, read_bytes=32),
                src(np.zeros((16, 8), np.float32), nbpt=32, read_bytes=16),
            ],
            constants.RealKvHashMode.PARTIAL,
        )
        self.assertEqual(d, (SourceDescriptor(2, 32, 32, 16, 96, 8), SourceDescriptor(1, 32, 16, 16, 32, 16)))
        d = check_real_kv_sources([src(np.zeros((8, 96), np.uint8), page_size=2, nbpt=32, read_bytes=32)], ALL)
        self.assertEqual(d[0].effective_read_bytes, 32)


class LaunchRefusalTest(RefusalMixin, absltest.TestCase):
    def test_more_than_four_sources_before_tracing(self):
        ctx = ctx_with(sources=[src(np.zeros((N, 16), np.uint8))] * 5)
        msg = r"^kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5$"
        self.assertRefused(ctx, ValueError, msg, lambda: canary_jax.verify(ctx, vplan(), backend="reference"))
        self.assertRefused(
            ctx, ValueError, msg, lambda: canary_jax.write(ctx, wplan(), tok(), tok(), tok(), backend="reference")
        )
        ctx_none = ctx_with(sources=[src(np.zeros((N, 16), np.uint8))] * 5, mode=constants.RealKvHashMode.NONE)
        self.assertRefused(ctx_none, ValueError, msg, lambda: canary_jax.verify(ctx_none, vplan(), backend="reference"))

    def test_source_errors_at_launch(self):
        for s, msg in (
            (src(np.zeros((N, 2, 16), np.uint8)), r"\(viewed as uint8\) must be 2-D, got 3-D"),
            (src(np.zeros((N, 16), np.uint8), page_size=2), r"row is too narrow"),
            (src(np.zeros((N, 48), np.uint8)[:, :32]), r"must be contiguous"),
        ):
            ctx = ctx_with(sources=[s])
            self.assertRefused(
                ctx, ValueError, msg, lambda ctx=ctx: canary_jax.verify(ctx, vplan(), backend="reference")
            )
            self.assertRefused(
                ctx,
                ValueError,
                msg,
                lambda ctx=ctx: canary_jax.write(ctx, wplan(), tok(), tok(), tok(), backend="reference"),
            )

    def test_canary_buffer_checks(self):
        for buf, exc, msg in (
            (
                jnp.zeros((N, 24), jnp.uint8),
                ValueError,
                r"^kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got 3$",
            ),
            (jnp.zeros((N, 8), jnp.uint8), ValueError, r"must hold at least 4 int64 fields, got 1$"),
            (
                jnp.zeros((N, 36), jnp.uint8),
                ValueError,
                r"canary_buf slot stride must be a multiple of 8 bytes, got 36",
            ),
            (jnp.zeros((N, 8), jnp.uint32), TypeError, r"canary_buf must have dtype uint8, got uint32"),
            (jnp.zeros((N * 32,), jnp.uint8), ValueError, r"canary_buf must be 2-D"),
            # No slots: refused, with the torch launchers' message (one check for both, see validation.py).
            (
                jnp.zeros((0, 32), jnp.uint8),
                ValueError,
                r"^kv-canary: canary_buf must have between 1 and 2\*\*31 - 1 slots, got 0$",
            ),
        ):
            ctx = ctx_with(buf=buf)
            self.assertRefused(ctx, exc, msg, lambda ctx=ctx: canary_jax.verify(ctx, vplan(), backend="reference"))
            self.assertRefused(
                ctx, exc, msg, lambda ctx=ctx: canary_jax.write(ctx, wplan(), tok(), tok(), tok(), backend="reference")
            )
        with self.assertRaisesRegex(ValueError, r"at least 4 int64 fields, got 3"):
            canary_jax.allocate_canary_buffer(N, 24)
        with self.assertRaisesRegex(ValueError, r"num_slots must be positive, got 0"):
            canary_jax.allocate_canary_buffer(0)

    def test_context_and_plan_kinds(self):
        ctx = ctx_with()
        self.assertRefused(
            ctx,
            TypeError,
            r"plan must be a VerifyPlan, got WritePlan",
            lambda: canary_jax.verify(ctx, wplan(), backend="reference"),
        )
        self.assertRefused(
            ctx,
            TypeError,
            r"plan must be a WritePlan, got VerifyPlan",
            lambda: canary_jax.write(ctx, vplan(), tok(), tok(), tok(), backend="reference"),
        )
        with self.assertRaisesRegex(TypeError, r"context must be a VerifyOrWriteContext, got dict"):
            canary_jax.verify({}, vplan(), backend="reference")
        bad_kind = ctx_with(kind=12)
        self.assertRefused(
            bad_kind,
            ValueError,
            r"kernel_kind must be a CanaryLaunchTag, got 12",
            lambda: canary_jax.verify(bad_kind, vplan(), backend="reference"),
        )
        small_log = canary_jax.ViolationLog.allocate(ring_capacity=4, num_tags=2)
        ctx2 = ctx_with(log=small_log)
        self.assertRefused(
            ctx2,
            ValueError,
            r"kernel_kind=2 is outside the counter arrays of length 2",
            lambda: canary_jax.verify(ctx2, vplan(), backend="reference"),
        )
        self.assertRefused(
            ctx, ValueError, r"backend must be one of", lambda: canary_jax.verify(ctx, vplan(), backend="cuda")
        )

    def test_verify_plan_field_checks(self):
        ctx = ctx_with()
        good = vplan()
        cases = [
            (
                dict(verify_slot_indices=jnp.zeros((4,), jnp.uint32)),
                ValueError,
                r"plan\.verify_slot_indices must have shape \[4, 2\], got \[4\]$",
            ),
            (
                dict(verify_slot_indices=jnp.zeros((4,), jnp.int32)),
                TypeError,
                r"plan\.verify_slot_indices must have dtype uint32, got int32",
            ),
            (
                dict(verify_expected_tokens=np.zeros((4,), np.int64)),
                TypeError,
                r"plan\.verify_expected_tokens must have dtype uint32, got int64",
            ),
            (
                dict(verify_expected_positions=jnp.zeros((5, 2), jnp.uint32)),
                ValueError,
                r"plan\.verify_expected_positions must have shape \[4, 2\], got \[5, 2\]$",
            ),
            (
                dict(verify_prev_slot_indices=jnp.zeros((4, 2), jnp.float32)),
                TypeError,
                r"plan\.verify_prev_slot_indices must have dtype uint32, got float32",
            ),
            (
                dict(verify_num_valid=jnp.zeros((2,), jnp.int32)),
                ValueError,
                r"plan\.verify_num_valid must have shape \[1\], got \[2\]$",
            ),
            (
                dict(verify_num_valid=jnp.zeros((1,), jnp.uint32)),
                TypeError,
                r"plan\.verify_num_valid must have dtype int32",
            ),
            (dict(enable=np.ones((1,), np.int64)), TypeError, r"plan\.enable must have dtype int32, got int64"),
        ]
        for kw, exc, msg in cases:
            plan = dataclasses.replace(good, **kw)
            self.assertRefused(ctx, exc, msg, lambda plan=plan: canary_jax.verify(ctx, plan, backend="reference"))

    def test_write_plan_field_checks(self):
        ctx = ctx_with()
        good = wplan(cap=8)
        cases = [
            (
                dict(write_offsets=jnp.zeros((8, 2), jnp.uint32)),
                ValueError,
                re.escape("canary_write: write_offsets.size(0) must equal write_req_capacity + 1 (9), got 8"),
            ),
            (
                dict(write_offsets=jnp.zeros((10, 2), jnp.uint32)),
                ValueError,
                re.escape("write_req_capacity + 1 (9), got 10"),
            ),
            (dict(write_offsets=jnp.zeros((9,), jnp.int32)), ValueError, r"write_offsets"),
            (
                dict(write_seed_slot_indices=jnp.zeros((8,), jnp.uint32)),
                ValueError,
                r"plan\.write_seed_slot_indices must have shape",
            ),
            (
                dict(write_seed_slot_indices=np.zeros((8,), np.int64)),
                TypeError,
                r"plan\.write_seed_slot_indices must have dtype uint32, got int64",
            ),
            (
                dict(write_num_valid_reqs=jnp.zeros((1,), jnp.int16)),
                TypeError,
                r"plan\.write_num_valid_reqs must have dtype int32",
            ),
        ]
        for kw, exc, msg in cases:
            plan = dataclasses.replace(good, **kw)
            self.assertRefused(
                ctx, exc, msg, lambda plan=plan: canary_jax.write(ctx, plan, tok(), tok(), tok(), backend="reference")
            )

    def test_log_field_checks(self):
        base = canary_jax.ViolationLog.allocate(ring_capacity=4)
        cases = [
            (
                dict(ring=jnp.zeros((4, 8), jnp.uint32)),
                ValueError,
                r"^kv-canary: violation_ring must have shape \[\*, 8, 2\], got \[4, 8\]$",
            ),
            (dict(ring=jnp.zeros((4, 8, 2), jnp.int32)), TypeError, r"violation_ring must have dtype uint32"),
            (dict(write_index=jnp.zeros((1,), jnp.uint32)), TypeError, r"violation_write_index must have dtype int32"),
            (dict(slot_run_counters=jnp.zeros((11, 2), jnp.uint32)), ValueError, r"slot_run_counters shape"),
            (
                dict(kernel_run_counters=jnp.zeros((12,), jnp.uint32)),
                ValueError,
                r"kernel_run_counters must have shape",
            ),
            (
                dict(enable_chain_position_assert=jnp.zeros((1,), jnp.bool_)),
                TypeError,
                r"enable_chain_position_assert must have dtype int32",
            ),
        ]
        for kw, exc, msg in cases:
            ctx = ctx_with(log=dataclasses.replace(base, **kw))
            self.assertRefused(ctx, exc, msg, lambda ctx=ctx: canary_jax.verify(ctx, vplan(), backend="reference"))
        with self.assertRaisesRegex(TypeError, r"context\.log must be a ViolationLog"):
            canary_jax.verify(ctx_with(log=object()), vplan(), backend="reference")

    def test_write_token_array_checks(self):
        ctx = ctx_with()
        p = wplan()
        f = np.zeros(T, np.float32)
        cases = [
            (
                lambda: canary_jax.write(ctx, p, f, tok(), tok(), backend="reference"),
                TypeError,
                r"input_ids must be an int64-valued integer array, got shape \[4\] dtype float32$",
            ),
            (
                lambda: canary_jax.write(ctx, p, tok(), tok((1, 2, 3)), tok(), backend="reference"),
                ValueError,
                r"^kv-canary: positions \(3 entries\) is shorter than input_ids \(4 entries\); they must have the "
                r"same length$",
            ),
            (
                # input_ids is the shorter one: it is named as such, not positions (SGLang binds T to input_ids)
                lambda: canary_jax.write(ctx, p, tok((1, 2, 3)), tok(), tok((1, 2, 3)), backend="reference"),
                ValueError,
                r"^kv-canary: input_ids \(3 entries\) is shorter than positions \(4 entries\)",
            ),
            (
                lambda: canary_jax.write(ctx, p, tok(), tok(), np.zeros((4, 3), np.int64), backend="reference"),
                ValueError,
                r"out_cache_loc must have shape \[\*\] \(int64\), got shape \[4, 3\]$",
            ),
            (
                lambda: canary_jax.write(ctx, p, tok(), tok(), jnp.zeros(4, jnp.float32), backend="reference"),
                TypeError,
                r"out_cache_loc must be an int64-valued integer array",
            ),
            (
                lambda: canary_jax.write(
                    ctx,
                    p,
                    tok(),
                    tok(),
                    tok(),
                    enable_write_input_assert=True,
                    expected_input_tokens=tok(),
                    expected_input_positions=tok((1, 2)),
                    backend="reference",
                ),
                ValueError,
                r"expected_input_positions \(2 entries\) is shorter than input_ids \(4 entries\)",
            ),
            (
                lambda: canary_jax.write(
                    ctx,
                    p,
                    tok(),
                    tok(),
                    tok(),
                    enable_write_input_assert=True,
                    expected_input_tokens=f,
                    expected_input_positions=tok(),
                    backend="reference",
                ),
                TypeError,
                r"expected_input_tokens must be an int64-valued",
            ),
            (
                lambda: canary_jax.write(ctx, p, [2**63, 0, 0, 0], tok(), tok(), backend="reference"),
                ValueError,
                r"input_ids holds a value that does not fit int64",
            ),
            (
                lambda: canary_jax.write(
                    ctx,
                    p,
                    tok(),
                    tok(),
                    tok(),
                    enable_write_input_assert=True,
                    expected_input_positions=tok(),
                    backend="reference",
                ),
                ValueError,
                r"^kv-canary: expected input tensors are required when enable_write_input_assert=True$",
            ),
            (
                lambda: canary_jax.write(
                    ctx,
                    p,
                    tok(),
                    tok(),
                    tok(),
                    enable_write_input_assert=False,
                    expected_input_tokens=tok(),
                    expected_input_positions=tok(),
                    backend="reference",
                ),
                ValueError,
                r"^kv-canary: expected input tensors must be None when enable_write_input_assert=False$",
            ),
        ]
        for fn, exc, msg in cases:
            self.assertRefused(ctx, exc, msg, fn)


class PlanLaunchCheckTest(absltest.TestCase):
    """``validation.check_plan_launch``: SGLang's plan-launch checks, shared by ``build_plans`` (kernel path) and
    the torch launcher (kernel path for CUDA tensors, the reference's for CPU tensors)."""

    GOOD = dict(
        swa_window_size=0,
        has_lut=False,
        lut_len=0,
        verify_capacity=8,
        plan_capacity=8,
        bs=2,
        write_req_capacity=4,
        has_pool=False,
        has_valid_lens=False,
    )
    # Every fault at once; each path names them one by one, in its own order.
    FAULTS = dict(swa_window_size=4, bs=5000, verify_capacity=9, has_pool=True)
    MESSAGES = {
        "swa": r"^kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when swa_window_size > 0$",
        "max_bs": r"^kv-canary: launch_canary_plan_kernels supports at most bs=4096 reqs per launch, got bs=5000\. "
        r"Bump _PLAN_BS_BLOCK_SIZE if real workloads need this\.$",
        "capacity_kernel": r"^kv-canary: launch_canary_plan_kernels verify_capacity=9 does not match "
        r"verify_plan_out\.verify_slot_indices\.shape\[0\]=8$",
        "capacity_reference": r"^kv-canary: launch_canary_plan_kernels_torch_reference verify_capacity=9 does not "
        r"match verify_plan_out\.verify_slot_indices\.shape\[0\]=8$",
        "bs": r"^kv-canary: bs=5000 exceeds write_req_capacity=4$",
        "lens_kernel": r"^kv-canary: launch_plan_entries_kernel requires req_to_verify_expected_tokens_valid_lens "
        r"when req_to_verify_expected_tokens is set$",
        "lens_reference": r"^kv-canary: launch_canary_plan_kernels_torch_reference requires "
        r"req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set$",
    }

    def _order(self, path, max_bs):
        """The messages, in the order ``path`` reports them, fixing each fault after it is reported."""
        from canary_jax.contract import validation

        kw = {**self.GOOD, **self.FAULTS}
        fixes = dict(swa_window_size=0, bs=2, verify_capacity=8, has_pool=False)
        seen = []
        for _ in range(10):
            try:
                validation.check_plan_launch(**kw, path=path, max_bs=max_bs)
            except ValueError as e:
                seen.append(str(e))
                key = next(k for k, m in self.MESSAGES.items() if re.search(m, str(e)))
                field = dict(swa="swa_window_size", max_bs="bs", bs="bs")
                field = field.get(key, "verify_capacity" if key.startswith("capacity") else "has_pool")
                kw[field] = fixes[field]
                continue
            return seen
        self.fail("never passed")

    def _assert_order(self, seen, keys):
        self.assertEqual(len(seen), len(keys), seen)
        for msg, key in zip(seen, keys):
            self.assertRegex(msg, self.MESSAGES[key])

    def test_kernel_path_order(self):
        # SGLang's launch_canary_plan_kernels: SWA LUT, bs limit, capacity, then (offsets kernel) bs against the
        # write capacity, then (launch_plan_entries_kernel) the valid lengths.
        self._assert_order(self._order("kernel", 4096), ["swa", "max_bs", "capacity_kernel", "lens_kernel"])
        # Without the CUDA bs limit (canary-jax's build_plans), bs > Cw is what is left.
        self._assert_order(self._order("kernel", None), ["swa", "capacity_kernel", "bs", "lens_kernel"])

    def test_reference_path_order(self):
        # SGLang's CPU reference: SWA LUT, capacity, valid lengths; it has no bs limit (max_bs is ignored) and
        # silently caps bs > Cw, which canary-jax refuses last.
        self._assert_order(self._order("reference", 4096), ["swa", "capacity_reference", "lens_reference", "bs"])

    def test_lut_length_and_passing_launches(self):
        from canary_jax.contract import validation

        with self.assertRaisesRegex(
            ValueError, r"^kv-canary: lut_len must be positive when has_swa_lut is True, got 0$"
        ):
            validation.check_plan_launch(**{**self.GOOD, "swa_window_size": 4, "has_lut": True})
        validation.check_plan_launch(**{**self.GOOD, "swa_window_size": 4, "has_lut": True, "lut_len": 1})
        validation.check_plan_launch(**{**self.GOOD, "verify_capacity": None, "has_pool": True, "has_valid_lens": True})
        validation.check_plan_launch(**{**self.GOOD, "bs": 4}, path="reference", max_bs=4)
        with self.assertRaisesRegex(ValueError, r"path must be 'kernel' or 'reference', got 'cuda'"):
            validation.check_plan_launch(**self.GOOD, path="cuda")

    def test_build_plans_uses_the_kernel_path(self):
        from canary_jax.planning.plan_builder import build_plans

        kw = dict(
            req_pool_indices=np.array([1, 2]),
            prefix_lens=np.array([1, 1]),
            extend_seq_lens=np.array([1, 1]),
            req_to_token=np.zeros((4, 8), np.int32),
            verify_capacity=8,
            write_req_capacity=4,
        )
        with self.assertRaisesRegex(ValueError, self.MESSAGES["lens_kernel"]):
            build_plans(**kw, req_to_verify_expected_tokens=np.zeros((4, 8), np.int32))
        with self.assertRaisesRegex(ValueError, self.MESSAGES["capacity_kernel"]):
            build_plans(
                **{**kw, "verify_capacity": 9}, verify_plan_out=canary_jax.VerifyPlan.allocate(verify_capacity=8)
            )


class PlanAllocationTest(absltest.TestCase):
    def test_allocate_capacity_errors(self):
        for c in (0, -3):
            with self.assertRaisesRegex(
                ValueError, rf"^kv-canary: VerifyPlan verify_capacity must be positive, got {c}$"
            ):
                canary_jax.VerifyPlan.allocate(verify_capacity=c)
            with self.assertRaisesRegex(
                ValueError, rf"^kv-canary: WritePlan write_req_capacity must be positive, got {c}$"
            ):
                canary_jax.WritePlan.allocate(write_req_capacity=c)

    def test_allocate_shapes(self):
        vp = canary_jax.VerifyPlan.allocate(verify_capacity=5)
        self.assertEqual(vp.verify_slot_indices.shape, (5, 2))
        self.assertEqual(vp.verify_capacity, 5)
        self.assertEqual(np.asarray(vp.enable).tolist(), [1])  # SGLang allocates enable as ones
        self.assertEqual((vp.verify_num_valid.dtype, vp.enable.dtype), (jnp.int32, jnp.int32))
        vp.check()
        wp = canary_jax.WritePlan.allocate(write_req_capacity=3)
        self.assertEqual((wp.write_offsets.shape, wp.write_seed_slot_indices.shape), ((4, 2), (3, 2)))
        self.assertEqual(wp.write_req_capacity, 3)
        wp.check()

    def test_host_builders(self):
        vp = canary_jax.VerifyPlan.from_entries(
            slots=[3, 2**40], positions=[0, -1], prev_slots=[-1, 3], expected_tokens=[7, 2**33], verify_capacity=4
        )
        self.assertEqual(ints.pairs_to_int64_np(vp.verify_slot_indices).tolist(), [3, 2**40, 0, 0])
        self.assertEqual(ints.pairs_to_int64_np(vp.verify_expected_tokens).tolist(), [7, 2**33, -1, -1])
        self.assertEqual(ints.pairs_to_int64_np(vp.verify_expected_positions).tolist(), [0, -1, 0, 0])
        self.assertEqual(np.asarray(vp.verify_num_valid).tolist(), [2])
        with self.assertRaisesRegex(ValueError, r"3 verify entries exceed verify_capacity=2"):
            canary_jax.VerifyPlan.from_entries(
                slots=[1, 2, 3], positions=[0, 1, 2], prev_slots=[-1, 1, 2], verify_capacity=2
            )
        with self.assertRaisesRegex(ValueError, r"positions has length 1, slots has 2"):
            canary_jax.VerifyPlan.from_entries(slots=[1, 2], positions=[0], prev_slots=[-1, 1])
        wp = canary_jax.WritePlan.from_requests(counts=[2, 0, 3], seed_slots=[-1, -1, 9], write_req_capacity=4)
        self.assertEqual(ints.pairs_to_int64_np(wp.write_offsets).tolist(), [0, 2, 2, 5, 0])
        self.assertEqual(ints.pairs_to_int64_np(wp.write_seed_slot_indices).tolist(), [-1, -1, 9, 0])
        self.assertEqual(np.asarray(wp.write_num_valid_reqs).tolist(), [3])
        with self.assertRaisesRegex(ValueError, r"bs=3 exceeds write_req_capacity=2"):
            canary_jax.WritePlan.from_requests(counts=[1, 1, 1], seed_slots=[-1] * 3, write_req_capacity=2)
        with self.assertRaisesRegex(ValueError, r"non-negative"):
            canary_jax.WritePlan.from_requests(counts=[-1], seed_slots=[-1])

    def test_violation_log_allocate(self):
        with self.assertRaisesRegex(ValueError, r"^kv-canary: ViolationLog ring_capacity must be positive, got 0$"):
            canary_jax.ViolationLog.allocate(ring_capacity=0)
        with self.assertRaisesRegex(ValueError, r"^kv-canary: CanaryDeviceState num_tags must be positive, got 0$"):
            canary_jax.ViolationLog.allocate(ring_capacity=4, num_tags=0)
        log = canary_jax.ViolationLog.allocate(ring_capacity=3)
        self.assertEqual((log.ring.shape, log.slot_run_counters.shape), ((3, 8, 2), (12, 2)))
        self.assertEqual(np.asarray(log.enable_chain_position_assert).tolist(), [1])
        self.assertEqual(log.ring_capacity, 3)
        off = canary_jax.ViolationLog.allocate(ring_capacity=3, enable_chain_position_assert=False)
        self.assertEqual(np.asarray(off.enable_chain_position_assert).tolist(), [0])


class Int64InputTest(absltest.TestCase):
    """int64 data is kept exact with x64 off (pairs), and refused where it would be truncated."""

    def test_numpy_int64_values_above_int32_kept(self):
        ctx = ctx_with(mode=constants.RealKvHashMode.NONE)
        big_tok, big_pos = 2**40 + 5, -(2**35)
        ctx = canary_jax.write(
            ctx,
            wplan(),
            np.array([big_tok, 0, 0, 0], np.int64),
            np.array([big_pos, 0, 0, 0], np.int64),
            np.array([3, 0, 0, 0], np.int64),
            backend="reference",
        )
        self.assertEqual(canary_jax.read_slot(ctx.canary_buf, 3), (big_tok, big_pos, oracle.s64(oracle.ANCHOR_HASH), 0))

    def test_accepted_forms_agree(self):
        values = [-1, 2**31, 0xFFFFFFFF, -(2**63)]
        want = np.array(values, np.int64)
        forms = [
            values,
            want,
            ints.int64_to_pairs_np(want),
            jnp.asarray(ints.int64_to_pairs_np(want)),
            jnp.asarray(ints.int64_to_pairs_np(want)).astype(jnp.int32),
        ]
        for form in forms:
            got = ints.pairs_to_int64_np(ints.as_int64_pairs(form, name="x", shape=(4,)))
            np.testing.assert_array_equal(got, want)
        # uint64 whose values fit int64: exact.
        big = np.array([0, 7, 2**32 + 1, 2**63 - 1], np.uint64)
        got = ints.pairs_to_int64_np(ints.as_int64_pairs(big, name="x", shape=(4,)))
        self.assertEqual(got.tolist(), [0, 7, 2**32 + 1, 2**63 - 1])

    def test_uint64_past_int64_refused(self):
        # -1 cast to uint64 is 2**64 - 1: an int64 tensor cannot hold it, and its bits would read as -1.
        for bad, value in (
            (np.array([-1, 5], np.int64).astype(np.uint64), 2**64 - 1),
            (np.array([3, 2**63], np.uint64), 2**63),
        ):
            with self.assertRaisesRegex(
                ValueError, rf"^kv-canary: x holds a value that does not fit int64: {value} \(uint64\)$"
            ):
                ints.as_int64_pairs(bad, name="x", shape=(2,))
            with self.assertRaisesRegex(ValueError, rf"^kv-canary: x holds a value that does not fit int64: {value}"):
                ints.int64_to_pairs_np(bad, name="x")
        # At a launch: refused naming the argument, and nothing changes.
        ctx = ctx_with()
        pos = np.array([0, 2**63 + 4, 0, 0], np.uint64)
        fn = lambda: canary_jax.write(ctx, wplan(), tok(), pos, tok(), backend="reference")  # noqa: E731
        RefusalMixin.assertRefused(self, ctx, ValueError, r"^kv-canary: positions holds a value that does not fit", fn)

    def test_uint64_jax_arrays_with_x64(self):
        with jax.enable_x64(True):
            ok = jnp.asarray(np.array([5, 2**63 - 1], np.uint64))
            self.assertEqual(ints.pairs_to_int64_np(ints.as_int64_pairs(ok, name="x")).tolist(), [5, 2**63 - 1])
            bad = jnp.asarray(np.array([5, 2**63], np.uint64))
            with self.assertRaisesRegex(
                ValueError, r"^kv-canary: x holds a value that does not fit int64: 9223372036854775808"
            ):
                ints.as_int64_pairs(bad, name="x")
            # Traced, the values cannot be checked: the dtype is refused.
            with self.assertRaisesRegex(TypeError, r"^kv-canary: x is a uint64 array inside a traced function"):
                jax.jit(lambda a: ints.as_int64_pairs(a, name="x"))(ok)

    def test_bools_refused(self):
        forms = ([True, False], np.array([True, False]), jnp.asarray([True, False]))
        for form in forms:
            with self.assertRaisesRegex(
                TypeError, r"^kv-canary: x must be an int64-valued integer array, got shape \[2\] dtype bool$"
            ):
                ints.as_int64_pairs(form, name="x", shape=(2,))
        with self.assertRaisesRegex(TypeError, r"expected integer data"):
            ints.int64_to_pairs_np([1, True])
        # Object arrays go through the exact path: a float inside is refused, not truncated.
        with self.assertRaisesRegex(TypeError, r"expected integer data"):
            ints.int64_to_pairs_np(np.array([1, 2.5], dtype=object))
        self.assertEqual(
            ints.int64_to_pairs_np(np.array([2**62, -3], dtype=object)).tolist(), [[0, 2**30], [2**32 - 3, 2**32 - 1]]
        )
        ctx = ctx_with()
        mask = np.array([True, False, True, True])
        for arg in ("input_ids", "positions", "out_cache_loc"):
            arrays = dict(input_ids=tok(), positions=tok(), out_cache_loc=tok())
            arrays[arg] = mask
            fn = lambda a=arrays: canary_jax.write(ctx, wplan(), **a, backend="reference")  # noqa: E731
            RefusalMixin.assertRefused(
                self,
                ctx,
                TypeError,
                rf"^kv-canary: {arg} must be an int64-valued integer array, got shape \[4\] dtype bool$",
                fn,
            )

    def test_narrow_forms_sign_or_zero_extend(self):
        self.assertEqual(
            ints.pairs_to_int64_np(
                ints.as_int64_pairs(jnp.asarray([-1, 5], jnp.int32), name="x", shape=(None,))
            ).tolist(),
            [-1, 5],
        )
        self.assertEqual(
            ints.pairs_to_int64_np(
                ints.as_int64_pairs(jnp.asarray([0xFFFFFFFF], jnp.uint32), name="x", shape=(1,))
            ).tolist(),
            [0xFFFFFFFF],
        )
        self.assertEqual(
            ints.pairs_to_int64_np(ints.as_int64_pairs(np.array([-3], np.int8), name="x", shape=(1,))).tolist(), [-3]
        )
        self.assertEqual(ints.pairs_to_int64_np(ints.as_int64_pairs([], name="x", shape=(0,))).shape, (0,))

    def test_python_ints_outside_int64_refused(self):
        for bad in ([2**63], [-1, 2**63], [2**64 - 1], [-(2**63) - 1]):
            with self.assertRaisesRegex(ValueError, r"kv-canary: x holds a value that does not fit int64"):
                ints.as_int64_pairs(bad, name="x")
        for bad in ([1.5], np.array([1.0]), jnp.asarray([1.0])):
            with self.assertRaisesRegex(TypeError, r"kv-canary: x must be an int64-valued integer array"):
                ints.as_int64_pairs(bad, name="x")

    def test_as_int32_refuses_truncation(self):
        with self.assertRaisesRegex(ValueError, r"kv-canary: n holds values outside int32"):
            ints.as_int32(np.array([2**31], np.int64), name="n")
        with self.assertRaisesRegex(ValueError, r"outside int32"):
            ints.as_int32(np.array([-(2**31) - 1], np.int64), name="n")
        self.assertEqual(
            np.asarray(ints.as_int32(np.array([2**31 - 1, -(2**31)], np.int64), name="n")).tolist(),
            [2**31 - 1, -(2**31)],
        )
        with self.assertRaisesRegex(TypeError, r"n must have dtype int32, got uint32"):
            ints.as_int32(jnp.zeros((1,), jnp.uint32), name="n")
        with self.assertRaisesRegex(TypeError, r"n must have dtype int32, got float64"):
            ints.as_int32(np.zeros((1,)), name="n")
        with self.assertRaisesRegex(ValueError, r"n must have shape \[1\], got \[2\]$"):
            ints.as_int32(np.zeros((2,), np.int32), name="n", shape=(1,))

    def test_pairs_round_trip(self):
        vals = np.array([0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF], np.int64)
        pairs = ints.int64_to_pairs_np(vals)
        self.assertEqual(pairs.dtype, np.uint32)
        self.assertEqual(pairs.tobytes(), vals.astype("<i8").tobytes())  # same bytes as SGLang's int64 tensor
        np.testing.assert_array_equal(ints.pairs_to_int64_np(pairs), vals)
        with self.assertRaisesRegex(TypeError, r"trailing dim of 2"):
            ints.pairs_to_int64_np(np.zeros((3, 3), np.uint32))

    def test_numpy_eight_byte_source_keeps_bytes(self):
        # With x64 off jit would narrow int64 / float64 numpy arrays; the launch must hash the real bytes.
        raw = np.random.default_rng(0).integers(0, 256, (N, 16), dtype=np.uint8)
        for dt in (np.int64, np.float64, np.uint8):
            data = raw.view(dt)
            ctx = ctx_with(sources=[src(data)])
            ctx = canary_jax.write(ctx, wplan(), tok(), tok((0, 0, 0, 0)), tok((5, 0, 0, 0)), backend="reference")
            want = oracle.real_kv_hash([oracle.Source.of(raw, 1, 16, 16)], oracle.ALL, 5)
            self.assertEqual(canary_jax.read_slot(ctx.canary_buf, 5).real_kv_hash, oracle.s64(want), dt)

    def test_bool_and_narrow_dtype_sources(self):
        mask = (np.arange(N * 16).reshape(N, 16) % 3) == 0
        raw = np.random.default_rng(1).integers(0, 256, (N, 16), dtype=np.uint8)
        cases = [
            (jnp.asarray(mask), mask.view(np.uint8)),
            (mask, mask.view(np.uint8)),
            (jnp.asarray(raw.view(np.int16)), raw),
            (jnp.asarray(raw.view(np.float32)), raw),
        ]
        for tensor, want_bytes in cases:
            ctx = ctx_with(sources=[src(tensor)])
            ctx = canary_jax.write(ctx, wplan(), tok(), tok((0, 0, 0, 0)), tok((6, 0, 0, 0)), backend="reference")
            want = oracle.real_kv_hash([oracle.Source.of(want_bytes, 1, 16, 16)], oracle.ALL, 6)
            self.assertEqual(canary_jax.read_slot(ctx.canary_buf, 6).real_kv_hash, oracle.s64(want), tensor.dtype)


class BackendPlatformTest(absltest.TestCase):
    """The backend and the Pallas interpret mode follow where the canary buffer lives, not JAX's default backend
    (a GPU host keeps CPU arrays too: compiling Pallas for the GPU on them fails). Simulated on a CPU by making
    JAX's default backend report a GPU."""

    def test_platform_of_arrays(self):
        from canary_jax.ops import backends

        self.assertEqual(backends.array_platform(jnp.zeros(2)), "cpu")
        self.assertIsNone(backends.array_platform(np.zeros(2)))
        seen = []
        jax.jit(lambda a: seen.append(backends.array_platform(a)) or a)(jnp.zeros(2))
        self.assertEqual(seen, [None])  # a tracer's device is unknown
        bound = backends.implementation("verify", "pallas", platform="cpu")
        self.assertEqual(bound.keywords, {"interpret": True})
        self.assertIs(bound, backends.implementation("verify", "pallas", platform="cpu"))  # one program cache key
        self.assertEqual(backends.implementation("write", "pallas", platform="cuda").keywords, {"interpret": False})
        self.assertEqual(backends.implementation("write", "pallas", platform="gpu").keywords, {"interpret": False})
        self.assertIs(backends.implementation("verify", "reference", platform="gpu"), canary_jax.verify_reference)

    def test_cpu_buffer_on_a_gpu_host(self):
        from unittest import mock

        from pallas_kernels.verify import verify_pallas

        def run(launch, ctx):
            ctx = canary_jax.write(
                ctx, wplan(), tok((7, 8, 9, 9)), tok((0, 1, 2, 2)), tok((4, 0, 0, 0)), backend="reference"
            )
            plan = canary_jax.VerifyPlan.from_entries(slots=[4, 5], positions=[1, 0], prev_slots=[-1, -1])
            return snapshot(launch(ctx, plan))

        want = run(
            lambda c, p: canary_jax.verify(c, p, backend="reference"), ctx_with(mode=constants.RealKvHashMode.NONE)
        )
        self.assertEqual(int(want[2][0]), 2)  # two violations: position and chain of slot 4, empty slot 5
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            self.assertEqual(canary_jax.resolve_backend(None), "pallas")  # the default backend's choice
            for launch in (
                lambda c, p: canary_jax.verify(c, p),  # auto: the CPU buffer picks the reference
                lambda c, p: canary_jax.verify(c, p, backend="pallas"),  # Pallas, interpreted on the CPU
                lambda c, p: verify_pallas(c, p),  # the wrapper called directly, on concrete CPU arrays
            ):
                got = run(launch, ctx_with(mode=constants.RealKvHashMode.NONE))
                for a, b in zip(got, want):
                    np.testing.assert_array_equal(a, b)


class LaunchMechanicsTest(absltest.TestCase):
    def test_inside_user_jit_matches_eager(self):
        def run(ctx):
            ctx = canary_jax.write(
                ctx, wplan(), tok((7, 8, 9, 9)), tok((0, 1, 2, 2)), tok((4, 0, 0, 0)), backend="reference"
            )
            return canary_jax.verify(
                ctx,
                canary_jax.VerifyPlan.from_entries(slots=[4], positions=[1], prev_slots=[-1], verify_capacity=4),
                backend="reference",
            )

        eager = run(ctx_with())
        jitted = jax.jit(run)(ctx_with())
        for a, b in zip(snapshot(eager), snapshot(jitted)):
            np.testing.assert_array_equal(a, b)
        self.assertEqual(eager.log.num_violations(), 1)

    def test_no_retrace_for_same_shapes(self):
        from canary_jax.ops import launch

        ctx = ctx_with(mode=constants.RealKvHashMode.NONE)
        ctx = canary_jax.verify(ctx, vplan(), backend="reference")
        n0 = launch.trace_count("verify")
        for k in range(3):
            ctx = canary_jax.verify(ctx, vplan(n=k + 1), backend="reference")
        self.assertEqual(launch.trace_count("verify"), n0)
        self.assertEqual(ctx.log.kernel_run_counter(TAG), 4)

    def test_resolve_backend(self):
        self.assertEqual(canary_jax.resolve_backend("REFERENCE"), "reference")
        self.assertEqual(canary_jax.resolve_backend("pallas"), "pallas")
        want = r"backend must be one of \('reference', 'pallas', 'pallas_tpu'\), got 'triton'"
        with self.assertRaisesRegex(ValueError, want):
            canary_jax.resolve_backend("triton")


if __name__ == "__main__":
    absltest.main()
