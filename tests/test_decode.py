"""Violation decoding and SGLang's report text (SPEC 9), with hand-written expected strings."""

from __future__ import annotations

import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants, decode, ints

H = 0xDE7FAE23A9A1B716
H_S = H - (1 << 64)


def ring_of(rows, capacity=4):
    ring = np.zeros((capacity, 8), np.int64)
    ring[: len(rows)] = rows
    return ring


class DecodeRecordsTest(absltest.TestCase):
    def test_fields_from_int64_ring(self):
        rows = [[2, 5, 0, 33, -1, H_S, H_S, 2], [0, 52, 13, 2, 2, -7, 12, 16]]
        recs = canary_jax.decode_violations(ring_of(rows), np.array([2], np.int32))
        self.assertLen(recs, 2)
        r = recs[0]
        self.assertEqual(
            (
                r.index,
                r.kernel_kind,
                r.slot_idx,
                r.position,
                r.stored_token,
                r.expected_token,
                r.stored_chain_hash,
                r.expected_aux,
                r.fail_reason_bits,
            ),
            (0, 2, 5, 0, 33, -1, H_S, H_S, 2),
        )
        self.assertEqual((r.tag, r.reasons, r.is_write), ("TAIL_K_FULL", ["verify_position"], False))
        w = recs[1]
        self.assertEqual((w.index, w.tag, w.reasons, w.is_write), (1, "HEAD_K_FULL", ["write_position"], True))
        d = w.as_dict()
        self.assertEqual(
            (d["slot_idx"], d["tag"], d["reasons"], d["stored_chain_hash"]), (52, "HEAD_K_FULL", ["write_position"], -7)
        )

    def test_ring_forms_and_cursor(self):
        rows = [[k, k, 0, 0, -1, 0, 0, 1] for k in range(3)]
        ring = ring_of(rows)
        pairs = ints.int64_to_pairs_np(ring)
        a = canary_jax.decode_violations(ring, 3)
        b = canary_jax.decode_violations(pairs, np.array([3], np.int32))
        self.assertEqual(a, b)
        self.assertEqual([r.slot_idx for r in canary_jax.decode_violations(ring, 3, start=1)], [1, 2])
        self.assertEqual(canary_jax.decode_violations(ring, 0), [])
        # write_index past capacity: only the R stored rows exist.
        self.assertLen(canary_jax.decode_violations(ring, 9), 4)

    def test_from_violation_log(self):
        log = canary_jax.ViolationLog.allocate(ring_capacity=2)
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=canary_jax.allocate_canary_buffer(8), kernel_kind=constants.CanaryLaunchTag.SWEEP_K_SWA, log=log
        )
        plan = canary_jax.VerifyPlan.from_entries(slots=[1, 2, 3], positions=[4, 5, 6], prev_slots=[0, 0, 0])
        ctx = canary_jax.verify(ctx, plan, backend="reference")
        recs = canary_jax.decode_violations(ctx.log)
        self.assertEqual(
            [(r.kernel_kind, r.slot_idx, r.position, r.fail_reason_bits) for r in recs], [(10, 1, 0, 2), (10, 2, 0, 2)]
        )
        self.assertEqual(ctx.log.ring_rows().tolist(), [[10, 1, 0, 0, -1, 0, 0, 2], [10, 2, 0, 0, -1, 0, 0, 2]])
        msgs = canary_jax.format_violations(ctx.log, step_when_pumped=3)
        self.assertLen(msgs, 2)
        self.assertTrue(msgs[0].endswith("  total_violations=3 ring_overflow=True step_when_pumped=3"))
        self.assertIn("canary_kind:       sweep_k_swa", msgs[0])

    def test_bad_ring_shapes(self):
        with self.assertRaisesRegex(ValueError, r"violation ring must be int64\[R, 8\] or uint32\[R, 8, 2\]"):
            canary_jax.decode_violations(np.zeros((4, 7), np.int64), 1)
        with self.assertRaisesRegex(ValueError, r"violation ring must be"):
            canary_jax.decode_violations(np.zeros((4, 8), np.int32), 1)
        with self.assertRaisesRegex(ValueError, r"violation_write_index must hold one value"):
            canary_jax.decode_violations(np.zeros((4, 8), np.int64), np.array([1, 2]))

    def test_labels(self):
        self.assertEqual(
            decode.reason_labels(63),
            [
                "verify_chain_hash",
                "verify_position",
                "verify_real_kv_hash",
                "write_token",
                "write_position",
                "verify_token",
            ],
        )
        self.assertEqual(decode.reason_labels(0), [])
        self.assertEqual(decode.tag_label(99), "unknown(99)")
        self.assertEqual(decode.tag_label(-1), "unknown(-1)")
        self.assertEqual(decode.canary_kind_label(4), "sweep_k_full")
        self.assertEqual(decode.canary_kind_label(7), "per_forward_head_v_swa")
        self.assertEqual(decode.canary_kind_label(12), "unknown(12)")


class FormatTest(absltest.TestCase):
    def fmt(self, row, *, total=1, overflow=False, step=7):
        return canary_jax.format_violation(
            decode.ViolationRecord.from_row(0, row), total=total, ring_overflow=overflow, step_when_pumped=step
        )

    def test_verify_row_without_token_bits(self):
        want = "\n".join(
            [
                "kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_position slot_idx=5 position=0 "
                "stored_token=33 expected_token=-1 stored_chain_hash=0xde7fae23a9a1b716 "
                "expected_aux=0xde7fae23a9a1b716",
                "KV cache canary violation detected (kernel_kind=TAIL_K_FULL, slot_idx=5, position=0)",
                "canary_kind:       per_forward_tail_k_full",
                "  fail_reasons: verify_position",
                "  stored:   token_id=33   position=0 prev_hash=0xde7fae23a9a1b716",
                "  expected: prev_hash=0xde7fae23a9a1b716",
                "  total_violations=1 ring_overflow=False step_when_pumped=7",
            ]
        )
        self.assertEqual(self.fmt([2, 5, 0, 33, -1, H_S, H_S, 2]), want)

    def test_verify_row_with_token_bits(self):
        want = "\n".join(
            [
                "kv_canary violation: launch_tag=HEAD_V_SWA fail_reason=verify_chain_hash+verify_position+verify_token "
                "slot_idx=41 position=1 stored_token=200 expected_token=201 stored_chain_hash=0x0000000000001234 "
                "expected_aux=0xffffffffffffffff",
                "KV cache canary violation detected (kernel_kind=HEAD_V_SWA, slot_idx=41, position=1)",
                "canary_kind:       per_forward_head_v_swa",
                "  fail_reasons: verify_chain_hash verify_position verify_token",
                "  stored:   token_id=200   position=1 prev_hash=0x0000000000001234",
                "  expected: token_id=201 prev_hash=0xffffffffffffffff",
                "  total_violations=1025 ring_overflow=True step_when_pumped=0",
            ]
        )
        self.assertEqual(
            self.fmt([7, 41, 1, 200, 201, 0x1234, -1, 1 | 2 | 32], total=1025, overflow=True, step=0), want
        )

    def test_write_row_token_bit(self):
        c = 0x1B798564098041C9
        want = "\n".join(
            [
                f"kv_canary violation: launch_tag=TAIL_K_SWA fail_reason=write_token slot_idx=11 position=1 "
                f"stored_token=20 expected_token=21 stored_chain_hash={c:#018x} expected_aux=0x0000000000000001",
                "KV cache canary violation detected (kernel_kind=TAIL_K_SWA, slot_idx=11, position=1)",
                "canary_kind:       per_forward_tail_k_swa",
                "  fail_reasons: write_token",
                f"  actual:   token_id=20   position=1 prev_hash={c:#018x}",
                "  expected: token_id=21   position=1",
                "  total_violations=2 ring_overflow=False step_when_pumped=9",
            ]
        )
        self.assertEqual(self.fmt([8, 11, 1, 20, 21, c, 1, 8], total=2, step=9), want)

    def test_write_row_chain_position(self):
        want = "\n".join(
            [
                "kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=write_position slot_idx=52 position=13 "
                "stored_token=2 expected_token=2 stored_chain_hash=0x8000000000000000 expected_aux=0x000000000000000c",
                "KV cache canary violation detected (kernel_kind=HEAD_K_FULL, slot_idx=52, position=13)",
                "canary_kind:       per_forward_head_k_full",
                "  fail_reasons: write_position",
                "  actual:   token_id=2   position=13 prev_hash=0x8000000000000000",
                "  expected: token_id=2   position=12",
                "  total_violations=1 ring_overflow=False step_when_pumped=7",
            ]
        )
        self.assertEqual(self.fmt([0, 52, 13, 2, 2, -(2**63), 12, 16]), want)

    def test_unknown_tag_and_no_bits(self):
        text = self.fmt([99, 3, 4, 5, 6, 0, 0, 0])
        lines = text.split("\n")
        self.assertEqual(
            lines[0],
            "kv_canary violation: launch_tag=unknown(99) fail_reason=none slot_idx=3 position=4 "
            "stored_token=5 expected_token=6 stored_chain_hash=0x0000000000000000 "
            "expected_aux=0x0000000000000000",
        )
        self.assertEqual(
            lines[1], "KV cache canary violation detected (kernel_kind=unknown(99), slot_idx=3, position=4)"
        )
        self.assertEqual(lines[2], "canary_kind:       unknown(99)")
        self.assertEqual(lines[3], "  fail_reasons: none")
        self.assertEqual(lines[5], "  expected: prev_hash=0x0000000000000000")

    def test_sweep_kind_label(self):
        lines = self.fmt([5, 1, 0, 0, -1, 0, 0, 4]).split("\n")
        self.assertEqual(lines[2], "canary_kind:       sweep_v_full")
        self.assertIn("fail_reason=verify_real_kv_hash ", lines[0])

    def test_format_violations_cursor_and_int64_ring(self):
        rows = [[2, 1, 0, 0, -1, 0, 0, 2], [2, 2, 0, 0, -1, 0, 0, 2], [2, 3, 0, 0, -1, 0, 0, 2]]
        msgs = canary_jax.format_violations(ring_of(rows, 3), np.array([5], np.int32), start=1, step_when_pumped=4)
        self.assertEqual([m.split("\n")[0].split(" ")[4] for m in msgs], ["slot_idx=2", "slot_idx=3"])
        self.assertTrue(all(m.endswith("total_violations=5 ring_overflow=True step_when_pumped=4") for m in msgs))


class DecodeEdgeCasesTest(absltest.TestCase):
    """Rows a live ring should never hold still decode to something visible."""

    def test_unknown_fail_bits_are_labelled(self):
        self.assertEqual(decode.reason_labels(1 | (1 << 40)), ["verify_chain_hash", "unknown(0x10000000000)"])
        self.assertEqual(decode.reason_labels(0), [])

    def test_bare_ring_needs_write_index(self):
        ring = np.zeros((4, 8), np.int64)
        with self.assertRaisesRegex(TypeError, "pass write_index together with a bare violation ring"):
            decode.decode_violations(ring)

    def test_wrapped_int32_write_index_means_full_ring(self):
        ring = np.zeros((4, 8), np.int64)
        ring[:, 7] = 2
        self.assertLen(decode.decode_violations(ring, np.array([-5], np.int32)), 4)


if __name__ == "__main__":
    absltest.main()


class CollapseAndDetailTest(absltest.TestCase):
    ROW = [2, 5, 3, 42, -1, H_S, 7, 4]

    def test_key_and_collapse(self):
        ring = ring_of([self.ROW, [0, 5, 3, 42, -1, H_S, 7, 4], self.ROW, self.ROW], capacity=6)
        recs = canary_jax.decode_violations(ring, 4)
        self.assertEqual(recs[0].key, tuple(self.ROW))
        self.assertEqual(recs[0].key, recs[2].key)
        self.assertNotEqual(recs[0].key, recs[1].key)  # another tag: another record
        c = decode.collapse_violations(recs)
        self.assertEqual([(x.record.index, x.count, x.first, x.last) for x in c], [(0, 3, 0, 3), (1, 1, 1, 1)])
        c = decode.collapse_violations(recs, steps=[10, 11, 12, 15])
        self.assertEqual([(x.count, x.first, x.last) for x in c], [(3, 10, 15), (1, 11, 11)])
        self.assertEqual(
            decode.format_repeat(c[0], unit="step"),
            "kv_canary violation repeated: launch_tag=TAIL_K_FULL fail_reason=verify_real_kv_hash slot_idx=5 "
            "position=3 count=3 first_step=10 last_step=15",
        )
        with self.assertRaisesRegex(ValueError, "steps has 1 entries for 4 records"):
            decode.collapse_violations(recs, steps=[1])

    def test_detail_line(self):
        d = decode.ViolationDetail(
            expected_position=9, stored_real_kv_hash=-1, recomputed_real_kv_hash=5, mapped_at=((2, 9), (3, 1))
        )
        self.assertEqual(
            decode.format_detail(d),
            "  detail:   expected_position=9 stored_real_kv_hash=0xffffffffffffffff "
            "recomputed_real_kv_hash=0x0000000000000005 req_to_token=[(2, 9), (3, 1)]",
        )
        only_map = decode.ViolationDetail(mapped_at=((1, 0),))
        self.assertEqual(decode.format_detail(only_map), "  detail:   req_to_token=[(1, 0)]")
        self.assertEqual(decode.format_detail(decode.ViolationDetail()), "")
        self.assertTrue(decode.ViolationDetail().empty)
