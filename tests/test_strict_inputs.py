"""Host-side builders and allocators refuse non-integers instead of truncating them."""

from __future__ import annotations

import numpy as np
from absl.testing import absltest

import canary_jax


class StrictHostInputsTest(absltest.TestCase):
    def test_plan_builders_refuse_floats_and_strings(self):
        with self.assertRaisesRegex(TypeError, "kv-canary: slots must hold integers, got float64"):
            canary_jax.VerifyPlan.from_entries(slots=[3.7], positions=[0], prev_slots=[-1])
        with self.assertRaisesRegex(TypeError, "kv-canary: slots must hold integers"):
            canary_jax.VerifyPlan.from_entries(slots=["3"], positions=[0], prev_slots=[-1])
        with self.assertRaisesRegex(TypeError, "kv-canary: counts must hold integers, got float64"):
            canary_jax.WritePlan.from_requests(counts=[2.5], seed_slots=[-1])

    def test_plan_builders_refuse_out_of_range_ints(self):
        with self.assertRaisesRegex(ValueError, "kv-canary: slots holds a value that does not fit int64"):
            canary_jax.VerifyPlan.from_entries(slots=[2**63], positions=[0], prev_slots=[-1])
        with self.assertRaisesRegex(ValueError, r"kv-canary: num_valid must be <= 2147483647, got 1099511627776"):
            canary_jax.VerifyPlan.from_entries(slots=[3], positions=[0], prev_slots=[-1], num_valid=2**40)

    def test_plan_builders_refuse_bools_and_uint64_past_int64(self):
        # A mask is not a slot; a uint64 of 2**63 or more is no int64 (its bits would read as a negative slot).
        with self.assertRaisesRegex(TypeError, r"^kv-canary: slots must hold integers, got bool data$"):
            canary_jax.VerifyPlan.from_entries(slots=[True], positions=[0], prev_slots=[-1])
        with self.assertRaisesRegex(TypeError, r"^kv-canary: counts must hold integers, got bool data$"):
            canary_jax.WritePlan.from_requests(counts=np.array([True, False]), seed_slots=[-1, -1])
        with self.assertRaisesRegex(
            ValueError, r"^kv-canary: slots holds a value that does not fit int64: 9223372036854775808 \(uint64\)$"
        ):
            canary_jax.VerifyPlan.from_entries(slots=np.array([2**63], np.uint64), positions=[0], prev_slots=[-1])
        with self.assertRaisesRegex(
            ValueError, r"^kv-canary: seed_slots holds a value that does not fit int64: 18446744073709551616$"
        ):
            canary_jax.WritePlan.from_requests(counts=[1], seed_slots=[2**64])
        plan = canary_jax.VerifyPlan.from_entries(
            slots=np.array([2**63 - 1], np.uint64), positions=np.array([3], np.uint8), prev_slots=[-1]
        )
        self.assertEqual(int(canary_jax.pairs_to_int64_np(plan.verify_slot_indices)[0]), 2**63 - 1)
        self.assertEqual(int(canary_jax.pairs_to_int64_np(plan.verify_expected_positions)[0]), 3)

    def test_plan_builders_keep_int64_extremes_exact(self):
        plan = canary_jax.VerifyPlan.from_entries(slots=[2**63 - 1], positions=[-(2**63)], prev_slots=[-1])
        self.assertEqual(int(canary_jax.pairs_to_int64_np(plan.verify_slot_indices)[0]), 2**63 - 1)
        self.assertEqual(int(canary_jax.pairs_to_int64_np(plan.verify_expected_positions)[0]), -(2**63))

    def test_allocators_refuse_non_integer_sizes(self):
        with self.assertRaisesRegex(TypeError, "kv-canary: num_slots must be an int, got 3.5"):
            canary_jax.allocate_canary_buffer(3.5)
        with self.assertRaisesRegex(TypeError, "kv-canary: ViolationLog ring_capacity must be an int, got 2.9"):
            canary_jax.ViolationLog.allocate(ring_capacity=2.9)
        with self.assertRaisesRegex(TypeError, "kv-canary: VerifyPlan verify_capacity must be an int"):
            canary_jax.VerifyPlan.allocate(verify_capacity=4.0)
        with self.assertRaisesRegex(TypeError, "kv-canary: num_slots must be an int, got True"):
            canary_jax.allocate_canary_buffer(True)
        self.assertEqual(canary_jax.allocate_canary_buffer(np.int64(5)).shape, (5, 32))

    def test_real_kv_source_refuses_non_integer_params(self):
        t = np.zeros((4, 16), np.uint8)
        with self.assertRaisesRegex(TypeError, "kv-canary: RealKvSource.page_size must be an int, got 1.5"):
            canary_jax.RealKvSource(tensor=t, page_size=1.5, num_bytes_per_token=16, read_bytes=16)
        with self.assertRaisesRegex(TypeError, "kv-canary: RealKvSource.read_bytes must be an int"):
            canary_jax.RealKvSource(tensor=t, page_size=1, num_bytes_per_token=16, read_bytes=16.0)


if __name__ == "__main__":
    absltest.main()
