"""Unit checks of the Pallas backend's helpers: in-kernel hashing, config validation, early refusals."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import hashing, ints, pairs
from canary_jax.ops import reference
from pallas_kernels.config import PallasConfig, default_interpret
from pallas_kernels.hashing import PairHash
from pallas_kernels.verify import verify_pallas
from pallas_kernels.write import write_pallas

M = (1 << 64) - 1


def _u64(vals) -> pairs.U64:
    arr = np.asarray([v & M for v in vals], dtype=np.uint64)
    return pairs.U64(jnp.asarray((arr & 0xFFFFFFFF).astype(np.uint32)), jnp.asarray((arr >> 32).astype(np.uint32)))


def _ints(u: pairs.U64) -> list[int]:
    lo, hi = np.asarray(u.lo).astype(np.uint64), np.asarray(u.hi).astype(np.uint64)
    return [int(x) for x in (lo | (hi << np.uint64(32)))]


class PairHashTest(absltest.TestCase):
    def test_portable_splitmix64_matches_python(self):
        rng = np.random.default_rng(0)
        vals = [0, 1, 2, 0x9E3779B97F4A7C15, M, 1 << 63] + [int(x) for x in rng.integers(0, 2**63, 200)]
        vals += [v | (1 << 63) for v in vals[6:50]]
        got = _ints(jax.jit(PairHash("portable").splitmix64)(_u64(vals)))
        self.assertEqual(got, [hashing.splitmix64_python(v) for v in vals])

    def test_spec_pins(self):
        h = PairHash("portable")
        self.assertEqual(_ints(h.splitmix64_mix3(_u64([1]), _u64([2]), _u64([3]))), [0xA55BDF37C08724B5])
        self.assertEqual(_ints(h.splitmix64_mix3(_u64([0]), _u64([0]), _u64([0]))), [0])
        self.assertEqual(_ints(h.splitmix64(_u64([0xC0FFEE1234567890]))), [0xDE7FAE23A9A1B716])
        anchor = pairs.const(hashing.ANCHOR_HASH, (3,))
        self.assertEqual(_ints(anchor), [0xDE7FAE23A9A1B716] * 3)

    def test_unknown_multiplier(self):
        with self.assertRaisesRegex(ValueError, r"multiplier must be one of"):
            PairHash("fast")


class ConfigTest(absltest.TestCase):
    def test_validation(self):
        with self.assertRaisesRegex(ValueError, r"verify_block must be a power of 2, got 100"):
            PallasConfig(verify_block=100)
        with self.assertRaisesRegex(ValueError, r"write_prefetch must be a power of 2, got 0"):
            PallasConfig(write_prefetch=0)
        with self.assertRaisesRegex(ValueError, r"write_prefetch must be a power of 2, got 6"):
            PallasConfig(write_prefetch=6)
        with self.assertRaisesRegex(ValueError, r"source_tile_words must be at least 2, got 1"):
            PallasConfig(source_tile_words=1)
        with self.assertRaisesRegex(ValueError, r"write_source_tile_words must be at least 2, got 1"):
            PallasConfig(write_source_tile_words=1)
        with self.assertRaisesRegex(ValueError, r"write_long_chunk must be a power of 2, got 12"):
            PallasConfig(write_long_chunk=12)
        with self.assertRaisesRegex(
            ValueError, r"write_long_chunk must be at most 256 \(unrolled per chunk\), got 512"
        ):
            PallasConfig(write_long_chunk=512)
        with self.assertRaisesRegex(ValueError, r"write_long_threshold must be a positive int, got 0"):
            PallasConfig(write_long_threshold=0)
        with self.assertRaisesRegex(ValueError, r"verify_source_block must be a power of 2, got True"):
            PallasConfig(verify_source_block=True)
        with self.assertRaisesRegex(ValueError, r"source_unroll must be a non-negative int, got True"):
            PallasConfig(source_unroll=True)
        with self.assertRaisesRegex(ValueError, r"source_unroll must be a non-negative int, got -1"):
            PallasConfig(source_unroll=-1)
        with self.assertRaisesRegex(ValueError, r"gather must be one of"):
            PallasConfig(gather="dword")

    def test_interpret_adjustments(self):
        cfg = PallasConfig()
        self.assertEqual(cfg.for_interpret(True).write_prefetch, 1)
        self.assertEqual(PallasConfig(write_prefetch=4).for_interpret(True).write_prefetch, 4)
        self.assertIs(cfg.for_interpret(False), cfg)
        self.assertEqual(cfg.resolved_multiplier(True), "portable")
        self.assertEqual(cfg.resolved_multiplier(False), "asm")
        with self.assertRaisesRegex(NotImplementedError, r"asm multiplier needs the compiled GPU backend"):
            PallasConfig(multiplier="asm").resolved_multiplier(True)

    def test_default_interpret_follows_platform(self):
        self.assertEqual(default_interpret(), jax.default_backend() not in ("gpu", "cuda", "rocm"))


def _pairs(a) -> jax.Array:
    return jnp.asarray(ints.int64_to_pairs_np(np.asarray(a, np.int64)))


class SourceGatherVariantsTest(absltest.TestCase):
    """Every real-KV load strategy gives the reference's bytes: write (entry programs) and verify, over
    sources with page sizes 1 and 4, rows wider than needed, and read lengths that are not a multiple of the
    tile (48 bytes = 12 words against tiles of 8 or 16 words)."""

    VARIANTS = (
        dict(source_gather="tile", source_tile_words=16, source_unroll=2),
        dict(source_gather="pair", source_unroll=2),
        dict(source_gather="tile", source_tile_words=8, source_unroll=0, write_prefetch=4),
        dict(source_gather="word", source_unroll=3),
        dict(source_gather="quad", source_unroll=0),
        dict(source_gather="tile_contiguous", source_tile_words=32, source_unroll=1),
    )

    def test_variants_match_reference(self):
        rng = np.random.default_rng(7)
        n = 96
        # page_size, bytes/token, read_bytes, row pad (a plain 16-byte source: the shared suites' default)
        geoms = ((1, 64, 48, 16), (4, 32, 32, 16))
        srcs = []
        for page, nbpt, read, pad in geoms:
            rows = -(-n // page)
            data = jnp.asarray(rng.integers(0, 256, (rows, page * nbpt + pad), dtype=np.uint8))
            srcs.append(canary_jax.RealKvSource(tensor=data, page_size=page, num_bytes_per_token=nbpt, read_bytes=read))
        slots = rng.permutation(np.arange(1, n))[:40]
        slots[7] = slots[3]  # a duplicate slot: the later entry wins
        counts = [10, 1, 1, 28]
        seeds = [-1, int(slots[0]), -1, int(slots[12])]
        plan = canary_jax.WritePlan.from_requests(counts=counts, seed_slots=seeds)
        ids, pos = _pairs(rng.integers(0, 1 << 40, 40)), _pairs(np.arange(40) % 9)
        loc = _pairs(np.concatenate([slots[:38], [-1, n + 5]]))  # a skipped and an out-of-range entry
        prev = np.concatenate([[-1], slots[:-1]])
        vplan = canary_jax.VerifyPlan.from_entries(slots=slots, positions=np.arange(40) % 9, prev_slots=prev)
        for mode in (canary_jax.RealKvHashMode.ALL, canary_jax.RealKvHashMode.PARTIAL):
            ctx = canary_jax.VerifyOrWriteContext(
                canary_buf=jnp.zeros((n, 32), jnp.uint8),
                kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
                log=canary_jax.ViolationLog.allocate(ring_capacity=64),
                real_kv_sources=tuple(srcs),
                real_kv_hash_mode=mode,
            )
            want = reference.write_reference(ctx, plan, ids, pos, loc)
            # Corrupt one source byte of a written slot so that verify has a real-KV row to report.
            bad = list(srcs)
            bad[0] = dataclasses.replace(srcs[0], tensor=srcs[0].tensor.at[int(slots[5]), 0].add(1))
            vwant = reference.verify_reference(want.replace(real_kv_sources=tuple(bad)), vplan)
            self.assertGreater(int(vwant.log.write_index[0]), 0)
            for kw in self.VARIANTS if mode == canary_jax.RealKvHashMode.ALL else self.VARIANTS[:1]:
                cfg = PallasConfig(write_fused_max_hashed=0, **kw)  # the entry programs (the fused suite: the rest)
                with self.subTest(mode=mode.name, **kw):
                    got = write_pallas(ctx, plan, ids, pos, loc, config=cfg)
                    np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf))
                    vgot = verify_pallas(got.replace(real_kv_sources=tuple(bad)), vplan, config=cfg)
                    np.testing.assert_array_equal(np.asarray(vgot.log.ring), np.asarray(vwant.log.ring))
                    np.testing.assert_array_equal(np.asarray(vgot.log.write_index), np.asarray(vwant.log.write_index))


class EarlyRefusalTest(absltest.TestCase):
    def _ctx(self, n_sources: int):
        data = jnp.zeros((16, 16), jnp.uint8)
        srcs = tuple(
            canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=16, read_bytes=16)
            for _ in range(n_sources)
        )
        return canary_jax.VerifyOrWriteContext(
            canary_buf=jnp.zeros((16, 32), jnp.uint8),
            kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
            log=canary_jax.ViolationLog.allocate(ring_capacity=4),
            real_kv_sources=srcs,
            real_kv_hash_mode=canary_jax.RealKvHashMode.ALL,
        )

    def test_more_than_four_sources_before_tracing(self):
        ctx = self._ctx(5)
        plan = canary_jax.VerifyPlan.from_entries(slots=[1], positions=[0], prev_slots=[-1])
        msg = r"^kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5$"
        with self.assertRaisesRegex(ValueError, msg):
            verify_pallas(ctx, plan)
        wplan = canary_jax.WritePlan.from_requests(counts=[1], seed_slots=[-1])
        z = jnp.zeros((1, 2), jnp.uint32)
        with self.assertRaisesRegex(ValueError, msg):
            write_pallas(ctx, wplan, z, z, z)

    def test_expected_inputs_presence(self):
        ctx = self._ctx(0)
        wplan = canary_jax.WritePlan.from_requests(counts=[1], seed_slots=[-1])
        z = jnp.zeros((1, 2), jnp.uint32)
        with self.assertRaisesRegex(ValueError, r"required when enable_write_input_assert=True"):
            write_pallas(ctx, wplan, z, z, z, enable_write_input_assert=True, expected_input_tokens=z)
        with self.assertRaisesRegex(ValueError, r"must be None when enable_write_input_assert=False"):
            write_pallas(ctx, wplan, z, z, z, expected_input_positions=z)


if __name__ == "__main__":
    absltest.main()
