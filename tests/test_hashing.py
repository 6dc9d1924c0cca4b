"""Golden hash values of SPEC 2.6, checked on canary_jax.contract.hashing (jnp on uint32 pairs) and on the oracle.

Every expected value is a Python-int literal from SPEC 2.6 (recomputed there independently with Python
ints); none is copied from canary_jax output.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.contract import constants, hashing, pairs
from canary_jax.contract.sources import SourceDescriptor, real_kv_hash_reference
from helpers import oracle

M64 = (1 << 64) - 1
ANCHOR_HASH = 0xDE7FAE23A9A1B716

SPLITMIX64_VECTORS = (
    (0x0, 0x0),
    (0x1, 0x5692161D100B05E5),
    (0x2, 0xDBD238973A2B148A),
    (0xC0FFEE1234567890, 0xDE7FAE23A9A1B716),
    (0x9E3779B97F4A7C15, 0xE220A8397B1DCDAF),
    (0xDEADBEEFCAFEBABE, 0x7AD6664F09FFE52C),
    (0xFFFFFFFFFFFFFFFF, 0xB4D055FCF2CBBD7B),
    (0x8000000000000000, 0x25C26EA579CEA98A),
)
MIX3_VECTORS = (
    ((0, 0, 0), 0x0),
    ((1, 2, 3), 0xA55BDF37C08724B5),
    ((ANCHOR_HASH, 42, 0), 0x1B798564098041C9),
    ((ANCHOR_HASH, M64, 0), 0xE5A9A05404A720CF),  # token -1 as u64
)
CHAIN5_TOKENS = (101, 202, 303, 404, 505)
CHAIN5 = (0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634)
CHAIN5_NEXT = 0x3A650FCC4023CD13
RESUME = (0x5E35681BCFCE7CF6, 0x56D3E7D2989B8E36, 0xDD87E0146C9036A8, 0x1CBB47092FF8336E, 0x3579999BB482D1FC)
PATTERN16 = bytes([0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x81, 0x82, 0x84, 0x88, 0x90, 0xA0, 0xC0, 0xFF])


def u64_of(v: int) -> pairs.U64:
    v &= M64
    return pairs.U64(jnp.asarray(np.uint32(v & 0xFFFFFFFF)), jnp.asarray(np.uint32(v >> 32)))


def to_int(u: pairs.U64) -> int:
    return int(np.asarray(u.lo)) | (int(np.asarray(u.hi)) << 32)


def vec(values) -> pairs.U64:
    arr = np.array([v & M64 for v in values], dtype=np.uint64)
    return pairs.U64(jnp.asarray((arr & 0xFFFFFFFF).astype(np.uint32)), jnp.asarray((arr >> 32).astype(np.uint32)))


def to_ints(u: pairs.U64) -> list[int]:
    lo = np.asarray(u.lo).astype(np.uint64)
    hi = np.asarray(u.hi).astype(np.uint64)
    return [int(x) for x in (lo | (hi << np.uint64(32)))]


def words_of(data: bytes) -> jax.Array:
    """Bytes -> uint32 little-endian words, shaped [1, n/4]."""
    return jnp.asarray(np.frombuffer(data, "<u4").astype(np.uint32)[None, :])


def stored_rkv(sources: list[tuple[bytes, int]], mode) -> int:
    """Combined fingerprint via canary_jax.contract.sources.real_kv_hash_reference: (bytes of slot 0, read_bytes)."""
    tensors, descs = [], []
    for data, read_bytes in sources:
        tensors.append(jnp.asarray(np.frombuffer(data, np.uint8)[None, :]))
        eff = 16 if mode == constants.RealKvHashMode.PARTIAL else read_bytes
        descs.append(SourceDescriptor(1, len(data), read_bytes, eff, len(data), 1))
    return to_ints(real_kv_hash_reference(tensors, descs, jnp.zeros((1,), jnp.int32)))[0]


class Splitmix64Test(absltest.TestCase):
    def test_vectors_jnp(self):
        got = to_ints(hashing.splitmix64(vec([x for x, _ in SPLITMIX64_VECTORS])))
        self.assertEqual([hex(g) for g in got], [hex(w) for w in (w for _, w in SPLITMIX64_VECTORS)])

    def test_vectors_scalar_jnp(self):
        for x, want in SPLITMIX64_VECTORS:
            self.assertEqual(to_int(hashing.splitmix64(u64_of(x))), want, hex(x))

    def test_vectors_oracle_and_python(self):
        for x, want in SPLITMIX64_VECTORS:
            self.assertEqual(oracle.splitmix64(x), want, hex(x))
            self.assertEqual(hashing.splitmix64_python(x), want, hex(x))

    def test_anchor_intermediates(self):
        # SPEC 2.6: after step 1 0x8C57997B738D9418, after step 2 0xDE7FAE22155EEB52.
        x = 0xC0FFEE1234567890
        s1 = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
        s2 = ((s1 ^ (s1 >> 27)) * 0x94D049BB133111EB) & M64
        self.assertEqual((s1, s2, s2 ^ (s2 >> 31)), (0x8C57997B738D9418, 0xDE7FAE22155EEB52, ANCHOR_HASH))
        self.assertEqual(hashing.ANCHOR_HASH, ANCHOR_HASH)
        self.assertEqual(oracle.ANCHOR_HASH, ANCHOR_HASH)
        self.assertEqual(ANCHOR_HASH - (1 << 64), -2414019407054260458)
        self.assertEqual(to_ints(pairs.const(hashing.ANCHOR_HASH, (3,))), [ANCHOR_HASH] * 3)

    def test_random_against_oracle(self):
        rnd = random.Random(7)
        xs = [rnd.getrandbits(64) for _ in range(512)] + [1 << k for k in range(64)] + [M64 >> k for k in range(64)]
        self.assertEqual(to_ints(hashing.splitmix64(vec(xs))), [oracle.splitmix64(x) for x in xs])

    def test_mulhi_u32_exhaustive_corners(self):
        vals = [0, 1, 2, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF, 0x12345678, 0x9ABCDEF0]
        a = np.array([x for x in vals for _ in vals], np.uint32)
        b = np.array([y for _ in vals for y in vals], np.uint32)
        got = np.asarray(pairs.mulhi_u32(jnp.asarray(a), jnp.asarray(b)))
        want = [(int(x) * int(y)) >> 32 for x, y in zip(a, b)]
        self.assertEqual(got.tolist(), want)

    def test_inside_jit_and_shapes(self):
        xs = [0x9E3779B97F4A7C15, 0, M64, 7]
        f = jax.jit(lambda lo, hi: hashing.splitmix64(pairs.U64(lo, hi)))
        u = vec(xs)
        out = f(u.lo.reshape(2, 2), u.hi.reshape(2, 2))
        self.assertEqual(out.lo.shape, (2, 2))
        self.assertEqual(to_ints(pairs.U64(out.lo.reshape(-1), out.hi.reshape(-1))), [oracle.splitmix64(x) for x in xs])


class Mix3Test(absltest.TestCase):
    def test_vectors(self):
        for (a, b, c), want in MIX3_VECTORS:
            self.assertEqual(to_int(hashing.splitmix64_mix3(u64_of(a), u64_of(b), u64_of(c))), want)
            self.assertEqual(oracle.mix3(a, b, c), want)

    def test_order_matters(self):
        self.assertNotEqual(oracle.mix3(1, 2, 3), oracle.mix3(3, 2, 1))
        self.assertNotEqual(to_int(hashing.splitmix64_mix3(u64_of(3), u64_of(2), u64_of(1))), 0xA55BDF37C08724B5)

    def test_chain_of_five(self):
        running = ANCHOR_HASH
        got = []
        for k, tok in enumerate(CHAIN5_TOKENS):
            got.append(running)
            running = to_int(hashing.splitmix64_mix3(u64_of(running), u64_of(tok), u64_of(k)))
        self.assertEqual(got, list(CHAIN5))
        self.assertEqual(running, CHAIN5_NEXT)
        self.assertEqual(oracle.chain_prev_hashes(CHAIN5_TOKENS, range(5)), list(CHAIN5) + [CHAIN5_NEXT])

    def test_resume_chain(self):
        # Seed slot (token 7, position 10, prev H); tokens 101..505 at positions 11..15.
        running = to_int(hashing.splitmix64_mix3(u64_of(ANCHOR_HASH), u64_of(7), u64_of(10)))
        got = []
        for k, tok in enumerate(CHAIN5_TOKENS):
            got.append(running)
            running = to_int(hashing.splitmix64_mix3(u64_of(running), u64_of(tok), u64_of(11 + k)))
        self.assertEqual(got, list(RESUME))
        self.assertEqual(
            oracle.chain_prev_hashes(CHAIN5_TOKENS, range(11, 16), oracle.mix3(ANCHOR_HASH, 7, 10))[:5], list(RESUME)
        )

    def test_random_against_oracle(self):
        rnd = random.Random(8)
        triples = [(rnd.getrandbits(64), rnd.getrandbits(64), rnd.getrandbits(64)) for _ in range(256)]
        got = to_ints(
            hashing.splitmix64_mix3(
                vec([t[0] for t in triples]), vec([t[1] for t in triples]), vec([t[2] for t in triples])
            )
        )
        self.assertEqual(got, [oracle.mix3(*t) for t in triples])


class RealKvFoldTest(absltest.TestCase):
    def test_fold_bytes_00_0f(self):
        data = bytes(range(16))
        self.assertEqual(oracle.splitmix64(0x0706050403020100), 0x6E068E3B28B76F49)  # after word 0
        acc1 = hashing.fold_words(words_of(data[:8]), 1)
        self.assertEqual(to_ints(acc1), [0x6E068E3B28B76F49])
        self.assertEqual(to_ints(hashing.fold_words(words_of(data), 2)), [0x447F1B95028CE131])
        self.assertEqual(oracle.fold_bytes(data), 0x447F1B95028CE131)
        self.assertEqual(oracle.combine([0x447F1B95028CE131]), 0xD6D75024DFD6C30C)
        self.assertEqual(
            to_ints(hashing.combine_sources([hashing.fold_words(words_of(data), 2)])), [0xD6D75024DFD6C30C]
        )

    def test_source_bytes_00_1f(self):
        data = bytes(range(32))
        self.assertEqual(to_ints(hashing.fold_words(words_of(data), 4)), [0xFAB780417B7BE8AD])
        self.assertEqual(oracle.fold_bytes(data), 0xFAB780417B7BE8AD)
        self.assertEqual(stored_rkv([(data, 32)], constants.RealKvHashMode.ALL), 0xB44181DFE9420039)
        self.assertEqual(stored_rkv([(data, 32)], constants.RealKvHashMode.PARTIAL), 0xD6D75024DFD6C30C)
        self.assertEqual(stored_rkv([(data, 16)], constants.RealKvHashMode.ALL), 0xD6D75024DFD6C30C)
        self.assertEqual(
            oracle.real_kv_hash([oracle.Source(np.frombuffer(data, np.uint8)[None], 1, 32, 32)], oracle.ALL, 0),
            0xB44181DFE9420039,
        )

    def test_pattern_literal(self):
        self.assertEqual(oracle.fold_bytes(PATTERN16), 0xF036E30B6961C78D)
        self.assertEqual(to_ints(hashing.fold_words(words_of(PATTERN16), 2)), [0xF036E30B6961C78D])
        for mode in (constants.RealKvHashMode.PARTIAL, constants.RealKvHashMode.ALL):
            self.assertEqual(stored_rkv([(PATTERN16, 16)], mode), 0x6041580849E6407D)

    def test_two_sources(self):
        src0, src1 = bytes(range(16)), bytes(range(16, 32))
        self.assertEqual(oracle.fold_bytes(src1), 0xFDF1EB0C91A6F417)
        self.assertEqual(to_ints(hashing.fold_words(words_of(src1), 2)), [0xFDF1EB0C91A6F417])
        self.assertEqual(stored_rkv([(src0, 16), (src1, 16)], constants.RealKvHashMode.ALL), 0xB6209A488C3F52B0)
        self.assertEqual(oracle.combine([oracle.fold_bytes(src0), oracle.fold_bytes(src1)]), 0xB6209A488C3F52B0)
        # tuple order matters
        self.assertNotEqual(stored_rkv([(src1, 16), (src0, 16)], constants.RealKvHashMode.ALL), 0xB6209A488C3F52B0)

    def test_all_ff_and_zeros(self):
        ff = b"\xff" * 16
        self.assertEqual(oracle.fold_bytes(ff), 0xD6BDF7544574C9CB)
        self.assertEqual(to_ints(hashing.fold_words(words_of(ff), 2)), [0xD6BDF7544574C9CB])
        self.assertEqual(stored_rkv([(ff, 16)], constants.RealKvHashMode.ALL), 0xCA5420B0710A0DAC)
        self.assertEqual(stored_rkv([(bytes(16), 16)], constants.RealKvHashMode.ALL), 0)
        self.assertEqual(oracle.real_kv_hash([oracle.Source(np.zeros((1, 16), np.uint8), 1, 16, 16)], oracle.ALL, 0), 0)

    def test_none_mode_and_no_sources(self):
        z = real_kv_hash_reference([], (), jnp.arange(4, dtype=jnp.int32))
        self.assertEqual(to_ints(z), [0] * 4)
        src = oracle.Source(np.full((1, 16), 0xAB, np.uint8), 1, 16, 16)
        self.assertEqual(oracle.real_kv_hash([src], oracle.NONE, 0), 0)
        self.assertEqual(oracle.real_kv_hash([], oracle.ALL, 0), 0)
        with self.assertRaisesRegex(ValueError, "at least one source"):
            hashing.combine_sources([])

    def test_long_fold_uses_loop_path(self):
        # read_bytes 256 -> 32 words: the fori_loop path of fold_words (> 8 words).
        rnd = random.Random(3)
        data = rnd.randbytes(256)
        self.assertEqual(to_ints(hashing.fold_words(words_of(data), 32)), [oracle.fold_bytes(data)])
        data2 = rnd.randbytes(64)
        self.assertEqual(to_ints(hashing.fold_words(words_of(data2), 8)), [oracle.fold_bytes(data2)])

    def test_legacy_chain_scheme_differs(self):
        # SPEC 2.6: legacy chain_100_steps.json = splitmix64(prev ^ token ^ position ^ rkv) with tokens
        # (i * 0x9E3779B97F4A7C15) & 0x7FFFFFFF; its steps 0xF0F807B576DF665D, 0x0435148CB5FCE8C6 must NOT be
        # what the newest mix3 chain produces.
        legacy, newest = [ANCHOR_HASH], [ANCHOR_HASH]
        for i in range(2):
            tok = (i * 0x9E3779B97F4A7C15) & 0x7FFFFFFF
            legacy.append(oracle.splitmix64(legacy[-1] ^ tok ^ i ^ 0))
            newest.append(to_int(hashing.splitmix64_mix3(u64_of(newest[-1]), u64_of(tok), u64_of(i))))
        self.assertEqual(legacy[1:], [0xF0F807B576DF665D, 0x0435148CB5FCE8C6])
        self.assertNotIn(newest[1], legacy)
        self.assertNotIn(newest[2], legacy)
        self.assertEqual(newest[1], oracle.mix3(ANCHOR_HASH, 0, 0))


if __name__ == "__main__":
    absltest.main()
