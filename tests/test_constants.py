"""Pins every constant, enum value, tag set and name of SPEC 1 (literals written from SPEC, not from code)."""

from __future__ import annotations

from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants


class ConstantsTest(absltest.TestCase):
    def test_chain_and_padding(self):
        self.assertEqual(constants.CANARY_CHAIN_ANCHOR, 0xC0FFEE1234567890)
        self.assertEqual(constants.REQ_POOL_IDX_PADDING, 0)
        self.assertEqual(constants.TOKEN_TO_KV_SLOT_PADDING, 0)
        self.assertEqual(constants.U64_MASK, 2**64 - 1)
        self.assertEqual(constants.SPLITMIX64_MUL1, 0xBF58476D1CE4E5B9)
        self.assertEqual(constants.SPLITMIX64_MUL2, 0x94D049BB133111EB)

    def test_slot_layout(self):
        self.assertEqual(constants.CANARY_FIELDS_PER_SLOT, 4)
        self.assertEqual(
            (
                constants.CANARY_FIELD_TOKEN,
                constants.CANARY_FIELD_POSITION,
                constants.CANARY_FIELD_PREV_HASH,
                constants.CANARY_FIELD_REAL_KV_HASH,
            ),
            (0, 1, 2, 3),
        )
        self.assertEqual(constants.CANARY_SLOT_BYTES, 32)

    def test_violation_row_layout(self):
        self.assertEqual(constants.VIOLATION_FIELDS, 8)
        self.assertEqual(
            constants.VIOLATION_FIELD_NAMES,
            (
                "kernel_kind",
                "slot_idx",
                "position",
                "stored_token",
                "expected_token",
                "stored_chain_hash",
                "expected_aux",
                "fail_reason_bits",
            ),
        )
        cols = (
            constants.VIOLATION_FIELD_KERNEL_KIND,
            constants.VIOLATION_FIELD_SLOT_IDX,
            constants.VIOLATION_FIELD_POSITION,
            constants.VIOLATION_FIELD_STORED_TOKEN,
            constants.VIOLATION_FIELD_EXPECTED_TOKEN,
            constants.VIOLATION_FIELD_STORED_CHAIN_HASH,
            constants.VIOLATION_FIELD_EXPECTED_AUX,
            constants.VIOLATION_FIELD_FAIL_REASON_BITS,
        )
        self.assertEqual(cols, tuple(range(8)))
        self.assertEqual(constants.DEFAULT_RING_CAPACITY, 1024)

    def test_real_kv_constants(self):
        self.assertEqual(constants.MAX_REAL_KV_SOURCES, 4)
        self.assertEqual(constants.REAL_KV_SOURCE_FIELDS_PER_ENTRY, 3)
        self.assertEqual(constants.REAL_KV_ALIGN_BYTES, 16)
        self.assertEqual(constants.PARTIAL_READ_BYTES, 16)

    def test_fail_reason(self):
        want = {
            "VERIFY_CHAIN_HASH_MISMATCH": 1,
            "VERIFY_POSITION_MISMATCH": 2,
            "VERIFY_REAL_KV_HASH_MISMATCH": 4,
            "WRITE_TOKEN_MISMATCH": 8,
            "WRITE_POSITION_MISMATCH": 16,
            "VERIFY_TOKEN_MISMATCH": 32,
        }
        self.assertEqual({m.name: int(m) for m in constants.FailReason}, want)
        self.assertEqual([m.name for m in constants.FailReason], list(want))  # bit order
        self.assertEqual(constants.FAIL_REASON_ALL_BITS, 63)
        self.assertEqual(
            int(constants.FailReason.VERIFY_TOKEN_MISMATCH | constants.FailReason.VERIFY_POSITION_MISMATCH), 34
        )

    def test_real_kv_hash_mode(self):
        self.assertEqual({m.name: int(m) for m in constants.RealKvHashMode}, {"NONE": 0, "PARTIAL": 1, "ALL": 2})
        for name, want in (("none", 0), ("Partial", 1), ("ALL", 2)):
            self.assertEqual(constants.RealKvHashMode.from_name(name), want)
        for bad in ("off", "bit", ""):
            with self.assertRaisesRegex(ValueError, r"^kv-canary: real_kv_hash_mode must be one of none/partial/all"):
                constants.RealKvHashMode.from_name(bad)

    def test_launch_tags(self):
        want = [
            "HEAD_K_FULL",
            "HEAD_V_FULL",
            "TAIL_K_FULL",
            "TAIL_V_FULL",
            "SWEEP_K_FULL",
            "SWEEP_V_FULL",
            "HEAD_K_SWA",
            "HEAD_V_SWA",
            "TAIL_K_SWA",
            "TAIL_V_SWA",
            "SWEEP_K_SWA",
            "SWEEP_V_SWA",
        ]
        self.assertEqual([(t.name, int(t)) for t in constants.CanaryLaunchTag], [(n, i) for i, n in enumerate(want)])
        self.assertLen(constants.CanaryLaunchTag, 12)
        self.assertEqual(constants.NUM_LAUNCH_TAGS, 12)

    def test_tag_sets(self):
        self.assertEqual(constants.SWEEP_TAGS, frozenset({4, 5, 10, 11}))
        self.assertEqual(constants.HEAD_TAGS, frozenset({0, 1, 6, 7}))
        self.assertEqual(constants.TAIL_TAGS, frozenset({2, 3, 8, 9}))
        self.assertEqual(constants.V_HALF_TAGS, frozenset({1, 3, 5, 7, 9, 11}))
        groups = {int(t): t.group for t in constants.CanaryLaunchTag}
        self.assertEqual(groups, {**{i: "FULL" for i in range(6)}, **{i: "SWA" for i in range(6, 12)}})
        for t in constants.CanaryLaunchTag:
            self.assertEqual(t.is_sweep, int(t) in {4, 5, 10, 11})
            self.assertEqual(t.is_head, int(t) in {0, 1, 6, 7})
            self.assertEqual(t.is_tail, int(t) in {2, 3, 8, 9})
            self.assertEqual(t.is_v_half, int(t) % 2 == 1)

    def test_package_reexports(self):
        self.assertIs(canary_jax.CanaryLaunchTag, constants.CanaryLaunchTag)
        self.assertIs(canary_jax.FailReason, constants.FailReason)
        self.assertIs(canary_jax.RealKvHashMode, constants.RealKvHashMode)
        self.assertEqual(canary_jax.CANARY_CHAIN_ANCHOR, 0xC0FFEE1234567890)
        self.assertEqual(canary_jax.CANARY_SLOT_BYTES, 32)
        self.assertEqual(canary_jax.MAX_REAL_KV_SOURCES, 4)

    def test_allocation_bytes(self):
        # SPEC 4.2 / 4.3: VerifyPlan 4*C*8 + 2*4, WritePlan (2*Cw+1)*8 + 4.
        self.assertEqual(canary_jax.VerifyPlan.allocation_bytes(10), 328)
        self.assertEqual(canary_jax.WritePlan.allocation_bytes(10), 172)


if __name__ == "__main__":
    absltest.main()
