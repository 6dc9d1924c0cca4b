"""The one-launch phase (``pallas_kernels.phase``: verify, then write, as one ``canary_phase`` kernel) against the
references run one after the other, interpreted.

Random canary buffers make most verify entries fail (chain, position, token and real-KV bits), spread over more
verify blocks than programs (each program loops) and, with a small rows chunk, over several chunks of block counts;
the write has slots written by several entries and both kinds of write rows. Each phase must leave the canary
buffer, ring, write index and counters the references leave, and the launch ticket zero.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import unittest

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.ops import backends, reference
from pallas_kernels import phase
from pallas_kernels.config import PallasConfig
from tests.helpers.jaxpr_walk import traced_eqns

N_SLOTS = 96
TAG = canary_jax.CanaryLaunchTag.TAIL_K_FULL
# Verify blocks of 16 entries over at most 3 programs: a 40-entry plan is 3 blocks, one per program; 100 entries
# are 7 blocks, so programs loop. The write takes the one program (at most 64 tokens).
CONFIG = PallasConfig(verify_block=16, verify_source_block=16, verify_max_programs=3, write_fused_max_hashed=64)
# A write request capacity and token count for phases that share one compiled program (requests past a plan's count
# and tokens past the last request are padding no launch reads): with the same verify capacity (which sets the
# verify's blocks), flags, ring and sources they compile once (CI time).
SHARED_WRITE = dict(req_capacity=9, num_tokens=9)


def _pairs(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2))


def _phase_inputs(rng, *, n_verify, counts, sources=(), ring=64, enable=1, req_capacity=None, num_tokens=None):
    slots = rng.integers(0, N_SLOTS + 4, n_verify)  # slot 0 (skipped) and slots past the buffer (failing) too
    prevs = np.where(rng.random(n_verify) < 0.3, -1, rng.integers(0, N_SLOTS, n_verify))
    vplan = canary_jax.VerifyPlan.from_entries(
        slots=slots,
        positions=rng.integers(0, 3, n_verify),
        prev_slots=prevs,
        expected_tokens=np.where(rng.random(n_verify) < 0.5, -1, rng.integers(0, 4, n_verify)),
        verify_capacity=n_verify + 5,
        enable=enable,
    )
    t = int(sum(counts))
    num_tokens = max(t, num_tokens or 0)
    loc = rng.integers(1, N_SLOTS, num_tokens)
    loc[rng.integers(0, t)] = -1  # skipped
    loc[t - 1] = loc[0]  # a slot written twice
    seeds = [-1] + [int(x) for x in rng.integers(1, N_SLOTS, len(counts) - 1)]
    wplan = canary_jax.WritePlan.from_requests(
        counts=list(counts), seed_slots=seeds, write_req_capacity=max(len(counts), req_capacity or 0)
    )
    buf = rng.integers(0, 256, (N_SLOTS, 32), dtype=np.uint8)
    buf[:, 0:8] = np.asarray(rng.integers(0, 4, (N_SLOTS, 1)), np.int64).view(np.uint8)  # some tokens match
    mode = canary_jax.RealKvHashMode.ALL if sources else canary_jax.RealKvHashMode.NONE
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=jnp.asarray(buf),
        kernel_kind=TAG,
        log=canary_jax.ViolationLog.allocate(ring_capacity=ring),
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=mode,
    )
    ids = rng.integers(0, 1 << 40, num_tokens)
    tokens = (_pairs(ids), _pairs(rng.integers(0, 6, num_tokens)), _pairs(loc))
    expected = (_pairs(np.where(rng.random(num_tokens) < 0.3, ids + 1, ids)), tokens[1])
    return ctx, vplan, wplan, tokens, expected


def _reference(ctx, vplan, wplan, tokens, expected, *, check, assert_inputs):
    out = reference.verify_reference(ctx, vplan, check_verify_expected_token=check)
    kw = dict(enable_write_input_assert=assert_inputs)
    if assert_inputs:
        kw.update(expected_input_tokens=expected[0], expected_input_positions=expected[1])
    return reference.write_reference(out, wplan, *tokens, **kw)


def _phase(ctx, vplan, wplan, tokens, expected, *, check, assert_inputs, config=CONFIG):
    kw = dict(check_verify_expected_token=check, enable_write_input_assert=assert_inputs, config=config)
    if assert_inputs:
        kw.update(expected_input_tokens=expected[0], expected_input_positions=expected[1])
    return phase.phase_pallas(ctx, vplan, wplan, *tokens, **kw)


def _pallas_calls(fn, *args) -> list[str]:
    """Names of the ``pallas_call`` s in ``fn``'s jaxpr (nested jits entered)."""

    def name(e):
        return str(e.params.get("name") or getattr(e.params.get("name_and_src_info"), "name", ""))

    return [name(e) for e in traced_eqns(fn, *args) if e.primitive.name == "pallas_call"]


class PhaseTest(absltest.TestCase):
    def assert_same(self, got, want):
        np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf))
        for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
            np.testing.assert_array_equal(
                np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)), err_msg=name
            )
        self.assertEqual(np.asarray(got.log.launch_ticket).tolist(), [0])

    def test_random_phases_match_the_references(self):
        rng = np.random.default_rng(7)
        cases = (  # (verify entries, request token counts, token check, input assert, ring rows)
            (40, [1] * 9, True, False, 64),
            (100, [3, 1, 2], False, True, 64),
            (100, [1, 1, 1, 1], True, True, 12),  # more rows than the ring holds: fill-once, index keeps counting
        )
        for n_verify, counts, check, assert_inputs, ring in cases:
            with self.subTest(n_verify=n_verify, counts=counts):
                args = _phase_inputs(rng, n_verify=n_verify, counts=counts, ring=ring, **SHARED_WRITE)
                want = _reference(*args, check=check, assert_inputs=assert_inputs)
                self.assertGreater(int(want.log.write_index[0]), 10)  # verify and write rows both
                self.assert_same(_phase(*args, check=check, assert_inputs=assert_inputs), want)

    def test_real_kv_sources(self):
        rng = np.random.default_rng(8)
        data = jnp.asarray(rng.integers(0, 256, (N_SLOTS + 4, 48), dtype=np.uint8))
        src = canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=48, read_bytes=32)
        args = _phase_inputs(rng, n_verify=40, counts=[2, 1, 1], sources=(src,))
        want = _reference(*args, check=False, assert_inputs=False)
        self.assert_same(_phase(*args, check=False, assert_inputs=False), want)

    def test_rows_over_several_chunks_of_block_counts(self):
        # Four block counts per chunk: 7 verify blocks span two chunks, the second's rows start after the first's.
        rng = np.random.default_rng(9)
        args = _phase_inputs(rng, n_verify=100, counts=[1, 2])
        want = _reference(*args, check=True, assert_inputs=False)
        with absltest.mock.patch.object(phase, "ROWS_CHUNK", 4):
            got = _phase(*args, check=True, assert_inputs=False, config=dataclasses.replace(CONFIG, verify_block=8))
        self.assert_same(got, want)

    def test_disabled_verify_still_writes_and_counts(self):
        # The token check on (its flags are the first random phase's: one compiled program): nothing to check.
        rng = np.random.default_rng(10)
        args = _phase_inputs(rng, n_verify=40, counts=[1, 1], enable=0, **SHARED_WRITE)
        want = _reference(*args, check=True, assert_inputs=False)
        self.assertEqual(int(want.log.kernel_run_counters[int(TAG), 0]), 2)
        self.assert_same(_phase(*args, check=True, assert_inputs=False), want)

    def test_one_launch_where_it_can_two_otherwise(self):
        rng = np.random.default_rng(12)
        ctx, vplan, wplan, tokens, expected = _phase_inputs(rng, n_verify=40, counts=[1] * 4)

        def names(c, config):
            return _pallas_calls(
                lambda x: _phase(x, vplan, wplan, tokens, expected, check=False, assert_inputs=False, config=config), c
            )

        self.assertEqual(names(ctx, CONFIG), ["canary_phase"])
        apart = ["canary_verify", "canary_verify_rows", "canary_write_fused"]
        self.assertEqual(names(ctx, dataclasses.replace(CONFIG, phase_one_launch=False)), apart)
        no_ticket = ctx.replace(log=dataclasses.replace(ctx.log, launch_ticket=None))
        self.assertEqual(names(no_ticket, CONFIG), apart)
        # Without a ticket the two launches give the same bytes and keep the log ticketless.
        want = _reference(ctx, vplan, wplan, tokens, expected, check=False, assert_inputs=False)
        got = _phase(no_ticket, vplan, wplan, tokens, expected, check=False, assert_inputs=False)
        np.testing.assert_array_equal(np.asarray(got.log.ring), np.asarray(want.log.ring))
        self.assertIsNone(got.log.launch_ticket)


class VerifyThenWriteChecksTest(absltest.TestCase):
    def test_every_check_runs_before_either_launch(self):
        # Outside jit the verify donates the log: a bad write argument must be refused before it runs, and a plan
        # of the wrong kind is named by its argument.
        rng = np.random.default_rng(14)
        ctx, vplan, wplan, tokens, _ = _phase_inputs(rng, n_verify=8, counts=[1, 1])
        ids, pos, loc = (canary_jax.pairs_to_int64_np(np.asarray(t)) for t in tokens)  # host int64 arrays
        for backend in ("reference", "pallas"):
            with self.subTest(backend=backend):
                with self.assertRaisesRegex(ValueError, r"input_ids \(2 entries\) is shorter than positions"):
                    canary_jax.verify_then_write(ctx, vplan, wplan, ids, np.append(pos, 0), loc, backend=backend)
                self.assertEqual(int(ctx.log.write_index[0]), 0)  # the caller's log is still there, unchanged
                with self.assertRaisesRegex(TypeError, r"^kv-canary: write_plan must be a WritePlan, got VerifyPlan"):
                    canary_jax.verify_then_write(ctx, vplan, vplan, ids, pos, loc, backend=backend)
        want = _reference(ctx, vplan, wplan, tokens, None, check=False, assert_inputs=False)
        out = canary_jax.verify_then_write(ctx, vplan, wplan, ids, pos, loc, backend="pallas")  # donates ctx's arrays
        np.testing.assert_array_equal(np.asarray(out.log.ring), np.asarray(want.log.ring))


@unittest.skipUnless(
    importlib.util.find_spec("triton") and importlib.util.find_spec("torch"), "needs the triton and torch packages"
)
class OfflineCompileTest(absltest.TestCase):
    def test_phase_compiles_for_sm90_with_one_release_acquire_ticket(self):
        """The TTIR of ``canary_phase`` (default config, a source and both asserts) compiles for sm_90 with
        triton's ptxas, no GPU needed; its PTX draws the ticket with one GPU-scope acquire-release atomic."""
        from interop.native import triton_kernels as tk
        from interop.native import triton_ttir as tt

        rng = np.random.default_rng(13)
        data = jnp.asarray(rng.integers(0, 256, (N_SLOTS + 4, 48), dtype=np.uint8))
        src = canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=48, read_bytes=32)
        ctx, vplan, wplan, tokens, exp = _phase_inputs(rng, n_verify=1000, counts=[1] * 128, sources=(src,))

        def run(c, vp):
            kw = dict(check=True, assert_inputs=True, interpret=False, config=PallasConfig())
            return phase._phase(c, vp, wplan, *tokens, *exp, **kw)

        eqns = [e for e in jax.make_jaxpr(run)(ctx, vplan).jaxpr.eqns if e.primitive.name == "pallas_call"]
        self.assertEqual([e.params["name"] for e in eqns], ["canary_phase"])
        spec = tt.kernel_spec(eqns[0])
        self.assertEqual(tk.compile_offline(spec, 90)["global_scratch_size"], 0)
        ptx = tk._compile(spec, 90)[0].asm["ptx"]
        self.assertEqual(ptx.count("atom.global.gpu.acq_rel.add"), 1)


@unittest.skipUnless(backends.is_gpu_platform(), "compiled phase: needs a GPU")
class CompiledPhaseTest(absltest.TestCase):
    """The compiled ``canary_phase`` on a GPU (default config: a persistent grid of many programs racing for the
    ticket) against the references, launch after launch on one log: a ticket left non-zero, or a last program that
    read another's counts or fail bits before they landed, would lose or misplace rows."""

    def test_many_programs_race_for_the_ticket(self):
        rng = np.random.default_rng(21)
        n_verify = 1 << 16
        ctx, vplan, wplan, tokens, expected = _phase_inputs(rng, n_verify=n_verify, counts=[1] * 128, ring=8192)
        got = want = ctx
        runs = [
            jax.jit(
                lambda c, vp, a=a: _phase(c, vp, wplan, tokens, expected, check=False, assert_inputs=a, config=None)
            )
            for a in (False, True)
        ]
        for step in range(12):
            # Most entries read slot 0 (skipped); about 1 in 200 a random record (failing): sparse rows in every
            # program's blocks, so the ranks depend on every block's count.
            slots = np.where(rng.random(n_verify) < 0.005, rng.integers(1, N_SLOTS, n_verify), 0)
            vplan = canary_jax.VerifyPlan.from_entries(
                slots=slots,
                positions=rng.integers(0, 3, n_verify),
                prev_slots=rng.integers(-1, N_SLOTS, n_verify),
                verify_capacity=n_verify,
            )
            want = _reference(want, vplan, wplan, tokens, expected, check=False, assert_inputs=step % 2 == 1)
            got = runs[step % 2](got, vplan)
            with self.subTest(step=step):
                self.assert_same(got, want)
        self.assertGreater(int(want.log.write_index[0]), 12 * 200)

    assert_same = PhaseTest.assert_same


if __name__ == "__main__":
    absltest.main()
