"""What the batch-adapter tests share (``tests/test_adapters_batches.py``, ``test_adapters_block_tables.py``,
``test_adapters_engines.py``): the sizes, the step config and state, logical batches written in each convention
(SGLang's dense ``req_to_token``, sglang-jax, vLLM-style block tables) and ``ParityBase``, whose checks compare a
convention's plans with SGLang's, byte for byte, and with the Python-int oracle (``tests/helpers/plan_oracle.py``).
"""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

from canary_jax.adapters import batches as ab
from canary_jax.contract import constants, ints
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_head, canary_plan
from helpers import engines as E
from helpers import plan_oracle

I64 = ints.pairs_to_int64_np

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

    def check_head_parity(self, batch: CanaryBatch, lb: E.LogicalBatch, *, state_seed: int) -> None:
        """From random canary bytes (``fresh_state(seed=state_seed)``), HEAD (verify with the token assert, then
        write with the input assert) on ``batch`` and on ``lb`` written SGLang's way leaves identical canary
        buffers, ring, counters."""
        self.assertGreater(len(lb.requests), 1)
        want, _ = canary_head(fresh_state(seed=state_seed), sglang_batch(sglang_dict(lb)), config=config())
        got, _ = canary_head(fresh_state(seed=state_seed), batch, config=config())
        self.assertGreater(int(np.asarray(want.log.write_index)[0]), 0)
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            self.assertEqual(np.asarray(a).tobytes(), np.asarray(b).tobytes())

    def check_parity(self, batch: CanaryBatch, lb: E.LogicalBatch, msg: str, cap: int = 128) -> None:
        d = sglang_dict(lb)
        want = canary_plan(fresh_state(), sglang_batch(d), config=config(cap))
        got = canary_plan(fresh_state(), batch, config=config(cap))
        self.assert_same_bytes(plan_bytes(got), plan_bytes(want), msg)
        self.assert_oracle(got, d, cap, msg)
        self.assert_write_inputs(batch, d, msg)
