"""The block-table adapter (``canary_jax.adapters.block_tables``: vLLM, tpu-inference, eSurge) and the plan builder's
slot tables: random logical batches written as block tables plan byte-identically to SGLang's convention on the
same batch and equal the Python-int oracle; the HEAD launch leaves identical bytes; computed slots equal
``slot_mapping``; rows moving between steps; SWA block tables and their LUT; int64 and null-block lookups; jit with
a device ``num_reqs``; the builder's work following the entries; the sweep after a step; ragged tables; and every
bad input refused before tracing with the field named. Shared checks: ``tests/helpers/batch_parity.py``.
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.adapters import batches as ab
from canary_jax.contract import constants, ints
from canary_jax.planning.plan_builder import BlockTable, GroupSlotTables, RaggedSlotTable, build_plans
from canary_jax.runtime.state import CanaryBatch
from canary_jax.runtime.step import canary_head, canary_plan, canary_tail
from canary_jax.runtime.sweep import build_sweep_plan_from_requests
from helpers import engines as E
from helpers.batch_parity import (
    I64,
    MAX_BLOCKS,
    MAX_REQS,
    MAX_SEQ,
    NUM_SLOTS,
    PS,
    ROWS,
    TOKENS,
    ParityBase,
    block_table_batch,
    config,
    fresh_state,
    logical,
    plan_bytes,
    sglang_batch,
    sglang_dict,
    sglang_jax_batch,
)


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
        self.check_head_parity(block_table_batch(lb, 3), lb, state_seed=2)

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
