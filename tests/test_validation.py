"""Validation error paths of the core contract (SPEC 3, 4, 10): real-KV sources and the launches that refuse bad
contexts, plans, logs and token arrays.

Every refused launch must raise before anything is traced or mutated: the tests compare the canary buffer
and the whole log before and after, and check the arrays were not donated. The plan-launch checks and plan
allocation are ``tests/test_validation_plans.py``'s, lossless int64 inputs ``tests/test_int64_inputs.py``'s, the
backend platform and launch mechanics ``tests/test_launch_backends.py``'s.
"""

from __future__ import annotations

import dataclasses
import re

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants
from canary_jax.contract.sources import SourceDescriptor, check_real_kv_sources
from helpers.launch_refusals import (
    ALL,
    N,
    RefusalMixin,
    T,
    ctx_with,
    snapshot,
    src,
    tok,
    vplan,
    wplan,
)


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


if __name__ == "__main__":
    absltest.main()
