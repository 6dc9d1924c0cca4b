"""Narrow int32 batch fields: a step traced with int32 ``req_pool_indices`` / ``prefix_lens`` / ``extend_seq_lens``
/ ``input_ids`` / ``positions`` / ``out_cache_loc`` (what serving stacks hold) hands them to the Pallas plan and
phase kernels as they are, with no widening op on the way (each would be a kernel launch of its own on a GPU), and
leaves the reference backend's bytes; the kernels read such fields sign-extended, also compiled for sm_90.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import unittest
import unittest.mock

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest
from jax._src.interpreters import partial_eval as pe

import canary_jax
from canary_jax.adapters.batches import from_sglang_jax
from canary_jax.contract import ints
from canary_jax.ops import reference
from canary_jax.planning.plan_inputs import check_plan_inputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_requests
from pallas_kernels import phase
from pallas_kernels.config import PallasConfig

ROWS, COLS, N_SLOTS = 4, 16, 80
EXTENDS = (3, 1, 2, 1)  # T = 7 tokens: chains of several tokens and of one
FIELDS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions", "out_cache_loc")


def _batch_fields(rng) -> dict:
    """A batch of 4 rows over a ``req_to_token`` of 5 rows: int32 numpy fields, token ids at the int32 extremes and
    negative, one token whose slot is skipped (-1)."""
    r2t = np.zeros((ROWS + 1, COLS), np.int32)
    r2t[1:] = rng.permutation(np.arange(1, N_SLOTS))[: ROWS * COLS].reshape(ROWS, COLS)  # no slot in two rows
    prefix = rng.integers(0, COLS - 3, ROWS).astype(np.int32)
    rows = np.repeat(np.arange(ROWS), EXTENDS)
    cols = prefix[rows] + np.concatenate([np.arange(n) for n in EXTENDS])
    ids = rng.integers(-(2**31), 2**31, len(rows)).astype(np.int32)
    ids[:2] = [-(2**31), 2**31 - 1]
    loc = r2t[rows + 1, cols].astype(np.int32)
    loc[3] = -1
    return dict(
        req_pool_indices=np.arange(1, ROWS + 1, dtype=np.int32),
        prefix_lens=prefix,
        extend_seq_lens=np.asarray(EXTENDS, np.int32),
        input_ids=ids,
        positions=cols.astype(np.int32),
        out_cache_loc=loc,
        req_to_token=r2t,
    )


def _step(state, fields, cfg):
    """Plan, HEAD, TAIL of one step, the batch built from ``fields`` inside the trace."""
    batch = CanaryBatch(**fields)
    plans = canary_plan(state, batch, config=cfg)
    state, plans = canary_head(state, batch, config=cfg, plans=plans)
    state, summary = canary_tail(state, plans, batch, config=cfg)
    return state, plans.per_group[0], summary


def _field_consumers(closed, first: int, count: int = len(FIELDS)) -> tuple[list, list]:
    """``(pallas_call names, other primitives)`` that read the ``count`` field inputs (``closed``'s invars from
    ``first``) or anything computed from them, after dead-code elimination, nested jits entered."""
    jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
    kernels, others = [], []

    def walk(jaxpr, tainted):
        for e in jaxpr.eqns:
            ins = [v for v in e.invars if not isinstance(v, jcore.Literal) and v in tainted]
            if not ins:
                continue
            if e.primitive.name in ("pjit", "jit"):
                inner = e.params["jaxpr"].jaxpr
                walk(inner, {iv for ov, iv in zip(e.invars, inner.invars) if ov in ins})
            elif e.primitive.name == "pallas_call":
                kernels.append(str(e.params.get("name")))
            else:
                others.append(e.primitive.name)
                tainted |= set(e.outvars)

    walk(jaxpr, set(jaxpr.invars[first : first + count]))
    return kernels, others


class NarrowStepTest(absltest.TestCase):
    def setUp(self):
        super().setUp()
        group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=N_SLOTS, has_v_half=False)
        self.state = CanaryState.create([group], ring_capacity=64)
        self.cfg = CanaryStepConfig(verify_capacity=64, write_req_capacity=ROWS, backend="pallas")

    def test_int32_fields_reach_the_kernels_unwidened_with_the_reference_bytes(self):
        rng = np.random.default_rng(3)
        host = _batch_fields(rng)
        table = jnp.asarray(host.pop("req_to_token"))

        def run(state, *cols, cfg):
            return _step(state, dict(zip(FIELDS, cols), req_to_token=table), cfg)

        cols = [jnp.asarray(host[n]) for n in FIELDS]
        closed = jax.make_jaxpr(lambda s, *c: run(s, *c, cfg=self.cfg))(self.state, *cols)
        kernels, others = _field_consumers(closed, len(jax.tree.leaves(self.state)))
        self.assertEqual(kernels, ["canary_plan", "canary_phase", "canary_phase"])
        self.assertEqual(others, [])

        state = self.state
        want_state = self.state
        ref_cfg = dataclasses.replace(self.cfg, backend="reference")
        for step in range(2):  # the second step verifies what the first wrote: chains, tokens, positions
            state, plan, summary = jax.jit(lambda s, *c: run(s, *c, cfg=self.cfg))(state, *cols)
            want_state, want_plan, want_summary = jax.jit(lambda s, *c: run(s, *c, cfg=ref_cfg))(want_state, *cols)
            with self.subTest(step=step):
                for got, want in zip(
                    jax.tree.leaves((state, plan, summary)), jax.tree.leaves((want_state, want_plan, want_summary))
                ):
                    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        # the prefixes were never written: every step reports them (rows the kernels and the reference agree on)
        self.assertGreater(int(summary.new_violations), 0)
        # the extreme and negative ids went in sign-extended: the canary's token field holds them as int64
        words = np.asarray(state.groups[0].k_tail).view(np.int64)
        loc = host["out_cache_loc"]
        for i in (0, 1):
            self.assertEqual(int(words[loc[i], 0]), int(host["input_ids"][i]))

    def test_a_step_is_its_three_kernels_and_layout_ops(self):
        # With the batch narrow, plan + HEAD + TAIL (PARTIAL, a real-KV source) leave nothing but their three
        # kernels and reshapes / bitcasts (free on a GPU) once dead code is gone: no packing, no glue kernels.
        host = _batch_fields(np.random.default_rng(8))
        table = jnp.asarray(host.pop("req_to_token"))
        kv = jnp.zeros((N_SLOTS, 64), jnp.bfloat16)
        cfg = dataclasses.replace(self.cfg, real_kv_hash_mode=canary_jax.RealKvHashMode.PARTIAL)

        def run(state, *cols):
            batch = CanaryBatch(**dict(zip(FIELDS, cols)), req_to_token=table)
            plans = canary_plan(state, batch, config=cfg)
            state, plans = canary_head(state, batch, config=cfg, plans=plans)
            src = canary_jax.RealKvSource(tensor=kv, page_size=1, num_bytes_per_token=128, read_bytes=16)
            return canary_tail(state, plans, batch, config=cfg, real_kv_sources=(((src,), ()),))[0]

        closed = jax.make_jaxpr(run)(self.state, *(jnp.asarray(host[n]) for n in FIELDS))
        jaxpr, _ = pe.dce_jaxpr(closed.jaxpr, [True] * len(closed.jaxpr.outvars))
        kernels, ops = [], set()

        def walk(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name in ("pjit", "jit"):
                    walk(e.params["jaxpr"].jaxpr)
                elif e.primitive.name == "pallas_call":
                    kernels.append(str(e.params.get("name")))
                else:
                    ops.add(e.primitive.name)

        walk(jaxpr)
        self.assertEqual(kernels, ["canary_plan", "canary_phase", "canary_phase"])
        self.assertLessEqual(ops, {"reshape", "bitcast_convert_type"})

    def test_sweep_plan_reads_the_int32_rows_unwidened(self):
        host = _batch_fields(np.random.default_rng(7))
        table = jnp.asarray(host["req_to_token"])
        lens = (host["prefix_lens"] + host["extend_seq_lens"]).astype(np.int32)

        def sweep(rpi, seq_lens):  # on the Pallas backend (the CPU's default is the reference)
            with unittest.mock.patch.dict(os.environ, {"CANARY_JAX_BACKEND": "pallas"}):
                return build_sweep_plan_from_requests(
                    req_to_token=table, req_pool_indices=rpi, seq_lens=seq_lens, verify_capacity=64
                )

        cols = (jnp.asarray(host["req_pool_indices"]), jnp.asarray(lens))
        closed = jax.make_jaxpr(sweep)(*cols)
        kernels, others = _field_consumers(closed, 0, 2)
        self.assertEqual((kernels, others), (["canary_plan"], []))
        got = jax.jit(sweep)(*cols)
        want = build_sweep_plan_from_requests(
            req_to_token=host["req_to_token"],
            req_pool_indices=host["req_pool_indices"].astype(np.int64),
            seq_lens=lens.astype(np.int64),
            verify_capacity=64,
        )
        self.assertEqual(int(want.verify_num_valid[0]), int(lens.sum()))
        for got_f, want_f in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(got_f), np.asarray(want_f))

    def test_the_batch_keeps_the_int32_fields_it_was_traced_with(self):
        host = _batch_fields(np.random.default_rng(4))
        seen = {}

        def probe(*cols):
            batch = CanaryBatch(**dict(zip(FIELDS, cols)), req_to_token=host["req_to_token"])
            seen["operands"] = [batch.operand(n) for n in FIELDS]
            seen["pairs"] = [getattr(batch, n) for n in FIELDS]
            swapped = batch.replace(input_ids=np.zeros(len(host["input_ids"]), np.int64))
            seen["swapped"] = [swapped.operand(n) for n in FIELDS]
            leaves, tree = jax.tree.flatten(batch)
            seen["tree"] = tree
            seen["unflattened"] = [jax.tree.unflatten(tree, leaves).operand(n) for n in FIELDS]
            return cols[0]

        cols = [jnp.asarray(host[n]) for n in FIELDS]
        jax.make_jaxpr(probe)(*cols)
        for name, op, pr in zip(FIELDS, seen["operands"], seen["pairs"]):
            self.assertEqual((op.dtype, op.shape), (jnp.int32, host[name].shape), name)
            self.assertEqual((pr.dtype, pr.shape), (jnp.uint32, (*host[name].shape, 2)), name)
        # the originals are no part of the pytree: a flattened batch has an eager batch's structure, and its pairs
        self.assertEqual([o.dtype for o in seen["unflattened"]], [jnp.uint32] * len(FIELDS))
        # the replaced field is its pairs now (a host int64 array); the others keep their int32 originals
        self.assertEqual(seen["swapped"][3].shape, (len(host["input_ids"]), 2))
        self.assertEqual([o.dtype for i, o in enumerate(seen["swapped"]) if i != 3], [jnp.int32] * 5)
        # concrete (untraced) int32 data is converted to pairs as before: nothing narrow outside a trace
        eager = CanaryBatch(**{n: jnp.asarray(host[n]) for n in FIELDS}, req_to_token=host["req_to_token"])
        self.assertEqual(eager.int32_fields, ())
        self.assertEqual(eager.operand("input_ids").shape, (len(host["input_ids"]), 2))
        self.assertEqual(jax.tree.structure(eager), seen["tree"])
        self.assertNotIn("int32_fields", [f.name for f in dataclasses.fields(CanaryBatch)])

    def test_sglang_jax_batches_hand_their_token_arrays_over_as_they_are(self):
        # from_sglang_jax inside jit (the README's EXTEND then DECODE steps): input_ids / positions / out_cache_loc
        # reach the phase kernels unwidened (the rows are derived: pairs), with the reference backend's bytes.
        steps = [
            dict(
                forward_mode="EXTEND",
                input_ids=[7, 8, 9, 30, 31, 0],
                positions=[0, 1, 2, 0, 1, 0],
                out_cache_loc=[5, 6, 7, 9, 10, -1],
                req_pool_indices=[0, 2, -1],
                seq_lens=[3, 2, 0],
                cache_loc=[5, 6, 7, 9, 10, 0, 0, 0],
                extend_prefix_lens=[0, 0, 0],
                extend_seq_lens=[3, 2, 0],
            ),
            dict(
                forward_mode="DECODE",
                input_ids=[10, 32, 0, 0, 0, 0],
                positions=[3, 2, 0, 0, 0, 0],
                out_cache_loc=[8, 11, -1, -1, -1, -1],
                req_pool_indices=[0, 2, -1],
                seq_lens=[4, 3, 0],
                cache_loc=[5, 6, 7, 8, 9, 10, 11, 0],
            ),
        ]
        cfg = CanaryStepConfig(verify_capacity=64, write_req_capacity=3, backend="pallas")
        got = want = self.state
        for fb in steps:
            mode = fb.pop("forward_mode")
            arrays = {k: jnp.asarray(v, jnp.int32) for k, v in fb.items()}

            def run(state, arrays, cfg, mode=mode):
                batch = from_sglang_jax(forward_mode=mode, **arrays, cache_loc_page_size=1)
                state, plans = canary_head(state, batch, config=cfg)
                return canary_tail(state, plans, batch, config=cfg)

            def tokens_in(s, ids, pos, loc, a=arrays):  # the three token arrays as the jaxpr's own inputs
                return run(s, {**a, "input_ids": ids, "positions": pos, "out_cache_loc": loc}, cfg)

            closed = jax.make_jaxpr(tokens_in)(got, *(arrays[k] for k in ("input_ids", "positions", "out_cache_loc")))
            kernels, others = _field_consumers(closed, len(jax.tree.leaves(got)), 3)
            self.assertEqual((kernels, others), (["canary_phase", "canary_phase"], []))
            got, summary = jax.jit(functools.partial(run, cfg=cfg))(got, arrays)
            want, want_summary = jax.jit(functools.partial(run, cfg=dataclasses.replace(cfg, backend="reference")))(
                want, arrays
            )
            for g, w in zip(jax.tree.leaves((got, summary)), jax.tree.leaves((want, want_summary))):
                np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        self.assertEqual(int(summary.verify_num_valid[0]), 5)  # the README's figures: 5 entries, no violation
        self.assertEqual(int(got.log.write_index[0]), 0)


class NarrowPhaseTest(absltest.TestCase):
    def test_phase_kernel_reads_narrow_tokens_as_their_pairs(self):
        # The one launch and the two launches it falls back to, with narrow ids, positions, slots and expected
        # tokens (the input assert on, one expected token off by one), against the references on their pairs.
        rng = np.random.default_rng(5)
        n, t = 40, 6
        vplan = canary_jax.VerifyPlan.from_entries(
            slots=rng.integers(0, N_SLOTS, n),
            positions=rng.integers(0, 3, n),
            prev_slots=rng.integers(-1, N_SLOTS, n),
            verify_capacity=n,
        )
        wplan = canary_jax.WritePlan.from_requests(counts=[2, 1, 3], seed_slots=[-1, 5, 7], write_req_capacity=4)
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=jnp.asarray(rng.integers(0, 256, (N_SLOTS, 32), dtype=np.uint8)),
            kernel_kind=canary_jax.CanaryLaunchTag.HEAD_K_FULL,
            log=canary_jax.ViolationLog.allocate(ring_capacity=64),
            real_kv_sources=(),
            real_kv_hash_mode=canary_jax.RealKvHashMode.NONE,
        )
        ids = np.array([-(2**31), 2**31 - 1, -5, 7, 0, 123456], np.int32)
        pos = rng.integers(0, 9, t).astype(np.int32)
        expected = ids.copy()
        expected[2] += 1
        narrow = [jnp.asarray(a) for a in (ids, pos, np.array([3, 9, -1, 9, 40, 41], np.int32), expected, pos)]
        wide = [ints.widen(a) for a in narrow]
        self.assertEqual([w.shape for w in wide], [(t, 2)] * 5)
        verified = reference.verify_reference(ctx, vplan, check_verify_expected_token=False)
        want = reference.write_reference(
            verified,
            wplan,
            *wide[:3],
            enable_write_input_assert=True,
            expected_input_tokens=wide[3],
            expected_input_positions=wide[4],
        )
        self.assertGreater(int(want.log.write_index[0]), 1)  # verify rows and the input-assert row
        config = PallasConfig(verify_block=16, verify_max_programs=2)
        for one_launch in (True, False):
            with self.subTest(one_launch=one_launch):
                got = phase.phase_pallas(
                    ctx,
                    vplan,
                    wplan,
                    *narrow[:3],
                    enable_write_input_assert=True,
                    expected_input_tokens=narrow[3],
                    expected_input_positions=narrow[4],
                    config=dataclasses.replace(config, phase_one_launch=one_launch),
                )
                np.testing.assert_array_equal(np.asarray(got.canary_buf), np.asarray(want.canary_buf))
                for name in ("ring", "write_index", "slot_run_counters", "kernel_run_counters"):
                    got_f, want_f = np.asarray(getattr(got.log, name)), np.asarray(getattr(want.log, name))
                    np.testing.assert_array_equal(got_f, want_f, err_msg=name)


@unittest.skipUnless(
    importlib.util.find_spec("triton") and importlib.util.find_spec("torch"), "needs the triton and torch packages"
)
class NarrowOfflineCompileTest(absltest.TestCase):
    def test_plan_and_phase_with_narrow_fields_compile_for_sm90(self):
        """The Triton IR of ``canary_plan`` and ``canary_phase`` with narrow int32 fields (as a traced step hands
        them over) compiles for sm_90 with triton's ptxas (no GPU needed)."""
        from interop.native import triton_kernels as tk
        from interop.native import triton_ttir as tt
        from pallas_kernels import plan as plan_kernel

        host = _batch_fields(np.random.default_rng(6))
        cols = [jnp.asarray(host[n]) for n in FIELDS]
        buf = jnp.zeros((N_SLOTS, 32), jnp.uint8)
        ctx = canary_jax.VerifyOrWriteContext(
            canary_buf=buf,
            kernel_kind=canary_jax.CanaryLaunchTag.HEAD_K_FULL,
            log=canary_jax.ViolationLog.allocate(ring_capacity=64),
            real_kv_sources=(),
            real_kv_hash_mode=canary_jax.RealKvHashMode.NONE,
        )

        def run(ctx, rpi, prefix, extend, ids, pos, loc):
            inputs = check_plan_inputs(
                req_pool_indices=rpi,
                prefix_lens=prefix,
                extend_seq_lens=extend,
                req_to_token=jnp.asarray(host["req_to_token"]),
                verify_capacity=64,
                write_req_capacity=ROWS,
                keep_int32=True,
            )
            vp, wp = plan_kernel.build_plans_pallas(inputs, interpret=False)
            kw = dict(check=False, assert_inputs=False, interpret=False, config=PallasConfig())
            return phase._phase(ctx, vp, wp, ids, pos, loc, None, None, **kw)

        eqns = []

        def collect(jaxpr):
            for e in jaxpr.eqns:
                if e.primitive.name in ("pjit", "jit"):
                    collect(e.params["jaxpr"].jaxpr)
                elif e.primitive.name == "pallas_call":
                    eqns.append(e)

        collect(jax.make_jaxpr(run)(ctx, *cols).jaxpr)
        self.assertEqual([e.params["name"] for e in eqns], ["canary_plan", "canary_phase"])
        for e, n in zip(eqns, (ROWS, len(host["input_ids"]))):
            with self.subTest(kernel=e.params["name"]):
                self.assertGreaterEqual(sum(v.aval.dtype == jnp.int32 and v.aval.shape == (n,) for v in e.invars), 3)
                self.assertEqual(tk.compile_offline(tt.kernel_spec(e), 90)["global_scratch_size"], 0)


if __name__ == "__main__":
    absltest.main()
