"""GPU-only checks of the compiled Pallas kernels against the jnp references (skipped without a GPU).

The shared suite (``tests/test_pallas_interpret.py``) already runs compiled on a GPU; these add what is too
large for interpret mode: a million verify entries with thousands of violations and ring overflow, a
heavily violating write with duplicate slots, slots at the end of a canary buffer whose byte offsets pass
2**31 and a real-KV source past 4 GiB (64-bit addressing), page sizes 1/16/64 with rows wider than needed,
the asm and portable multipliers, and x64 off vs on. Every comparison is whole-buffer, byte for byte.
"""

from __future__ import annotations

import os
import unittest

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants, ints
from canary_jax.ops import backends, reference

ON_GPU = backends.is_gpu_platform()
# Developers can dry-run this module on CPU (interpret mode, tiny sizes): CANARY_GPU_TESTS_ON_CPU=1.
DRY_RUN = not ON_GPU and os.environ.get("CANARY_GPU_TESTS_ON_CPU") == "1"


def _sz(gpu: int, cpu: int) -> int:
    return gpu if ON_GPU else cpu


TAG = constants.CanaryLaunchTag.TAIL_K_FULL


def _pairs(a) -> jax.Array:
    return jnp.asarray(ints.int64_to_pairs_np(np.asarray(a, np.int64)))


def _log(ring: int) -> canary_jax.ViolationLog:
    return canary_jax.ViolationLog.allocate(ring_capacity=ring)


def _same_state(tc, a: canary_jax.VerifyOrWriteContext, b: canary_jax.VerifyOrWriteContext, *, buffers: bool = True):
    if buffers:
        tc.assertTrue(bool(jnp.array_equal(a.canary_buf, b.canary_buf)), "canary buffer differs")
    np.testing.assert_array_equal(np.asarray(a.log.ring), np.asarray(b.log.ring), err_msg="ring")
    np.testing.assert_array_equal(np.asarray(a.log.write_index), np.asarray(b.log.write_index))
    np.testing.assert_array_equal(np.asarray(a.log.slot_run_counters), np.asarray(b.log.slot_run_counters))
    np.testing.assert_array_equal(np.asarray(a.log.kernel_run_counters), np.asarray(b.log.kernel_run_counters))


def _fresh(ctx: canary_jax.VerifyOrWriteContext) -> canary_jax.VerifyOrWriteContext:
    """A copy of the buffers ``canary_jax.verify`` / ``write`` donate, so ``ctx`` stays usable."""
    log = jax.tree_util.tree_map(jnp.copy, ctx.log)
    return ctx.replace(canary_buf=jnp.copy(ctx.canary_buf), log=log)


def _random_state(rng, num_slots: int, stride: int = 32) -> jax.Array:
    buf = rng.integers(0, 256, size=(num_slots, stride), dtype=np.uint8)
    recs = buf[:, :32].view("<i8").reshape(num_slots, 4)
    recs[:, 1] = rng.integers(0, 8, num_slots)  # plausible positions
    recs[:, 3] = np.where(rng.random(num_slots) < 0.5, 0, recs[:, 3])
    return jnp.asarray(buf)


def _chains(rng, num_slots: int, num_reqs: int, length: int):
    """Disjoint random slot chains: slots[r, k], prev slot of each, positions."""
    slots = rng.permutation(np.arange(1, num_slots))[: num_reqs * length].reshape(num_reqs, length)
    prev = np.concatenate([np.full((num_reqs, 1), -1), slots[:, :-1]], axis=1)
    pos = np.broadcast_to(np.arange(length), (num_reqs, length))
    return slots.astype(np.int64), prev.astype(np.int64), pos.astype(np.int64)


def _write_fixture(rng, num_slots, num_reqs, length, *, seed_frac=0.5, dup_frac=0.0):
    slots, _, pos = _chains(rng, num_slots, num_reqs, length)
    loc = slots.reshape(-1).copy()
    if dup_frac:
        k = int(dup_frac * loc.size)
        loc[rng.integers(0, loc.size, k)] = loc[rng.integers(0, loc.size, k)]
    seeds = np.where(rng.random(num_reqs) < seed_frac, rng.integers(1, num_slots, num_reqs), -1)
    plan = canary_jax.WritePlan.from_requests(counts=[length] * num_reqs, seed_slots=seeds)
    ids = rng.integers(-(2**40), 2**40, loc.size)
    return plan, _pairs(ids), _pairs(pos.reshape(-1) + rng.integers(0, 2, loc.size)), _pairs(loc), ids


@unittest.skipUnless(ON_GPU or DRY_RUN, "needs a GPU (compiled Pallas kernels)")
class GpuPallasTest(absltest.TestCase):
    def test_verify_million_entries_thousands_of_violations(self):
        rng = np.random.default_rng(0)
        n, c = _sz(1 << 21, 512), _sz(1 << 20, 700)
        buf = _random_state(rng, n)
        slots = rng.integers(1, n, c)
        prev = np.where(rng.random(c) < 0.9, rng.integers(1, n, c), rng.choice([-1, 0], c))
        pos = rng.integers(0, 8, c)
        plan = canary_jax.VerifyPlan.from_entries(slots=slots, positions=pos, prev_slots=prev, num_valid=c - 7)
        for ring in (_sz(4096, 64), _sz(1 << 21, 1024)):  # overflowing many times over / every row recorded
            ctx = canary_jax.VerifyOrWriteContext(canary_buf=buf, kernel_kind=TAG, log=_log(ring))
            a = reference.verify_reference(ctx, plan)
            b = canary_jax.verify(_fresh(ctx), plan, backend="pallas")
            self.assertGreater(int(b.log.write_index[0]), _sz(100_000, 300))
            _same_state(self, a, b, buffers=False)

    def test_verify_clean_chains_with_sources(self):
        rng = np.random.default_rng(1)
        n = _sz(1 << 16, 1024)
        for page, nbpt, read, width_pad, mode in (
            (1, 64, 64, 0, constants.RealKvHashMode.ALL),
            (16, 32, 32, 48, constants.RealKvHashMode.ALL),
            (64, 16, 16, 16, constants.RealKvHashMode.PARTIAL),
        ):
            rows = -(-n // page)
            data = rng.integers(0, 256, (rows, page * nbpt + width_pad), dtype=np.uint8)
            src = canary_jax.RealKvSource(
                tensor=jnp.asarray(data), page_size=page, num_bytes_per_token=nbpt, read_bytes=read
            )
            ctx = canary_jax.VerifyOrWriteContext(
                canary_buf=jnp.zeros((n, 32), jnp.uint8),
                kernel_kind=TAG,
                log=_log(64),
                real_kv_sources=(src, src),
                real_kv_hash_mode=mode,
            )
            nr, ln = _sz(64, 4), _sz(128, 8)
            plan, ids, pos, loc, _ = _write_fixture(rng, n, nr, ln, seed_frac=0.0)
            wa = reference.write_reference(ctx, plan, ids, pos, loc)
            wb = canary_jax.write(_fresh(ctx), plan, ids, pos, loc, backend="pallas")
            _same_state(self, wa, wb)
            slots = np.asarray(ints.pairs_to_int64_np(np.asarray(loc))).reshape(nr, ln)
            prev = np.concatenate([np.full((nr, 1), -1), slots[:, :-1]], axis=1)
            vplan = canary_jax.VerifyPlan.from_entries(
                slots=slots.reshape(-1),
                prev_slots=prev.reshape(-1),
                positions=np.asarray(ints.pairs_to_int64_np(np.asarray(pos))),
            )
            va = reference.verify_reference(wb, vplan)
            vb = canary_jax.verify(_fresh(wb), vplan, backend="pallas")
            _same_state(self, va, vb, buffers=False)

    def test_write_many_requests_violations_duplicates(self):
        rng = np.random.default_rng(2)
        n = _sz(1 << 18, 2048)
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=_random_state(rng, n), kernel_kind=TAG, log=_log(_sz(2048, 32))
        )
        for nreq, length in ((_sz(4096, 40), 1), (_sz(64, 5), 37), (1, _sz(5000, 200))):
            # One request: give it a seed, or a launch without the input assert has no violation to compare.
            plan, ids, pos, loc, ids_np = _write_fixture(
                rng, n, nreq, length, dup_frac=0.05, seed_frac=1.0 if nreq == 1 else 0.5
            )
            etok = _pairs(np.where(rng.random(ids_np.size) < 0.9, ids_np, ids_np + 1))
            epos = pos
            for assert_inputs in (False, True):
                kw = dict(
                    enable_write_input_assert=assert_inputs,
                    expected_input_tokens=etok if assert_inputs else None,
                    expected_input_positions=epos if assert_inputs else None,
                )
                a = reference.write_reference(ctx, plan, ids, pos, loc, **kw)
                b = canary_jax.write(_fresh(ctx), plan, ids, pos, loc, backend="pallas", **kw)
                self.assertGreater(int(a.log.write_index[0]), 0)
                _same_state(self, a, b)

    @unittest.skipUnless(ON_GPU, "needs 7 GB of device memory")
    def test_addressing_past_2_pow_31_bytes(self):
        # 2**26 + 2**14 slots x 32 B = 2.15 GB canary buffer; a 4.3 GB real-KV source (64-bit offsets).
        n = (1 << 26) + (1 << 14)
        rows = n // 4 + 16  # 4.3 GB > 2**32 bytes
        src_data = jnp.zeros((rows, 256), jnp.uint8).at[-128:].set(7)
        src = canary_jax.RealKvSource(tensor=src_data, page_size=4, num_bytes_per_token=64, read_bytes=64)
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=jnp.zeros((n, 32), jnp.uint8),
            kernel_kind=TAG,
            log=_log(64),
            real_kv_sources=(src,),
            real_kv_hash_mode=constants.RealKvHashMode.ALL,
        )
        last = np.arange(n - 200, n, dtype=np.int64)
        plan = canary_jax.WritePlan.from_requests(counts=[200], seed_slots=[-1])
        ids, pos, loc = _pairs(last * 3), _pairs(np.arange(200)), _pairs(last)
        a = reference.write_reference(ctx, plan, ids, pos, loc)
        b = canary_jax.write(_fresh(ctx), plan, ids, pos, loc, backend="pallas")
        _same_state(self, a, b)
        rec = canary_jax.read_slot(b.canary_buf, n - 1)
        self.assertEqual(rec.token, 3 * (n - 1))
        self.assertNotEqual(rec.real_kv_hash, 0)
        vplan = canary_jax.VerifyPlan.from_entries(
            slots=last, positions=np.arange(200) + 1, prev_slots=np.concatenate([[-1], last[:-1]])
        )
        va = reference.verify_reference(b, vplan)
        vb = canary_jax.verify(_fresh(b), vplan, backend="pallas")
        self.assertEqual(int(vb.log.write_index[0]), 200)  # every position is off by one
        _same_state(self, va, vb, buffers=False)

    def test_asm_and_portable_multipliers_agree(self):
        from pallas_kernels.config import PallasConfig
        from pallas_kernels.verify import verify_pallas
        from pallas_kernels.write import write_pallas

        if not ON_GPU:
            self.skipTest("the asm multiplier needs the GPU")
        rng = np.random.default_rng(3)
        n = 1 << 14
        data = rng.integers(0, 256, (n, 64), dtype=np.uint8)
        src = canary_jax.RealKvSource(tensor=jnp.asarray(data), page_size=1, num_bytes_per_token=64, read_bytes=64)
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=_random_state(rng, n),
            kernel_kind=TAG,
            log=_log(256),
            real_kv_sources=(src,),
            real_kv_hash_mode=constants.RealKvHashMode.ALL,
        )
        plan, ids, pos, loc, _ = _write_fixture(rng, n, 32, 50)
        outs = [write_pallas(ctx, plan, ids, pos, loc, config=PallasConfig(multiplier=m)) for m in ("asm", "portable")]
        _same_state(self, outs[0], outs[1])
        _same_state(self, outs[0], reference.write_reference(ctx, plan, ids, pos, loc))
        vplan = canary_jax.VerifyPlan.from_entries(
            slots=rng.integers(1, n, 3000), positions=rng.integers(0, 3, 3000), prev_slots=rng.integers(-1, n, 3000)
        )
        vouts = [
            verify_pallas(outs[0], vplan, config=PallasConfig(multiplier=m, gather=g, source_gather=sg))
            for m, g, sg in (("asm", "pair", "quad"), ("portable", "word", "word"), ("asm", "quad", "pair"))
        ]
        for v in vouts[1:]:
            _same_state(self, vouts[0], v, buffers=False)
        _same_state(self, vouts[0], reference.verify_reference(outs[0], vplan), buffers=False)

    def test_x64_on_matches_x64_off(self):
        rng = np.random.default_rng(4)
        n = _sz(1 << 12, 256)
        buf = np.asarray(_random_state(rng, n))
        plan_args = _write_fixture(rng, n, 8, 20)
        vs = rng.integers(1, n, 300), rng.integers(0, 3, 300), rng.integers(-1, n, 300)
        results = []
        for x64 in (False, True):
            jax.config.update("jax_enable_x64", x64)
            try:
                ctx = canary_jax.VerifyOrWriteContext(canary_buf=jnp.asarray(buf), kernel_kind=TAG, log=_log(64))
                plan, ids, pos, loc, _ = plan_args
                w = canary_jax.write(
                    ctx,
                    plan,
                    jnp.asarray(np.asarray(ids)),
                    jnp.asarray(np.asarray(pos)),
                    jnp.asarray(np.asarray(loc)),
                    backend="pallas",
                )
                vplan = canary_jax.VerifyPlan.from_entries(slots=vs[0], positions=vs[1], prev_slots=vs[2])
                v = canary_jax.verify(w, vplan, backend="pallas")
                results.append((np.asarray(v.canary_buf), np.asarray(v.log.ring), np.asarray(v.log.write_index)))
            finally:
                jax.config.update("jax_enable_x64", False)
        for x, y in zip(*results):
            np.testing.assert_array_equal(x, y)


if __name__ == "__main__":
    absltest.main()
