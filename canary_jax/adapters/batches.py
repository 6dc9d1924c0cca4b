"""Canary batches from the batch conventions of JAX serving stacks, built on the device inside the step.

The step API (:mod:`canary_jax.runtime.step`) reads a :class:`~canary_jax.runtime.state.CanaryBatch` in SGLang's
vocabulary: per request row ``req_pool_indices`` (0 = padding row), ``prefix_lens`` (tokens already in the KV),
``extend_seq_lens`` (tokens written this step); per token ``input_ids``, ``positions``, ``out_cache_loc`` (the
slot written; < 0 = no write); and where each (request, position) lives. Other stacks say the same things
differently. The functions here translate, with jnp only (jit-able, no host sync, fixed shapes), and give the
plan builder a :class:`~canary_jax.planning.slot_tables.SlotTable` over the stack's own layout instead of a dense
``req_to_token``, so the plans are byte-identical to those SGLang's builder makes for the same logical batch
and the work stays proportional to the planned entries.

=====================  ========================================================  ==================================
convention             the stack's batch                                         canary batch
=====================  ========================================================  ==================================
sglang-jax             ``ForwardBatch``: ``req_pool_indices`` (rows from 0;      ``req_pool_indices + 1`` (0 =
:func:`from_sglang_    padding -1), ``seq_lens`` (after the step; padding 0),    padding), prefix / extend as SGLang
jax`                   ``extend_prefix_lens`` / ``extend_seq_lens`` (EXTEND),    (decode: ``seq_lens - 1`` / 1), a
                       decode prefix ``seq_lens - 1``; ``out_cache_loc``         :class:`RaggedSlotTable` over
                       (padding -1); ragged ``cache_loc`` (``req_to_token``      ``cache_loc``
                       stays on the host)
vLLM-style             ``block_table`` ``[num_rows, max_blocks]``, ``block_      ``row + 1`` for rows < num_reqs,
:func:`from_block_     size``, ``seq_lens`` (after the step),                    prefix ``seq_lens - query_len``,
tables`                ``query_start_loc`` ``[num_rows + 1]``, ``num_reqs``      a :class:`BlockTable` computing
                       (rows past it padding), ``slot_mapping`` (optional;       ``bt[r, p // bs] * bs + p % bs``
                       padding -1), ``input_ids``, ``positions``                 in the gather
=====================  ========================================================  ==================================

Rows may move between steps (vLLM condenses and reorders its persistent batch; sglang-jax reuses
``req_to_token`` rows). Nothing the canary keeps is keyed by a row: the canary buffers are keyed by KV slot,
and within one step the rows only say which table row and expected-token row to read. So a request read from a
new row next step is checked exactly as before.

Errors: every field is checked before anything is traced; a wrong rank, dtype or length raises a ``ValueError``
or ``TypeError`` naming the function, the field, its shape and what was expected. Fields given as host data
(numpy, lists) also have their *values* checked (each function's Raises says which), naming the field, the
index, the value and the limit. Fields given as JAX arrays (and everything inside a ``jit``) are never read on
the host: their values are the caller's contract, and each function says what the plans then do.

:func:`from_sglang_jax` / :func:`from_sglang_jax_batch` live in :mod:`canary_jax.adapters.sglang_jax`,
:func:`from_block_tables` in :mod:`canary_jax.adapters.block_tables` and the field checks they share in
:mod:`canary_jax.adapters.batch_fields`; all are re-exported here. This module keeps what runs around the step
for any convention: :func:`sweep_plan_after_step` and :func:`update_swa_lut`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.adapters.batch_fields import _ints
from canary_jax.adapters.block_tables import from_block_tables
from canary_jax.adapters.sglang_jax import from_sglang_jax, from_sglang_jax_batch
from canary_jax.contract import ints, pairs
from canary_jax.ops.plan_launch import build_plans
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime.state import CanaryBatch

__all__ = [
    "from_block_tables",
    "from_sglang_jax",
    "from_sglang_jax_batch",
    "sweep_plan_after_step",
    "update_swa_lut",
]


# --- after the step: the sweep over what the batch holds, the SWA LUT of what it wrote ------------------
@jax.jit
def _kv_lens(prefix: jax.Array, extend: jax.Array) -> jax.Array:
    return pairs.pack(pairs.add(pairs.unpack(prefix), pairs.unpack(extend)))


def sweep_plan_after_step(
    batch: CanaryBatch,
    *,
    verify_capacity: int,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
) -> VerifyPlan:
    """A sweep VerifyPlan over every KV token the batch's requests hold after the step.

    For each live row ``r`` (``req_pool_indices[r] != 0``), positions ``[ws, prefix_lens[r] +
    extend_seq_lens[r])`` read through the batch's own slot table (dense, block table or ragged), prev = the
    real predecessor; exactly :func:`canary_jax.runtime.sweep.build_sweep_plan_from_requests` with ``seq_lens =
    prefix + extend``, for any batch convention. Run it with :func:`~canary_jax.runtime.step.canary_sweep`
    after the step's TAIL. Jit-able; overflow sets ``enable = 0``.

    Args:
      batch: a CanaryBatch (from SGLang fields or the adapters here).
      verify_capacity: C (static).
      swa_window_size, full_to_swa_index_mapping: as for :func:`~canary_jax.ops.plan_launch.build_plans` (the
        window of an SWA group; the LUT is not applied to a GroupSlotTables' ``swa`` table).

    Returns:
      The VerifyPlan.

    Raises:
      TypeError: ``batch`` not a CanaryBatch; ValueError / TypeError from ``build_plans``.
    """
    if not isinstance(batch, CanaryBatch):
        raise TypeError(f"kv-canary: sweep_plan_after_step: batch must be a CanaryBatch, got {type(batch).__name__}")
    bs = batch.batch_size
    vp, _ = build_plans(
        req_pool_indices=batch.req_pool_indices,
        prefix_lens=_kv_lens(jnp.asarray(batch.prefix_lens), jnp.asarray(batch.extend_seq_lens)),
        extend_seq_lens=np.zeros((bs,), np.int32),
        req_to_token=batch.req_to_token,
        verify_capacity=verify_capacity,
        write_req_capacity=max(1, bs),
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
    )
    return vp


@jax.jit
def _update_lut(lut: jax.Array, full: jax.Array, swa: jax.Array) -> jax.Array:
    n, t = lut.shape[0], full.shape[0]
    if n == 0 or t == 0:
        return lut
    idx, ok = pairs.index(pairs.unpack(full), n)
    order = jnp.arange(t, dtype=jnp.int32)
    target = jnp.where(ok, idx, n)  # n: dropped
    winner = jnp.full((n,), -1, jnp.int32).at[target].max(order, mode="drop")
    win = ok & (winner[jnp.where(ok, idx, 0)] == order)
    return lut.at[jnp.where(win, idx, n)].set(swa, mode="drop")


def update_swa_lut(lut: Any, full_slots: Any, swa_slots: Any) -> jax.Array:
    """``lut[full_slots[t]] = swa_slots[t]`` for this step's tokens: the full-to-SWA LUT an SWA canary group
    applies to ``out_cache_loc`` when it writes, kept current from two per-token slot mappings (vLLM's hybrid
    KV cache gives one ``slot_mapping`` per KV-cache group).

    With :func:`from_block_tables` ``swa_block_table=...`` the SWA group's *plans* read the SWA block table
    directly, so the LUT only has to be right for the tokens written this step: ``O(T)`` per step, no eviction
    bookkeeping. Store the result in the SWA group (``swa_index_lut``) before the step's HEAD. Jit-able.

    Args:
      lut: int64-valued ``[full_pool_size + 1]`` (any lossless int form; ``uint32[L, 2]`` pairs returned).
      full_slots: int64-valued ``[T]`` full-pool slots (entries outside ``[0, L)``, e.g. -1 padding, are
        skipped).
      swa_slots: int64-valued ``[T]`` SWA-pool slots of the same tokens.

    Returns:
      ``uint32[L, 2]``: the updated LUT. A full slot named twice takes the later token's SWA slot.

    Raises:
      ValueError / TypeError: wrong ranks, lengths or dtypes (naming the argument).
    """
    who = "update_swa_lut"
    table = ints.as_int64_pairs(lut, name=f"{who}: lut", shape=(None,))
    full = _ints(full_slots, who, "full_slots", None, "[num_tokens]")
    swa = _ints(swa_slots, who, "swa_slots", int(full.shape[0]), "[num_tokens]")
    return _update_lut(jnp.asarray(table), full, swa)
