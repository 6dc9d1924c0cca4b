"""Verify suite, real-KV part: fingerprints over 0..4 sources, hash modes, page sizes, layouts.

``VerifyRealKvSuite`` is mixed into ``verify_suite.VerifySuite``; concrete classes take it from there. Each
case builds sources and compares the implementation's ring, counters and buffer with the oracle after every
launch (see ``suite_base``: an implementation is added by a ``test_*.py`` class setting ``VERIFY_IMPL`` /
``WRITE_IMPL`` / ``CONFIG`` / ``BACKEND``).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import canary_jax
from helpers import oracle
from helpers.suite_base import (
    ALL,
    B_RKV,
    BYTES00_0F_STORED,
    BYTES00_1F_ALL32_STORED,
    FF16_STORED,
    H_S,
    NONE,
    PARTIAL,
    PATTERN16,
    PATTERN16_STORED,
    TAG,
    TWO_SOURCES_STORED,
    H,
    SrcSpec,
    SuiteBase,
    s64,
)


class VerifyRealKvSuite(SuiteBase):
    """Verify with real-KV sources: every implementation reproduces the oracle's fingerprints byte for byte."""

    def test_verify_real_kv_flip_sets_only_bit4(self):
        data = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        data[30] = np.frombuffer(PATTERN16, np.uint8)
        h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=PARTIAL)
        h.lay_chain([30], [1], [0])
        self.assertEqual(h.record(30)[3], s64(PATTERN16_STORED))
        h.verify([(30, 0, -1)])
        self.assertEqual(h.rows(), [])
        # Flip byte 0 of the slot's KV (as SGLang's perturbation does): only bit 4 fires.
        data2 = data.copy()
        data2[30, 0] ^= 0xFF
        h.ctx = h.ctx.replace(
            real_kv_sources=(
                canary_jax.RealKvSource(tensor=jnp.asarray(data2), page_size=1, num_bytes_per_token=16, read_bytes=16),
            )
        )
        h.osrcs = (oracle.Source.of(data2, 1, 16, 16),)
        h.verify([(30, 0, -1)])
        exp_rkv = oracle.combine([oracle.fold_bytes(bytes([0xFE]) + PATTERN16[1:])])
        rows = h.rows()
        self.assertLen(rows, 1)
        self.assertEqual(rows[0][7], B_RKV)
        self.assertEqual(rows[0][:7], [int(TAG), 30, 0, 1, -1, H_S, H_S])
        self.assertNotEqual(exp_rkv, PATTERN16_STORED)

    def test_verify_none_mode_ignores_sources(self):
        data = np.full((self.NUM_SLOTS, 16), 0xAB, np.uint8)
        h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=NONE)
        h.lay_chain([30], [1], [0])
        self.assertEqual(h.record(30)[3], 0)
        h.verify([(30, 0, -1)])
        self.assertEqual(h.rows(), [])
        # A nonzero stored real_kv_hash still fails in NONE mode (expected 0).
        h.poke(30, [1, 0, H, 77])
        h.verify([(30, 0, -1)])
        self.assertEqual(h.rows(), [[int(TAG), 30, 0, 1, -1, H_S, H_S, B_RKV]])

    def test_verify_partial_vs_all(self):
        data = np.zeros((self.NUM_SLOTS, 32), np.uint8)
        data[3] = np.arange(32, dtype=np.uint8)
        for mode, read_bytes, want in (
            (PARTIAL, 32, BYTES00_0F_STORED),
            (ALL, 16, BYTES00_0F_STORED),
            (ALL, 32, BYTES00_1F_ALL32_STORED),
        ):
            h = self.harness(sources=[SrcSpec(data, 1, 32, read_bytes)], mode=mode)
            h.poke(3, [0, 0, H, want])
            h.verify([(3, 0, -1)])
            self.assertEqual(h.rows(), [], (mode, read_bytes))
            h.poke(3, [0, 0, H, 0])
            h.verify([(3, 0, -1)])
            self.assertEqual(h.rows()[0][7], B_RKV)

    def test_verify_pattern_literal_both_modes(self):
        data = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        data[8] = np.frombuffer(PATTERN16, np.uint8)
        for mode in (PARTIAL, ALL):
            h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=mode)
            h.poke(8, [1, 0, H, PATTERN16_STORED])
            h.verify([(8, 0, -1)])
            self.assertEqual(h.rows(), [])

    def test_verify_one_to_four_sources(self):
        rng = np.random.default_rng(1)
        datas = [rng.integers(0, 256, (self.NUM_SLOTS, 32), dtype=np.uint8) for _ in range(4)]
        for n in range(1, 5):
            srcs = [SrcSpec(d, 1, 32, 32) for d in datas[:n]]
            h = self.harness(sources=srcs, mode=ALL)
            h.lay_chain([10, 11], [1, 2], [0, 1])  # oracle fingerprints
            h.verify([(10, 0, -1), (11, 1, 10)])
            self.assertEqual(h.rows(), [], n)
            # Source order matters: reversed sources give another fingerprint.
            if n >= 2:
                rev = oracle.real_kv_hash(tuple(reversed(h.osrcs)), ALL, 10)
                self.assertNotEqual(rev, oracle.u64(h.record(10)[3]))

    def test_verify_two_sources_literal(self):
        d0 = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        d1 = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        d0[6] = np.arange(16)
        d1[6] = np.arange(16, 32)
        h = self.harness(sources=[SrcSpec(d0, 1, 16, 16), SrcSpec(d1, 1, 16, 16)], mode=ALL)
        h.poke(6, [0, 0, H, TWO_SOURCES_STORED])
        h.verify([(6, 0, -1)])
        self.assertEqual(h.rows(), [])

    def test_verify_page_sizes_and_holey_rows(self):
        for page_size, nbpt, extra in ((1, 16, 0), (4, 32, 16), (16, 16, 48), (64, 16, 0)):
            rows_ = -(-self.NUM_SLOTS // page_size)
            width = page_size * nbpt + extra  # trailing "hole" bytes are ignored
            data = np.zeros((rows_, width), np.uint8)
            slot = 37
            r, c = slot // page_size, (slot % page_size) * nbpt
            data[r, c : c + 16] = np.frombuffer(PATTERN16, np.uint8)
            data[:, page_size * nbpt :] = 0xEE  # holes
            h = self.harness(sources=[SrcSpec(data, page_size, nbpt, 16)], mode=ALL)
            h.poke(slot, [1, 0, H, PATTERN16_STORED])
            h.poke(slot + 1, [1, 0, H, 0])  # neighbour: all-zero bytes -> 0
            h.verify([(slot, 0, -1), (slot + 1, 0, -1)])
            self.assertEqual(h.rows(), [], (page_size, nbpt, extra))

    def test_verify_wide_element_dtype_source(self):
        # A bfloat16-like 2-D source (int16 elements): the slot's bytes are the little-endian element bytes.
        data = np.zeros((self.NUM_SLOTS, 8), np.int16)
        data[4] = np.frombuffer(PATTERN16, np.int16)
        h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=PARTIAL)
        h.poke(4, [1, 0, H, PATTERN16_STORED])
        h.verify([(4, 0, -1)])
        self.assertEqual(h.rows(), [])

    def test_verify_all_ones_and_zero_bytes(self):
        data = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        data[2] = 0xFF
        h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=ALL)
        h.poke(2, [0, 0, H, FF16_STORED])
        h.poke(3, [0, 0, H, 0])  # all-zero KV bytes fingerprint to 0
        h.verify([(2, 0, -1), (3, 0, -1)])
        self.assertEqual(h.rows(), [])

    def test_verify_slot_stride_wider_than_record(self):
        h = self.harness(stride=64)
        h.lay_chain([3, 4], [1, 2], [0, 1])
        buf = np.array(h.ctx.canary_buf)
        buf[:, 32:] = 0x5A  # bytes past the record are not part of it
        h.st.buf[:, 32:] = 0x5A
        h.ctx = h.ctx.replace(canary_buf=jnp.asarray(buf))
        h.verify([(3, 0, -1), (4, 1, 3)])
        self.assertEqual(h.rows(), [])

    # --- out-of-range rows ---
    def test_verify_out_of_range_slot_ignores_source_rows(self):
        # The source has rows for slots past the canary buffer; an out-of-range verify slot still reads as
        # an all-zero record with a zero fingerprint (no real-KV bit), it does not hash those rows.
        n = self.NUM_SLOTS
        data = np.full((2 * n, 16), 0x33, np.uint8)
        h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=ALL)
        self.assertNotEqual(oracle.real_kv_hash(h.osrcs, ALL, n + 5), 0)
        h.verify([(n + 5, 0, 0)])
        self.assertEqual(h.rows(), [])

    def test_verify_source_rows_outside_read_as_zero(self):
        data = np.full((8, 16), 0x11, np.uint8)  # only slots 0..7 have KV rows
        h = self.harness(sources=[SrcSpec(data, 1, 16, 16)], mode=ALL)
        h.poke(5, [0, 0, H, oracle.real_kv_hash(h.osrcs, ALL, 5)])
        h.poke(20, [0, 0, H, 0])  # row 20 outside the source -> zero bytes -> 0
        h.verify([(5, 0, -1), (20, 0, -1)])
        self.assertEqual(h.rows(), [])
        self.assertNotEqual(h.record(5)[3], 0)
