"""Validation of plans (SPEC 4, 7): SGLang's plan-launch checks shared by ``build_plans`` and the torch launcher
(``validation.check_plan_launch``), and the allocation of plans and violation logs and the plans' host builders.
"""

from __future__ import annotations

import re

import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import ints


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


if __name__ == "__main__":
    absltest.main()
