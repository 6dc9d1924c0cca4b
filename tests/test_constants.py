"""Pins every constant, enum value, tag set and name of SPEC 1 (literals written from SPEC, not from code)."""

from __future__ import annotations

from absl.testing import absltest

import canary_jax
from canary_jax import constants as C


class ConstantsTest(absltest.TestCase):

    def test_chain_and_padding(self):
        self.assertEqual(C.CANARY_CHAIN_ANCHOR, 0xC0FFEE1234567890)
        self.assertEqual(C.REQ_POOL_IDX_PADDING, 0)
        self.assertEqual(C.TOKEN_TO_KV_SLOT_PADDING, 0)
        self.assertEqual(C.U64_MASK, 2**64 - 1)
        self.assertEqual(C.SPLITMIX64_MUL1, 0xBF58476D1CE4E5B9)
        self.assertEqual(C.SPLITMIX64_MUL2, 0x94D049BB133111EB)

    def test_slot_layout(self):
        self.assertEqual(C.CANARY_FIELDS_PER_SLOT, 4)
        self.assertEqual((C.CANARY_FIELD_TOKEN, C.CANARY_FIELD_POSITION, C.CANARY_FIELD_PREV_HASH,
                          C.CANARY_FIELD_REAL_KV_HASH), (0, 1, 2, 3))
        self.assertEqual(C.CANARY_SLOT_BYTES, 32)

    def test_violation_row_layout(self):
        self.assertEqual(C.VIOLATION_FIELDS, 8)
        self.assertEqual(C.VIOLATION_FIELD_NAMES, ("kernel_kind", "slot_idx", "position", "stored_token",
                                                   "expected_token", "stored_chain_hash", "expected_aux",
                                                   "fail_reason_bits"))
        cols = (C.VIOLATION_FIELD_KERNEL_KIND, C.VIOLATION_FIELD_SLOT_IDX, C.VIOLATION_FIELD_POSITION,
                C.VIOLATION_FIELD_STORED_TOKEN, C.VIOLATION_FIELD_EXPECTED_TOKEN, C.VIOLATION_FIELD_STORED_CHAIN_HASH,
                C.VIOLATION_FIELD_EXPECTED_AUX, C.VIOLATION_FIELD_FAIL_REASON_BITS)
        self.assertEqual(cols, tuple(range(8)))
        self.assertEqual(C.DEFAULT_RING_CAPACITY, 1024)

    def test_real_kv_constants(self):
        self.assertEqual(C.MAX_REAL_KV_SOURCES, 4)
        self.assertEqual(C.REAL_KV_SOURCE_FIELDS_PER_ENTRY, 3)
        self.assertEqual(C.REAL_KV_ALIGN_BYTES, 16)
        self.assertEqual(C.PARTIAL_READ_BYTES, 16)

    def test_fail_reason(self):
        want = {
            "VERIFY_CHAIN_HASH_MISMATCH": 1,
            "VERIFY_POSITION_MISMATCH": 2,
            "VERIFY_REAL_KV_HASH_MISMATCH": 4,
            "WRITE_TOKEN_MISMATCH": 8,
            "WRITE_POSITION_MISMATCH": 16,
            "VERIFY_TOKEN_MISMATCH": 32,
        }
        self.assertEqual({m.name: int(m) for m in C.FailReason}, want)
        self.assertEqual([m.name for m in C.FailReason], list(want))  # bit order
        self.assertEqual(C.FAIL_REASON_ALL_BITS, 63)
        self.assertEqual(int(C.FailReason.VERIFY_TOKEN_MISMATCH | C.FailReason.VERIFY_POSITION_MISMATCH), 34)

    def test_real_kv_hash_mode(self):
        self.assertEqual({m.name: int(m) for m in C.RealKvHashMode}, {"NONE": 0, "PARTIAL": 1, "ALL": 2})
        for name, want in (("none", 0), ("Partial", 1), ("ALL", 2)):
            self.assertEqual(C.RealKvHashMode.from_name(name), want)
        for bad in ("off", "bit", ""):
            with self.assertRaisesRegex(ValueError, r"^kv-canary: real_kv_hash_mode must be one of none/partial/all"):
                C.RealKvHashMode.from_name(bad)

    def test_launch_tags(self):
        want = ["HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL", "SWEEP_K_FULL", "SWEEP_V_FULL",
                "HEAD_K_SWA", "HEAD_V_SWA", "TAIL_K_SWA", "TAIL_V_SWA", "SWEEP_K_SWA", "SWEEP_V_SWA"]
        self.assertEqual([(t.name, int(t)) for t in C.CanaryLaunchTag], [(n, i) for i, n in enumerate(want)])
        self.assertLen(C.CanaryLaunchTag, 12)
        self.assertEqual(C.NUM_LAUNCH_TAGS, 12)

    def test_tag_sets(self):
        self.assertEqual(C.SWEEP_TAGS, frozenset({4, 5, 10, 11}))
        self.assertEqual(C.HEAD_TAGS, frozenset({0, 1, 6, 7}))
        self.assertEqual(C.TAIL_TAGS, frozenset({2, 3, 8, 9}))
        self.assertEqual(C.V_HALF_TAGS, frozenset({1, 3, 5, 7, 9, 11}))
        groups = {int(t): t.group for t in C.CanaryLaunchTag}
        self.assertEqual(groups, {**{i: "FULL" for i in range(6)}, **{i: "SWA" for i in range(6, 12)}})
        for t in C.CanaryLaunchTag:
            self.assertEqual(t.is_sweep, int(t) in {4, 5, 10, 11})
            self.assertEqual(t.is_head, int(t) in {0, 1, 6, 7})
            self.assertEqual(t.is_tail, int(t) in {2, 3, 8, 9})
            self.assertEqual(t.is_v_half, int(t) % 2 == 1)

    def test_package_reexports(self):
        self.assertIs(canary_jax.CanaryLaunchTag, C.CanaryLaunchTag)
        self.assertIs(canary_jax.FailReason, C.FailReason)
        self.assertIs(canary_jax.RealKvHashMode, C.RealKvHashMode)
        self.assertEqual(canary_jax.CANARY_CHAIN_ANCHOR, 0xC0FFEE1234567890)
        self.assertEqual(canary_jax.CANARY_SLOT_BYTES, 32)
        self.assertEqual(canary_jax.MAX_REAL_KV_SOURCES, 4)

    def test_allocation_bytes(self):
        # SPEC 4.2 / 4.3: VerifyPlan 4*C*8 + 2*4, WritePlan (2*Cw+1)*8 + 4.
        self.assertEqual(canary_jax.VerifyPlan.allocation_bytes(10), 328)
        self.assertEqual(canary_jax.WritePlan.allocation_bytes(10), 172)


if __name__ == "__main__":
    absltest.main()
