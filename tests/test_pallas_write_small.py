"""The register-resident write of small launches (``pallas_kernels.write_small``), interpreted, against the jnp
references and against the general one-program body (``PallasConfig(write_small_max_tokens=0)``).

Random launches, each the second of two on one log (so rows land past a non-zero write index, and often past the
ring's end), with many writers of a few slots (inside and across requests), multi-token requests (the serial
chains) beside one-token ones, seeds of -1 / in the buffer / past it, skipped and out-of-range slots, requests past
``num_valid_reqs`` and offsets past the token count, the chain-position assert on and off, the input assert on and
off, a real-KV source; through the one-program write and through the phase kernel (narrow int32 tokens there),
with ``jax_enable_x64`` off and on. Shapes are fixed (one compiled program per flag set: CI time).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.ops import reference
from pallas_kernels import phase
from pallas_kernels.config import PallasConfig
from pallas_kernels.write import write_pallas
from tests.helpers.jaxpr_walk import traced_eqns

N_SLOTS = 40
REQ_CAPACITY = 12
NUM_TOKENS = 24
TAG = canary_jax.CanaryLaunchTag.TAIL_K_FULL
SMALL = PallasConfig(write_small_max_tokens=128)  # every launch of these tests takes the small body
GENERAL = PallasConfig(write_small_max_tokens=0)  # the general one-program body
PHASE = PallasConfig(verify_block=16, verify_source_block=16, verify_max_programs=2)


def _pairs(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2))


def _source(rng):
    data = jnp.asarray(rng.integers(0, 256, (N_SLOTS, 48), dtype=np.uint8))
    return canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=48, read_bytes=32)


def _context(rng, *, sources=(), chain_assert=True, ring=8):
    buf = rng.integers(0, 256, (N_SLOTS, 32), dtype=np.uint8)
    buf[:, 8:16] = np.asarray(rng.integers(0, 4, (N_SLOTS, 1)), np.int64).view(np.uint8)  # small stored positions
    return canary_jax.VerifyOrWriteContext(
        canary_buf=jnp.asarray(buf),
        kernel_kind=TAG,
        log=canary_jax.ViolationLog.allocate(ring_capacity=ring, enable_chain_position_assert=chain_assert),
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=canary_jax.RealKvHashMode.ALL if sources else canary_jax.RealKvHashMode.NONE,
    )


def _launch(rng, *, decode: bool):
    """``(plan, ids, pos, loc, exp_ids, exp_pos)`` as int64 numpy arrays (the plan built): one-token requests
    (``decode``) or requests of 0..7 tokens whose offsets may run past the token count."""
    n = int(rng.integers(1, REQ_CAPACITY + 1))
    counts = [1] * n if decode else [int(c) for c in rng.integers(0, 8, n)]
    seeds = rng.choice([-1, -1, N_SLOTS + 3] + list(range(N_SLOTS)), n)
    plan = canary_jax.WritePlan.from_requests(
        counts=counts,
        seed_slots=seeds,
        write_req_capacity=REQ_CAPACITY,
        num_valid_reqs=int(rng.integers(max(0, n - 2), n + 2)),  # sometimes fewer live rows than requests
    )
    loc = rng.integers(1, 6, NUM_TOKENS)  # a few slots, each written by many entries
    odd = rng.random(NUM_TOKENS)
    loc = np.where(odd < 0.1, -1, np.where(odd < 0.15, N_SLOTS + 2, np.where(odd < 0.2, 2**33 + 3, loc)))
    ids = rng.integers(-(2**40), 2**40, NUM_TOKENS)
    pos = rng.integers(0, 6, NUM_TOKENS)  # mostly not the run position + 1: chain-position rows
    exp_ids = np.where(rng.random(NUM_TOKENS) < 0.2, ids + 1, ids)
    exp_pos = np.where(rng.random(NUM_TOKENS) < 0.2, pos - 1, pos)
    return plan, ids, pos, loc, exp_ids, exp_pos


def _write_args(arrays, assert_inputs):
    plan, ids, pos, loc, exp_ids, exp_pos = arrays
    kw = dict(enable_write_input_assert=assert_inputs)
    if assert_inputs:
        kw.update(expected_input_tokens=_pairs(exp_ids), expected_input_positions=_pairs(exp_pos))
    return (plan, _pairs(ids), _pairs(pos), _pairs(loc)), kw


def _verify_plan(rng):
    return canary_jax.VerifyPlan.from_entries(
        slots=rng.integers(0, N_SLOTS, 20),
        positions=rng.integers(0, 4, 20),
        prev_slots=np.where(rng.random(20) < 0.3, -1, rng.integers(0, N_SLOTS, 20)),
        verify_capacity=24,
    )


class SmallWriteTest(absltest.TestCase):
    def assert_same(self, got, want, msg=""):
        np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf), err_msg=msg)
        for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
            np.testing.assert_array_equal(
                np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)), err_msg=f"{msg} {name}"
            )

    def _write_pairs(self, rng, cases, *, sources=False, configs=(SMALL,)):
        """``cases`` of ``(decode, assert_inputs, chain_assert)``: two launches each on one log, every config
        against the reference after each. Returns the most rows any case appended past the ring's end."""
        overflow = 0
        for decode, assert_inputs, chain_assert in cases:
            ctx = _context(rng, sources=(_source(rng),) if sources else (), chain_assert=chain_assert)
            got = {cfg: ctx for cfg in configs}
            want = ctx
            for step in range(2):
                args, kw = _write_args(_launch(rng, decode=decode), assert_inputs)
                want = reference.write_reference(want, *args, **kw)
                for cfg in configs:
                    got[cfg] = write_pallas(got[cfg], *args, config=cfg, **kw)
                    self.assert_same(got[cfg], want, f"{decode=} {assert_inputs=} {chain_assert=} {step=} {cfg}")
            if assert_inputs or chain_assert:  # rows, mostly more than the ring holds
                self.assertGreater(int(want.log.write_index[0]), 0)
            overflow = max(overflow, int(want.log.write_index[0]) - want.log.ring.shape[0])
        return overflow

    def test_takes_the_small_body(self):
        # The small body's launch has one scratch output (the serial chains'), the general body's four.
        rng = np.random.default_rng(0)
        ctx = _context(rng)
        args, kw = _write_args(_launch(rng, decode=False), False)

        def outputs(cfg):
            launch = traced_eqns(lambda c: write_pallas(c, *args, config=cfg, **kw), ctx)
            return [len(e.outvars) for e in launch if e.primitive.name == "pallas_call"]

        self.assertEqual(outputs(SMALL), [1 + 1 + 4])  # words, chain, the log's four
        self.assertEqual(outputs(GENERAL), [1 + 4 + 4])  # words, flags, prev_at, chain_exp, counts, the log's four

    def test_random_launches_match_reference_and_general_body(self):
        rng = np.random.default_rng(1)
        cases = [(True, False, True), (False, False, True), (False, False, False), (True, False, False)]
        self.assertGreater(self._write_pairs(rng, cases, configs=(SMALL, GENERAL)), 0)

    def test_random_launches_with_input_assert(self):
        rng = np.random.default_rng(2)
        self.assertGreater(self._write_pairs(rng, [(False, True, True), (True, True, True), (False, True, False)]), 0)

    def test_random_launches_with_a_source(self):
        rng = np.random.default_rng(3)
        self._write_pairs(rng, [(False, True, True), (True, True, True)], sources=True, configs=(SMALL, GENERAL))

    def test_many_writers_of_one_slot_in_one_long_request(self):
        # One request of 24 tokens, every entry writing slot 7 but a skipped one: the last entry wins, its
        # prev_hash the chain's 23rd step; the chain-position assert passes (positions follow the seed's).
        rng = np.random.default_rng(4)
        ctx = _context(rng)
        seed_pos = int(np.asarray(ctx.canary_buf)[9, 8:16].view(np.int64)[0])
        plan = canary_jax.WritePlan.from_requests(counts=[NUM_TOKENS], seed_slots=[9], write_req_capacity=REQ_CAPACITY)
        loc = np.full(NUM_TOKENS, 7)
        loc[5] = -1
        pos = seed_pos + 1 + np.concatenate([np.arange(5), [99], np.arange(5, NUM_TOKENS - 1)])
        args = (plan, _pairs(rng.integers(0, 1000, NUM_TOKENS)), _pairs(pos), _pairs(loc))
        want = reference.write_reference(ctx, *args)
        self.assertEqual(int(want.log.write_index[0]), 0)
        self.assert_same(write_pallas(ctx, *args, config=SMALL), want)

    def test_phase_kernel_with_narrow_tokens(self):
        rng = np.random.default_rng(5)
        for decode, assert_inputs in ((False, True), (True, True)):
            ctx = _context(rng, ring=16)
            vplan = _verify_plan(rng)
            arrays = _launch(rng, decode=decode)
            (plan, *_), kw = _write_args(arrays, assert_inputs)
            narrow = [jnp.asarray(np.clip(a, -(2**31), 2**31 - 1).astype(np.int32)) for a in arrays[1:]]
            ids, pos, loc, exp_ids, exp_pos = narrow
            kw.update(expected_input_tokens=exp_ids, expected_input_positions=exp_pos)
            want = reference.verify_reference(ctx, vplan, check_verify_expected_token=True)
            want = reference.write_reference(
                want,
                plan,
                *(_pairs(np.asarray(a, np.int64)) for a in (ids, pos, loc)),
                enable_write_input_assert=True,
                expected_input_tokens=_pairs(np.asarray(exp_ids, np.int64)),
                expected_input_positions=_pairs(np.asarray(exp_pos, np.int64)),
            )
            got = phase.phase_pallas(
                ctx, vplan, plan, ids, pos, loc, check_verify_expected_token=True, config=PHASE, **kw
            )
            self.assert_same(got, want, f"{decode=}")
            self.assertEqual(np.asarray(got.log.launch_ticket).tolist(), [0])

    def test_x64_on(self):
        rng = np.random.default_rng(6)
        with jax.enable_x64(True):
            self._write_pairs(rng, [(False, True, True), (True, True, True)])
            ctx = _context(rng, sources=(_source(rng),))
            vplan = _verify_plan(rng)
            args, kw = _write_args(_launch(rng, decode=False), False)
            want = reference.write_reference(reference.verify_reference(ctx, vplan), *args, **kw)
            got = phase.phase_pallas(ctx, vplan, *args, config=PHASE, **kw)
            self.assert_same(got, want)

    def test_config_field(self):
        self.assertEqual(dataclasses.replace(SMALL, write_small_max_tokens=0), GENERAL)
        with self.assertRaisesRegex(ValueError, "write_small_max_tokens"):
            PallasConfig(write_small_max_tokens=-1)


if __name__ == "__main__":
    absltest.main()
