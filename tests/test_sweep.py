"""Sweep plans from a radix tree and from running requests (SPEC 9 "Sweep")."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import ints
from canary_jax.planning.plan_builder import build_plans
from canary_jax.runtime.sweep import (
    RadixNode,
    SweepSchedule,
    build_sweep_plan_from_radix,
    build_sweep_plan_from_requests,
    sweep_entries_to_plan,
    walk_radix_tree,
)

I64 = ints.pairs_to_int64_np


def entries(plan):
    n = int(plan.verify_num_valid[0])
    return (
        I64(plan.verify_slot_indices)[:n].tolist(),
        I64(plan.verify_expected_positions)[:n].tolist(),
        I64(plan.verify_prev_slot_indices)[:n].tolist(),
    )


class RadixTest(absltest.TestCase):
    def test_single_node(self):
        # SGLang's sweep_plan_builder test: radix [100, 101, 102] -> positions 0..2, prev [-1, 100, 101].
        root = RadixNode()
        root.add([100, 101, 102])
        plan = build_sweep_plan_from_radix(root)
        self.assertEqual(entries(plan), ([100, 101, 102], [0, 1, 2], [-1, 100, 101]))
        self.assertEqual(int(plan.enable[0]), 1)
        self.assertEqual(plan.verify_capacity, 3)
        np.testing.assert_array_equal(I64(plan.verify_expected_tokens), -1)

    def test_small_tree_positions_by_depth_and_prev_across_nodes(self):
        #        root
        #       /    \
        #   A[1,2]   D[9]
        #    /   \
        #  B[3]  C[4,5]
        #   |
        #  E[6]
        root = RadixNode(children={})
        a = RadixNode(value=[1, 2], children={})
        root.children["a"] = a
        b = a.add([3])
        a.add([4, 5])
        b.add([6])
        root.add([9])  # dict children: keyed by insertion count
        got = walk_radix_tree(root)
        self.assertEqual(got.slots.tolist(), [1, 2, 3, 6, 4, 5, 9])
        self.assertEqual(got.positions.tolist(), [0, 1, 2, 3, 2, 3, 0])
        self.assertEqual(got.prev_slots.tolist(), [-1, 1, 2, 3, 2, 4, -1])
        self.assertEqual(got.slots.dtype, np.int64)

    def test_root_slots_count_for_depth_but_are_not_emitted(self):
        root = RadixNode(value=[7, 8])
        root.add([1])
        got = walk_radix_tree(root)
        self.assertEqual((got.slots.tolist(), got.positions.tolist(), got.prev_slots.tolist()), ([1], [2], [8]))

    def test_empty_tree(self):
        plan = build_sweep_plan_from_radix(RadixNode())
        self.assertEqual(int(plan.verify_num_valid[0]), 0)
        self.assertEqual(plan.verify_capacity, 1)
        self.assertEqual(int(plan.enable[0]), 1)

    def test_lut_translation_evicted_to_zero_negatives_kept(self):
        root = RadixNode()
        root.add([1, 2, 3]).add([4])
        lut = np.array([0, 11, 0, 13, 14], np.int64)  # full slot 2 evicted from the SWA pool
        plan = build_sweep_plan_from_radix(root, full_to_swa_index_mapping=lut, verify_capacity=8)
        self.assertEqual(entries(plan), ([11, 0, 13, 14], [0, 1, 2, 3], [-1, 11, 0, 13]))
        self.assertEqual(plan.verify_capacity, 8)
        # Slots past the LUT clamp to its last entry (the plan builder's rule); int32 LUTs work too.
        root = RadixNode()
        root.add([1, 40])
        plan = build_sweep_plan_from_radix(root, full_to_swa_index_mapping=lut.astype(np.int32))
        self.assertEqual(entries(plan)[0], [11, 14])

    def test_filters(self):
        root = RadixNode()
        locked = root.add([1, 2], lock_ref=1)
        locked.add([3])
        root.add([4], swa_tombstone=True)
        got = walk_radix_tree(root, unlocked_only=True)
        self.assertEqual(
            (got.slots.tolist(), got.positions.tolist(), got.prev_slots.tolist()), ([3, 4], [2, 0], [2, -1])
        )
        got = walk_radix_tree(root, swa_resident_only=True)
        self.assertEqual(got.slots.tolist(), [1, 2, 3])

    def test_capacity_exceeded_raises(self):
        root = RadixNode()
        root.add(list(range(1, 6)))
        with self.assertRaisesRegex(
            RuntimeError, "radix-walker emitted 5 sweep verify entries, exceeding pre-allocated sweep_verify_capacity=4"
        ):
            build_sweep_plan_from_radix(root, verify_capacity=4)

    def test_deep_tree_does_not_recurse(self):
        root = RadixNode()
        node = root
        for i in range(3000):
            node = node.add([i + 1])
        got = walk_radix_tree(root)
        self.assertEqual(got.positions[-1], 2999)
        self.assertEqual(got.prev_slots[-1], 2999)

    def test_duck_typed_nodes(self):
        class Node:
            def __init__(self, value, children=None):
                self.value = None if value is None else np.asarray(value, np.int64)
                self.children = children or {}

        root = Node(None, {"x": Node([5, 6], {"y": Node([7])})})
        plan = sweep_entries_to_plan(walk_radix_tree(root))
        self.assertEqual(entries(plan), ([5, 6, 7], [0, 1, 2], [-1, 5, 6]))


class RequestSweepTest(absltest.TestCase):
    def test_matches_the_plan_builder_verify_half(self):
        r2t = np.zeros((4, 10), np.int32)
        r2t[1, :6] = [3, 4, 5, 6, 7, 8]
        r2t[2, :3] = [9, 10, 11]
        lut = np.arange(20, dtype=np.int64) + 100
        kw = dict(
            req_to_token=jnp.asarray(r2t),
            req_pool_indices=np.array([1, 2, 0]),
            verify_capacity=16,
            swa_window_size=4,
            full_to_swa_index_mapping=lut,
        )
        plan = build_sweep_plan_from_requests(seq_lens=np.array([6, 3, 0]), **kw)
        self.assertEqual(
            entries(plan),
            ([105, 106, 107, 108, 109, 110, 111], [2, 3, 4, 5, 0, 1, 2], [104, 105, 106, 107, -1, 109, 110]),
        )
        vp, _ = build_plans(
            req_pool_indices=kw["req_pool_indices"],
            prefix_lens=np.array([6, 3, 0]),
            extend_seq_lens=np.array([0, 0, 0]),
            req_to_token=kw["req_to_token"],
            verify_capacity=16,
            write_req_capacity=3,
            swa_window_size=4,
            full_to_swa_index_mapping=lut,
        )
        for a, b in zip(jax.tree_util.tree_leaves(plan), jax.tree_util.tree_leaves(vp)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def test_jit_and_overflow(self):
        r2t = jnp.asarray(np.arange(40, dtype=np.int32).reshape(4, 10))

        @jax.jit
        def f(seq):
            return build_sweep_plan_from_requests(
                req_to_token=r2t, req_pool_indices=jnp.array([1, 2], jnp.int32), seq_lens=seq, verify_capacity=8
            )

        ok = f(jnp.array([3, 5], jnp.int32))
        self.assertEqual((int(ok.enable[0]), int(ok.verify_num_valid[0])), (1, 8))
        over = f(jnp.array([4, 5], jnp.int32))
        self.assertEqual((int(over.enable[0]), int(over.verify_num_valid[0])), (0, 8))


class ScheduleTest(absltest.TestCase):
    def test_interval(self):
        s = SweepSchedule(4)
        due = [step for step in range(12) if s.due(step)]
        self.assertEqual(due, [0, 4, 8])
        self.assertFalse(SweepSchedule(0).due(0))
        with self.assertRaisesRegex(ValueError, "sweep_interval must be non-negative, got -1"):
            SweepSchedule(-1)

    def test_pass_log_every_hundred(self):
        s = SweepSchedule(1)
        with self.assertLogs("canary_jax.runtime.sweep", level=logging.INFO) as cm:
            for step in range(100):
                s.mark_done(step)
        self.assertEqual(cm.output, ["INFO:canary_jax.runtime.sweep:[canary] sweep succeeded 100 times (last_step=99)"])
        self.assertEqual(s.sweep_passes, 100)


if __name__ == "__main__":
    absltest.main()
