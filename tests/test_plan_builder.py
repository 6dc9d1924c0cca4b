"""build_plans and scatter_req_token_ids: hand scenarios per plan rule, errors, x64, jit, and oracle fuzz."""

from __future__ import annotations

import random
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import ints
from canary_jax.ops import plan_launch
from canary_jax.planning.plan_builder import build_plans, scatter_req_token_ids, swa_translate
from canary_jax.planning.plans import VerifyPlan, WritePlan
from helpers import plan_oracle

I64 = ints.pairs_to_int64_np

# Fixed shapes, reused so each configuration compiles once.
MAX_REQS, MAX_SEQ = 8, 24
BS, CAP, CW = 6, 64, 8
LUT_LEN = 40


def plan_arrays(vp: VerifyPlan, wp: WritePlan) -> dict:
    return dict(
        slots=I64(vp.verify_slot_indices),
        tokens=I64(vp.verify_expected_tokens),
        positions=I64(vp.verify_expected_positions),
        prevs=I64(vp.verify_prev_slot_indices),
        num_valid=int(np.asarray(vp.verify_num_valid)[0]),
        enable=int(np.asarray(vp.enable)[0]),
        offsets=I64(wp.write_offsets),
        seeds=I64(wp.write_seed_slot_indices),
        num_valid_reqs=int(np.asarray(wp.write_num_valid_reqs)[0]),
    )


class PlanTestBase(absltest.TestCase):
    backend = None  # None: the jnp builder; a name: canary_jax.ops.plan_launch on it (tests/test_pallas_plan.py)

    def build(self, **kw):
        if self.backend is None:
            return build_plans(**kw)
        return plan_launch.build_plans(**kw, backend=self.backend)

    def assert_matches_oracle(self, got: dict, want: plan_oracle.PlanResult, bs: int, msg: str = "") -> None:
        self.assertEqual(got["num_valid"], want.num_valid, msg)
        self.assertEqual(got["enable"], want.enable, msg)
        if want.enable:
            n = want.num_valid
            np.testing.assert_array_equal(got["slots"][:n], want.slots, msg)
            np.testing.assert_array_equal(got["tokens"][:n], want.tokens, msg)
            np.testing.assert_array_equal(got["positions"][:n], want.positions, msg)
            np.testing.assert_array_equal(got["prevs"][:n], want.prevs, msg)
        np.testing.assert_array_equal(got["offsets"][: bs + 1], want.write_offsets, msg)
        np.testing.assert_array_equal(got["offsets"][bs + 1 :], 0, msg)
        np.testing.assert_array_equal(got["seeds"][:bs], want.seeds, msg)
        self.assertEqual(got["num_valid_reqs"], want.num_valid_reqs, msg)

    def run_both(self, *, strict=True, **kw):
        """Runs build_plans and the oracle on the same inputs and compares them.

        Request rows are padded to BS with padding rows (rpi 0, which contribute nothing) and LUTs shorter
        than LUT_LEN are padded, so most scenarios share one compiled program.
        """
        n = len(kw["rpi"])
        if n < BS:
            kw["rpi"] = list(kw["rpi"]) + [0] * (BS - n)
            kw["prefix"] = list(kw["prefix"]) + [0] * (BS - n)
            kw["extend"] = list(kw["extend"]) + [0] * (BS - n)
            if kw.get("valid") is not None:
                kw["valid"] = list(kw["valid"]) + [0] * (BS - n)
        if kw.get("lut") is not None and len(kw["lut"]) < LUT_LEN and not kw.pop("exact_lut", False):
            kw["lut"] = list(kw["lut"]) + [999] * (LUT_LEN - len(kw["lut"]))
        jkw = dict(
            req_pool_indices=np.asarray(kw["rpi"], np.int64),
            prefix_lens=np.asarray(kw["prefix"], np.int64),
            extend_seq_lens=np.asarray(kw["extend"], np.int64),
            req_to_token=jnp.asarray(kw["r2t"], jnp.int32),
            verify_capacity=kw.get("cap", CAP),
            write_req_capacity=kw.get("cw", CW),
            swa_window_size=kw.get("w", 0),
            full_to_swa_index_mapping=None if kw.get("lut") is None else np.asarray(kw["lut"], np.int64),
            req_to_verify_expected_tokens=None if kw.get("pool") is None else jnp.asarray(kw["pool"], jnp.int32),
            req_to_verify_expected_tokens_valid_lens=(
                None if kw.get("valid") is None else np.asarray(kw["valid"], np.int64)
            ),
            kv_token_id_vs_position_offset=kw.get("k", 0),
        )
        got = plan_arrays(*self.build(**jkw))
        want = plan_oracle.plan_oracle(
            req_pool_indices=kw["rpi"],
            prefix_lens=kw["prefix"],
            extend_seq_lens=kw["extend"],
            req_to_token=np.asarray(kw["r2t"]),
            verify_capacity=kw.get("cap", CAP),
            write_req_capacity=kw.get("cw", CW),
            swa_window_size=kw.get("w", 0),
            lut=kw.get("lut"),
            pool=kw.get("pool"),
            valid_lens=kw.get("valid"),
            k=kw.get("k", 0),
            strict=strict,
        )
        self.assert_matches_oracle(got, want, len(kw["rpi"]))
        return got


def table(rows: dict[int, list[int]]) -> np.ndarray:
    t = np.zeros((MAX_REQS, MAX_SEQ), np.int32)
    for r, slots in rows.items():
        t[r, : len(slots)] = slots
    return t


class PlanHandTest(PlanTestBase):
    def test_full_two_requests_and_padding_rows(self):
        # row 1 holds 4 prefix tokens at slots 10..13 and extends 2; row 2 holds 2 tokens, extends 1;
        # the last rows are padding (rpi 0): no entries, no write tokens, seed -1.
        r2t = table({1: [10, 11, 12, 13, 14, 15], 2: [20, 21, 22]})
        got = self.run_both(rpi=[1, 2, 0, 0], prefix=[4, 2, 7, 0], extend=[2, 1, 5, 0], r2t=r2t)
        self.assertEqual(got["num_valid"], 6)
        np.testing.assert_array_equal(got["slots"][:6], [10, 11, 12, 13, 20, 21])
        np.testing.assert_array_equal(got["positions"][:6], [0, 1, 2, 3, 0, 1])
        np.testing.assert_array_equal(got["prevs"][:6], [-1, 10, 11, 12, -1, 20])
        np.testing.assert_array_equal(got["tokens"][:6], -1)
        np.testing.assert_array_equal(got["offsets"][:5], [0, 2, 3, 3, 3])
        np.testing.assert_array_equal(got["seeds"][:4], [13, 21, -1, -1])
        self.assertEqual(got["num_valid_reqs"], BS)

    def test_padding_row_in_the_middle_contributes_nothing(self):
        r2t = table({1: [10, 11, 12], 3: [30, 31]})
        got = self.run_both(rpi=[1, 0, 3], prefix=[2, 9, 1], extend=[1, 4, 1], r2t=r2t)
        np.testing.assert_array_equal(got["slots"][:3], [10, 11, 30])
        np.testing.assert_array_equal(got["offsets"][:4], [0, 1, 1, 2])
        np.testing.assert_array_equal(got["seeds"][:3], [11, -1, 30])

    def test_prefill_with_no_prefix_seeds_anchor(self):
        r2t = table({1: [5, 6, 7]})
        got = self.run_both(rpi=[1], prefix=[0], extend=[3], r2t=r2t)
        self.assertEqual(got["num_valid"], 0)
        self.assertEqual(got["enable"], 1)
        np.testing.assert_array_equal(got["offsets"][:2], [0, 3])
        self.assertEqual(got["seeds"][0], -1)

    def test_zero_or_negative_extend_gives_no_write_and_seed_minus_one(self):
        r2t = table({1: [5, 6, 7], 2: [8, 9]})
        got = self.run_both(rpi=[1, 2], prefix=[3, 2], extend=[0, -4], r2t=r2t)
        np.testing.assert_array_equal(got["offsets"][:3], [0, 0, 0])
        np.testing.assert_array_equal(got["seeds"][:2], [-1, -1])
        self.assertEqual(got["num_valid"], 5)  # verify still covers both prefixes

    def test_negative_prefix_gives_no_entries(self):
        r2t = table({1: [5, 6, 7]})
        got = self.run_both(rpi=[1], prefix=[-3], extend=[1], r2t=r2t)
        self.assertEqual(got["num_valid"], 0)
        self.assertEqual(got["seeds"][0], -1)

    def test_swa_window_does_not_reset_the_chain(self):
        # prefix 6, window 2 -> positions 4, 5; position 4's prev is the real predecessor (position 3).
        r2t = table({1: [1, 2, 3, 4, 5, 6, 7]})
        lut = list(range(100, 120))  # full slot x -> swa slot 100 + x
        got = self.run_both(rpi=[1], prefix=[6], extend=[1], r2t=r2t, w=2, lut=lut)
        self.assertEqual(got["num_valid"], 2)
        np.testing.assert_array_equal(got["positions"][:2], [4, 5])
        np.testing.assert_array_equal(got["slots"][:2], [105, 106])
        np.testing.assert_array_equal(got["prevs"][:2], [104, 105])
        self.assertEqual(got["seeds"][0], 106)

    def test_swa_window_larger_than_prefix_starts_at_zero_with_anchor(self):
        r2t = table({1: [1, 2, 3]})
        lut = list(range(100, 120))
        got = self.run_both(rpi=[1], prefix=[3], extend=[1], r2t=r2t, w=8, lut=lut)
        np.testing.assert_array_equal(got["positions"][:3], [0, 1, 2])
        np.testing.assert_array_equal(got["prevs"][:3], [-1, 101, 102])

    def test_lut_eviction_maps_to_zero_and_negatives_pass_through(self):
        r2t = table({1: [1, 2, 3, -1, 4]})
        lut = [0, 0, 7, 8, 9, 10]  # full slot 1 evicted (0)
        got = self.run_both(rpi=[1], prefix=[5], extend=[1], r2t=r2t, w=4, lut=lut)
        np.testing.assert_array_equal(got["positions"][:4], [1, 2, 3, 4])
        np.testing.assert_array_equal(got["slots"][:4], [7, 8, -1, 9])
        np.testing.assert_array_equal(got["prevs"][:4], [0, 7, 8, -1])
        self.assertEqual(got["seeds"][0], 9)

    def test_lut_applies_with_zero_window(self):
        # SGLang translates whenever a LUT is given, also for W == 0.
        r2t = table({1: [1, 2]})
        got = self.run_both(rpi=[1], prefix=[2], extend=[1], r2t=r2t, w=0, lut=[0, 50, 60])
        np.testing.assert_array_equal(got["slots"][:2], [50, 60])
        np.testing.assert_array_equal(got["prevs"][:2], [-1, 50])

    def test_swa_slot_past_the_lut_clamps_to_last_entry(self):
        # Decision (SPEC 13 b): SGLang's kernels clamp, its Python reference raises; we clamp and never read
        # outside the LUT.
        r2t = table({1: [1, 9, 2]})
        lut = [0, 11, 12, 13]  # slot 9 is past the end -> LUT[3] = 13
        with self.assertRaisesRegex(ValueError, "SWA slot 9 is outside full_to_swa_index_mapping length 4"):
            plan_oracle.plan_oracle(
                req_pool_indices=[1],
                prefix_lens=[3],
                extend_seq_lens=[1],
                req_to_token=r2t,
                verify_capacity=CAP,
                write_req_capacity=CW,
                swa_window_size=8,
                lut=lut,
                strict=True,
            )
        got = self.run_both(rpi=[1], prefix=[3], extend=[1], r2t=r2t, w=8, lut=lut, exact_lut=True, strict=False)
        np.testing.assert_array_equal(got["slots"][:3], [11, 13, 12])
        np.testing.assert_array_equal(got["prevs"][:3], [-1, 11, 13])
        translated = swa_translate(
            ints.as_int64_pairs(np.array([-5, 0, 3, 4, 2**40]), name="x"),
            ints.as_int64_pairs(np.array(lut), name="lut"),
        )
        np.testing.assert_array_equal(I64(translated), [-5, 0, 13, 13, 13])

    def test_expected_token_gather_bounds(self):
        # Pool row 1 holds tokens 100.. for 6 positions; valid_len 4 -> positions >= 4 (after offset) skip.
        r2t = table({1: [1, 2, 3, 4, 5, 6]})
        pool = np.zeros((MAX_REQS, MAX_SEQ), np.int32)
        pool[1, :6] = [100, 101, 102, 103, 104, 105]
        got = self.run_both(rpi=[1], prefix=[6], extend=[1], r2t=r2t, pool=pool, valid=[4], k=0)
        np.testing.assert_array_equal(got["tokens"][:6], [100, 101, 102, 103, -1, -1])
        # EAGLE-draft offset +1: position p checks pool[p + 1].
        got = self.run_both(rpi=[1], prefix=[6], extend=[1], r2t=r2t, pool=pool, valid=[4], k=1)
        np.testing.assert_array_equal(got["tokens"][:6], [101, 102, 103, -1, -1, -1])
        # Negative offset: p + k < 0 skips.
        got = self.run_both(rpi=[1], prefix=[3], extend=[1], r2t=r2t, pool=pool, valid=[4], k=-1)
        np.testing.assert_array_equal(got["tokens"][:3], [-1, 100, 101])

    def test_expected_token_read_past_the_pool_is_minus_one(self):
        # valid_len claims 10 but the pool is only 4 wide: the reference raises IndexError, we skip (-1).
        r2t = table({1: [1, 2, 3, 4, 5, 6]})
        pool = np.full((MAX_REQS, 4), 7, np.int32)
        got = self.run_both(rpi=[1], prefix=[6], extend=[1], r2t=r2t, pool=pool, valid=[10], strict=False)
        np.testing.assert_array_equal(got["tokens"][:6], [7, 7, 7, 7, -1, -1])
        # Pool with fewer rows than req_to_token: row 5 is outside -> -1.
        r2t = table({5: [1, 2]})
        got = self.run_both(
            rpi=[5], prefix=[2], extend=[1], r2t=r2t, pool=np.ones((3, 4), np.int32), valid=[2], strict=False
        )
        np.testing.assert_array_equal(got["tokens"][:2], [-1, -1])

    def test_negative_tokens_in_pool_sign_extend(self):
        r2t = table({1: [1, 2]})
        pool = np.zeros((MAX_REQS, MAX_SEQ), np.int32)
        pool[1, :2] = [-7, 2**31 - 1]
        got = self.run_both(rpi=[1], prefix=[2], extend=[1], r2t=r2t, pool=pool, valid=[2])
        np.testing.assert_array_equal(got["tokens"][:2], [-7, 2**31 - 1])

    def test_overflow_disables_and_clamps_num_valid(self):
        # SGLang's plan_ref_overflow test: cap 4, prefix [5, 5] -> enable 0, num_valid 4.
        r2t = table({1: [1, 2, 3, 4, 5, 6], 2: [7, 8, 9, 10, 11, 12]})
        out = VerifyPlan.from_entries(slots=[9, 9, 9, 9], positions=[1, 2, 3, 4], prev_slots=[3, 3, 3, 3])
        vp, wp = self.build(
            req_pool_indices=np.array([1, 2]),
            prefix_lens=np.array([5, 5]),
            extend_seq_lens=np.array([1, 1]),
            req_to_token=jnp.asarray(r2t),
            verify_plan_out=out,
            write_req_capacity=CW,
        )
        self.assertEqual(int(vp.enable[0]), 0)
        self.assertEqual(int(vp.verify_num_valid[0]), 4)
        # Entries are not written on overflow: the out plan's contents survive.
        np.testing.assert_array_equal(I64(vp.verify_slot_indices), [9, 9, 9, 9])
        np.testing.assert_array_equal(I64(vp.verify_prev_slot_indices), [3, 3, 3, 3])
        # Write metadata is still produced.
        np.testing.assert_array_equal(I64(wp.write_offsets), [0, 1, 2] + [0] * (CW - 2))
        np.testing.assert_array_equal(I64(wp.write_seed_slot_indices)[:2], [5, 11])
        # Exactly at capacity is fine.
        got = self.run_both(rpi=[1, 2], prefix=[2, 2], extend=[1, 1], r2t=r2t, cap=4)
        self.assertEqual((got["enable"], got["num_valid"]), (1, 4))
        got = self.run_both(rpi=[1, 2], prefix=[3, 2], extend=[1, 1], r2t=r2t, cap=4)
        self.assertEqual((got["enable"], got["num_valid"]), (0, 4))

    def test_overflow_with_huge_prefixes_saturates(self):
        # Per-request counts far above int32 range must not wrap the total back under capacity.
        r2t = table({1: [1, 2]})
        got = self.run_both(rpi=[1] * BS, prefix=[2**40] * BS, extend=[1] * BS, r2t=r2t, strict=False)
        self.assertEqual((got["enable"], got["num_valid"]), (0, CAP))
        got = self.run_both(rpi=[1] * BS, prefix=[2**31 - 1] * BS, extend=[1] * BS, r2t=r2t, strict=False)
        self.assertEqual((got["enable"], got["num_valid"]), (0, CAP))

    def test_entries_past_num_valid_keep_out_plan_and_seeds_past_bs(self):
        r2t = table({1: [4, 5]})
        out_v = VerifyPlan.from_entries(slots=[1, 2, 3], positions=[7, 7, 7], prev_slots=[8, 8, 8])
        out_w = WritePlan.from_requests(counts=[1, 1, 1], seed_slots=[33, 34, 35])
        vp, wp = self.build(
            req_pool_indices=np.array([1]),
            prefix_lens=np.array([2]),
            extend_seq_lens=np.array([1]),
            req_to_token=jnp.asarray(r2t),
            verify_plan_out=out_v,
            write_plan_out=out_w,
        )
        np.testing.assert_array_equal(I64(vp.verify_slot_indices), [4, 5, 3])
        np.testing.assert_array_equal(I64(vp.verify_expected_positions), [0, 1, 7])
        np.testing.assert_array_equal(I64(wp.write_seed_slot_indices), [5, 34, 35])
        np.testing.assert_array_equal(I64(wp.write_offsets), [0, 1, 0, 0])
        self.assertEqual(int(wp.write_num_valid_reqs[0]), 1)

    def test_seed_column_clamps_to_max_seq_len(self):
        # prefix 30 > max_seq_len 24: the reference clamps the seed column to 23 (and would raise for verify).
        r2t = table({1: list(range(100, 124))})
        got = self.run_both(rpi=[1], prefix=[30], extend=[1], r2t=r2t, cap=64, strict=False)
        self.assertEqual(got["seeds"][0], 123)
        # Verify entries past the table read slot 0 (skipped by verify); positions stay exact.
        np.testing.assert_array_equal(got["positions"][:30], np.arange(30))
        np.testing.assert_array_equal(got["slots"][24:30], 0)
        np.testing.assert_array_equal(got["prevs"][25:30], 0)

    def test_request_row_outside_req_to_token_reads_zero(self):
        r2t = table({1: [1, 2]})
        got = self.run_both(rpi=[MAX_REQS + 3, -2], prefix=[2, 2], extend=[1, 1], r2t=r2t, strict=False)
        np.testing.assert_array_equal(got["slots"][:4], [0, 0, 0, 0])
        np.testing.assert_array_equal(got["prevs"][:4], [-1, 0, -1, 0])
        np.testing.assert_array_equal(got["seeds"][:2], [0, 0])
        np.testing.assert_array_equal(got["offsets"][:3], [0, 1, 2])

    def test_large_int64_values_are_lossless(self):
        # Positions past 2**32 with a small window: exact int64 positions, slots read 0 (outside the table).
        r2t = table({1: [1, 2]})
        big = 2**33 + 5
        got = self.run_both(rpi=[1], prefix=[big], extend=[2**35], r2t=r2t, w=3, lut=[0, 1, 2, 3], strict=False)
        np.testing.assert_array_equal(got["positions"][:3], [big - 3, big - 2, big - 1])
        np.testing.assert_array_equal(got["offsets"][:2], [0, 2**35])
        self.assertEqual(got["seeds"][0], 0)  # column clamped to 23: r2t[1, 23] = 0 -> LUT[0] = 0

    def test_write_offsets_sum_is_int64(self):
        r2t = table({1: [1], 2: [2]})
        got = self.run_both(rpi=[1, 2], prefix=[1, 1], extend=[2**32 - 1, 2**32 + 7], r2t=r2t)
        np.testing.assert_array_equal(got["offsets"][:3], [0, 2**32 - 1, 2**33 + 6])


class PlanErrorTest(absltest.TestCase):
    R2T = jnp.zeros((4, 8), jnp.int32)

    def kw(self, **over):
        kw = dict(
            req_pool_indices=np.array([1]),
            prefix_lens=np.array([1]),
            extend_seq_lens=np.array([1]),
            req_to_token=self.R2T,
            verify_capacity=8,
            write_req_capacity=4,
        )
        kw.update(over)
        return kw

    def test_swa_requires_lut(self):
        with self.assertRaisesRegex(
            ValueError,
            "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when swa_window_size > 0",
        ):
            build_plans(**self.kw(swa_window_size=4))

    def test_capacity_mismatch(self):
        with self.assertRaisesRegex(
            ValueError,
            r"verify_capacity=5 does not match "
            r"verify_plan_out.verify_slot_indices.shape\[0\]=8",
        ):
            build_plans(**self.kw(verify_capacity=5, verify_plan_out=VerifyPlan.allocate(verify_capacity=8)))

    def test_pool_requires_valid_lens(self):
        with self.assertRaisesRegex(
            ValueError, "requires req_to_verify_expected_tokens_valid_lens when req_to_verify_expected_tokens is set"
        ):
            build_plans(**self.kw(req_to_verify_expected_tokens=jnp.zeros((4, 8), jnp.int32)))

    def test_bs_exceeds_write_capacity(self):
        with self.assertRaisesRegex(ValueError, r"kv-canary: bs=3 exceeds write_req_capacity=2"):
            build_plans(
                **self.kw(
                    req_pool_indices=np.array([1, 2, 3]),
                    prefix_lens=np.array([1, 1, 1]),
                    extend_seq_lens=np.array([1, 1, 1]),
                    write_req_capacity=2,
                )
            )

    def test_capacities_must_be_positive(self):
        with self.assertRaisesRegex(ValueError, "VerifyPlan verify_capacity must be positive, got 0"):
            build_plans(**self.kw(verify_capacity=0))
        with self.assertRaisesRegex(ValueError, "WritePlan write_req_capacity must be positive, got 0"):
            build_plans(**self.kw(write_req_capacity=0))

    def test_dtypes_and_shapes(self):
        with self.assertRaisesRegex(TypeError, "req_to_token must have dtype int32, got float32"):
            build_plans(**self.kw(req_to_token=jnp.zeros((4, 8), jnp.float32)))
        with self.assertRaisesRegex(ValueError, "req_to_token must be 2-D"):
            build_plans(**self.kw(req_to_token=jnp.zeros((8,), jnp.int32)))
        with self.assertRaisesRegex(ValueError, "prefix_lens length must be 1, got 2"):
            build_plans(**self.kw(prefix_lens=np.array([1, 2])))
        with self.assertRaisesRegex(TypeError, "req_pool_indices must be an int64-valued integer array"):
            build_plans(**self.kw(req_pool_indices=np.array([1.0])))
        with self.assertRaisesRegex(ValueError, "lut_len must be positive"):
            build_plans(**self.kw(swa_window_size=2, full_to_swa_index_mapping=np.zeros((0,), np.int64)))
        with self.assertRaisesRegex(ValueError, "swa_window_size must be non-negative"):
            build_plans(**self.kw(swa_window_size=-1))


class PlanJitAndX64Test(PlanTestBase):
    def inputs(self):
        r2t = table({1: [3, 4, 5, 6, 7], 2: [8, 9, 10]})
        pool = np.arange(MAX_REQS * 8, dtype=np.int32).reshape(MAX_REQS, 8)
        return dict(
            req_pool_indices=jnp.array([1, 2, 0], jnp.int32),
            prefix_lens=jnp.array([4, 2, 0], jnp.int32),
            extend_seq_lens=jnp.array([1, 1, 0], jnp.int32),
            req_to_token=jnp.asarray(r2t),
            verify_capacity=16,
            write_req_capacity=4,
            swa_window_size=3,
            full_to_swa_index_mapping=jnp.arange(40, dtype=jnp.int32) * 2,
            req_to_verify_expected_tokens=jnp.asarray(pool),
            req_to_verify_expected_tokens_valid_lens=jnp.array([3, 8, 0], jnp.int32),
        )

    def test_inside_user_jit_no_retrace(self):
        traces = []

        @jax.jit
        def step(rpi, prefix, extend, r2t):
            traces.append(1)
            kw = self.inputs()
            kw.update(req_pool_indices=rpi, prefix_lens=prefix, extend_seq_lens=extend, req_to_token=r2t)
            return self.build(**kw)

        kw = self.inputs()
        args = (kw["req_pool_indices"], kw["prefix_lens"], kw["extend_seq_lens"], kw["req_to_token"])
        a = plan_arrays(*step(*args))
        b = plan_arrays(*step(args[0], args[1] + 1, args[2], args[3]))
        self.assertLen(traces, 1)
        eager = plan_arrays(*self.build(**kw))
        for key in a:
            np.testing.assert_array_equal(a[key], eager[key], key)
        self.assertEqual(b["num_valid"], 6)  # window 3: min(5, 3) + min(3, 3)

    def test_x64_on_is_byte_identical(self):
        kw = self.inputs()
        off = jax.tree_util.tree_map(np.asarray, self.build(**kw))
        with jax.enable_x64(True):
            kw64 = dict(kw)
            for name in (
                "req_pool_indices",
                "prefix_lens",
                "extend_seq_lens",
                "req_to_verify_expected_tokens_valid_lens",
            ):
                kw64[name] = jnp.asarray(np.asarray(kw[name]), jnp.int64)
            kw64["full_to_swa_index_mapping"] = jnp.asarray(np.asarray(kw["full_to_swa_index_mapping"]), jnp.int64)
            self.assertEqual(kw64["prefix_lens"].dtype, jnp.int64)
            on = jax.tree_util.tree_map(np.asarray, self.build(**kw64))
        for x, y in zip(jax.tree_util.tree_leaves(off), jax.tree_util.tree_leaves(on)):
            self.assertEqual(x.dtype, y.dtype)
            np.testing.assert_array_equal(x, y)

    def test_int_forms_agree(self):
        kw = self.inputs()
        base = plan_arrays(*self.build(**kw))
        kw2 = dict(kw)
        kw2["prefix_lens"] = ints.int64_to_pairs_np(np.asarray(kw["prefix_lens"]))
        kw2["req_pool_indices"] = np.asarray(kw["req_pool_indices"], np.int64)
        kw2["full_to_swa_index_mapping"] = np.asarray(kw["full_to_swa_index_mapping"], np.int64)
        other = plan_arrays(*self.build(**kw2))
        for key in base:
            np.testing.assert_array_equal(base[key], other[key], key)


class PlanStructureTest(absltest.TestCase):
    """The verify entries are written once per field: no entry-sized concatenate or pad (``pairs.pack`` per field
    or a ``[row, col]`` gather index), and a fresh plan neither allocates nor reads an old plan (issue #17)."""

    C = 4096  # a capacity no other dimension here has

    def kw(self, **over):
        r2t = table({1: [3, 4, 5, 6, 7], 2: [8, 9, 10]})
        kw = dict(
            req_pool_indices=jnp.array([1, 2, 0, 0, 0, 0, 0, 0], jnp.int32),
            prefix_lens=jnp.array([4, 2, 0, 0, 0, 0, 0, 0], jnp.int32),
            extend_seq_lens=jnp.array([1, 1, 0, 0, 0, 0, 0, 0], jnp.int32),
            req_to_token=jnp.asarray(r2t),
            verify_capacity=self.C,
            write_req_capacity=8,
            swa_window_size=3,
            full_to_swa_index_mapping=jnp.arange(40, dtype=jnp.int32) * 2,
            req_to_verify_expected_tokens=jnp.arange(MAX_REQS * 8, dtype=jnp.int32).reshape(MAX_REQS, 8),
            req_to_verify_expected_tokens_valid_lens=jnp.array([3, 8, 0, 0, 0, 0, 0, 0], jnp.int32),
        )
        kw.update(over)
        return kw

    def test_no_entry_sized_concatenate_or_pad(self):
        for over in ({}, dict(swa_window_size=0, full_to_swa_index_mapping=None)):
            kw = self.kw(**over)
            arrays = {k: v for k, v in kw.items() if isinstance(v, jax.Array)}
            fn = lambda a, kw=kw: build_plans(**{**kw, **a})  # noqa: E731
            hlo = jax.jit(fn).lower(arrays).compile().as_text()
            bad = [
                line.strip()
                for line in hlo.splitlines()
                if re.search(rf"= \w+\[{self.C}[,\]]\S* (concatenate|pad)\(", line)
            ]
            self.assertEqual(bad, [], over)

    def test_fresh_plan_is_not_an_input_and_dead_entries_are_zero(self):
        kw = self.kw()
        jaxpr = jax.make_jaxpr(lambda: build_plans(**kw))()
        shapes = [tuple(v.aval.shape) for eqn in jaxpr.eqns for v in eqn.invars if hasattr(v, "aval")]
        self.assertNotIn((self.C, 2), shapes)
        vp, _ = build_plans(**kw)
        n = int(vp.verify_num_valid[0])
        self.assertEqual(n, 5)  # window 3: min(4, 3) + min(2, 3)
        for f in (vp.verify_slot_indices, vp.verify_expected_tokens, vp.verify_expected_positions):
            self.assertFalse(np.asarray(f)[n:].any())
        self.assertFalse(np.asarray(vp.verify_prev_slot_indices)[n:].any())


class PlanFuzzTest(PlanTestBase):
    """Seeded fuzz of build_plans against the Python-int oracle (fixed shapes, one compile per config)."""

    def fuzz(self, *, seed, n, w, use_lut, use_pool, cap, strict):
        rng = random.Random(seed)
        lut_len = 40
        for _ in range(n):
            r2t = np.zeros((MAX_REQS, MAX_SEQ), np.int32)
            for r in range(1, MAX_REQS):
                r2t[r] = [rng.randrange(1, lut_len - 1 if strict else lut_len + 8) for _ in range(MAX_SEQ)]
                if rng.random() < 0.2:
                    r2t[r, rng.randrange(MAX_SEQ)] = -1
            bs_live = rng.randrange(0, BS + 1)
            rpi = [rng.randrange(1, MAX_REQS) for _ in range(bs_live)] + [0] * (BS - bs_live)
            max_p = MAX_SEQ if strict else MAX_SEQ + 6
            prefix = [rng.randrange(-2, max_p + 1) if rng.random() < 0.9 else 0 for _ in range(BS)]
            extend = [rng.randrange(-1, 9) for _ in range(BS)]
            lut = [rng.choice([0, rng.randrange(1, 500), -1]) for _ in range(lut_len)] if use_lut else None
            pool = valid = None
            if use_pool:
                pool = np.array(
                    [[rng.randrange(-(2**31), 2**31) for _ in range(MAX_SEQ)] for _ in range(MAX_REQS)], np.int32
                )
                valid = [rng.randrange(0, MAX_SEQ + (1 if strict else 6)) for _ in range(BS)]
            self.run_both(
                rpi=rpi,
                prefix=prefix,
                extend=extend,
                r2t=r2t,
                cap=cap,
                w=w,
                lut=lut,
                pool=pool,
                valid=valid,
                k=rng.choice([0, 1]) if use_pool else 0,
                strict=strict,
            )

    def test_fuzz_full(self):
        self.fuzz(seed=1, n=40, w=0, use_lut=False, use_pool=False, cap=CAP, strict=True)

    def test_fuzz_full_small_capacity(self):
        self.fuzz(seed=2, n=40, w=0, use_lut=False, use_pool=True, cap=20, strict=True)

    def test_fuzz_swa(self):
        self.fuzz(seed=3, n=40, w=5, use_lut=True, use_pool=True, cap=CAP, strict=True)

    def test_fuzz_out_of_range_decisions(self):
        self.fuzz(seed=4, n=40, w=7, use_lut=True, use_pool=True, cap=CAP, strict=False)


class ScatterTest(absltest.TestCase):
    POOL = np.full((5, 6), -9, np.int32)

    def check(self, flat, offsets, rpi):
        got = scatter_req_token_ids(
            flat_in=np.asarray(flat, np.int64),
            offsets=np.asarray(offsets, np.int64),
            req_pool_indices=np.asarray(rpi, np.int64),
            pool_out=jnp.asarray(self.POOL),
        )
        want = plan_oracle.scatter_oracle(flat_in=flat, offsets=offsets, req_pool_indices=rpi, pool_out=self.POOL)
        np.testing.assert_array_equal(np.asarray(got), want)
        return np.asarray(got)

    def test_basic_and_truncation(self):
        got = self.check([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [0, 3, 11], [1, 3])
        np.testing.assert_array_equal(got[1], [1, 2, 3, -9, -9, -9])
        np.testing.assert_array_equal(got[3], [4, 5, 6, 7, 8, 9])  # truncated at the pool width
        np.testing.assert_array_equal(got[[0, 2, 4]], -9)

    def test_int64_values_keep_low_word(self):
        got = self.check([2**32 + 5, -1, 2**31], [0, 3], [2])
        np.testing.assert_array_equal(got[2, :3], [5, -1, -(2**31)])

    def test_empty_and_bad_rows(self):
        self.check([], [0, 0], [1])
        self.check([1, 2], [0, 1, 2], [7, -1])  # rows outside the pool write nothing
        self.check([1, 2, 3], [2, 1, 5], [1, 2])  # negative length, segment past the end (masked)

    def test_duplicate_rows_later_request_wins(self):
        got = self.check([1, 2, 3, 4, 5], [0, 3, 5], [2, 2])
        np.testing.assert_array_equal(got[2], [4, 5, 3, -9, -9, -9])

    def test_fuzz(self):
        rng = random.Random(7)
        for _ in range(30):
            bs = 4
            lens = [rng.randrange(0, 9) for _ in range(bs)]
            offsets = [0]
            for n in lens:
                offsets.append(offsets[-1] + n)
            flat = [rng.randrange(-(2**40), 2**40) for _ in range(offsets[-1])]
            flat = (flat + [0] * 40)[:40]  # fixed length keeps one compile
            rpi = [rng.randrange(0, 6) for _ in range(bs)]
            self.check(flat, offsets, rpi)

    def test_errors(self):
        pool = jnp.zeros((2, 3), jnp.int32)
        with self.assertRaisesRegex(ValueError, r"scatter_req_token_ids flat_in must be 1-D, got shape \(2, 3\)"):
            scatter_req_token_ids(
                flat_in=np.zeros((2, 3), np.int64),
                offsets=np.array([0, 1]),
                req_pool_indices=np.array([0]),
                pool_out=pool,
            )
        with self.assertRaisesRegex(ValueError, r"offsets length 3 != bs\+1 \(2\)"):
            scatter_req_token_ids(
                flat_in=np.zeros(3, np.int64),
                offsets=np.array([0, 1, 2]),
                req_pool_indices=np.array([0]),
                pool_out=pool,
            )
        with self.assertRaisesRegex(ValueError, "pool_out must be 2-D"):
            scatter_req_token_ids(
                flat_in=np.zeros(3, np.int64),
                offsets=np.array([0, 1]),
                req_pool_indices=np.array([0]),
                pool_out=jnp.zeros((3,), jnp.int32),
            )
        with self.assertRaisesRegex(TypeError, "pool_out must be int32, got int64"):
            scatter_req_token_ids(
                flat_in=np.zeros(3, np.int64),
                offsets=np.array([0, 1]),
                req_pool_indices=np.array([0]),
                pool_out=np.zeros((2, 3), np.int64),
            )
        with self.assertRaisesRegex(TypeError, "flat_in must be int64/int32, got float32"):
            scatter_req_token_ids(
                flat_in=np.zeros(3, np.float32), offsets=np.array([0, 1]), req_pool_indices=np.array([0]), pool_out=pool
            )


if __name__ == "__main__":
    absltest.main()
