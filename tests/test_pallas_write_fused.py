"""The one-launch write (``pallas_kernels.write_fused``) against the reference and the multi-launch write.

A small launch (``PallasConfig.write_fused_max_tokens``) runs as one ``pallas_call`` with nothing around it;
these tests pin that structure and the bytes: random launches with slots written by several entries (the
claim loop's rounds), skipped and out-of-range slots, both input and chain-position violations, with and
without real-KV sources, each compared with :func:`canary_jax.ops.reference.write_reference` and with the
multi-launch path (the default). The fused path also runs the whole shared write suite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import hashing
from canary_jax.ops import backends, reference
from helpers import write_suite
from pallas_kernels.config import PallasConfig
from pallas_kernels.write import write_pallas
from tests.helpers.jaxpr_walk import traced_eqns

FUSED = PallasConfig(write_fused_max_tokens=512, write_fused_max_hashed=256)
MULTI = PallasConfig(write_fused_max_tokens=0, write_fused_max_hashed=0)  # the multi-launch write
N_SLOTS = 64
# Every launch below has this request capacity and token count (counts padded with the plan's capacity, token
# arrays with a tail past the offsets that no request claims): one compiled program per config and assert
# setting, shared by every case (CI time).
REQ_CAPACITY = 12
NUM_TOKENS = 18


def _pairs(values) -> jax.Array:
    v = np.asarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2)
    return jnp.asarray(v)


def _primitives(fn, *args) -> list[str]:
    """Primitive names of ``fn``'s jaxpr, nested jits inlined (a ``pallas_call``'s kernel body is not entered)."""

    return [e.primitive.name for e in traced_eqns(fn, *args)]


def _launch(rng, *, counts, dup_slot, sources=()):
    """A write launch of ``sum(counts)`` entries over ``N_SLOTS`` slots; ``dup_slot`` is written by one entry of
    every request (so by several requests, and twice by request 0). Token arrays have ``NUM_TOKENS`` rows: the
    tail past the last request holds random entries no request claims."""
    t = int(sum(counts))
    assert t <= NUM_TOKENS and len(counts) <= REQ_CAPACITY, counts
    slots = rng.integers(1, N_SLOTS, NUM_TOKENS)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    for s, c in zip(starts, counts):
        if c:
            slots[s + c - 1] = dup_slot
    if counts[0] >= 2:
        slots[starts[0]] = dup_slot
    slots[rng.integers(0, t)] = -1  # a skipped entry
    slots[rng.integers(0, t)] = N_SLOTS + 3  # an out-of-range slot: not stored, not counted
    seeds = [-1] + [int(x) for x in rng.integers(1, N_SLOTS, len(counts) - 1)]
    plan = canary_jax.WritePlan.from_requests(counts=list(counts), seed_slots=seeds, write_req_capacity=REQ_CAPACITY)
    buf = jnp.asarray(rng.integers(0, 256, (N_SLOTS, 32), dtype=np.uint8))
    log = canary_jax.ViolationLog.allocate(ring_capacity=16)  # the chain-position assert is on (SGLang's default)
    mode = canary_jax.RealKvHashMode.ALL if sources else canary_jax.RealKvHashMode.NONE
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=buf,
        kernel_kind=canary_jax.CanaryLaunchTag.HEAD_K_FULL,
        log=log,
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
    )
    ids = rng.integers(0, 1 << 40, NUM_TOKENS)
    pos = rng.integers(0, 6, NUM_TOKENS)  # mostly not seed position + 1: chain-position rows (more than the ring holds)
    exp_ids = np.where(rng.random(NUM_TOKENS) < 0.2, ids + 1, ids)  # some input-assert rows
    return ctx, plan, _pairs(ids), _pairs(pos), _pairs(slots), _pairs(exp_ids), _pairs(pos)


class FusedWriteTest(absltest.TestCase):
    def assert_same(self, got, want):
        for name in ("canary_buf",):
            np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))
        for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
            np.testing.assert_array_equal(np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)))

    def test_small_launch_is_one_pallas_call_and_nothing_else(self):
        rng = np.random.default_rng(3)
        ctx, plan, ids, pos, loc, *_ = _launch(rng, counts=[1] * 8, dup_slot=5)

        def run(config):
            return lambda c: write_pallas(c, plan, ids, pos, loc, config=config)

        fused = _primitives(run(FUSED), ctx)
        self.assertEqual(fused.count("pallas_call"), 1, fused)
        # No device work besides the kernel: only views (reshapes and bitcasts) of its operands and outputs.
        self.assertLessEqual(set(fused), {"pallas_call", "reshape", "bitcast_convert_type"}, fused)
        multi = _primitives(run(MULTI), ctx)
        self.assertGreaterEqual(multi.count("pallas_call"), 3, multi)

    def test_random_launches_match_reference_and_multi_launch(self):
        rng = np.random.default_rng(11)
        # Each shape with one input-assert setting (both settings appear); one capacity and token count for all.
        cases = (([1] * 12, False), ([3, 1, 4, 1, 5], True), ([2, 0, 7, 1], False), ([6, 6, 6], True))
        for counts, assert_inputs in cases:
            dup = int(rng.integers(1, N_SLOTS))
            ctx, plan, ids, pos, loc, exp_ids, exp_pos = _launch(rng, counts=counts, dup_slot=dup)
            kw = dict(enable_write_input_assert=assert_inputs)
            if assert_inputs:
                kw.update(expected_input_tokens=exp_ids, expected_input_positions=exp_pos)
            want = reference.write_reference(ctx, plan, ids, pos, loc, **kw)
            with self.subTest(counts=counts, assert_inputs=assert_inputs):
                self.assertGreater(int(want.log.write_index[0]), 0)  # the launch has violation rows
                for cfg in (FUSED, MULTI):
                    self.assert_same(write_pallas(ctx, plan, ids, pos, loc, config=cfg, **kw), want)

    def test_many_writers_of_one_slot_last_wins(self):
        # Seven entries in three requests write slot 9; the last (request 2's only entry) owns it: its record is
        # (token, position, prev_hash = ANCHOR_HASH, 0) with the seed -1. The shapes are _launch's (its programs);
        # the token tail past the three requests would write slots 1..11 if it were read.
        plan = canary_jax.WritePlan.from_requests(
            counts=[4, 2, 1], seed_slots=[-1, -1, -1], write_req_capacity=REQ_CAPACITY
        )
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=jnp.zeros((N_SLOTS, 32), jnp.uint8),
            kernel_kind=canary_jax.CanaryLaunchTag.HEAD_K_FULL,
            log=canary_jax.ViolationLog.allocate(ring_capacity=16),
        )
        tail = NUM_TOKENS - 7
        ids = _pairs([100, 101, 102, 103, 200, 201, 300] + [7777] * tail)
        pos = _pairs([0, 1, 2, 3, 0, 1, 0] + [5] * tail)
        loc = _pairs([9] * 7 + list(range(1, tail + 1)))
        for cfg in (FUSED, MULTI):
            out = write_pallas(ctx, plan, ids, pos, loc, config=cfg)
            rec = np.asarray(out.canary_buf)[9].view("<i8")
            anchor = hashing.ANCHOR_HASH - (1 << 64) if hashing.ANCHOR_HASH >= 1 << 63 else hashing.ANCHOR_HASH
            self.assertEqual(rec.tolist(), [300, 0, anchor, 0])
            counters = np.ascontiguousarray(np.asarray(out.log.slot_run_counters)).reshape(-1).view("<i8")
            self.assertEqual(int(counters[int(ctx.kernel_kind)]), 7)  # every written entry counts
            self.assertEqual(np.count_nonzero(np.asarray(out.canary_buf)[np.arange(N_SLOTS) != 9]), 0)

    def test_with_real_kv_sources(self):
        rng = np.random.default_rng(5)
        data = jnp.asarray(rng.integers(0, 256, (N_SLOTS, 48), dtype=np.uint8))
        src = canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=48, read_bytes=32)
        ctx, plan, ids, pos, loc, *_ = _launch(rng, counts=[2, 1, 3, 1], dup_slot=7, sources=(src,))
        want = reference.write_reference(ctx, plan, ids, pos, loc)
        for cfg in (FUSED, MULTI):
            self.assert_same(write_pallas(ctx, plan, ids, pos, loc, config=cfg), want)

    def test_config_bounds(self):
        for kw in ({"write_fused_max_tokens": -1}, {"write_fused_max_hashed": True}, {"write_fused_num_warps": 12}):
            with self.assertRaisesRegex(ValueError, next(iter(kw))):
                PallasConfig(**kw)


class PallasFusedWriteSuiteTest(write_suite.WriteSuite, absltest.TestCase):
    """The shared write suite on the fused write (the default multi-launch one runs it in ``test_pallas_interpret``)."""

    BACKEND = "pallas"
    VERIFY_IMPL = staticmethod(backends.implementation("verify", "pallas"))
    WRITE_IMPL = staticmethod(backends.implementation("write", "pallas"))
    CONFIG = FUSED


if __name__ == "__main__":
    absltest.main()
