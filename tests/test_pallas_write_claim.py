"""The multi-launch write's slot claim (``pallas_kernels.write_claim``, the ``canary_write_claim`` launch) and the
launch structure around it: nothing but views of the operands between the write's ``pallas_call`` s.

* The launches, traced (interpreted and compiled, with and without the long-request role, the input assert and a
  real-KV source, and a step's chain reuse): outside the kernels only reshapes, bitcasts (the canary words' u8 / u32
  view and the claim's u32 / f32 view) and the flag words' memset.
* Slots written several times within one block and across blocks of a persistent grid (programs that run their
  blocks out of entry order): the last writer owns the slot, byte for byte with
  :func:`canary_jax.ops.reference.write_reference`, and each contested slot holds its last writer's token.
* The claim launch alone (interpreted) against a numpy ``maximum.at``.
* The compiled claim lowered to Triton IR on this host: a masked vector ``atomic_rmw max`` on i32.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.ops import chain_hints, reference
from pallas_kernels.config import PallasConfig
from pallas_kernels.write import write_pallas
from pallas_kernels.write_claim import claim_slots
from pallas_kernels.write_flags import CLAIM_WORD, WriteFlag
from tests.helpers.jaxpr_walk import traced_eqns

N_SLOTS = 64
MULTI = PallasConfig(write_fused_max_tokens=0, write_fused_max_hashed=0)
LONG = PallasConfig(write_fused_max_tokens=0, write_fused_max_hashed=0, write_long_threshold=2, write_long_chunk=4)
# Blocks of 8 entries over 2 programs: program 0 claims blocks 0, 2, 4 before program 1 claims blocks 1, 3
# (interpreted, programs run one after another), so later entries claim before earlier ones.
SMALL_BLOCKS = dict(write_fused_max_tokens=0, write_fused_max_hashed=0, write_block=8, write_max_programs=2)
VIEWS = {"reshape", "bitcast_convert_type"}
AFTER_CHAINS = ["canary_write_claim", "canary_write_won", "canary_write_store"]  # the launches after the chains


def _pairs(values) -> jax.Array:
    return jnp.asarray(np.asarray(values, dtype=np.int64).view(np.uint32).reshape(-1, 2))


def _launch(rng, counts, slots, *, sources=(), assert_flag=True):
    """A write of ``len(slots)`` tokens in requests of ``counts`` entries (seeds -1 and in-range slots mixed)."""
    t = len(slots)
    seeds = [-1 if r % 2 == 0 else int(rng.integers(0, N_SLOTS)) for r in range(len(counts))]
    plan = canary_jax.WritePlan.from_requests(counts=list(counts), seed_slots=seeds, write_req_capacity=len(counts))
    log = canary_jax.ViolationLog.allocate(ring_capacity=16)
    if not assert_flag:
        log = dataclasses.replace(log, enable_chain_position_assert=jnp.zeros_like(log.enable_chain_position_assert))
    ctx = canary_jax.VerifyOrWriteContext(
        canary_buf=jnp.asarray(rng.integers(0, 256, (N_SLOTS, 32), dtype=np.uint8)),
        kernel_kind=canary_jax.CanaryLaunchTag.HEAD_K_FULL,
        log=log,
        real_kv_sources=tuple(sources),
        real_kv_hash_mode=canary_jax.RealKvHashMode.ALL if sources else canary_jax.RealKvHashMode.NONE,
    )
    ids = rng.integers(1, 1 << 40, t)
    pos = rng.integers(0, 4, t)  # mostly not run position + 1: chain-position rows where the gate is on
    return ctx, plan, ids, _pairs(ids), _pairs(pos), _pairs(slots)


def _source(rng):
    data = jnp.asarray(rng.integers(0, 256, (N_SLOTS, 48), dtype=np.uint8))
    return canary_jax.RealKvSource(tensor=data, page_size=1, num_bytes_per_token=48, read_bytes=32)


def _write(ctx, ids, pos, loc, *, plan, **kw):
    return write_pallas(ctx, plan, ids, pos, loc, **kw)


def _sub_jaxprs(params):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(x, "jaxpr", x)
            if hasattr(inner, "eqns"):
                yield inner


def _kernel_primitives(jaxpr) -> list[str]:
    """Every primitive inside a kernel body, loops and branches entered."""
    out = []
    for e in jaxpr.eqns:
        out.append(e.primitive.name)
        for inner in _sub_jaxprs(e.params):
            out += _kernel_primitives(inner)
    return out


class LaunchStructureTest(absltest.TestCase):
    def assert_views_only(self, eqns, kernels, memsets):
        """``eqns`` are ``kernels`` (pallas_call names, in order) with only views between them and ``memsets``
        zeroed flag-word arrays (``u32[T]`` from a scalar)."""
        self.assertEqual([e.params["name"] for e in eqns if e.primitive.name == "pallas_call"], kernels)
        glue = [e for e in eqns if e.primitive.name != "pallas_call"]
        self.assertLessEqual({e.primitive.name for e in glue}, VIEWS | {"broadcast_in_dim"}, glue)
        fills = [e for e in glue if e.primitive.name == "broadcast_in_dim"]
        self.assertEqual(len(fills), memsets, fills)
        for e in fills:  # jnp.zeros of the flag words: a scalar literal broadcast to u32[T]
            (src,), (out,) = e.invars, e.outvars
            self.assertEqual((src.aval.shape, out.aval.dtype, len(out.aval.shape)), ((), jnp.uint32, 1))
            self.assertEqual(int(src.val), 0)
        for e in glue:
            if e.primitive.name == "bitcast_convert_type":
                (src,), (out,) = e.invars, e.outvars
                a, b = src.aval, out.aval
                same = a.dtype.itemsize == b.dtype.itemsize and a.shape == b.shape
                # the canary buffer's uint8[N, S] <-> uint32[N, S/4] view (a trailing axis of 4 bytes)
                canary = {a.dtype, b.dtype} == {jnp.dtype(jnp.uint8), jnp.dtype(jnp.uint32)}
                self.assertTrue(same or canary, e)

    def test_multi_launch_write_is_kernels_and_views(self):
        rng = np.random.default_rng(0)
        src = _source(rng)
        shapes = ((MULTI, [1] * 8, False), (LONG, [9, 7], True))  # (config, counts, long role)
        for interpret, (cfg, counts, long_role), sources, assert_inputs in itertools.product(
            (True, False), shapes, ((), (src,)), (False, True)
        ):
            ctx, plan, _, ids, pos, loc = _launch(rng, counts, rng.integers(0, N_SLOTS, sum(counts)), sources=sources)
            kw = dict(enable_write_input_assert=assert_inputs, config=cfg, interpret=interpret)
            if assert_inputs:
                kw.update(expected_input_tokens=ids, expected_input_positions=pos)
            names = ["canary_write_chain"] + ["canary_write_long"] * long_role + AFTER_CHAINS
            with self.subTest(interpret=interpret, long=long_role, sources=len(sources), assert_inputs=assert_inputs):
                eqns = traced_eqns(functools.partial(_write, plan=plan, **kw), ctx, ids, pos, loc)
                self.assert_views_only(eqns, names, memsets=1)

    def test_chain_reuse_launches_are_kernels_and_views(self):
        # A step's second write takes the first's chain hint: its flags start from the hint (no memset at all).
        rng = np.random.default_rng(1)
        ctx, plan, _, ids, pos, loc = _launch(rng, [9, 7], rng.integers(0, N_SLOTS, 16))

        def step(c1, c2):
            with chain_hints.chain_scope():
                a = write_pallas(c1, plan, ids, pos, loc, config=LONG, interpret=True)
                b = write_pallas(c2, plan, ids, pos, loc, config=LONG, interpret=True)
            return a, b

        one = ["canary_write_chain", "canary_write_long"] + AFTER_CHAINS
        self.assert_views_only(traced_eqns(step, ctx, ctx), one + one, memsets=1)


class DuplicateSlotsTest(absltest.TestCase):
    def assert_same(self, got, want):
        np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf))
        for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
            np.testing.assert_array_equal(np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name)))

    def check(self, cfg, counts, slots, seed, **kw):
        rng = np.random.default_rng(seed)
        ctx, plan, raw_ids, ids, pos, loc = _launch(rng, counts, slots, **kw)
        want = reference.write_reference(ctx, plan, ids, pos, loc)
        got = write_pallas(ctx, plan, ids, pos, loc, config=cfg, interpret=True)
        self.assert_same(got, want)
        # Independently of both: every slot written holds the token of its last writer (the requests cover the
        # tokens in order, so the last entry in entry order), as int64 field 0.
        tokens = np.asarray(got.canary_buf).view("<i8")[:, 0]
        for s in {int(x) for x in slots if 0 <= x < N_SLOTS}:
            last = max(i for i, x in enumerate(slots) if x == s)
            self.assertEqual(int(tokens[s]), int(raw_ids[last]), s)

    def test_duplicates_within_a_block_and_across_blocks(self):
        rng = np.random.default_rng(7)
        # 40 tokens over 5 blocks of 8: slots from {0..4} (each written in several blocks, several times per block),
        # a skipped and an out-of-range entry, over requests of mixed lengths.
        slots = rng.integers(0, 5, 40)
        slots[[3, 17]] = [-1, N_SLOTS + 2]
        counts = [5, 1, 9, 3, 8, 2, 12]
        for name, cfg in (("lanes", SMALL_BLOCKS), ("long role", dict(SMALL_BLOCKS, write_long_threshold=2))):
            for x64 in (False, True):
                with self.subTest(role=name, x64=x64), jax.enable_x64(x64):
                    self.check(PallasConfig(**cfg, write_long_chunk=4), counts, slots, seed=3)

    def test_one_slot_for_every_entry(self):
        # Every written entry of 3 blocks claims slot 9: the last one (entry 23) owns it.
        slots = np.full(24, 9)
        slots[23] = -1  # ... but the last entry skips, so entry 22 does
        self.check(PallasConfig(**SMALL_BLOCKS), [6, 6, 12], slots, seed=4, assert_flag=False)

    def test_claim_launch_alone_is_a_max(self):
        rng = np.random.default_rng(9)
        t, n = 40, 16
        words = rng.integers(0, 1 << 32, (n, 8), dtype=np.uint64).astype(np.uint32)
        words[:, CLAIM_WORD] = rng.integers(0, 30, n)  # some claims above some entries' i + 1
        loc = rng.integers(0, 4, t)  # 4 slots, each claimed many times in every block
        flags = rng.integers(0, 2, t).astype(np.uint32) * np.uint32(WriteFlag.WRITTEN)
        flags |= np.uint32(WriteFlag.GATE)  # other bits do not claim
        off = np.where(flags & WriteFlag.WRITTEN, loc, n + 3)  # (non-written entries' slots are never read)
        want = words.copy()
        written = np.flatnonzero(flags & WriteFlag.WRITTEN)
        np.maximum.at(want[:, CLAIM_WORD], loc[written], (written + 1).astype(np.uint32))
        got = claim_slots(
            jnp.asarray(words),
            _pairs(off),
            jnp.asarray(flags),
            num_tokens=t,
            block=8,
            grid=(2,),
            compiler_params=None,
            interpret=True,
        )
        np.testing.assert_array_equal(np.asarray(got), want)


class CompiledClaimTest(absltest.TestCase):
    def claim_eqn(self, interpret: bool):
        rng = np.random.default_rng(2)
        ctx, plan, _, ids, pos, loc = _launch(rng, [1] * 8, rng.integers(0, N_SLOTS, 8))
        eqns = traced_eqns(lambda c: write_pallas(c, plan, ids, pos, loc, config=MULTI, interpret=interpret), ctx)
        (eqn,) = [e for e in eqns if e.primitive.name == "pallas_call" and e.params["name"] == "canary_write_claim"]
        return eqn

    @absltest.skipUnless(importlib.util.find_spec("torch"), "the Triton IR printer lives in interop, which needs torch")
    def test_compiled_claim_is_a_masked_atomic_max(self):
        from interop.native import triton_ttir

        eqn = self.claim_eqn(interpret=False)
        self.assertEqual(_kernel_primitives(eqn.params["jaxpr"]).count("atomic_rmw"), 1)
        ttir = triton_ttir.kernel_spec(eqn).ttir
        # the float path's signed max on the bits, over a pointer tensor, with the written entries as its mask
        pat = r"tt\.atomic_rmw max, [^:]*: \(tensor<(\d+)x!tt\.ptr<i32>>, tensor<\1xi32>, tensor<\1xi1>\)"
        self.assertRegex(ttir, pat)
        self.assertEqual(len(re.findall(r"tt\.atomic_rmw max\b", ttir)), 1)

    def test_interpreted_claim_uses_no_atomics(self):
        # Interpret-mode atomics refuse masks and lose duplicate updates: the interpreted claim loops instead.
        # Two loops (the blocks, and the claim's rounds in each), a masked store and no atomic.
        prims = _kernel_primitives(self.claim_eqn(interpret=True).params["jaxpr"])
        self.assertEqual((prims.count("atomic_rmw"), prims.count("while"), prims.count("masked_swap")), (0, 2, 1))


if __name__ == "__main__":
    absltest.main()
