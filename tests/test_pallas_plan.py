"""The plan kernel (pallas_kernels/plan.py): build_plans(backend="pallas") against the Python-int plan oracle (the
hand scenarios, a fuzz, jit and x64 of tests/test_plan_builder.py) and against the jnp builder on every slot table
it takes; one pallas_call and nothing else; the launches it leaves to the jnp builder. Interpreted on the CPU,
compiled on a GPU."""

from __future__ import annotations

import dataclasses
import random

import jax
import jax.numpy as jnp
import numpy as np
import test_plan_builder as tpb
from absl.testing import absltest

from canary_jax.contract import ints
from canary_jax.ops import backends, plan_launch
from canary_jax.planning import plan_inputs
from canary_jax.planning.expected_tokens import ExpectedTokenTable
from canary_jax.planning.plan_builder import build_plans
from canary_jax.planning.plans import VerifyPlan, WritePlan
from canary_jax.planning.slot_tables import BlockTable, GroupSlotTables, RaggedSlotTable, ReqToTokenTable, SlotTable
from pallas_kernels import plan as plan_kernel
from pallas_kernels.config import PallasConfig


class PallasPlanHandTest(tpb.PlanHandTest):
    backend = "pallas"


class PallasPlanJitAndX64Test(tpb.PlanJitAndX64Test):
    backend = "pallas"


class PallasPlanFuzzTest(tpb.PlanFuzzTest):
    backend = "pallas"

    # Fewer cases than the jnp builder's fuzz (each configuration still compiles once).
    def test_fuzz_full(self):
        self.fuzz(seed=11, n=12, w=0, use_lut=False, use_pool=False, cap=tpb.CAP, strict=True)

    def test_fuzz_full_small_capacity(self):
        self.fuzz(seed=12, n=12, w=0, use_lut=False, use_pool=True, cap=20, strict=True)

    def test_fuzz_swa(self):
        self.fuzz(seed=13, n=12, w=5, use_lut=True, use_pool=True, cap=tpb.CAP, strict=True)

    def test_fuzz_out_of_range_decisions(self):
        self.fuzz(seed=14, n=12, w=7, use_lut=True, use_pool=True, cap=tpb.CAP, strict=False)


def _leaves(plans):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(plans)]


class PlanKernelTablesTest(absltest.TestCase):
    """Every table the kernel reads, against the jnp builder (pinned by the oracle in test_plan_builder), with
    rows, positions and blocks in and out of range."""

    def both(self, **kw):
        want = _leaves(build_plans(**kw))
        got = _leaves(plan_launch.build_plans(**kw, backend="pallas"))
        self.assertLen(got, len(want))
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        return got

    def batch(self, rng, bs=5):
        live = rng.randrange(1, bs + 1)
        return dict(
            req_pool_indices=np.array([rng.randrange(1, 6) for _ in range(live)] + [0] * (bs - live), np.int64),
            prefix_lens=np.array([rng.randrange(-1, 30) for _ in range(bs)], np.int64),
            extend_seq_lens=np.array([rng.randrange(-1, 4) for _ in range(bs)], np.int64),
            verify_capacity=96,
            write_req_capacity=8,
        )

    def test_block_table_with_null_block(self):
        rng = random.Random(1)
        for _ in range(4):
            bt = np.array([[rng.choice([0, rng.randrange(1, 50)]) for _ in range(6)] for _ in range(4)], np.int32)
            for null in (0, None):
                self.both(**self.batch(rng), req_to_token=BlockTable(block_table=bt, block_size=4, null_block=null))

    def test_ragged_table_and_lut(self):
        rng = random.Random(2)
        for _ in range(4):
            loc = np.array([rng.randrange(-2, 60) for _ in range(70)], np.int32)
            starts = np.array([rng.randrange(0, 75) for _ in range(4)], np.int64)
            lens = np.array([rng.randrange(-1, 30) for _ in range(4)], np.int64)
            table = RaggedSlotTable(cache_loc=loc, row_starts=starts, row_lens=lens)
            lut = np.array([rng.choice([0, -1, rng.randrange(1, 99)]) for _ in range(40)], np.int64)
            self.both(
                **self.batch(rng), req_to_token=table, swa_window_size=rng.choice([0, 3]), full_to_swa_index_mapping=lut
            )

    def test_expected_token_tables(self):
        rng = random.Random(3)
        r2t = jnp.asarray(np.array([[rng.randrange(1, 90) for _ in range(24)] for _ in range(8)], np.int32))
        tokens = np.array([[rng.randrange(-(2**31), 2**31) for _ in range(20)] for _ in range(6)], np.int32)
        for row_index in (None, np.array([5, -1, 2, 9], np.int64)):
            for k in (0, 1):
                kw = self.batch(rng)
                pool = ExpectedTokenTable(tokens=tokens, row_index=row_index)
                valid = np.array([rng.randrange(0, 26) for _ in range(5)], np.int64)
                self.both(
                    **kw,
                    req_to_token=r2t,
                    req_to_verify_expected_tokens=pool,
                    req_to_verify_expected_tokens_valid_lens=valid,
                    kv_token_id_vs_position_offset=k,
                )

    def test_group_tables_swa_side_skips_the_lut(self):
        rng = random.Random(4)
        full = BlockTable(block_table=np.arange(1, 25, dtype=np.int32).reshape(4, 6), block_size=4)
        swa = BlockTable(block_table=np.array([[0, 0, 3, 4, 5, 6]] * 4, np.int32), block_size=4)
        lut = np.arange(200, dtype=np.int64) * 3
        got = self.both(
            **self.batch(rng),
            req_to_token=GroupSlotTables(full=full, swa=swa),
            swa_window_size=6,
            full_to_swa_index_mapping=lut,
        )
        self.assertTrue(np.any(ints.pairs_to_int64_np(got[0]) != 0))

    def test_many_programs_and_rows_over_old_plans(self):
        # 40 rows (a 6-step search over 64 lanes), blocks of 32 entries over 3 programs: every program loops. Fresh
        # plans and old ones (whose untouched entries and seeds must survive), one capacity that overflows.
        rng = random.Random(5)
        r2t = jnp.asarray(np.array([[rng.randrange(1, 999) for _ in range(40)] for _ in range(50)], np.int32))
        cfg = PallasConfig(plan_block=32, plan_max_programs=3)
        for cap, old in ((100, False), (2000, False), (2000, True)):
            kw = dict(
                req_pool_indices=np.array([rng.randrange(1, 50) for _ in range(36)] + [0] * 4, np.int64),
                prefix_lens=np.array([rng.randrange(0, 41) for _ in range(40)], np.int64),
                extend_seq_lens=np.array([rng.randrange(0, 3) for _ in range(40)], np.int64),
                req_to_token=r2t,
                verify_capacity=cap,
                write_req_capacity=64,
            )
            if old:
                ints_of = lambda n: [rng.randrange(-(2**62), 2**62) for _ in range(n)]  # noqa: E731
                kw["verify_plan_out"] = VerifyPlan.from_entries(
                    slots=ints_of(cap), positions=ints_of(cap), prev_slots=ints_of(cap), expected_tokens=ints_of(cap)
                )
                kw["write_plan_out"] = WritePlan.from_requests(counts=[1] * 64, seed_slots=ints_of(64))
                del kw["verify_capacity"], kw["write_req_capacity"]
            want_v, want_w = build_plans(**kw)
            inputs = plan_inputs.check_plan_inputs(**kw)
            got = plan_kernel.build_plans_pallas(inputs, config=cfg)
            for g, w in zip(_leaves(got), _leaves((want_v, want_w))):
                np.testing.assert_array_equal(g, w)
            self.assertEqual(int(want_v.enable[0]), 1 if cap == 2000 else 0)  # one capacity overflows
            if old:  # the old plan's tail and seeds past the live rows are still there
                n = int(want_v.verify_num_valid[0])
                np.testing.assert_array_equal(
                    ints.pairs_to_int64_np(got[0].verify_slot_indices)[n:],
                    ints.pairs_to_int64_np(kw["verify_plan_out"].verify_slot_indices)[n:],
                )

    def test_one_row(self):
        # A decode batch of 1 (the kernel's vectors are padded to MIN_LANES).
        r2t = jnp.asarray(np.arange(1, 97, dtype=np.int32).reshape(4, 24))
        for prefix in (0, 1, 23, 24):
            kw = dict(
                req_pool_indices=np.array([2]),
                prefix_lens=np.array([prefix]),
                extend_seq_lens=np.array([1]),
                req_to_token=r2t,
                verify_capacity=24,
                write_req_capacity=1,
            )
            self.both(**kw)

    def test_x64_on_block_table(self):
        rng = random.Random(6)
        kw = dict(
            self.batch(rng),
            req_to_token=BlockTable(block_table=np.arange(24, dtype=np.int32).reshape(4, 6), block_size=4),
        )
        off = self.both(**kw)
        with jax.enable_x64(True):
            on = self.both(**kw)
        for a, b in zip(off, on):
            np.testing.assert_array_equal(a, b)


class PlanKernelLaunchTest(absltest.TestCase):
    def kw(self, table):
        return dict(
            req_pool_indices=np.array([1, 2, 0]),
            prefix_lens=np.array([3, 5, 0]),
            extend_seq_lens=np.array([1, 1, 0]),
            req_to_token=table,
            verify_capacity=32,
            write_req_capacity=4,
            swa_window_size=2,
            full_to_swa_index_mapping=np.arange(30, dtype=np.int64),
        )

    def test_one_pallas_call_and_no_other_kernel_work(self):
        table = jnp.arange(48, dtype=jnp.int32).reshape(4, 12)
        jaxpr = jax.make_jaxpr(lambda t: plan_launch.build_plans(**self.kw(t), backend="pallas"))(table)
        prims = [e.primitive.name for e in jaxpr.jaxpr.eqns]
        inner = [e for e in jaxpr.jaxpr.eqns if e.primitive.name in ("pjit", "jit")]
        for e in inner:
            prims += [x.primitive.name for x in e.params["jaxpr"].jaxpr.eqns]
        self.assertEqual(prims.count("pallas_call"), 1, prims)
        for heavy in ("gather", "scatter", "scatter-add", "cumsum", "while", "scan", "sort"):
            self.assertNotIn(heavy, prims)

    def test_backends_without_a_plan_kernel_use_the_builder(self):
        self.assertIsNone(backends.plan_kernel("reference"))
        self.assertIsNone(backends.plan_kernel("pallas_tpu"))
        self.assertIsNotNone(backends.plan_kernel("pallas"))

    def test_unsupported_launches_fall_back_with_the_same_bytes(self):
        @dataclasses.dataclass(frozen=True)
        class Doubled(SlotTable):  # a user's own table: the kernel cannot read it
            base: jax.Array

            max_seq_len = 12

            def check(self):
                pass

            def lookup(self, batch_row, rpi, pos):
                return jnp.stack([pos[:, 0] * 2 + self.base[0], pos[:, 1]], axis=1)

        jax.tree_util.register_dataclass(Doubled, data_fields=["base"], meta_fields=[])
        table = Doubled(jnp.ones((1,), jnp.uint32))
        self.assertFalse(plan_kernel.supports(table, None, None, bs=3, cap=32))
        a = _leaves(plan_launch.build_plans(**self.kw(table), backend="pallas"))
        b = _leaves(build_plans(**self.kw(table)))
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)
        r2t = ReqToTokenTable(req_to_token=jnp.zeros((4, 12), jnp.int32))
        self.assertTrue(plan_kernel.supports(r2t, None, None, bs=4096, cap=2**20 - 2))
        self.assertFalse(plan_kernel.supports(r2t, None, None, bs=2**15, cap=8))  # rows past the 16-bit offset sums
        self.assertFalse(plan_kernel.supports(r2t, None, None, bs=4096, cap=2**20))  # the count cumsum past uint32


if __name__ == "__main__":
    absltest.main()
