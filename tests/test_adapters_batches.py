"""Batch adapters (canary_jax.adapters.batches) and the plan builder's slot tables.

For each convention (sglang-jax, vLLM-style block tables), random logical batches (prefill, chunked prefill,
decode, shared prefix pages, padding rows and tokens) written in that convention must give plans byte-identical
to the SGLang-convention builder on the same logical batch written SGLang's way, and equal to the Python-int
oracle (``tests/helpers/plan_oracle.py``); the HEAD launch on both must leave identical canary bytes and logs.
Also: jit, rows moving between steps, SWA block tables, x64 on (a subprocess) byte-identical to x64 off, the
builder's work following the entries, and every bad input refused before tracing with the field named. Last,
the toy engines of ``tests/helpers/engines.py`` run clean for tens of steps and catch each injected fault; the
hybrid (full + sliding-window) engine also plans, every step, what SGLang's convention plans, and stays quiet
when an SWA block freed out of the window is corrupted and then reused.

Run as a script (``python tests/test_adapters_batches.py --dump OUT.npz``) it writes the plans of the fixed
scenarios, for the x64 subprocess.
"""

from __future__ import annotations

import collections
import os
import random
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.adapters import batches as ab
from canary_jax.contract import constants, ints
from canary_jax.planning.plan_builder import BlockTable, GroupSlotTables, RaggedSlotTable, build_plans
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan, canary_sweep, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_requests
from helpers import engines as E
from helpers import plan_oracle

I64 = ints.pairs_to_int64_np
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

PS, MAX_BLOCKS, NUM_PAGES, MAX_REQS = 4, 8, 96, 6
ROWS, TOKENS = 4, 16
MAX_SEQ = PS * MAX_BLOCKS
NUM_SLOTS = NUM_PAGES * PS
CACHE_LOC = 160
FR = constants.FailReason


def config(cap: int = 128, asserts: bool = True) -> CanaryStepConfig:
    return CanaryStepConfig(
        verify_capacity=cap,
        write_req_capacity=ROWS,
        enable_write_input_assert=asserts,
        enable_verify_token_assert=asserts,
        backend="reference",
    )


def fresh_state(swa_lut=None, seed: int | None = None) -> CanaryState:
    """A FULL group (and an SWA group when ``swa_lut``), canary buffers random when ``seed`` (so HEAD verify has
    something to report)."""
    groups = [CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=NUM_SLOTS, has_v_half=False)]
    if swa_lut is not None:
        groups.append(
            CanaryBufferGroup.allocate(
                kind=PoolKind.SWA, num_slots=NUM_SLOTS, has_v_half=False, swa_index_lut=swa_lut, swa_window_size=5
            )
        )
    if seed is not None:
        rnd = np.random.default_rng(seed)
        groups = [g.with_buffers(k_head=jnp.asarray(rnd.integers(0, 256, g.k_head.shape, np.uint8))) for g in groups]
    return CanaryState.create(groups, ring_capacity=64)


def plan_bytes(plans) -> dict:
    out = {}
    for g, (vp, wp) in enumerate(plans.per_group):
        for name in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions"):
            out[f"{g}_{name}"] = np.asarray(getattr(vp, name))
        out[f"{g}_prev"] = np.asarray(vp.verify_prev_slot_indices)
        out[f"{g}_num_valid"] = np.asarray(vp.verify_num_valid)
        out[f"{g}_enable"] = np.asarray(vp.enable)
        out[f"{g}_offsets"] = np.asarray(wp.write_offsets)
        out[f"{g}_seeds"] = np.asarray(wp.write_seed_slot_indices)
        out[f"{g}_nvr"] = np.asarray(wp.write_num_valid_reqs)
    return out


def sglang_batch(d: dict) -> CanaryBatch:
    """The SGLang-convention CanaryBatch (dense req_to_token; expected tokens addressed by req_pool_indices)."""
    n = d["num_live_tokens"]
    true = d["input_ids"].copy()
    true[n:] = 0
    return CanaryBatch(
        req_pool_indices=d["req_pool_indices"],
        prefix_lens=d["prefix_lens"],
        extend_seq_lens=d["extend_seq_lens"],
        input_ids=d["input_ids"],
        positions=d["positions"],
        out_cache_loc=d["out_cache_loc"],
        req_to_token=d["req_to_token"],
        expected_inputs=ExpectedInputs(tokens=true, positions=d["positions"]),
        req_to_verify_expected_tokens=d["expected_tokens"],
        req_to_verify_expected_tokens_valid_lens=d["expected_tokens_valid_lens"],
    )


def logical(seed: int, *, decode: bool, swa_window: int = 0) -> E.LogicalBatch:
    return E.random_logical_batch(
        random.Random(seed),
        page_size=PS,
        num_rows=ROWS,
        num_tokens=TOKENS,
        max_blocks=MAX_BLOCKS,
        num_pages=NUM_PAGES,
        max_reqs=MAX_REQS,
        decode=decode,
        swa_window=swa_window,
    )


def sglang_jax_batch(lb: E.LogicalBatch, seed: int, wrap=np.asarray) -> CanaryBatch:
    rng = random.Random(seed)
    d = E.to_sglang_jax(
        lb, cache_loc_len=CACHE_LOC, cache_loc_page_size=rng.choice([1, 2, 4]), max_reqs=MAX_REQS, rng=rng
    )
    pool, valid = d.pop("expected_tokens"), d.pop("expected_tokens_valid_lens")
    ex = ExpectedInputs(tokens=wrap(d["input_ids"]), positions=wrap(d["positions"]))
    d = {k: (wrap(v) if isinstance(v, np.ndarray) and k != "cache_loc" else v) for k, v in d.items()}
    return ab.from_sglang_jax(**d, expected_inputs=ex, expected_tokens=pool, expected_tokens_valid_lens=wrap(valid))


def block_table_batch(lb: E.LogicalBatch, seed: int, wrap=np.asarray, **kw) -> CanaryBatch:
    rng = random.Random(seed)
    opts = dict(slot_mapping=rng.random() < 0.5, dynamic_pad=rng.random() < 0.5)
    opts.update(kw)
    d = E.to_block_tables(lb, max_blocks=MAX_BLOCKS, rng=rng, **opts)
    pool, valid = d.pop("expected_tokens"), d.pop("expected_tokens_valid_lens")
    ex = ExpectedInputs(tokens=wrap(d["input_ids"]), positions=wrap(d["positions"]))
    for k in ("input_ids", "positions", "query_start_loc", "seq_lens", "slot_mapping"):
        if k in d:
            d[k] = wrap(d[k])
    if isinstance(d["num_reqs"], np.ndarray) and rng.random() < 0.5:
        d["num_reqs"] = jnp.asarray(d["num_reqs"])  # a device scalar; else a host array of shape (1,)
    return ab.from_block_tables(**d, expected_inputs=ex, expected_tokens=pool, expected_tokens_valid_lens=wrap(valid))


def sglang_dict(lb: E.LogicalBatch) -> dict:
    return E.to_sglang(lb, max_reqs=MAX_REQS, max_seq_len=MAX_SEQ, num_slots=NUM_SLOTS)


class ParityBase(absltest.TestCase):
    def assert_same_bytes(self, got: dict, want: dict, msg: str) -> None:
        self.assertEqual(sorted(got), sorted(want))
        for k in want:
            self.assertEqual(got[k].tobytes(), want[k].tobytes(), f"{msg}: {k}")

    def assert_oracle(self, plans, d: dict, cap: int, msg: str, group: int = 0, **kw) -> None:
        """The plans of group ``group`` against the Python-int oracle on the SGLang-convention batch."""
        want = plan_oracle.plan_oracle(
            req_pool_indices=d["req_pool_indices"],
            prefix_lens=d["prefix_lens"],
            extend_seq_lens=d["extend_seq_lens"],
            req_to_token=d["req_to_token"],
            verify_capacity=cap,
            write_req_capacity=ROWS,
            pool=d["expected_tokens"],
            valid_lens=d["expected_tokens_valid_lens"],
            strict=True,
            **kw,
        )
        vp, wp = plans.per_group[group]
        self.assertEqual(int(np.asarray(vp.verify_num_valid)[0]), want.num_valid, msg)
        self.assertEqual(int(np.asarray(vp.enable)[0]), want.enable, msg)
        n = want.num_valid if want.enable else 0
        np.testing.assert_array_equal(I64(vp.verify_slot_indices)[:n], want.slots or [], msg)
        np.testing.assert_array_equal(I64(vp.verify_prev_slot_indices)[:n], want.prevs or [], msg)
        np.testing.assert_array_equal(I64(vp.verify_expected_positions)[:n], want.positions or [], msg)
        np.testing.assert_array_equal(I64(vp.verify_expected_tokens)[:n], want.tokens or [], msg)
        np.testing.assert_array_equal(I64(wp.write_offsets)[: ROWS + 1], want.write_offsets, msg)
        np.testing.assert_array_equal(I64(wp.write_seed_slot_indices)[:ROWS], want.seeds, msg)

    def assert_write_inputs(self, got: CanaryBatch, d: dict, msg: str) -> None:
        """The tokens the write consumes (the first ``sum(extend)``) and their slots match SGLang's; the rest
        are never written (out_cache_loc -1)."""
        n = d["num_live_tokens"]
        live = I64(got.req_pool_indices) != 0
        np.testing.assert_array_equal(live, d["req_pool_indices"] != 0, msg)
        for f in ("prefix_lens", "extend_seq_lens"):
            np.testing.assert_array_equal(I64(getattr(got, f))[live], d[f][live], f"{msg}: {f}")
        np.testing.assert_array_equal(I64(got.input_ids)[:n], d["input_ids"][:n], msg)
        np.testing.assert_array_equal(I64(got.positions)[:n], d["positions"][:n], msg)
        np.testing.assert_array_equal(I64(got.out_cache_loc)[:n], d["out_cache_loc"][:n], msg)
        np.testing.assert_array_equal(I64(got.out_cache_loc)[n:], -1, msg)

    def check_parity(self, batch: CanaryBatch, lb: E.LogicalBatch, msg: str, cap: int = 128) -> None:
        d = sglang_dict(lb)
        want = canary_plan(fresh_state(), sglang_batch(d), config=config(cap))
        got = canary_plan(fresh_state(), batch, config=config(cap))
        self.assert_same_bytes(plan_bytes(got), plan_bytes(want), msg)
        self.assert_oracle(got, d, cap, msg)
        self.assert_write_inputs(batch, d, msg)


class SglangJaxTest(ParityBase):
    def test_random_batches_match_sglang_and_oracle(self):
        # Prefill from scratch, chunked-prefill continuations, shared prefix pages, decode; padding rows (-1)
        # and tokens (-1); rows from 0; cache_loc spans aligned to 1, 2 or 4; capacity 128 and an overflowing 24.
        for seed in range(12):
            lb = logical(seed, decode=seed % 3 == 2)
            batch = sglang_jax_batch(lb, seed)
            self.check_parity(batch, lb, f"seed {seed}", cap=24 if seed % 4 == 3 else 128)

    def test_hand_batch(self):
        # Row 0 is a real request (4 tokens in the KV, 2 new, page size 4 spans); row 3 prefills 3 tokens; one
        # padding row. cache_loc spans: row 0 -> [0, 8), row 3 -> [8, 12).
        b = ab.from_sglang_jax(
            forward_mode="EXTEND",
            input_ids=np.array([11, 12, 21, 22, 23, 0], np.int32),
            positions=np.array([4, 5, 0, 1, 2, 0], np.int32),
            out_cache_loc=np.array([28, 29, 12, 13, 14, -1], np.int32),
            req_pool_indices=np.array([0, 3, -1], np.int32),
            seq_lens=np.array([6, 3, 0], np.int32),
            cache_loc=np.array([20, 21, 22, 23, 28, 29, 7, 7, 12, 13, 14, 7, 0, 0], np.int32),
            extend_prefix_lens=np.array([4, 0, 0], np.int32),
            extend_seq_lens=np.array([2, 3, 0], np.int32),
            cache_loc_page_size=4,
        )
        np.testing.assert_array_equal(I64(b.req_pool_indices), [1, 4, 0])
        np.testing.assert_array_equal(I64(b.req_to_token.row_starts), [0, 8, 12])
        vp, wp = build_plans(
            req_pool_indices=b.req_pool_indices,
            prefix_lens=b.prefix_lens,
            extend_seq_lens=b.extend_seq_lens,
            req_to_token=b.req_to_token,
            verify_capacity=8,
            write_req_capacity=3,
        )
        self.assertEqual(int(np.asarray(vp.verify_num_valid)[0]), 4)
        np.testing.assert_array_equal(I64(vp.verify_slot_indices)[:4], [20, 21, 22, 23])
        np.testing.assert_array_equal(I64(vp.verify_prev_slot_indices)[:4], [-1, 20, 21, 22])
        np.testing.assert_array_equal(I64(wp.write_offsets), [0, 2, 5, 5])
        np.testing.assert_array_equal(I64(wp.write_seed_slot_indices), [23, -1, -1])

    def test_decode_prefix_is_seq_lens_minus_one(self):
        b = ab.from_sglang_jax(
            forward_mode="DECODE",
            input_ids=np.array([5, 6, 0, 0], np.int32),
            positions=np.array([6, 2, 0, 0], np.int32),
            out_cache_loc=np.array([9, 3, -1, -1], np.int32),
            req_pool_indices=np.array([2, 0, -1, -1], np.int32),
            seq_lens=np.array([7, 3, 0, 0], np.int32),
            cache_loc=np.zeros(16, np.int32),
        )
        np.testing.assert_array_equal(I64(b.prefix_lens), [6, 2, 0, 0])
        np.testing.assert_array_equal(I64(b.extend_seq_lens), [1, 1, 0, 0])
        np.testing.assert_array_equal(I64(b.req_pool_indices), [3, 1, 0, 0])
        np.testing.assert_array_equal(I64(b.req_to_token.row_starts), [0, 7, 10, 10])

    def test_mixed_mode_derives_prefix_and_forward_batch_reader(self):
        class ForwardMode:
            name = "MIXED"

        class FB:  # an sglang-jax ForwardBatch's attribute names; MIXED leaves the extend lengths None
            forward_mode = ForwardMode()
            input_ids = np.array([1, 2, 3, 0], np.int32)
            positions = np.array([3, 4, 9, 0], np.int32)
            out_cache_loc = np.array([4, 5, 10, -1], np.int32)
            req_pool_indices = np.array([1, 0], np.int32)
            seq_lens = np.array([5, 10], np.int32)
            cache_loc = np.arange(16, dtype=np.int32)
            extend_prefix_lens = None
            extend_seq_lens = None

        b = ab.from_sglang_jax_batch(FB(), extend_seq_lens=np.array([2, 1], np.int32))
        np.testing.assert_array_equal(I64(b.prefix_lens), [3, 9])
        np.testing.assert_array_equal(I64(b.extend_seq_lens), [2, 1])

    def test_head_launch_matches_sglang_bytes(self):
        # From random canary bytes, HEAD (verify with the token assert, then write with the input assert) on the
        # sglang-jax batch and on the SGLang batch leaves identical canary buffers, ring, counters.
        lb = logical(5, decode=False)
        self.assertGreater(len(lb.requests), 1)
        d = sglang_dict(lb)
        want, _ = canary_head(fresh_state(seed=1), sglang_batch(d), config=config())
        got, _ = canary_head(fresh_state(seed=1), sglang_jax_batch(lb, 5), config=config())
        self.assertGreater(int(np.asarray(want.log.write_index)[0]), 0)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            self.assertEqual(np.asarray(a).tobytes(), np.asarray(b).tobytes())

    def test_inside_jit(self):
        lb = logical(7, decode=False)
        d = E.to_sglang_jax(lb, cache_loc_len=CACHE_LOC, cache_loc_page_size=2, max_reqs=MAX_REQS, rng=random.Random(7))
        mode, page = d.pop("forward_mode"), d.pop("cache_loc_page_size")
        d.pop("expected_tokens"), d.pop("expected_tokens_valid_lens")
        state = fresh_state()

        @jax.jit
        def plan(arrays):
            return canary_plan(
                state,
                ab.from_sglang_jax(forward_mode=mode, cache_loc_page_size=page, **arrays),
                config=config(asserts=False),
            )

        got = plan({k: jnp.asarray(v) for k, v in d.items()})
        want = canary_plan(fresh_state(), sglang_batch(sglang_dict(lb)), config=config(asserts=False))
        self.assert_same_bytes(plan_bytes(got), plan_bytes(want), "jit")

    def test_bad_inputs_name_the_field(self):
        base = dict(
            forward_mode="EXTEND",
            input_ids=np.zeros(4, np.int32),
            positions=np.zeros(4, np.int32),
            out_cache_loc=np.zeros(4, np.int32),
            req_pool_indices=np.zeros(2, np.int32),
            seq_lens=np.zeros(2, np.int32),
            cache_loc=np.zeros(8, np.int32),
            extend_seq_lens=np.zeros(2, np.int32),
        )
        cases = [
            (
                dict(positions=np.zeros(5, np.int32)),
                ValueError,
                r"from_sglang_jax: positions must have shape \(4,\) "
                r"\[num_tokens\], got shape \(5,\)",
            ),
            (
                dict(seq_lens=np.zeros((2, 1), np.int32)),
                ValueError,
                r"seq_lens must be a 1-D integer array \[bs\], got shape \(2, 1\) dtype int32",
            ),
            (
                dict(req_pool_indices=np.zeros((2, 2), np.int32)),
                ValueError,
                r"req_pool_indices must be a 1-D "
                r"integer array \[bs\], got shape \(2, 2\)",
            ),
            (
                dict(out_cache_loc=np.zeros(4, np.float32)),
                TypeError,
                r"out_cache_loc must be an integer array "
                r"\[num_tokens\], got shape \(4,\) dtype float32",
            ),
            (
                dict(cache_loc=np.zeros((2, 4), np.int32)),
                ValueError,
                r"cache_loc must be a 1-D int32 array \[N\], "
                r"got shape \(2, 4\)",
            ),
            (
                dict(cache_loc=jnp.zeros(8, jnp.float32)),
                TypeError,
                r"cache_loc must be a 1-D int32 array \[N\], got "
                r"shape \(8,\) dtype float32",
            ),
            (dict(extend_seq_lens=None), ValueError, r"extend_seq_lens \(EXTEND batches\) is required"),
            (
                dict(forward_mode="TARGET_VERIFY"),
                NotImplementedError,
                "Unsupported forward mode for kv-canary: TARGET_VERIFY",
            ),
            (dict(cache_loc_page_size=0), ValueError, "cache_loc_page_size must be >= 1, got 0"),
            (
                dict(expected_tokens=np.zeros((2, 4), np.int32)),
                ValueError,
                "expected_tokens and expected_tokens_valid_lens go together",
            ),
        ]
        for change, exc, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(exc, pattern):
                ab.from_sglang_jax(**{**base, **change})

    def test_cache_loc_shorter_than_the_spans_is_refused_for_host_data(self):
        # Row 0 holds 3 slots, row 1 (padding, -1) 0, row 2 holds 4: spans [0:3], [3:7] of cache_loc.
        base = dict(
            forward_mode="DECODE",
            input_ids=np.zeros(3, np.int32),
            positions=np.zeros(3, np.int32),
            out_cache_loc=np.array([5, 9, -1], np.int32),
            req_pool_indices=np.array([0, 2, -1], np.int32),
            seq_lens=np.array([3, 4, 0], np.int32),
        )
        ab.from_sglang_jax(**base, cache_loc=np.arange(1, 8, dtype=np.int32))  # exactly long enough
        msg = (
            r"^kv-canary: from_sglang_jax: cache_loc has 6 entries but row 1 \(seq_lens\[1\] = 4\) reads "
            r"cache_loc\[3:7\] \(spans of the rows' seq_lens, in row order, each padded to cache_loc_page_size=1\)$"
        )
        for mode, extra in (("DECODE", {}), ("EXTEND", dict(extend_seq_lens=np.array([1, 1, 0], np.int32)))):
            with self.subTest(mode=mode), self.assertRaisesRegex(ValueError, msg):
                ab.from_sglang_jax(**{**base, **extra, "forward_mode": mode}, cache_loc=np.arange(1, 7, dtype=np.int32))
        with self.assertRaisesRegex(ValueError, r"cache_loc has 7 entries but row 1 .* reads cache_loc\[4:8\]"):
            ab.from_sglang_jax(**base, cache_loc=np.arange(1, 8, dtype=np.int32), cache_loc_page_size=2)
        # Device fields are not read on the host: a short cache_loc then reads slot 0 past its end.
        dev = {**base, "req_pool_indices": jnp.asarray(base["req_pool_indices"])}
        ab.from_sglang_jax(**dev, cache_loc=np.arange(1, 7, dtype=np.int32))


class BlockTableTest(ParityBase):
    def test_random_batches_match_sglang_and_oracle(self):
        # Block tables per batch row (garbage rows past num_reqs, null block 0 past each request's pages),
        # query_start_loc padded with 1, num_reqs static or a device scalar, slot_mapping given or computed.
        for seed in range(12):
            lb = logical(100 + seed, decode=seed % 3 == 2)
            batch = block_table_batch(lb, seed)
            self.check_parity(batch, lb, f"seed {seed}", cap=24 if seed % 4 == 3 else 128)

    def test_head_launch_matches_sglang_bytes(self):
        lb = logical(105, decode=False)
        self.assertGreater(len(lb.requests), 1)
        d = sglang_dict(lb)
        want, _ = canary_head(fresh_state(seed=2), sglang_batch(d), config=config())
        got, _ = canary_head(fresh_state(seed=2), block_table_batch(lb, 3), config=config())
        self.assertGreater(int(np.asarray(want.log.write_index)[0]), 0)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            self.assertEqual(np.asarray(a).tobytes(), np.asarray(b).tobytes())

    def test_computed_slots_equal_slot_mapping(self):
        for seed in range(4):
            lb = logical(200 + seed, decode=False)
            a = block_table_batch(lb, seed, slot_mapping=True, dynamic_pad=False)
            b = block_table_batch(lb, seed, slot_mapping=False, dynamic_pad=True)
            np.testing.assert_array_equal(I64(a.out_cache_loc), I64(b.out_cache_loc))

    def test_rows_move_between_steps(self):
        # Step 1 prefills requests A, B, C from rows 0, 1, 2; B finishes; step 2 decodes C from row 0 and A from
        # row 1 (vLLM condensed and reordered its batch). The canary reports nothing, and its canary bytes equal
        # those of the SGLang-convention run, whose req_to_token rows never move.
        reqs = [([101, 102, 103, 104, 105], [3, 4]), ([201, 202, 203], [7]), ([301, 302, 303, 304, 305, 306], [9, 10])]
        slots = [[pages[p // PS] * PS + p % PS for p in range(len(toks))] for toks, pages in reqs]
        cfg = config(asserts=False)

        def tokens(items):
            ids = [t for i, p, e in items for t in reqs[i][0][p : p + e]]
            pos = [q for i, p, e in items for q in range(p, p + e)]
            loc = [s for i, p, e in items for s in slots[i][p : p + e]]
            pad = TOKENS - len(ids)
            return np.array(ids + [0] * pad), np.array(pos + [0] * pad), np.array(loc + [0] * pad)

        def vllm_step(items):  # items: (request, prefix, extend) in batch-row order
            bt = np.zeros((ROWS, MAX_BLOCKS), np.int32)
            seq = np.zeros(ROWS, np.int32)
            qsl = [0]
            for row, (i, p, e) in enumerate(items):
                bt[row, : len(reqs[i][1])] = reqs[i][1]
                seq[row] = p + e
                qsl.append(qsl[-1] + e)
            ids, pos, _ = tokens(items)
            return ab.from_block_tables(
                input_ids=ids,
                positions=pos,
                query_start_loc=np.array(qsl + [1] * (ROWS + 1 - len(qsl))),
                seq_lens=seq,
                block_table=bt,
                block_size=PS,
                num_reqs=len(items),
            )

        def sglang_step(items):  # request i always lives in req_to_token row i + 1
            r2t = np.zeros((MAX_REQS + 1, MAX_SEQ), np.int32)
            for i, sl in enumerate(slots):
                r2t[i + 1, : len(sl)] = sl
            ids, pos, loc = tokens(items)
            pad = ROWS - len(items)
            return CanaryBatch(
                req_pool_indices=np.array([i + 1 for i, _, _ in items] + [0] * pad),
                prefix_lens=np.array([p for _, p, _ in items] + [0] * pad),
                extend_seq_lens=np.array([e for _, _, e in items] + [0] * pad),
                input_ids=ids,
                positions=pos,
                out_cache_loc=loc,
                req_to_token=r2t,
            )

        def run(batches):
            state = fresh_state()
            for b in batches:
                state, plans = canary_head(state, b, config=cfg)
                state, _ = canary_tail(state, plans, b, config=cfg)
            return state

        step1 = [(0, 0, 4), (1, 0, 3), (2, 0, 5)]
        vllm = run([vllm_step(step1), vllm_step([(2, 5, 1), (0, 4, 1)])])
        sgl = run([sglang_step(step1), sglang_step([(0, 4, 1), (2, 5, 1)])])
        self.assertEqual(int(np.asarray(vllm.log.write_index)[0]), 0)
        for name in ("k_head", "k_tail"):
            self.assertEqual(
                np.asarray(getattr(vllm.groups[0], name)).tobytes(), np.asarray(getattr(sgl.groups[0], name)).tobytes()
            )
        # step 2 verified the 9 prefix tokens of A and C in HEAD and TAIL
        counters = I64(vllm.log.slot_run_counters)
        self.assertEqual(int(counters[constants.CanaryLaunchTag.HEAD_K_FULL]), 12 + 9 + 2)

    def test_swa_block_table_matches_sglang_lut(self):
        # The SWA group reads its own block table (blocks out of the window are the null block) and plans what
        # SGLang plans from req_to_token + the full-to-SWA LUT (evicted = 0), through the step API.
        for seed in range(6):
            lb = logical(300 + seed, decode=seed % 2 == 1, swa_window=5)
            d = sglang_dict(lb)
            batch = block_table_batch(lb, seed)
            self.assertIsInstance(batch.req_to_token, GroupSlotTables)
            want = canary_plan(fresh_state(swa_lut=d["lut"]), sglang_batch(d), config=config())
            # The SWA group's own LUT is not read for planning: give it a different one.
            got = canary_plan(fresh_state(swa_lut=np.arange(NUM_SLOTS + 1)), batch, config=config())
            self.assert_same_bytes(plan_bytes(got), plan_bytes(want), f"seed {seed}")
            self.assert_oracle(got, d, 128, f"seed {seed}", group=1, swa_window_size=5, lut=list(d["lut"]))

    def test_update_swa_lut(self):
        lut = np.arange(10, dtype=np.int64) * 100
        got = ab.update_swa_lut(lut, np.array([3, -1, 12, 3, 0]), np.array([7, 8, 9, 5, 4]))
        want = lut.copy()
        want[3], want[0] = 5, 4  # -1 and 12 are outside the LUT; the later token wins slot 3
        np.testing.assert_array_equal(I64(got), want)

    def test_block_table_lookup_int64_and_null_block(self):
        # A block id whose slot passes 2**31 is computed exactly in int64; the null block and positions past
        # the table read slot 0.
        table = BlockTable(block_table=np.array([[2**30, 0, 5]], np.int32), block_size=8, null_block=0)
        pos = ints.as_int64_pairs(np.array([3, 9, 17, 24, -1, 2**40]), name="pos")
        got = I64(table.lookup(jnp.zeros(6, jnp.int32), pos, pos))
        np.testing.assert_array_equal(got, [2**30 * 8 + 3, 0, 5 * 8 + 1, 0, 0, 0])
        no_null = BlockTable(block_table=np.array([[2**30, 0, 5]], np.int32), block_size=8, null_block=None)
        self.assertEqual(int(I64(no_null.lookup(jnp.zeros(1, jnp.int32), pos[1:2], pos[1:2]))[0]), 1)

    def test_inside_jit_with_device_num_reqs(self):
        lb = logical(107, decode=False)
        d = E.to_block_tables(lb, max_blocks=MAX_BLOCKS, rng=random.Random(1), slot_mapping=False, dynamic_pad=True)
        d.pop("expected_tokens"), d.pop("expected_tokens_valid_lens")
        bs = d.pop("block_size")
        state = fresh_state()

        @jax.jit
        def plan(arrays):
            return canary_plan(state, ab.from_block_tables(block_size=bs, **arrays), config=config(asserts=False))

        got = plan({k: jnp.asarray(v) for k, v in d.items()})
        want = canary_plan(fresh_state(), sglang_batch(sglang_dict(lb)), config=config(asserts=False))
        self.assert_same_bytes(plan_bytes(got), plan_bytes(want), "jit")

    def test_builder_work_follows_entries_not_the_table(self):
        # A block table of 4 x 4096 blocks of 16 (262144 positions): no traced intermediate is larger than the
        # table itself or the plan; nothing of the size of a dense req_to_token (rows x positions) is built.
        rows, blocks, bsz, cap = 4, 4096, 16, 256
        table = BlockTable(block_table=jnp.zeros((rows, blocks), jnp.int32), block_size=bsz)
        jaxpr = jax.make_jaxpr(
            lambda t: build_plans(
                req_pool_indices=np.array([1, 2, 0, 0]),
                prefix_lens=np.array([100, 7, 0, 0]),
                extend_seq_lens=np.array([1, 1, 0, 0]),
                req_to_token=t,
                verify_capacity=cap,
                write_req_capacity=rows,
            )
        )(table)
        sizes = []

        def walk(x):
            if hasattr(x, "eqns"):
                for eqn in x.eqns:
                    sizes.extend(int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape"))
                    for p in eqn.params.values():
                        walk(p)
            elif hasattr(x, "jaxpr"):
                walk(x.jaxpr)
            elif isinstance(x, (tuple, list)):
                for y in x:
                    walk(y)

        walk(jaxpr.jaxpr)
        self.assertGreater(len(sizes), 100)
        self.assertLessEqual(max(sizes), max(rows * blocks, 2 * (cap + 1)))
        self.assertLess(max(sizes), rows * blocks * bsz)

    def test_sweep_plan_after_step_matches_dense_sweep(self):
        for seed in range(3):
            lb = logical(400 + seed, decode=False)
            d = sglang_dict(lb)
            got = ab.sweep_plan_after_step(block_table_batch(lb, seed), verify_capacity=128)
            want = build_sweep_plan_from_requests(
                req_to_token=d["req_to_token"],
                req_pool_indices=d["req_pool_indices"],
                seq_lens=d["prefix_lens"] + d["extend_seq_lens"],
                verify_capacity=128,
            )
            for name in (
                "verify_slot_indices",
                "verify_prev_slot_indices",
                "verify_expected_positions",
                "verify_num_valid",
                "enable",
            ):
                self.assertEqual(np.asarray(getattr(got, name)).tobytes(), np.asarray(getattr(want, name)).tobytes())
            sj = ab.sweep_plan_after_step(sglang_jax_batch(lb, seed), verify_capacity=128)
            self.assertEqual(
                np.asarray(sj.verify_slot_indices).tobytes(), np.asarray(want.verify_slot_indices).tobytes()
            )

    def test_ragged_table_reads_only_inside_spans(self):
        t = RaggedSlotTable(cache_loc=np.arange(10, 20, dtype=np.int32), row_starts=[0, 4], row_lens=[3, 6])
        rows = jnp.array([0, 0, 1, 1, 1, 2], jnp.int32)
        pos = ints.as_int64_pairs(np.array([2, 3, 5, 6, -1, 0]), name="pos")
        # row 0: p=2 -> cache_loc[2]; p=3 is past its length 3. row 1: p=5 -> cache_loc[4 + 5]; p=6 past its
        # length, p=-1 negative. Batch row 2 has no span.
        np.testing.assert_array_equal(I64(t.lookup(rows, pos, pos)), [12, 0, 19, 0, 0, 0])

    def test_bad_inputs_name_the_field(self):
        base = dict(
            input_ids=np.zeros(4, np.int32),
            positions=np.zeros(4, np.int32),
            query_start_loc=np.zeros(3, np.int32),
            seq_lens=np.zeros(2, np.int32),
            block_table=np.zeros((2, 3), np.int32),
            block_size=4,
        )
        cases = [
            (
                dict(block_table=np.zeros(6, np.int32)),
                ValueError,
                r"from_block_tables: block_table must be a 2-D "
                r"int32 array \[num_rows, max_blocks_per_req\] \(tpu-inference keeps block_tables flat: reshape it to "
                r"\[max_num_reqs, -1\]\), got shape \(6,\)",
            ),
            (dict(block_table=np.zeros((1, 3), np.int32)), ValueError, r"block_table must have at least 2 rows"),
            (
                dict(block_table=np.zeros((2, 3), np.float64)),
                TypeError,
                r"block_table must be a 2-D int32 array "
                r"\[num_rows, max_blocks_per_req\], got shape \(2, 3\) dtype float64",
            ),
            (
                dict(query_start_loc=np.zeros(2, np.int32)),
                ValueError,
                r"query_start_loc must have shape \(3,\) "
                r"\[num_rows \+ 1\], got shape \(2,\)",
            ),
            (
                dict(seq_lens=np.zeros(2, np.float32)),
                TypeError,
                r"seq_lens must be an integer array \[num_rows\], "
                r"got shape \(2,\) dtype float32",
            ),
            (dict(slot_mapping=np.zeros(3, np.int64)), ValueError, r"slot_mapping must have shape \(4,\)"),
            (dict(num_reqs=3), ValueError, r"num_reqs must be <= 2, got 3"),
            (dict(num_reqs=np.array([3])), ValueError, r"num_reqs must be <= 2, got 3"),
            (dict(num_reqs=np.zeros((1,), np.float32)), ValueError, r"num_reqs must be an int or an integer array"),
            (
                dict(num_reqs=jnp.zeros((2,), jnp.int32)),
                ValueError,
                r"num_reqs must be an int or an integer array "
                r"of shape \(\) or \(1,\), got shape \(2,\)",
            ),
            (dict(block_size=0), ValueError, "block_size must be positive, got 0"),
            (dict(swa_block_table=np.zeros((2,), np.int32)), ValueError, r"swa_block_table must be a 2-D int32"),
            (
                dict(expected_tokens=np.zeros((1, 4), np.int32), expected_tokens_valid_lens=np.zeros(2, np.int32)),
                ValueError,
                r"expected_tokens must have at least 2 rows",
            ),
            (dict(expected_inputs=(1, 2)), TypeError, "expected_inputs must be an ExpectedInputs"),
        ]
        for change, exc, pattern in cases:
            with self.subTest(pattern=pattern), self.assertRaisesRegex(exc, pattern):
                ab.from_block_tables(**{**base, **change})

    def test_wrong_length_seq_lens_is_named(self):
        with self.assertRaisesRegex(
            ValueError,
            r"^kv-canary: from_block_tables: seq_lens must have shape \(4,\) \[num_rows\], got shape \(5,\) dtype "
            r"int32 \(query_start_loc has 5 entries and block_table 4 rows\)$",
        ):
            ab.from_block_tables(
                input_ids=np.zeros(4, np.int32),
                positions=np.zeros(4, np.int32),
                query_start_loc=np.zeros(5, np.int32),
                seq_lens=np.zeros(5, np.int32),
                block_table=np.zeros((4, 3), np.int32),
                block_size=4,
            )

    def test_bad_host_values_are_refused(self):
        base = dict(
            input_ids=np.zeros(4, np.int32),
            positions=np.array([4, 5, 2, 0], np.int32),
            query_start_loc=np.array([0, 2, 3, 1, 1], np.int32),  # past num_reqs: tpu-inference's padding
            seq_lens=np.array([6, 3, 0, 0], np.int32),
            block_table=np.array([[5, 7, -1], [3, 0, -4], [-9, 0, 0], [0, 0, 0]], np.int32),  # unread: any value
            block_size=4,
            num_reqs=2,
        )
        ab.from_block_tables(**base)
        cases = [
            (
                dict(seq_lens=np.array([6, 0, 0, 0], np.int32)),
                r"^kv-canary: from_block_tables: seq_lens\[1\] = 0 is smaller than row 1's 1 new tokens "
                r"\(query_start_loc\[2\] - query_start_loc\[1\]\); seq_lens counts the KV tokens after the step, so "
                r"its prefix would be negative$",
            ),
            (
                dict(query_start_loc=np.array([0, 2, 1, 1, 1], np.int32)),
                r"^kv-canary: from_block_tables: query_start_loc must be non-decreasing over the 2 live rows "
                r"\(num_reqs\), got query_start_loc\[2\] = 1 < query_start_loc\[1\] = 2$",
            ),
            (
                dict(query_start_loc=np.array([0, 2, 5, 1, 1], np.int32)),
                r"^kv-canary: from_block_tables: query_start_loc\[2\] = 5 \(the end of the 2 live rows' new tokens, "
                r"num_reqs = 2\) is past the 4 tokens of input_ids$",
            ),
            (
                dict(block_table=np.array([[5, -1, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]], np.int32)),
                r"^kv-canary: from_block_tables: block_table\[0, 1\] = -1 is a negative block id in a block row 0 "
                r"reads \(null_block=0\); pass null_block=-1 if it means no block$",
            ),
            (
                dict(swa_block_table=np.array([[5, 7, 0], [-2, 0, 0], [0, 0, 0], [0, 0, 0]], np.int32)),
                r"^kv-canary: from_block_tables: swa_block_table\[1, 0\] = -2 is a negative block id",
            ),
        ]
        for change, pattern in cases:
            with self.subTest(field=next(iter(change))), self.assertRaisesRegex(ValueError, pattern):
                ab.from_block_tables(**{**base, **change})
        # A declared null block of -1 is accepted; device fields (and a device num_reqs) are not read on the host.
        neg_null = np.array([[5, -1, 0], [3, 0, 0], [0, 0, 0], [0, 0, 0]], np.int32)
        ab.from_block_tables(**{**base, "block_table": neg_null, "null_block": -1})
        ab.from_block_tables(**{**base, "seq_lens": jnp.array([6, 0, 0, 0], jnp.int32)})
        ab.from_block_tables(
            **{**base, "query_start_loc": np.array([0, 2, 1, 1, 1], np.int32), "num_reqs": jnp.int32(2)}
        )


# --- x64 -------------------------------------------------------------------------------------------------
def _x64_scenarios():
    """(name, batch builder) pairs; the builder takes a ``wrap`` for the int64-valued arrays."""
    out = []
    for seed in range(3):
        lb = logical(500 + seed, decode=seed == 2)
        out.append((f"sglang_jax_{seed}", lambda wrap, lb=lb, seed=seed: sglang_jax_batch(lb, seed, wrap)))
        out.append((f"block_{seed}", lambda wrap, lb=lb, seed=seed: block_table_batch(lb, seed, wrap)))
    return out


def x64_dump(int64_inputs: bool) -> dict:
    wrap = (lambda a: jnp.asarray(np.asarray(a, np.int64))) if int64_inputs else np.asarray
    out = {"x64": np.array([bool(jax.config.read("jax_enable_x64"))])}
    for name, make in _x64_scenarios():
        for k, v in plan_bytes(canary_plan(fresh_state(), make(wrap), config=config())).items():
            out[f"{name}/{k}"] = v
    return out


class X64Test(absltest.TestCase):
    def test_x64_on_gives_the_same_bytes(self):
        # A subprocess with JAX_ENABLE_X64=1 (also feeding JAX int64 arrays) plans the fixed scenarios; every
        # plan byte equals this process's (x64 off), which equal the SGLang-convention plans checked above.
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "x64.npz")
            env = dict(
                os.environ,
                JAX_ENABLE_X64="1",
                JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
            )
            proc = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--dump", out],
                env=env,
                capture_output=True,
                text=True,
                timeout=600,
            )
            self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
            with np.load(out) as z:
                on = {k: z[k] for k in z.files}
        self.assertFalse(bool(jax.config.read("jax_enable_x64")))
        self.assertTrue(bool(on.pop("x64")[0]))
        off = x64_dump(int64_inputs=False)
        off.pop("x64")
        self.assertEqual(sorted(on), sorted(off))
        for k in off:
            self.assertEqual(on[k].tobytes(), off[k].tobytes(), k)
        # and the x64-off plans equal the SGLang-convention builder's on the same logical batches
        for name, _ in _x64_scenarios():
            seed = int(name.rsplit("_", 1)[1])
            lb = logical(500 + seed, decode=seed == 2)
            want = plan_bytes(canary_plan(fresh_state(), sglang_batch(sglang_dict(lb)), config=config()))
            for k, v in want.items():
                self.assertEqual(off[f"{name}/{k}"].tobytes(), v.tobytes(), f"{name}/{k}")


# --- engines ---------------------------------------------------------------------------------------------
EXPECTED_BITS = {
    "kv_flip": FR.VERIFY_REAL_KV_HASH_MISMATCH,
    "table_remap": FR.VERIFY_POSITION_MISMATCH,
    "token_swap": FR.WRITE_TOKEN_MISMATCH,
}


class EngineTest(absltest.TestCase):
    CLEAN_STEPS = 24

    def run_engine(self, cls) -> None:
        engine = cls(seed=3)
        for _ in range(self.CLEAN_STEPS):
            engine.step()
        self.assertEqual(engine.violations(), (0, 0), f"{cls.__name__} clean run")
        # the clean run exercised what it claims to
        self.assertGreater(engine.stats["shared_pages"], 0)
        self.assertGreater(engine.stats["chunked_prefills"], 0)
        self.assertGreater(engine.stats["finished"], 0)
        self.assertGreater(engine.stats["sweeps"], 0)
        self.assertGreater(engine.pages.reused, 0)
        if cls is E.BlockTableEngine:
            self.assertGreater(engine.stats["row_moves"], 0)
        else:
            self.assertGreater(engine.stats["row0_used"], 0)
        for kind, inject in E.FAULTS.items():
            with self.subTest(kind=kind):
                engine = cls(seed=11)  # a fresh episode
                info = None
                for _ in range(12):
                    info = engine.step(inject=None if info else inject) or info
                    if info:
                        break
                self.assertIsNotNone(info, f"{kind} found nothing to break")
                n, bits = engine.violations()
                self.assertGreater(n, 0, f"{kind} went undetected")
                self.assertTrue(bits & EXPECTED_BITS[kind], f"{kind}: fail bits {FR(bits)!r}")

    def test_sglang_jax_engine(self):
        self.run_engine(E.SglangJaxEngine)

    def test_block_table_engine(self):
        self.run_engine(E.BlockTableEngine)


def _swa_tag(tag: int) -> bool:
    return constants.CanaryLaunchTag(tag).group == "SWA"


class HybridSwaEngineTest(absltest.TestCase):
    """vLLM's hybrid KV cache (a full-attention group and a sliding-window group, each with its block table and
    pool; ``E.HybridBlockTableEngine``) through the step API: HEAD, the model's KV write into both pools, TAIL
    with each group's layer-0 K, a periodic sweep of both groups. Every step's plans equal, byte for byte, those
    of SGLang's convention (dense ``req_to_token`` + full-to-SWA LUT, SPEC 7) for the same logical batch, but
    for one documented difference (see :meth:`HybridBlockTableEngine.sglang_view`)."""

    CLEAN_STEPS = 30
    SEED = 5

    def parity_observer(self, counts):
        swa_state = None

        def observe(engine, work, arrays, batch, plans):
            nonlocal swa_state
            v = engine.sglang_view(work, arrays)
            if swa_state is None:
                swa_state = CanaryState.create(
                    [
                        CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=engine.num_slots, has_v_half=False),
                        CanaryBufferGroup.allocate(
                            kind=PoolKind.SWA,
                            num_slots=engine.num_swa_slots,
                            has_v_half=False,
                            swa_index_lut=v["full_to_swa_index_mapping"],
                            swa_window_size=engine.SWA_WINDOW,
                        ),
                    ]
                )
            full, swa = swa_state.groups
            state = swa_state.replace(groups=(full, swa.replace(swa_index_lut=v["full_to_swa_index_mapping"])))
            sglang = CanaryBatch(
                req_pool_indices=v["req_pool_indices"],
                prefix_lens=v["prefix_lens"],
                extend_seq_lens=v["extend_seq_lens"],
                input_ids=arrays["input_ids"],
                positions=arrays["positions"],
                out_cache_loc=arrays["model_slots"],
                req_to_token=v["req_to_token"],
                expected_inputs=ExpectedInputs(tokens=arrays["expected_true"], positions=arrays["positions"]),
                req_to_verify_expected_tokens=v["expected_tokens"],
                req_to_verify_expected_tokens_valid_lens=arrays["valid_lens"],
            )
            want = plan_bytes(canary_plan(state, sglang, config=engine.config))
            got = plan_bytes(plans)
            # vLLM frees SWA blocks per request; SGLang's LUT is per full slot. Where a request's window-start
            # predecessor is freed in its own SWA row while another request still holds that shared slot,
            # vLLM's plan says prev 0 (chain check skipped) and SGLang's the live slot: patch exactly those.
            prefix = v["prefix_lens"]
            counts_per_row = [min(int(q), engine.SWA_WINDOW) if q > 0 else 0 for q in prefix]
            want["1_prev"] = want["1_prev"].copy()
            for i, p in v["prev_conflicts"]:
                idx = sum(counts_per_row[:i]) + p - max(0, int(prefix[i]) - engine.SWA_WINDOW)
                self.assertNotEqual(int(I64(want["1_prev"][idx : idx + 1])[0]), 0)
                want["1_prev"][idx] = 0
                counts["prev_conflicts"] += 1
            for k in want:
                self.assertEqual(got[k].tobytes(), want[k].tobytes(), f"step {engine.step_no}: {k}")
            self.assertEqual(int(got["1_enable"][0]), 1)
            counts["swa_entries"] += int(got["1_num_valid"][0])
            counts["full_entries"] += int(got["0_num_valid"][0])
            counts["steps"] += 1

        return observe

    def test_clean_run_matches_sglang_plans(self):
        engine = E.HybridBlockTableEngine(seed=self.SEED)
        counts = collections.Counter()
        observe = self.parity_observer(counts)
        for _ in range(self.CLEAN_STEPS):
            engine.step(observe=observe)
        self.assertEqual(engine.violations(), (0, 0), "hybrid clean run")
        self.assertEqual(counts["steps"], self.CLEAN_STEPS)
        st = engine.stats
        # the run exercised what it claims to: chunked prefill, decode past the window, full and SWA prefix
        # hits, SWA blocks freed out of the window and reused by other requests, finished requests, both sweeps
        for key in ("chunked_prefills", "decode_past_window", "shared_pages", "swa_shared_blocks", "swa_freed"):
            self.assertGreater(st[key], 0, key)
        self.assertGreater(st["finished"], 5)
        self.assertGreater(st["sweeps"], 5)
        self.assertGreater(st["row_moves"], 0)
        self.assertGreater(engine.swa.reused, 5)
        self.assertGreater(engine.pages.reused, 0)
        self.assertGreater(counts["swa_entries"], 100)
        self.assertGreater(counts["full_entries"], counts["swa_entries"])
        self.assertLess(engine.num_swa_slots, engine.num_slots)
        counters = I64(engine.state.log.slot_run_counters)
        for tag in ("HEAD_K_SWA", "TAIL_K_SWA", "SWEEP_K_SWA", "HEAD_K_FULL", "TAIL_K_FULL", "SWEEP_K_FULL"):
            self.assertGreater(int(counters[constants.CanaryLaunchTag[tag]]), 0, tag)

    def test_each_fault_is_detected_by_its_group(self):
        expected = {
            "swa_kv_flip": (FR.VERIFY_REAL_KV_HASH_MISMATCH, "SWA"),
            "swa_table_remap": (FR.VERIFY_POSITION_MISMATCH, "SWA"),
            "kv_flip": (FR.VERIFY_REAL_KV_HASH_MISMATCH, "FULL"),
            "token_swap": (FR.WRITE_TOKEN_MISMATCH, None),
        }
        for kind, inject in E.HYBRID_FAULTS.items():
            with self.subTest(kind=kind):
                engine = E.HybridBlockTableEngine(seed=11)  # a fresh episode
                for _ in range(6):  # past the window first
                    engine.step()
                info = None
                for _ in range(12):
                    info = engine.step(inject=inject)
                    if info:
                        break
                self.assertIsNotNone(info, f"{kind} found nothing to break")
                n, rows = engine.violation_rows()
                self.assertGreater(n, 0, f"{kind} went undetected")
                bit, group = expected[kind]
                hits = [r for r in rows if int(r[7]) & bit]
                self.assertTrue(hits, f"{kind}: fail bits {FR(int(np.bitwise_or.reduce(rows[:, 7])))!r}")
                if group is not None:
                    self.assertTrue(all(_swa_tag(int(r[0])) == (group == "SWA") for r in rows), f"{kind}: {rows}")

    def test_freed_swa_block_reused_is_quiet(self):
        # A block that left every window (freed, not in the prefix cache) gets a flipped byte in each slot. Read
        # now, those slots fail (control: a sweep of the block, whose canary records are still there). Instead
        # the pool hands it to another request, whose writes replace the KV and the records; its HEAD / TAIL
        # windows and the sweeps cover it again. Nothing is reported: the canary never reads a freed SWA block
        # (it is the null block in its old owner's SWA row).
        engine = E.HybridBlockTableEngine(seed=self.SEED)
        block = first = 0
        for _ in range(12):
            engine.step()
            block, first = E.flip_freed_swa_block(engine)
            if block:
                break
        self.assertTrue(block, "no freed SWA block to flip")
        ps = engine.PAGE_SIZE
        control = VerifyPlan.from_entries(
            slots=[block * ps + i for i in range(ps)], positions=[first + i for i in range(ps)], prev_slots=[0] * ps
        )
        probe = canary_sweep(engine.state, (None, control), config=engine.config, real_kv_sources=engine.sources())
        rows = I64(probe.log.ring)[: int(np.asarray(probe.log.write_index)[0])]
        self.assertEqual(len(rows), ps)
        self.assertTrue(all(int(r[7]) == FR.VERIFY_REAL_KV_HASH_MISMATCH for r in rows), rows)
        self.assertEqual(engine.violations(), (0, 0))  # the probe's log was not kept
        sweeps_at_flip = engine.stats["sweeps"]
        for _ in range(20):
            engine.step()
            if engine.stats["watched_verified"] >= ps and engine.stats["sweeps"] > sweeps_at_flip + 1:
                break
        self.assertGreaterEqual(engine.stats["watched_verified"], ps, "the block was not reused")
        self.assertGreater(engine.stats["sweeps"], sweeps_at_flip + 1)
        self.assertEqual(engine.violations(), (0, 0))


if __name__ == "__main__":
    if "--dump" in sys.argv:
        np.savez(sys.argv[sys.argv.index("--dump") + 1], **x64_dump(int64_inputs=True))
    else:
        absltest.main()
