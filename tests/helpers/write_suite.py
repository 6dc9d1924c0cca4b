"""Write suite: chains from -1 and from seeds, input asserts, the chain-position assert and its gates,
skipped and out-of-range slots, plan bounds (offsets, num_valid_reqs), counters, real-KV fingerprints,
boundary values and row order.

``WriteSuite`` is a mixin: a ``test_*.py`` class mixes it into ``absltest.TestCase`` and sets ``VERIFY_IMPL``
/ ``WRITE_IMPL`` / ``CONFIG`` / ``BACKEND`` (see ``suite_base``); each launch then calls that implementation
with that configuration (``test_pallas_long_chain.py`` runs it with the long-request role on).
"""

from __future__ import annotations

import numpy as np

from helpers import oracle
from helpers.suite_base import (
    ALL,
    B_WPOS,
    B_WTOK,
    BYTES00_0F_STORED,
    BYTES00_1F_ALL32_STORED,
    CHAIN5_NEXT,
    CHAIN5_PREV,
    CHAIN5_TOKENS,
    H_S,
    MIX3_000,
    NONE,
    PARTIAL,
    PATTERN16,
    PATTERN16_STORED,
    RESUME_PREV,
    TAG,
    TWO_SOURCES_STORED,
    H,
    SrcSpec,
    SuiteBase,
    s64,
)


class WriteSuite(SuiteBase):
    """Write behaviour every implementation must reproduce byte for byte."""

    SOURCE_CASES = ((1, 1), (2, 4), (3, 16), (4, 64))
    """``(sources, page_size)`` of test_write_one_to_four_sources_and_pages (one kernel variant each)."""

    def test_write_seed_minus_one_five_step_chain(self):
        h = self.harness()
        slots = [3, 9, 4, 120, 66]
        h.write([(-1, [(s, CHAIN5_TOKENS[k], k) for k, s in enumerate(slots)])])
        for k, s in enumerate(slots):
            self.assertEqual(h.record(s), (CHAIN5_TOKENS[k], k, s64(CHAIN5_PREV[k]), 0))
        self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (5, 1, 0))
        # A continuation seeded from the last slot starts from CHAIN5_NEXT.
        h.write([(66, [(67, 606, 5)])])
        self.assertEqual(h.record(67), (606, 5, s64(CHAIN5_NEXT), 0))
        h.verify([(s, k, slots[k - 1] if k else -1) for k, s in enumerate(slots + [67])])
        self.assertEqual(h.rows(), [])

    def test_write_resume_from_seed(self):
        h = self.harness()
        h.poke(50, [7, 10, H, 0])  # seed slot: token 7, position 10, prev H
        slots = [51, 52, 53, 54, 55]
        h.write([(50, [(s, CHAIN5_TOKENS[k], 11 + k) for k, s in enumerate(slots)])])
        self.assertEqual([oracle.u64(h.record(s)[2]) for s in slots], list(RESUME_PREV))
        self.assertEqual(h.write_index, 0)  # positions 11.. follow seed position 10: no chain-position row
        h.verify([(s, 11 + k, slots[k - 1] if k else 50) for k, s in enumerate(slots)])
        self.assertEqual(h.rows(), [])

    def test_write_token_mismatch_input_assert(self):
        h = self.harness()
        # Entry 1 carries token 20 but the oracle expected 21: bit 8; the chain advances on 20.
        h.write([(-1, [(10, 5, 0, 5, 0), (11, 20, 1, 21, 1), (12, 30, 2, 30, 2)])], input_assert=True)
        c1 = oracle.mix3(H, 5, 0)
        self.assertEqual(h.rows(), [[int(TAG), 11, 1, 20, 21, s64(c1), 1, B_WTOK]])
        h.verify([(10, 0, -1), (11, 1, 10), (12, 2, 11)])
        self.assertEqual(h.write_index, 1)  # downstream verify is clean

    def test_write_position_mismatch_input_assert(self):
        h = self.harness()
        h.write([(-1, [(10, 5, 0, 5, 0), (11, 6, 4, 6, 1), (12, 7, 9, 8, 2)])], input_assert=True)
        c1 = oracle.mix3(H, 5, 0)
        c2 = oracle.mix3(c1, 6, 4)
        self.assertEqual(
            h.rows(),
            [[int(TAG), 11, 4, 6, 6, s64(c1), 1, B_WPOS], [int(TAG), 12, 9, 7, 8, s64(c2), 2, B_WPOS | B_WTOK]],
        )
        self.assertEqual(h.record(12), (7, 9, s64(c2), 0))

    def test_write_three_bad_entries_three_rows(self):
        h = self.harness()
        ents = [(20 + k, 100 + k, k, 100 + k + (k % 2), k) for k in range(6)]  # odd entries bad tokens
        h.write([(-1, ents)], input_assert=True)
        self.assertEqual([r[1] for r in h.rows()], [21, 23, 25])
        h.verify([(20 + k, k, 19 + k if k else -1) for k in range(6)])
        self.assertEqual(h.write_index, 3)

    def test_write_input_assert_off_ignores_mismatches(self):
        h = self.harness()
        h.write([(-1, [(10, 5, 0, 77, 77), (11, 6, 1, 88, 88)])], input_assert=False)
        self.assertEqual(h.write_index, 0)
        self.assertEqual(h.slot_counter(), 2)

    def test_write_chain_position_assert(self):
        h = self.harness()
        h.poke(50, [7, 10, H, 0])
        seed_run = oracle.mix3(H, 7, 10)
        # Positions 11, 13, 14 after seed position 10: entry 1 jumps (expects 12), then 14 follows 13.
        h.write([(50, [(51, 1, 11), (52, 2, 13), (53, 3, 14)])])
        c1 = oracle.mix3(seed_run, 1, 11)
        self.assertEqual(h.rows(), [[int(TAG), 52, 13, 2, 2, s64(c1), 12, B_WPOS]])

    def test_write_chain_position_gates(self):
        # Gate off for a -1 seed, and with the device flag at 0.
        h = self.harness(chain_assert=0)
        h.poke(50, [7, 10, H, 0])
        h.write([(50, [(51, 1, 30)])])
        h2 = self.harness()
        h2.write([(-1, [(51, 1, 30), (52, 1, 99)])])
        self.assertEqual((h.write_index, h2.write_index), (0, 0))

    def test_write_input_assert_row_before_chain_row(self):
        h = self.harness()
        h.poke(50, [7, 10, H, 0])
        seed_run = oracle.mix3(H, 7, 10)
        h.write([(50, [(51, 1, 20, 2, 11)])], input_assert=True)
        self.assertEqual(
            h.rows(),
            [
                [int(TAG), 51, 20, 1, 2, s64(seed_run), 11, B_WTOK | B_WPOS],
                [int(TAG), 51, 20, 1, 1, s64(seed_run), 11, B_WPOS],
            ],
        )

    def test_write_negative_out_cache_loc_skipped(self):
        h = self.harness()
        h.poke(12, [1, 2, 3, 4])
        h.write([(-1, [(10, 5, 0), (-1, 6, 1, 0, 0), (-5, 6, 1), (12, 7, 1)])], input_assert=True)
        self.assertEqual(h.slot_counter(), 2)
        self.assertEqual(h.write_index, 0)  # skipped entries produce no input-assert row either
        self.assertEqual(h.record(12), (7, 1, s64(oracle.mix3(H, 5, 0)), 0))  # chain did not advance on skips

    def test_write_out_of_range_slot_skipped(self):
        n = self.NUM_SLOTS
        h = self.harness()
        h.write([(-1, [(10, 5, 0), (n, 6, 1), (n + 77, 6, 1), (2**40, 1, 1), (11, 7, 1)])])
        self.assertEqual(h.slot_counter(), 2)
        self.assertEqual(h.record(11), (7, 1, s64(oracle.mix3(H, 5, 0)), 0))

    def test_write_out_of_range_seed_reads_zero_record(self):
        n = self.NUM_SLOTS
        h = self.harness()
        # seed >= N: all-zero record -> running = mix3(0,0,0) = 0, gate on with run_pos 0 -> expects 1.
        h.write([(n + 3, [(10, 5, 1), (11, 6, 5)])])
        self.assertEqual(h.record(10), (5, 1, MIX3_000, 0))
        self.assertEqual(h.rows(), [[int(TAG), 11, 5, 6, 6, s64(oracle.mix3(0, 5, 1)), 2, B_WPOS]])

    def test_write_padding_rows_and_num_valid_reqs(self):
        h = self.harness()
        # Requests: real, padding (0 entries), real, then one past num_valid_reqs that must write nothing.
        reqs = [(-1, [(10, 1, 0)]), (-1, []), (-1, [(20, 2, 0), (21, 3, 1)]), (-1, [(30, 4, 0)])]
        h.write(reqs, num_valid_reqs=3)
        self.assertEqual(h.slot_counter(), 3)
        self.assertEqual(h.record(30), (0, 0, 0, 0))
        self.assertEqual(h.record(1), (0, 0, 0, 0))  # token tail past the offsets is never consumed

    def test_write_num_valid_reqs_clamped(self):
        h = self.harness()
        reqs = [(-1, [(10 + r, r, 0)]) for r in range(self.WRITE_REQ_CAPACITY)]
        h.write(reqs, num_valid_reqs=self.WRITE_REQ_CAPACITY + 100)
        self.assertEqual(h.slot_counter(), self.WRITE_REQ_CAPACITY)
        h.write(reqs, num_valid_reqs=-1)
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (self.WRITE_REQ_CAPACITY, 2))

    def test_write_offsets_clamped_to_token_count(self):
        t, cw = self.NUM_TOKENS, self.WRITE_REQ_CAPACITY
        h = self.harness()
        ids = list(range(1000, 1000 + t))
        pos = list(range(t))
        loc = [(3 + k) % self.NUM_SLOTS for k in range(t)]
        # Request 0 claims [0, t + 50): clamped to the t tokens; request 1 [t + 50, t + 60) and request 2
        # [t + 60, -5) clamp to empty ranges.
        offsets = [0, t + 50, t + 60, -5] + [0] * (cw + 1 - 4)
        h.write_raw(offsets, [-1] * cw, 3, ids, pos, loc, ids, pos)
        self.assertEqual(h.slot_counter(), t)
        self.assertEqual(h.record(3 + t - 1)[:2], (1000 + t - 1, t - 1))

    def test_write_with_no_tokens_only_counts_the_launch(self):
        h = self.harness()
        h.write([(-1, [(5, 7, 0)])])
        before = np.asarray(h.ctx.canary_buf).copy()
        h.write_raw([0] * (self.WRITE_REQ_CAPACITY + 1), [-1] * self.WRITE_REQ_CAPACITY, 0, [], [], [], [], [])
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (1, 2))
        np.testing.assert_array_equal(np.asarray(h.ctx.canary_buf), before)

    def test_write_kernel_counter_zero_reqs(self):
        h = self.harness()
        h.write([], num_valid_reqs=0)
        h.write([(-1, [])])
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (0, 2))
        self.assertFalse(np.asarray(h.ctx.canary_buf).any())

    def test_write_slot_counter_sums_entries(self):
        h = self.harness()
        h.write([(-1, [(1, 1, 0), (2, 1, 1)]), (-1, [(3, 1, 0)]), (-1, [(4, 1, 0), (5, 1, 1), (6, 1, 2)])])
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (6, 1))
        h.write([(-1, [(7, 1, 0)])])
        self.assertEqual((h.slot_counter(), h.kernel_counter()), (7, 2))

    def test_write_slot_zero_not_special(self):
        h = self.harness()
        h.write([(-1, [(0, 5, 0)])])
        self.assertEqual(h.record(0), (5, 0, H_S, 0))
        self.assertEqual(h.slot_counter(), 1)

    def test_write_seeds_read_before_launch(self):
        h = self.harness()
        h.poke(40, [9, 3, 0x77, 0])
        # Request 0 rewrites slot 40; request 1 seeds from slot 40: it sees the old record.
        h.write([(-1, [(40, 1, 0)]), (40, [(41, 2, 4)])])
        self.assertEqual(h.record(41), (2, 4, s64(oracle.mix3(0x77, 9, 3)), 0))

    def test_write_duplicate_slot_later_entry_wins(self):
        h = self.harness()
        h.write([(-1, [(40, 1, 0), (40, 2, 1)]), (-1, [(40, 3, 0)])])
        self.assertEqual(h.record(40), (3, 0, H_S, 0))
        self.assertEqual(h.slot_counter(), 3)

    def test_write_stride_bytes_past_record_untouched(self):
        buf = np.full((self.NUM_SLOTS, 64), 0x5A, np.uint8)
        h = self.harness(stride=64, buf=buf)
        h.write([(-1, [(3, 1, 0), (4, 2, 1)])])
        out = np.asarray(h.ctx.canary_buf)
        self.assertTrue((out[:, 32:] == 0x5A).all())
        self.assertTrue((out[5:, :] == 0x5A).all())

    def test_write_real_kv_modes(self):
        data = np.zeros((self.NUM_SLOTS, 32), np.uint8)
        data[3] = np.arange(32)
        data[4, :16] = np.frombuffer(PATTERN16, np.uint8)
        for mode, rb, want3 in (
            (NONE, 32, 0),
            (PARTIAL, 32, BYTES00_0F_STORED),
            (ALL, 16, BYTES00_0F_STORED),
            (ALL, 32, BYTES00_1F_ALL32_STORED),
        ):
            h = self.harness(sources=[SrcSpec(data, 1, 32, rb)], mode=mode)
            h.write([(-1, [(3, 1, 0), (4, 2, 1)])])
            self.assertEqual(oracle.u64(h.record(3)[3]), want3, (mode, rb))
            if mode != NONE and rb == 16 or mode == PARTIAL:
                self.assertEqual(oracle.u64(h.record(4)[3]), PATTERN16_STORED)
            h.verify([(3, 0, -1), (4, 1, 3)])
            self.assertEqual(h.write_index, 0)

    def test_write_one_to_four_sources_and_pages(self):
        rng = np.random.default_rng(2)
        for n, page_size in self.SOURCE_CASES:
            srcs = []
            for _ in range(n):
                rows_ = -(-self.NUM_SLOTS // page_size)
                srcs.append(
                    SrcSpec(rng.integers(0, 256, (rows_, page_size * 32 + 16), dtype=np.uint8), page_size, 32, 32)
                )
            h = self.harness(sources=srcs, mode=ALL)
            ents = [(s, s, k) for k, s in enumerate(range(60, 60 + 20))]
            h.write([(-1, ents)])  # harness compares per-slot fingerprints with the oracle
            rkvs = {h.record(s)[3] for s in range(60, 80)}
            self.assertLen(rkvs, 20)

    def test_write_two_sources_literal(self):
        d0 = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        d1 = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        d0[6] = np.arange(16)
        d1[6] = np.arange(16, 32)
        h = self.harness(sources=[SrcSpec(d0, 1, 16, 16), SrcSpec(d1, 1, 16, 16)], mode=PARTIAL)
        h.write([(-1, [(6, 1, 0)])])
        self.assertEqual(oracle.u64(h.record(6)[3]), TWO_SOURCES_STORED)

    def test_write_boundary_values(self):
        tokens = [0, 1, 0xFFFFFFFF, -1, 2**31, 2**31 - 1, 2**63 - 1, -(2**63)]
        positions = [0, 1, 127, 128, 2**31 - 1, 2**31, 2**32 + 5, 2**63 - 1]
        h = self.harness()
        slots = list(range(80, 80 + len(tokens)))
        h.write([(-1, [(s, tokens[k], positions[k]) for k, s in enumerate(slots)])])
        hs = oracle.chain_prev_hashes(tokens, positions)
        for k, s in enumerate(slots):
            self.assertEqual(h.record(s), (tokens[k], positions[k], s64(hs[k]), 0))
        # Chain-position assert at the int64 edge: seed position 2**63 - 1 expects wrap to -2**63.
        h.write([(slots[-1], [(100, 1, -(2**63)), (101, 2, 0)])])
        self.assertEqual(
            h.rows(), [[int(TAG), 101, 0, 2, 2, s64(oracle.mix3(hs[-1], 1, -(2**63))), -(2**63) + 1, B_WPOS]]
        )

    def test_write_multi_request_row_order(self):
        h = self.harness()
        h.poke(50, [7, 10, H, 0])
        reqs = [(50, [(51, 1, 11, 1, 11), (52, 2, 15, 9, 12)]), (-1, [(60, 3, 0, 4, 0)]), (50, [(70, 5, 12, 5, 11)])]
        h.write(reqs, input_assert=True)
        self.assertEqual(
            [(r[1], r[7]) for r in h.rows()],
            [(52, B_WTOK | B_WPOS), (52, B_WPOS), (60, B_WTOK), (70, B_WPOS), (70, B_WPOS)],
        )
