"""The step API cannot lose protection, copy the pool or recompile per batch (issue #12, step part).

One test per defect, each on the reference and the Pallas backend (interpreted on a CPU), with
``jax_enable_x64`` off and on (Pallas with x64 on: the padded-step case only, see ``STEP_MODES``):

1. real-KV sources are an argument of every hashing call: a KV byte flipped after a step is seen by the next
   TAIL and by a sweep; the state holds no KV data; a hashing mode without a source is refused (naming the
   group and the mode) and the refused call changes nothing;
2. a donated jitted step returns the pool and the canary state, not a second pool (a structural property: on
   Pallas with x64 off only, see ``STRUCTURE_MODES``);
3. numpy int64 batch fields (request index 2**40, position 2**32 + 7) are carried exactly with x64 off, eagerly
   and through a caller's ``jit``; a ``req_to_token`` value outside int32 is refused;
5. eager steps over token counts 1..300 compile a handful of programs (buckets) and store exactly the bytes of
   the unpadded step (checked against the Python-int oracle, and against an unpadded launch).

The Pallas cases run in one child process (:class:`PallasInChildProcessTest`): each interpreted Pallas compile
keeps hundreds of memory mappings on XLA:CPU until the process ends (``../shared/PITFALLS.md``), and these
cases alone take thousands of the 65530 a process may hold.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from canary_jax.contract import constants, decode, ints, layout, validation
from canary_jax.contract.sources import RealKvSource
from canary_jax.ops.buckets import Buckets
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime import phases
from canary_jax.runtime import step as step_lib
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_step, canary_sweep, canary_tail
from helpers import oracle

T = constants.CanaryLaunchTag
MODE = constants.RealKvHashMode
NUM_SLOTS = 512
KV_BYTES = 16
CHILD_ENV = "CANARY_STEP_SAFETY_PALLAS_CHILD"
IN_CHILD = os.environ.get(CHILD_ENV) == "1"
MODES = [(f"{b}_x64_{'on' if x else 'off'}", b, x) for b in ("reference", "pallas") for x in (False, True)]
# Pallas with x64 on runs one step case only: the padded step (test_padded_step_is_byte_identical_to_unpadded),
# whose launches meet every step-level kernel path (write, verify entries, PARTIAL real KV, a chain-position fault,
# padding rows and tokens) with the kernels traced under x64, byte for byte against the unpadded jit. The other
# cases' x64-on risk is in the host-side batch handling, which is backend-independent and runs with x64 on for
# the reference backend here; the Pallas kernels with x64 on are also checked against the Python-int oracle by
# tests/test_adapters_layouts.py (kernel body, PARTIAL and ALL) and tests/test_pallas_long_chain.py (long role).
# The output bytes of a compiled step are fixed by its output pytree (the pool, the canary state, the summary),
# whose shapes and dtypes x64 does not change (every int64 is a uint32 pair): the Pallas step compiled a second
# time with x64 on would measure the same number.
STRUCTURE_MODES = [m for m in MODES if m[0] != "pallas_x64_on"]
STEP_MODES = STRUCTURE_MODES  # Pallas x64 off only (see above)
# The stale-source and bucket-count cases check the host side (refusals, sources taken per call, bucketing), which
# no backend changes; their Pallas runs are covered by the padded step here, tests/test_buckets.py (padded Pallas
# launches equal unpadded) and tests/test_integration.py (CanaryGuard on both kernel backends). Reference only.
HOST_MODES = [m for m in MODES if m[1] == "reference"]


def in_x64_mode(fn):
    """Runs the test body with ``jax_enable_x64`` as the test's ``x64`` parameter says."""

    @functools.wraps(fn)
    def run(self, backend, x64):
        if (backend == "pallas") != IN_CHILD:
            self.skipTest("Pallas cases run in a child process (PallasInChildProcessTest), the rest here")
        with jax.enable_x64(x64):
            return fn(self, backend, x64)

    return run


def new_state(num_slots=NUM_SLOTS):
    group = CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=False)
    return CanaryState.create((group,), ring_capacity=16)


def config(backend, mode=MODE.NONE, **kw):
    return CanaryStepConfig(verify_capacity=64, write_req_capacity=4, real_kv_hash_mode=mode, backend=backend, **kw)


def sources(pool):
    """The one group's (sources_k, sources_v): the pool as it is now."""
    width = int(pool.shape[1])
    return (((RealKvSource(tensor=pool, page_size=1, num_bytes_per_token=width, read_bytes=width),), ()),)


def batch_of(*, prefix, slots, tokens, row=1, r2t_slots=(), num_rows=1):
    """One request (row ``row``) extending ``prefix`` with ``tokens`` at ``slots``; req_to_token holds
    ``r2t_slots`` then ``slots``."""
    n = len(slots)
    r2t = np.zeros((4, 320), np.int32)
    held = list(r2t_slots) + list(slots)
    r2t[1, : len(held)] = held
    pad = num_rows - 1
    return CanaryBatch(
        req_pool_indices=np.array([row] + [0] * pad, np.int64),
        prefix_lens=np.array([prefix] + [0] * pad, np.int64),
        extend_seq_lens=np.array([n] + [0] * pad, np.int64),
        input_ids=np.array(tokens, np.int64),
        positions=np.arange(prefix, prefix + n, dtype=np.int64),
        out_cache_loc=np.array(slots, np.int64),
        req_to_token=r2t,
    )


def kv_rows(tokens):
    return np.array([[(t * 7 + j + 1) % 251 for j in range(KV_BYTES)] for t in tokens], np.uint8)


def write_pool(pool, slots, tokens):
    return pool.at[np.asarray(slots)].set(kv_rows(tokens))


def copied(tree):
    return jax.tree_util.tree_map(jnp.array, tree)


def tree_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


class StaleSourcesTest(parameterized.TestCase):
    """Defect 1: the pool is an argument of every hashing call, never kept."""

    @parameterized.named_parameters(*HOST_MODES)
    @in_x64_mode
    def test_flip_after_a_step_is_seen_and_no_source_is_refused(self, backend, x64):
        cfg = config(backend, MODE.PARTIAL)
        pool = jnp.zeros((NUM_SLOTS, KV_BYTES), jnp.uint8)
        # Step 1: prefill 4 tokens into slots 1..4.
        b1 = batch_of(prefix=0, slots=[1, 2, 3, 4], tokens=[11, 12, 13, 14])
        state, plans = canary_head(new_state(), b1, config=cfg)
        pool = write_pool(pool, [1, 2, 3, 4], [11, 12, 13, 14])
        state, summary = canary_tail(state, plans, b1, config=cfg, real_kv_sources=sources(pool))
        self.assertEqual(int(summary.violations_total), 0)
        # The state holds the canary's buffers and log only: no leaf is (or is as large as) the pool.
        self.assertFalse(hasattr(state.groups[0], "real_kv_sources_k"))
        self.assertEqual(tree_bytes(state.groups), 2 * NUM_SLOTS * constants.CANARY_SLOT_BYTES)
        # A KV byte of slot 2 flips after the step.
        pool = pool.at[2, 5].set(pool[2, 5] ^ 0x10)
        # A sweep of the prefix with the pool as it is now sees it.
        sweep = VerifyPlan.from_entries(slots=[1, 2, 3, 4], positions=[0, 1, 2, 3], prev_slots=[-1, 1, 2, 3])
        swept = canary_sweep(copied(state), (sweep,), config=cfg, real_kv_sources=sources(pool))
        rec = decode.decode_violations(swept.log)
        self.assertEqual([(r.tag, r.slot_idx, r.reasons) for r in rec], [("SWEEP_K_FULL", 2, ["verify_real_kv_hash"])])
        # Step 2 (decode): HEAD has no real KV; TAIL verifies the prefix against the pool now.
        b2 = batch_of(prefix=4, slots=[5], tokens=[15], r2t_slots=[1, 2, 3, 4])
        # Refused before anything runs: no sources at all, or none for the K half (PARTIAL and ALL).
        state, plans = canary_head(state, b2, config=cfg)
        before = jax.tree_util.tree_map(np.asarray, state)
        with self.assertRaisesRegex(
            ValueError, r"real_kv_hash_mode=PARTIAL hashes the real KV, but canary_tail got no"
        ):
            canary_tail(state, plans, b2, config=cfg)
        with self.assertRaisesRegex(ValueError, r"real_kv_hash_mode=ALL .* group 0 \(FULL\) has no real-KV source"):
            canary_tail(state, plans, b2, config=config(backend, MODE.ALL), real_kv_sources=(((), ()),))
        with self.assertRaisesRegex(ValueError, r"real_kv_hash_mode=ALL .* canary_sweep got no real_kv_sources"):
            canary_sweep(state, (sweep,), config=config(backend, MODE.ALL))
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(before)):
            np.testing.assert_array_equal(np.asarray(a), b)  # the refused calls changed (and donated) nothing
        pool = write_pool(pool, [5], [15])
        state, summary = canary_tail(state, plans, b2, config=cfg, real_kv_sources=sources(pool))
        rec = decode.decode_violations(state.log)
        self.assertEqual([(r.tag, r.slot_idx, r.reasons) for r in rec], [("TAIL_K_FULL", 2, ["verify_real_kv_hash"])])
        self.assertEqual(int(summary.new_violations), 1)


def kv_write_fn(pool, batch):
    """The model's KV write: one row per token at its slot (slots fit int32: the low word of the pair)."""
    loc = batch.out_cache_loc[:, 0].astype(jnp.int32)
    tok = batch.input_ids[:, 0].astype(jnp.int32)
    rows = ((tok[:, None] * 7 + jnp.arange(pool.shape[1], dtype=jnp.int32)[None, :] + 1) % 251).astype(jnp.uint8)
    pool = pool.at[loc].set(rows)
    return pool, sources(pool)


class NoPoolCopyTest(parameterized.TestCase):
    """Defect 2: a donated step's outputs are the pool plus the canary state, nothing more."""

    @parameterized.named_parameters(*STRUCTURE_MODES)
    @in_x64_mode
    def test_donated_step_outputs_one_pool(self, backend, x64):
        num_slots = 1024
        cfg = config(backend, MODE.ALL)
        state = new_state(num_slots)
        pool = jnp.zeros((num_slots, 1024), jnp.uint8)  # 1 MiB, four times the canary buffers
        batch = batch_of(prefix=0, slots=[1, 2, 3], tokens=[7, 8, 9])

        def split_step(state, batch, pool):
            state, plans = canary_head(state, batch, config=cfg)
            pool, _ = kv_write_fn(pool, batch)
            state, summary = canary_tail(state, plans, batch, config=cfg, real_kv_sources=sources(pool))
            return state, pool, summary

        def one_call(state, batch, pool):
            return canary_step(state, batch, kv_write_fn, pool, config=cfg)

        budget = tree_bytes(state) + pool.nbytes + 1024  # + the StepSummary and XLA's output table (bytes)
        for step in (split_step, one_call):
            compiled = jax.jit(step, donate_argnums=(0, 2)).lower(state, batch, pool).compile()
            out = compiled.memory_analysis().output_size_in_bytes
            self.assertGreaterEqual(out, pool.nbytes)
            self.assertLessEqual(out, budget, f"{step.__name__}: {out} output bytes for a {pool.nbytes}-byte pool")


class Int64FieldsTest(parameterized.TestCase):
    """Defect 3: int64 batch fields are carried exactly (or refused), never cut to int32."""

    @parameterized.named_parameters(*STEP_MODES)
    @in_x64_mode
    def test_request_index_and_position_beyond_int32(self, backend, x64):
        cfg = config(backend)
        big = dict(
            # Not a padding row (its low word is 0): its write must happen. As a device array (pairs): host data
            # naming a row past req_to_token is refused below, a device value is the caller's contract.
            req_pool_indices=jnp.asarray(ints.int64_to_pairs_np(np.array([2**40], np.int64))),
            prefix_lens=np.array([0], np.int64),
            extend_seq_lens=np.array([2], np.int64),
            input_ids=np.array([2**33 + 5, -(2**40)], np.int64),
            positions=np.array([2**32 + 7, 2**32 + 8], np.int64),
            out_cache_loc=np.array([3, 4], np.int64),
            req_to_token=np.zeros((4, 8), np.int64),  # int64 data, every value fits int32: accepted
        )
        batch = CanaryBatch(**big)
        chain = oracle.chain_prev_hashes([2**33 + 5, -(2**40)], [2**32 + 7, 2**32 + 8])
        want = [(2**33 + 5, 2**32 + 7, oracle.s64(chain[0]), 0), (-(2**40), 2**32 + 8, oracle.s64(chain[1]), 0)]

        def step(state, batch):
            state, plans = canary_head(state, batch, config=cfg)
            return canary_tail(state, plans, batch, config=cfg)

        for run in (step, jax.jit(step)):  # eagerly (padded) and inside a caller's jit (inline)
            state, summary = run(new_state(), batch)
            for buf in (state.groups[0].k_head, state.groups[0].k_tail):
                self.assertEqual([tuple(layout.read_slot(buf, s)) for s in (3, 4)], want)
            self.assertEqual(state.log.slot_run_counter(T.TAIL_K_FULL), 2)
        with self.assertRaisesRegex(ValueError, r"req_to_token holds values outside int32 .*refusing to truncate"):
            CanaryBatch(**{**big, "req_to_token": np.full((4, 8), 2**31, np.int64)})
        state = new_state()
        before = jax.tree_util.tree_map(np.asarray, state)
        with self.assertRaisesRegex(
            ValueError,
            r"^kv-canary: req_pool_indices\[0\] = 1099511627776 is outside req_to_token's 4 rows "
            r"\(request rows 1\.\.3; 0 is the padding row\)$",
        ):
            step(state, CanaryBatch(**{**big, "req_pool_indices": np.array([2**40], np.int64)}))
        for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(before)):
            np.testing.assert_array_equal(np.asarray(a), b)  # refused: nothing donated or changed


class BucketsTest(parameterized.TestCase):
    """Defect 5: eager steps pad to buckets: few programs, the unpadded step's bytes."""

    @parameterized.named_parameters(*HOST_MODES)
    @in_x64_mode
    def test_token_counts_1_to_300_compile_few_programs(self, backend, x64):
        # The default policy over all 300 counts with x64 off; with x64 on fewer launches and a two-size bucket
        # list keep the test quick (the bucketing itself is swept over every count by the x64-off case).
        full = not x64
        counts = list(range(1, 301)) if full else list(range(1, 301, 23)) + [300]
        policy = None if full else Buckets(sizes=(32, 320))
        cfg = config(backend, buckets=policy)
        state, pool = new_state(), jnp.zeros((NUM_SLOTS, KV_BYTES), jnp.uint8)
        expect = np.zeros((NUM_SLOTS, 4), np.int64)
        programs = phases.step_jit._cache_size()
        for i, n in enumerate(counts):
            tokens = [(i * 1009 + j * 31) % 50000 + 2**31 * (j % 3) for j in range(n)]
            slots = list(range(1, n + 1))
            batch = batch_of(prefix=0, slots=slots, tokens=tokens, num_rows=1 + i % 3)
            state, pool, _ = canary_step(state, batch, kv_write_fn, pool, config=cfg)
            chain = oracle.chain_prev_hashes(tokens, range(n))
            expect[slots] = [(t, p, oracle.s64(h), 0) for t, p, h in zip(tokens, range(n), chain)]
        self.assertLessEqual(phases.step_jit._cache_size() - programs, 6 if policy is None else 2)
        for name in ("k_head", "k_tail"):
            np.testing.assert_array_equal(layout.read_all_slots(getattr(state.groups[0], name)), expect)
        # Padded entries are never counted: each write launch counted exactly its tokens.
        self.assertEqual(state.log.slot_run_counter(T.HEAD_K_FULL), sum(counts))
        self.assertEqual(state.log.kernel_run_counter(T.TAIL_K_FULL), 2 * len(counts))
        self.assertEqual(state.log.num_violations(), 0)

    @parameterized.named_parameters(*MODES)
    @in_x64_mode
    def test_padded_step_is_byte_identical_to_unpadded(self, backend, x64):
        # Verify entries, PARTIAL real KV and a chain-position fault, with tokens past the extends (malformed:
        # extend 6 over 5 real tokens), so padding rows and tokens meet every path.
        cfg = config(backend, MODE.PARTIAL)
        pool = write_pool(jnp.zeros((NUM_SLOTS, KV_BYTES), jnp.uint8), [1, 2, 3], [4, 5, 6])
        # The prefix's records come from the reference backend (the same bytes; it spares Pallas two compiles that
        # are not under test): the padded and the unpadded step below both run on ``backend``.
        setup = config("reference", MODE.PARTIAL)
        prefill = batch_of(prefix=0, slots=[1, 2, 3], tokens=[4, 5, 6])
        state, plans = canary_head(new_state(), prefill, config=setup)
        state, _ = canary_tail(state, plans, prefill, config=setup, real_kv_sources=sources(pool))
        batch = batch_of(prefix=3, slots=[7, 8, 9, 10, 11], tokens=[1, 2, 3, 4, 5], r2t_slots=[1, 2, 3], num_rows=2)
        # The extends as a device array: host data with extends past the tokens is refused (check_batch_values).
        batch = batch.replace(
            extend_seq_lens=jnp.array([6, 0], jnp.int32), positions=np.array([3, 4, 9, 6, 7], np.int64)
        )
        unpadded = jax.jit(functools.partial(canary_step, kv_write_fn=kv_write_fn, config=cfg))
        want = unpadded(copied(state), batch, kv_state=copied(pool))
        got = canary_step(state, batch, kv_write_fn, pool, config=cfg)
        self.assertGreater(int(got[2].new_violations), 0)
        # Canary state and summary: every byte. The pool: every slot but 0, which the model's padding tokens
        # write (out_cache_loc 0, the padding slot, as in SGLang's padded batches).
        for a, b in zip(jax.tree_util.tree_leaves((got[0], got[2])), jax.tree_util.tree_leaves((want[0], want[2]))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        np.testing.assert_array_equal(np.asarray(got[1])[1:], np.asarray(want[1])[1:])


def host_batch(**kw):
    """Row 1 extends prefix 0 by 2 tokens at slots 3, 4; a third token past the extend (owned by no request)."""
    r2t = np.zeros((4, 8), np.int32)
    r2t[1, :2] = [3, 4]
    fields = dict(
        req_pool_indices=[1, 0],
        prefix_lens=[0, 0],
        extend_seq_lens=[2, 0],
        input_ids=[5, 6, 7],
        positions=[0, 1, 0],
        out_cache_loc=[3, 4, 0],
        req_to_token=r2t,
    )
    fields.update(kw)
    return CanaryBatch(**fields)


def unchanged(test, state, before):
    for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(before)):
        test.assertFalse(a.is_deleted(), "a refused call must not donate the state")
        np.testing.assert_array_equal(np.asarray(a), b)


def step_write(kv, batch):
    return kv, None


class HostValueChecksTest(absltest.TestCase):
    """Host values that break SGLang's batch contract are refused by every step entry point, naming the field,
    index, value and limit; SGLang's padding stays accepted; device values are the caller's contract."""

    def entry_points(self, cfg):
        plans = canary_plan(new_state(), host_batch(), config=cfg)
        return {
            "canary_plan": lambda st, b: canary_plan(st, b, config=cfg),
            "canary_head": lambda st, b: canary_head(st, b, config=cfg),
            "canary_tail": lambda st, b: canary_tail(st, plans, b, config=cfg),
            "canary_step": lambda st, b: canary_step(st, b, step_write, jnp.zeros((4,), jnp.uint8), config=cfg),
        }

    def test_bad_host_values_are_refused_by_every_entry_point(self):
        cfg = config("reference")
        cases = [
            (
                dict(out_cache_loc=[3, NUM_SLOTS, 0]),
                rf"^kv-canary: out_cache_loc\[1\] = {NUM_SLOTS} is outside \[0, {NUM_SLOTS}\) \(num_slots of group 0's "
                r"\(FULL\) canary buffers\); token 1 is written by row 0 \(req_pool_indices\[0\] = 1\)\. Negative "
                r"entries skip the write \(SGLang's padding\); slots past the canary buffer are refused$",
            ),
            (
                dict(prefix_lens=[-1, 0]),
                r"^kv-canary: prefix_lens\[0\] = -1 is negative on a non-padding row "
                r"\(req_pool_indices\[0\] = 1\)$",
            ),
            (dict(extend_seq_lens=[-2, 0]), r"^kv-canary: extend_seq_lens\[0\] = -2 is negative on a non-padding row"),
            (
                dict(extend_seq_lens=[4, 0]),
                r"^kv-canary: the non-padding rows' extend_seq_lens sum to 4 but the batch has 3 tokens "
                r"\(input_ids, positions, out_cache_loc\)$",
            ),
            (
                dict(req_pool_indices=[-1, 0]),
                r"^kv-canary: req_pool_indices\[0\] = -1 is negative; 0 is the padding row \(SGLang's "
                r"REQ_POOL_IDX_PADDING\) and request rows start at 1$",
            ),
            (
                dict(req_pool_indices=[1, 4]),
                r"^kv-canary: req_pool_indices\[1\] = 4 is outside req_to_token's 4 rows \(request rows 1\.\.3; "
                r"0 is the padding row\)$",
            ),
        ]
        for kw, msg in cases:
            batch = host_batch(**kw)
            for name, call in self.entry_points(cfg).items():
                with self.subTest(field=next(iter(kw)), entry=name):
                    state = new_state()
                    before = jax.tree_util.tree_map(np.asarray, state)
                    with self.assertRaisesRegex(ValueError, msg):
                        call(state, batch)
                    unchanged(self, state, before)

    def test_sglang_padding_is_accepted_and_device_values_are_the_callers_contract(self):
        cfg = config("reference")
        # Padding row with any lengths, a negative slot (no write), slot 0, a token past the extends at any slot.
        ok = host_batch(
            prefix_lens=[0, -7], extend_seq_lens=[2, -3], out_cache_loc=[-1, 0, 10**6], req_pool_indices=[1, 0]
        )
        for name, call in self.entry_points(cfg).items():
            with self.subTest(entry=name):
                call(new_state(), ok)
        # The same bad slot on the device (or inside a jit) is not read on the host: skipped by the write kernel.
        dev = host_batch(out_cache_loc=jnp.array([3, NUM_SLOTS, 0], jnp.int32))
        state, _, _ = canary_step(new_state(), dev, step_write, jnp.zeros((4,), jnp.uint8), config=cfg)
        self.assertEqual(state.log.slot_run_counter(T.HEAD_K_FULL), 1)  # slot 3 written; 512 skipped
        jax.jit(lambda st, b: canary_head(st, b, config=cfg))(new_state(), host_batch(out_cache_loc=[3, NUM_SLOTS, 0]))

    def test_donated_state_and_kv_state_are_named(self):
        cfg = config("reference")
        state = new_state()
        new, plans = canary_head(state, host_batch(), config=cfg)
        msg = (
            r"^kv-canary: the state's canary buffers were donated by an earlier call \(canary_head, canary_tail and "
            r"canary_step donate them when called eagerly\); use the state that call returned$"
        )
        with self.assertRaisesRegex(ValueError, msg):
            canary_head(state, host_batch(), config=cfg)
        with self.assertRaisesRegex(ValueError, msg):
            canary_sweep(state, (None,), config=cfg)
        kv = jnp.zeros((4,), jnp.uint8)
        new, _, _ = canary_step(new, host_batch(), step_write, kv, config=cfg)
        before = jax.tree_util.tree_map(np.asarray, new)
        with self.assertRaisesRegex(
            ValueError, r"^kv-canary: kv_state holds an array donated by an earlier call .*use the kv_state"
        ):
            canary_step(new, host_batch(), step_write, kv, config=cfg)
        unchanged(self, new, before)

    def test_kv_write_fn_returning_a_one_tuple_is_named(self):
        cfg = config("reference")
        state = new_state()
        before = jax.tree_util.tree_map(np.asarray, state)
        with self.assertRaisesRegex(
            TypeError,
            r"^kv-canary: kv_write_fn must return a pair \(kv_state, real_kv_sources\): the new KV state and one "
            r"\(sources_k, sources_v\) pair per group, or None with real_kv_hash_mode NONE; got a tuple of 1$",
        ):
            canary_step(state, host_batch(), one_tuple_write, jnp.zeros((4,), jnp.uint8), config=cfg)
        unchanged(self, state, before)

    def test_three_d_source_message_carries_the_shape(self):
        cfg = config("reference", MODE.PARTIAL)
        state, plans = canary_head(new_state(), host_batch(), config=cfg)
        before = jax.tree_util.tree_map(np.asarray, state)
        three_d = RealKvSource(
            tensor=jnp.zeros((NUM_SLOTS, 2, 16), jnp.uint8), page_size=1, num_bytes_per_token=32, read_bytes=32
        )
        with self.assertRaisesRegex(
            ValueError,
            r"^kv-canary: real_kv_sources\[0\]\.tensor \(viewed as uint8\) must be 2-D, got 3-D "
            rf"\(shape \({NUM_SLOTS}, 2, 16\), dtype uint8\); view the pool as \[rows, row_elems\]",
        ):
            canary_tail(state, plans, host_batch(), config=cfg, real_kv_sources=(((three_d,), ()),))
        unchanged(self, state, before)


def one_tuple_write(kv, batch):
    return (kv,)


def none_mode_write(kv, batch):
    return kv, sources(jnp.zeros((NUM_SLOTS, KV_BYTES), jnp.uint8))


class WarningsTest(absltest.TestCase):
    def test_sources_in_none_mode_warn_once_per_entry_point(self):
        validation._WARNED_UNHASHED.clear()
        cfg = config("reference")  # NONE
        pool = jnp.zeros((NUM_SLOTS, KV_BYTES), jnp.uint8)
        sweep = VerifyPlan.from_entries(slots=[3], positions=[0], prev_slots=[-1])
        calls = {
            "canary_tail": lambda st: canary_tail(
                *canary_head(st, host_batch(), config=cfg), host_batch(), config=cfg, real_kv_sources=sources(pool)
            )[0],
            "canary_sweep": lambda st: canary_sweep(st, (sweep,), config=cfg, real_kv_sources=sources(pool)),
            "canary_step": lambda st: canary_step(st, host_batch(), none_mode_write, jnp.zeros(4), config=cfg)[0],
        }
        for who, call in calls.items():
            with self.subTest(entry=who):
                with warnings.catch_warnings(record=True) as got:
                    warnings.simplefilter("always")
                    call(new_state())
                    call(new_state())  # once per process per entry point
                mine = [w for w in got if "real_kv_hash_mode is NONE" in str(w.message)]
                self.assertEqual(len(mine), 1, [str(w.message) for w in got])
                self.assertIs(mine[0].category, UserWarning)
                self.assertRegex(
                    str(mine[0].message),
                    rf"^kv-canary: {who} got 1 real-KV source\(s\) but real_kv_hash_mode is NONE, so the real KV is "
                    r"not hashed \(only the bookkeeping is checked\); set real_kv_hash_mode to PARTIAL or ALL",
                )
        with warnings.catch_warnings(record=True) as got:  # no sources: no warning
            warnings.simplefilter("always")
            validation._WARNED_UNHASHED.clear()
            canary_sweep(new_state(), (sweep,), config=cfg)
        self.assertEqual([w for w in got if "NONE" in str(w.message)], [])

    def test_a_new_kv_write_fn_per_call_warns(self):
        cfg = CanaryStepConfig(verify_capacity=61, write_req_capacity=4, backend="reference")  # its own config
        old = step_lib.MAX_KV_WRITE_FNS_PER_CONFIG
        step_lib.MAX_KV_WRITE_FNS_PER_CONFIG = 2
        try:
            state, kv = new_state(), jnp.zeros((4,), jnp.uint8)
            with warnings.catch_warnings(record=True) as got:
                warnings.simplefilter("always")
                for _ in range(2):  # the same function twice: one object
                    state, kv, _ = canary_step(state, host_batch(), step_write, kv, config=cfg)
                for _ in range(4):  # a lambda per call: a new static argument each time
                    state, kv, _ = canary_step(state, host_batch(), lambda k, b: (k, None), kv, config=cfg)
            mine = [w for w in got if "distinct kv_write_fn" in str(w.message)]
            self.assertEqual(len(mine), 1)  # once, at the third distinct object
            self.assertIs(mine[0].category, UserWarning)
            self.assertRegex(
                str(mine[0].message),
                r"^kv-canary: canary_step has been called with 3 distinct kv_write_fn objects under one config; "
                r"kv_write_fn is a static argument, so each new object .* compiles a new program",
            )
        finally:
            step_lib.MAX_KV_WRITE_FNS_PER_CONFIG = old


class PallasInChildProcessTest(absltest.TestCase):
    """Runs every Pallas case above in a fresh process, so its compiled programs' mappings are released."""

    def test_pallas_cases(self):
        if IN_CHILD:
            self.skipTest("this is the child")
        here = os.path.dirname(os.path.abspath(__file__))
        env = dict(os.environ, **{CHILD_ENV: "1"})
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(here), here, env.get("PYTHONPATH", "")])
        # one process (pyproject's addopts would start two xdist workers for this one file)
        cmd = [sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider"]
        cmd.append(os.path.abspath(__file__))
        proc = subprocess.run(
            cmd + ["-k", "pallas"], cwd=os.path.dirname(here), env=env, capture_output=True, text=True, timeout=1800
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:] + proc.stderr[-2000:])
        # Every Pallas case ran: the int64 fields with x64 off, the padded step with x64 off and on, and the
        # output-bytes test.
        self.assertRegex(proc.stdout, r"\b4 passed\b")


if __name__ == "__main__":
    absltest.main()
