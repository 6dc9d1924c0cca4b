"""The grid write (``pallas_kernels.write_grid``, one ``canary_write_grid`` launch whose programs meet at grid
barriers) against the reference, Python-int goldens and the multi-launch write.

Interpreted here, the kernel's programs run each pass in turn (the compiled partition of blocks and request lanes,
without the barriers); the compiled kernel is lowered to Triton IR on this host and run on the GPU by the CUDA
session (``benchmarks/write_grid_session.sh``). Launches: slots written by several entries in different programs'
blocks, seeds that another request of the launch writes, skipped and out-of-range slots, input-assert and
chain-position rows (more than the ring holds), with and without a real-KV source.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import hashing
from canary_jax.ops import reference
from pallas_kernels import write_grid
from pallas_kernels.config import PallasConfig
from pallas_kernels.write import write_pallas
from tests.helpers.jaxpr_walk import traced_eqns

N_SLOTS = 256
# blocks of 16 entries over 3 programs: program 0 runs blocks 0, 3, 6, ..., so later entries claim in other programs
GRID = PallasConfig(write_fused_max_tokens=0, write_fused_max_hashed=0, write_block=16, write_grid_programs=3)
GRID_HASHED = dataclasses.replace(GRID, write_grid_max_hashed=4096)
MULTI = dataclasses.replace(GRID, write_grid_max_tokens=0)


def _pairs(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2))


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _context(rng, sources=(), log=None):
    return canary_jax.VerifyOrWriteContext(
        canary_buf=jnp.asarray(rng.integers(0, 256, (N_SLOTS, 32), dtype=np.uint8)),
        kernel_kind=canary_jax.CanaryLaunchTag.TAIL_K_FULL,
        log=log or canary_jax.ViolationLog.allocate(ring_capacity=24),
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=canary_jax.RealKvHashMode.ALL if sources else canary_jax.RealKvHashMode.NONE,
    )


def _launch(rng, counts, *, tokens):
    """Requests of ``counts`` entries over a token array of ``tokens`` rows (a tail no request claims); slots with
    writers in several programs' blocks, seeds that the launch writes, a skipped and an out-of-range slot."""
    t = int(sum(counts))
    slots = rng.permutation(N_SLOTS)[:tokens].astype(np.int64)
    for a, b in ((1, t - 1), (2, t // 2), (t // 2, t - 2), (3, 17)):  # writers in different blocks
        slots[b] = slots[a]
    slots[5] = -1
    slots[6] = N_SLOTS + 9
    seeds = [
        int(slots[rng.integers(0, t)]) if r % 3 == 1 else int(rng.integers(-1, N_SLOTS)) for r in range(len(counts))
    ]
    plan = canary_jax.WritePlan.from_requests(counts=list(counts), seed_slots=seeds, write_req_capacity=len(counts))
    ids = rng.integers(0, 1 << 40, tokens)
    pos = rng.integers(0, 4, tokens)  # mostly not the seed's position + 1: chain-position rows
    exp_ids = np.where(rng.random(tokens) < 0.2, ids + 1, ids)
    return plan, _pairs(ids), _pairs(pos), _pairs(slots), _pairs(exp_ids), _pairs(pos)


class GridWriteTest(absltest.TestCase):
    def assert_same(self, got, want):
        np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf))
        for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters", "launch_ticket"):
            np.testing.assert_array_equal(np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)))

    def test_launches_match_reference_and_multi_launch(self):
        rng = np.random.default_rng(7)
        # a decode batch whose requests span two lane blocks, and a mixed batch with the input assert
        cases = (([1] * 100, 100, False), ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3], 48, True))
        for counts, tokens, assert_inputs in cases:
            ctx = _context(rng)
            plan, ids, pos, loc, exp_ids, exp_pos = _launch(rng, counts, tokens=tokens)
            kw = dict(enable_write_input_assert=assert_inputs)
            if assert_inputs:
                kw.update(expected_input_tokens=exp_ids, expected_input_positions=exp_pos)
            want = reference.write_reference(ctx, plan, ids, pos, loc, **kw)
            with self.subTest(requests=len(counts), assert_inputs=assert_inputs):
                self.assertGreater(int(want.log.write_index[0]), 24)  # rows past the ring's capacity
                self.assert_same(write_pallas(ctx, plan, ids, pos, loc, config=GRID, **kw), want)
                self.assert_same(write_pallas(ctx, plan, ids, pos, loc, config=MULTI, **kw), want)

    def test_with_a_real_kv_source(self):
        rng = np.random.default_rng(5)
        data = jnp.asarray(rng.integers(0, 256, (N_SLOTS, 48), dtype=np.uint8))
        src = canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=48, read_bytes=32)
        ctx = _context(rng, sources=(src,))
        plan, ids, pos, loc, *_ = _launch(rng, [2, 1, 3] + [1] * 40, tokens=50)
        want = reference.write_reference(ctx, plan, ids, pos, loc)
        self.assert_same(write_pallas(ctx, plan, ids, pos, loc, config=GRID_HASHED), want)

    def test_last_writer_in_another_program_wins(self):
        # 40 one-token requests, seeds -1, all write slot 9 but the last; entry 38 (block 2, program 2) owns it.
        # Its record, from Python ints: (token, position, prev_hash = ANCHOR_HASH, real_kv_hash 0).
        rng = np.random.default_rng(1)
        ctx = _context(rng)
        plan = canary_jax.WritePlan.from_requests(counts=[1] * 40, seed_slots=[-1] * 40, write_req_capacity=40)
        ids = [1000 + k for k in range(40)]
        pos = [0] * 40
        slots = [9] * 39 + [12]
        out = write_pallas(ctx, plan, _pairs(ids), _pairs(pos), _pairs(slots), config=GRID)
        buf = np.asarray(out.canary_buf)
        self.assertEqual(buf[9].view("<i8").tolist(), [1038, 0, _signed(hashing.ANCHOR_HASH), 0])
        self.assertEqual(buf[12].view("<i8").tolist(), [1039, 0, _signed(hashing.ANCHOR_HASH), 0])
        untouched = np.ones(N_SLOTS, bool)
        untouched[[9, 12]] = False
        np.testing.assert_array_equal(buf[untouched], np.asarray(ctx.canary_buf)[untouched])
        counters = np.ascontiguousarray(np.asarray(out.log.slot_run_counters)).reshape(-1).view("<i8")
        self.assertEqual(int(counters[int(ctx.kernel_kind)]), 40)  # every written entry counts
        self.assertEqual(int(out.log.write_index[0]), 0)  # seeds -1 at position 0: no chain-position rows

    def test_one_grid_launch_and_nothing_else(self):
        rng = np.random.default_rng(3)
        ctx = _context(rng)
        plan, ids, pos, loc, *_ = _launch(rng, [1] * 40, tokens=40)

        def names(config, c):
            eqns = traced_eqns(lambda c: write_pallas(c, plan, ids, pos, loc, config=config), c)
            return [e.params["name"] if e.primitive.name == "pallas_call" else e.primitive.name for e in eqns]

        grid = names(GRID, ctx)
        self.assertEqual([n for n in grid if n.startswith("canary_")], ["canary_write_grid"])
        self.assertLessEqual(set(grid) - {"canary_write_grid"}, {"reshape", "bitcast_convert_type"}, grid)
        # a log without a launch ticket (SGLang's tensors) keeps the multi-launch write
        bare = _context(rng, log=dataclasses.replace(ctx.log, launch_ticket=None))
        multi = [n for n in names(GRID, bare) if n.startswith("canary_")]
        self.assertEqual(multi, ["canary_write_chain", "canary_write_claim", "canary_write_won", "canary_write_store"])

    def test_which_launches_take_the_grid(self):
        cfg = PallasConfig()
        self.assertTrue(write_grid.takes_grid(4096, 4096, False, True, cfg))  # a decode step of 4096 requests
        self.assertFalse(write_grid.takes_grid(4097, 4097, False, True, cfg))  # past write_grid_max_tokens
        self.assertFalse(write_grid.takes_grid(4096, 4096, False, False, cfg))  # no launch ticket
        self.assertFalse(write_grid.takes_grid(4096, 4096, True, True, cfg))  # real-KV sources: not by default
        self.assertFalse(write_grid.takes_grid(4096, 32, False, True, cfg))  # long requests: the long role
        self.assertEqual(write_grid.grid_programs(4096, 128, 32, interpret=True), 32)
        self.assertEqual(write_grid.grid_programs(300, 128, 32, interpret=True), 3)
        for kw in ({"write_grid_max_tokens": -1}, {"write_grid_programs": 0}, {"write_grid_num_warps": 3}):
            with self.assertRaisesRegex(ValueError, next(iter(kw))):
                PallasConfig(**kw)


class CompiledGridTest(absltest.TestCase):
    @absltest.skipUnless(importlib.util.find_spec("torch"), "the Triton IR printer lives in interop, which needs torch")
    def test_compiled_kernel_lowers_with_barriers_and_the_claim(self):
        from interop.native import triton_ttir

        rng = np.random.default_rng(2)
        ctx = _context(rng)
        plan, ids, pos, loc, *_ = _launch(rng, [1] * 40, tokens=40)
        eqns = traced_eqns(lambda c: write_pallas(c, plan, ids, pos, loc, config=GRID, interpret=False), ctx)
        (eqn,) = [e for e in eqns if e.primitive.name == "pallas_call"]
        self.assertEqual(eqn.params["name"], "canary_write_grid")
        ttir = triton_ttir.kernel_spec(eqn).ttir
        # 4 barriers (an arrival and a read in each one's wait loop) and the last arrival; the claim's vector max
        self.assertEqual(len(re.findall(r"tt\.atomic_rmw add\b", ttir)), 9)
        self.assertRegex(ttir, r"tt\.atomic_rmw max, [^:]*: \(tensor<16x!tt\.ptr<i32>>")
        self.assertEqual(len(re.findall(r"scf\.while", ttir)), 4)


if __name__ == "__main__":
    absltest.main()
