"""Verify suite: one hand scenario per fail reason, ring and counter rules, plan bounds, boundary values,
out-of-range slots, more than 65535 entries, and a seeded fuzz of random canary contents.

``VerifySuite`` (with the real-KV cases of ``verify_real_kv_suite``) is a mixin: a ``test_*.py`` class mixes
it into ``absltest.TestCase`` and sets ``VERIFY_IMPL`` / ``WRITE_IMPL`` / ``CONFIG`` / ``BACKEND`` (see
``suite_base``); each launch then calls that implementation with that configuration.
"""

from __future__ import annotations

import random

import numpy as np

from canary_jax.contract import constants
from helpers import oracle
from helpers.suite_base import (
    B_CHAIN,
    B_POS,
    B_RKV,
    B_TOK,
    CHAIN5_PREV,
    CHAIN5_TOKENS,
    H_S,
    MIX3_000,
    PARTIAL,
    TAG,
    H,
    SrcSpec,
    counters_int64,
    s64,
)
from helpers.verify_real_kv_suite import VerifyRealKvSuite


class VerifySuite(VerifyRealKvSuite):
    """Verify behaviour every implementation must reproduce byte for byte."""

    # --- one scenario per fail reason ---
    def test_verify_anchor_head_passes(self):
        h = self.harness()
        h.poke(7, [42, 0, H, 0])  # slot 7 holds position 0 of a request, prev = anchor hash
        h.verify([(7, 0, -1)])  # prev -1: head -> expected chain = splitmix64(anchor)
        self.assertEqual(h.rows(), [])
        self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (1, 1, 0))

    def test_verify_five_step_chain_clean(self):
        h = self.harness()
        slots = [11, 3, 50, 4, 127]
        for k, slot in enumerate(slots):  # the hand-computed prev hashes of SPEC 2.6
            h.poke(slot, [CHAIN5_TOKENS[k], k, CHAIN5_PREV[k], 0])
        h.verify([(s, k, slots[k - 1] if k else -1) for k, s in enumerate(slots)])
        self.assertEqual(h.rows(), [])
        self.assertEqual(h.slot_counter(), 5)

    def test_verify_chain_mismatch_head_wrong_prev(self):
        h = self.harness()
        h.poke(9, [42, 0, 0x1234, 0])  # head stores a wrong prev hash
        h.verify([(9, 0, -1)])
        self.assertEqual(h.rows(), [[int(TAG), 9, 0, 42, -1, 0x1234, H_S, B_CHAIN]])

    def test_verify_position_mismatch_only(self):
        h = self.harness()
        h.lay_chain([20, 21, 22], [5, 6, 7], [0, 1, 2])
        # Middle entry: plan expects position 9, slot stores 1; chain still fine.
        h.verify([(20, 0, -1), (21, 9, 20), (22, 2, 21)])
        exp_chain = oracle.mix3(H, 5, 0)
        self.assertEqual(h.rows(), [[int(TAG), 21, 1, 6, -1, s64(exp_chain), s64(exp_chain), B_POS]])

    def test_verify_token_mismatch_bit32(self):
        h = self.harness()
        h.lay_chain([40, 41], [100, 200], [0, 1])
        # -1 skips, match is clean, mismatch -> bit 32 with stored / expected columns.
        h.verify([(40, 0, -1, -1), (41, 1, 40, 200)], check=True)
        self.assertEqual(h.rows(), [])
        h.verify([(40, 0, -1, 100), (41, 1, 40, 201)], check=True)
        c1 = s64(oracle.mix3(H, 100, 0))
        self.assertEqual(h.rows(), [[int(TAG), 41, 1, 200, 201, c1, c1, B_TOK]])

    def test_verify_token_and_position_bits_34(self):
        h = self.harness()
        h.lay_chain([40], [100], [0])
        h.verify([(40, 3, -1, 5)], check=True)
        self.assertEqual(h.rows(), [[int(TAG), 40, 0, 100, 5, H_S, H_S, B_TOK | B_POS]])

    def test_verify_token_check_off_never_uses_array(self):
        h = self.harness()
        h.lay_chain([40, 41], [100, 200], [0, 1])
        # Garbage expected tokens, flag off: no token bit; a position failure shows column 4 = -1.
        h.verify([(40, 0, -1, 12345), (41, 7, 40, 999)], check=False)
        c1 = s64(oracle.mix3(H, 100, 0))
        self.assertEqual(h.rows(), [[int(TAG), 41, 1, 200, -1, c1, c1, B_POS]])

    def test_verify_expected_token_minus_one_column(self):
        h = self.harness()
        h.lay_chain([40], [100], [0])
        # Check on, expected -1 (sentinel): no token bit, column 4 carries the gathered -1.
        h.verify([(40, 1, -1, -1)], check=True)
        self.assertEqual(h.rows(), [[int(TAG), 40, 0, 100, -1, H_S, H_S, B_POS]])

    def test_verify_exact_row_layout(self):
        # SGLang's pinned row: HEAD_K_FULL, slot 5 stores (token 33, position 0, prev H); plan expects 99.
        h = self.harness()
        h.poke(5, [33, 0, H, 0])
        h.verify([(5, 99, -1)], tag=constants.CanaryLaunchTag.HEAD_K_FULL)
        self.assertEqual(h.rows(), [[0, 5, 0, 33, -1, H_S, H_S, 2]])
        raw = np.asarray(h.ctx.log.ring)[0].astype("<u4").tobytes()
        self.assertLen(raw, 64)
        want = b"".join(oracle.u64(v).to_bytes(8, "little") for v in [0, 5, 0, 33, -1, H, H, 2])
        self.assertEqual(raw, want)
        self.assertEqual(h.kernel_counter(constants.CanaryLaunchTag.HEAD_K_FULL), 1)
        self.assertEqual(h.kernel_counter(TAG), 0)

    def test_verify_prev_slot_zero_skips_only_chain_check(self):
        h = self.harness()
        h.poke(12, [5, 3, 0xBAD, 0])  # prev hash garbage, stored position 3
        h.verify([(12, 3, 0)])  # prev 0: unreachable -> chain skipped, exp_chain column = stored prev
        self.assertEqual(h.rows(), [])
        h.verify([(12, 4, 0)])  # position still fires
        self.assertEqual(h.rows(), [[int(TAG), 12, 3, 5, -1, 0xBAD, 0xBAD, B_POS]])

    def test_verify_corrupted_token_shows_on_successor(self):
        h = self.harness()
        slots = [60, 61, 62, 63, 64]
        hs = h.lay_chain(slots, list(CHAIN5_TOKENS), list(range(5)))
        self.assertEqual([oracle.u64(x) for x in hs], list(CHAIN5_PREV))
        h.poke(62, [999, 2, CHAIN5_PREV[2], 0])  # token of k=2 trampled
        h.verify([(s, k, slots[k - 1] if k else -1) for k, s in enumerate(slots)])
        # Slot 62 itself looks fine (its prev is right); its successor 63 carries the chain bit.
        exp = s64(oracle.mix3(CHAIN5_PREV[2], 999, 2))
        self.assertEqual(h.rows(), [[int(TAG), 63, 3, 404, -1, s64(CHAIN5_PREV[3]), exp, B_CHAIN]])

    # --- the ring, plan bounds and counters ---
    def test_verify_failure_matrix(self):
        # (position | prev_hash | real_kv) x (head | mid | last) x (ring open | full at capacity 4).
        data = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        rng = np.random.default_rng(0)
        data[:] = rng.integers(0, 256, data.shape, dtype=np.uint8)
        slots = [70, 71, 72, 73]
        for ring_full in (False, True):
            for field in ("position", "prev_hash", "real_kv"):
                for k in (0, 2, 3):
                    h = self.harness(ring=self.SMALL_RING, sources=[SrcSpec(data, 1, 16, 16)], mode=PARTIAL)
                    h.lay_chain(slots, [1, 2, 3, 4], [0, 1, 2, 3])
                    tok, pos, prev, rkv = h.record(slots[k])
                    if field == "position":
                        pos += 100
                    elif field == "prev_hash":
                        prev ^= 1
                    else:
                        rkv ^= 1 << 63
                    h.poke(slots[k], [tok, pos, prev, rkv])
                    pre = 0
                    if ring_full:  # fill the 4-row ring with unrelated failures first
                        h.poke(100, [0, 0, 0, 0])
                        h.verify([(100, 1, 0)] * 5)
                        pre = 5
                    h.verify([(s, j, slots[j - 1] if j else -1) for j, s in enumerate(slots)])
                    bit = {"position": B_POS, "prev_hash": B_CHAIN, "real_kv": B_RKV}[field]
                    # A trampled stored position or prev_hash also breaks the successor's chain hash;
                    # real_kv_hash is not part of the chain.
                    n_new = 2 if (field != "real_kv" and k < 3) else 1
                    self.assertEqual(h.write_index, pre + n_new, (ring_full, field, k))
                    if not ring_full:
                        self.assertEqual(h.rows()[0][1], slots[k])
                        self.assertEqual(h.rows()[0][7], bit)
                    else:
                        self.assertEqual([r[1] for r in h.rows()], [100] * 4)  # fill-once: no wrap

    def test_verify_ring_full_keeps_counting(self):
        h = self.harness(ring=self.SMALL_RING)
        h.poke(100, [0, 0, 0, 0])
        h.verify([(100, k, 0) for k in range(1, 7)])  # 6 position failures into a 4-row ring
        self.assertEqual(h.write_index, 6)
        self.assertEqual([r[2:3] + [r[7]] for r in h.rows()], [[0, B_POS]] * 4)
        h.verify([(100, 9, 0)])
        self.assertEqual(h.write_index, 7)
        self.assertLen(h.rows(), 4)

    def test_verify_slot_zero_skipped_but_counted(self):
        h = self.harness()
        h.poke(0, [1, 2, 3, 4])  # garbage in the padding slot
        h.verify([(0, 77, 5)])
        self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (1, 1, 0))

    def test_verify_enable_zero(self):
        h = self.harness()
        h.poke(100, [0, 0, 0, 0])
        h.verify([(100, 5, 0)] * 3, enable=0)  # would fail if read
        self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (0, 1, 0))
        self.assertFalse(np.asarray(h.ctx.log.ring).any())
        h.verify([(100, 5, 0)] * 3, enable=2)  # only exactly 0 disables
        self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (3, 2, 3))

    def test_verify_empty_plan(self):
        h = self.harness()
        h.verify([], tail=(100, 5, 0, -1))  # entries past num_valid = 0 would fail if read
        self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (0, 1, 0))

    def test_verify_entries_past_num_valid_not_read(self):
        h = self.harness()
        h.lay_chain([30], [1], [0])
        h.verify([(30, 0, -1)] * 3, num_valid=1, tail=(100, 5, 0, -1))
        self.assertEqual((h.slot_counter(), h.write_index), (1, 0))

    def test_verify_num_valid_clamped(self):
        h = self.harness()
        h.poke(100, [0, 0, 0, 0])
        # num_valid above capacity reads exactly capacity entries; negative reads none.
        h.verify([], num_valid=self.VERIFY_CAPACITY + 1000, tail=(100, 1, 0, -1))
        self.assertEqual((h.slot_counter(), h.write_index), (self.VERIFY_CAPACITY, self.VERIFY_CAPACITY))
        h.verify([], num_valid=-3, tail=(100, 1, 0, -1))
        self.assertEqual(
            (h.slot_counter(), h.write_index, h.kernel_counter()), (self.VERIFY_CAPACITY, self.VERIFY_CAPACITY, 2)
        )

    def test_verify_fifty_simultaneous_violations(self):
        h = self.harness()
        for s in range(1, 51):
            h.poke(s, [s, s, 0, 0])
        # Entry k checks slot 50 - k with a wrong expected position: 50 rows, ascending entry order.
        h.verify([(50 - k, 1000 + k, 0) for k in range(50)])
        self.assertEqual(h.write_index, 50)
        self.assertEqual([r[1] for r in h.rows()], [50 - k for k in range(50)])

    def test_verify_kernel_kind_stamping(self):
        h = self.harness()
        h.poke(5, [33, 0, H, 0])
        tags = (
            constants.CanaryLaunchTag.SWEEP_V_FULL,
            constants.CanaryLaunchTag.TAIL_K_SWA,
            constants.CanaryLaunchTag.SWEEP_V_SWA,
        )
        for tag in tags:
            h.verify([(5, 1, -1)], tag=tag)
        self.assertEqual([r[0] for r in h.rows()], [5, 8, 11])
        for tag in tags:
            self.assertEqual((h.kernel_counter(tag), h.slot_counter(tag)), (1, 1))
        self.assertEqual(int(counters_int64(h.ctx.log.kernel_run_counters).sum()), 3)

    def test_verify_counters_linear_and_deterministic(self):
        h = self.harness()
        h.lay_chain([1, 2, 3], [5, 6, 7], [0, 1, 2])
        h.poke(9, [1, 1, 1, 1])
        ents = [(1, 0, -1), (2, 1, 1), (9, 0, -1), (3, 2, 2)]
        for rep in range(10):
            h.verify(ents)
            self.assertEqual((h.slot_counter(), h.kernel_counter(), h.write_index), (4 * (rep + 1), rep + 1, rep + 1))
        rows = h.rows()
        self.assertTrue(all(r == rows[0] for r in rows))

    # --- boundary values ---
    def test_verify_boundary_values(self):
        tokens = [0, 1, 0xFFFFFFFF, -1, 2**31, 2**31 - 1, 2**63 - 1, -(2**63)]
        positions = [0, 1, 127, 128, 129, 2**31 - 1, 2**32, 2**62]
        h = self.harness()
        slots = list(range(80, 80 + len(tokens)))
        h.lay_chain(slots, tokens, positions)
        h.verify([(s, positions[k], slots[k - 1] if k else -1, tokens[k]) for k, s in enumerate(slots)], check=True)
        self.assertEqual(h.rows(), [])
        # Each off by one in position -> one row each, with the exact stored values.
        h.verify([(s, s64(positions[k] + 1), slots[k - 1] if k else -1) for k, s in enumerate(slots)])
        self.assertEqual([r[2:4] for r in h.rows()], [[positions[k], tokens[k]] for k in range(len(slots))])

    def test_verify_boundary_hashes(self):
        # prev_hash values 0, splitmix64(0) (= 0), all ones, sign bit, rkv boundary values, with prev 0.
        h = self.harness()
        values = [0, (1 << 64) - 1, 1 << 63, (1 << 63) - 1, 1]
        for k, v in enumerate(values):
            h.poke(90 + k, [k, k, v, 0])
        h.verify([(90 + k, k, 0) for k in range(len(values))])
        self.assertEqual(h.rows(), [])
        for k, v in enumerate(values):
            h.poke(90 + k, [k, k, v, v])  # nonzero rkv with no sources fails (except v = 0)
        h.verify([(90 + k, k, 0) for k in range(len(values))])
        self.assertEqual([r[1] for r in h.rows()], [91, 92, 93, 94])
        self.assertEqual([oracle.u64(r[5]) for r in h.rows()], values[1:])

    # --- out-of-range decisions (canary-jax never reads outside a buffer) ---
    def test_verify_out_of_range_slots_read_as_zero_records(self):
        n = self.NUM_SLOTS
        h = self.harness()
        h.lay_chain([5], [1], [0])
        # slot >= N: all-zero record -> position 0 matches, chain: prev 0 != anchor hash -> bit 1.
        # negative slot: same; prev >= N: expected chain = mix3(0, 0, 0) = 0.
        h.verify([(n, 0, -1), (n + 1000, 3, 5), (-7, 0, -1), (5, 0, n + 5), (2**40, 0, 0)])
        r = h.rows()
        self.assertEqual(r[0], [int(TAG), n, 0, 0, -1, 0, H_S, B_CHAIN])
        self.assertEqual(r[1], [int(TAG), n + 1000, 0, 0, -1, 0, s64(oracle.mix3(H, 1, 0)), B_CHAIN | B_POS])
        self.assertEqual(r[2], [int(TAG), -7, 0, 0, -1, 0, H_S, B_CHAIN])
        self.assertEqual(r[3], [int(TAG), 5, 0, 1, -1, H_S, MIX3_000, B_CHAIN])
        self.assertLen(r, 4)  # 2**40 with prev 0 and position 0 reads clean zeros
        self.assertEqual(h.slot_counter(), 5)

    def test_verify_more_than_65535_entries(self):
        cap = self.LARGE_ENTRIES
        h = self.harness()
        h.lay_chain([1, 2], [10, 20], [0, 1])
        ents = [(1, 0, -1), (2, 1, 1)] * (cap // 2)
        bad = [*self.LARGE_BAD_ENTRIES, cap - 1]
        for k in bad:
            ents[k] = (ents[k][0], 500 + k, ents[k][2])
        h.verify(ents, cap=cap)
        self.assertEqual(h.slot_counter(), cap)
        self.assertEqual([r[1] for r in h.rows()], [ents[k][0] for k in bad])
        self.assertEqual(h.write_index, 3)

    # --- seeded fuzz ---
    def test_fuzz_random_verify(self):
        """Uniformly random canary contents and plans (mostly failures): exact rows and order."""
        for seed in self.FUZZ_SEEDS:
            rnd = random.Random(1000 + seed)
            n = self.NUM_SLOTS
            buf = np.frombuffer(rnd.randbytes(n * self.SLOT_STRIDE), np.uint8).reshape(n, -1).copy()
            for s in range(n):  # make some records plausible: small positions, some chain links
                if rnd.random() < 0.5:
                    oracle.write_record(buf, s, [rnd.randrange(50), rnd.randrange(8), oracle.s64(H), 0])
            h = self.harness(buf=buf, ring=self.SMALL_RING if seed % 2 else None)
            for _ in range(3):
                ents = [
                    (
                        rnd.randrange(-2, n + 2),
                        rnd.randrange(8),
                        rnd.choice([-1, 0, rnd.randrange(n)]),
                        rnd.choice([-1, rnd.randrange(50)]),
                    )
                    for _ in range(rnd.randint(0, self.VERIFY_CAPACITY))
                ]
                h.verify(ents, check=bool(rnd.getrandbits(1)))
