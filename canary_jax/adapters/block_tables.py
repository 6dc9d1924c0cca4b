"""The canary batch of a vLLM-style batch: block tables, ``query_start_loc``, ``seq_lens`` (:func:`from_block_tables`).

The convention of vLLM, tpu-inference and EasyDeL eSurge (see :func:`from_block_tables`): per-row new-token
offsets, KV lengths after the step, and a block table the plans read through a
:class:`~canary_jax.planning.slot_tables.BlockTable` (no ``req_to_token`` is built); the written slots come from
``slot_mapping`` or from the block table. Re-exported by :mod:`canary_jax.adapters.batches`, whose docstring
gives the conventions side by side.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.adapters.batch_fields import (
    _describe,
    _expected_inputs,
    _expected_tokens,
    _host,
    _host_num_reqs,
    _ints,
    _num_reqs,
    _prechecked_batch,
    _table,
    _where_pairs,
)
from canary_jax.contract import ints, pairs
from canary_jax.planning.slot_tables import BlockTable, GroupSlotTables, SlotTable
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.state import CanaryBatch

__all__ = ["from_block_tables"]


def _check_block_table_values(who, qsl, seq, bt, swa_bt, t, n, bsz, null_block) -> None:
    """Value checks of a vLLM-style batch's host fields (see :func:`from_block_tables`, Raises)."""
    if qsl is None or n is None:
        return
    for r in range(n):
        if qsl[r + 1] < qsl[r]:
            raise ValueError(
                f"kv-canary: {who}: query_start_loc must be non-decreasing over the {n} live rows (num_reqs), got "
                f"query_start_loc[{r + 1}] = {int(qsl[r + 1])} < query_start_loc[{r}] = {int(qsl[r])}"
            )
    if qsl[n] > t:
        raise ValueError(
            f"kv-canary: {who}: query_start_loc[{n}] = {int(qsl[n])} (the end of the {n} live rows' new tokens, "
            f"num_reqs = {n}) is past the {t} tokens of input_ids"
        )
    if seq is None:
        return
    for r in range(n):
        q = int(qsl[r + 1] - qsl[r])
        if seq[r] < q:
            raise ValueError(
                f"kv-canary: {who}: seq_lens[{r}] = {int(seq[r])} is smaller than row {r}'s {q} new tokens "
                f"(query_start_loc[{r + 1}] - query_start_loc[{r}]); seq_lens counts the KV tokens after the step, "
                "so its prefix would be negative"
            )
    for name, table in (("block_table", bt), ("swa_block_table", swa_bt)):
        if table is None:
            continue
        for r in range(n):
            used = table[r, : min(-(-int(seq[r]) // bsz), table.shape[1])]
            bad = np.flatnonzero((used < 0) if null_block is None else ((used < 0) & (used != null_block)))
            if bad.size:
                j = int(bad[0])
                raise ValueError(
                    f"kv-canary: {who}: {name}[{r}, {j}] = {int(used[j])} is a negative block id in a block row {r} "
                    f"reads (null_block={null_block}); pass null_block={int(used[j])} if it means no block"
                )


@jax.jit
def _block_table_rows(qsl, seq_lens, num_reqs):
    """Per-row fields of a vLLM-style batch: canary rpi, prefix, extend (``uint32[num_rows, 2]`` pairs)."""
    rows = seq_lens.shape[0]
    r = jnp.arange(rows, dtype=jnp.int32)
    live = r < num_reqs
    q = pairs.unpack(qsl)
    query_len = pairs.sub(pairs.U64(q.lo[1:], q.hi[1:]), pairs.U64(q.lo[:-1], q.hi[:-1]))
    extend = _where_pairs(live, pairs.pack(query_len), 0)
    prefix = _where_pairs(live, pairs.pack(pairs.sub(pairs.unpack(seq_lens), pairs.unpack(extend))), 0)
    rpi = _where_pairs(live, pairs.pack(pairs.from_int32(r + 1)), 0)
    return rpi, prefix, extend


def _token_slots(qsl, prefix, rpi, num_reqs, num_tokens: int, table: SlotTable) -> jax.Array:
    """The slot each of the ``num_tokens`` tokens writes, from the table (``uint32[T, 2]``; -1 past the live
    tokens): token ``t`` of row ``r`` (``qsl[r] <= t < qsl[r + 1]``) is position ``prefix[r] + t - qsl[r]``,
    where tpu-inference's ragged paged attention writes its KV (it has no slot_mapping)."""
    rows = prefix.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    if rows == 0 or num_tokens == 0:
        return pairs.pack(pairs.const(-1, (num_tokens,)))
    r = jnp.arange(rows, dtype=jnp.int32)
    q = pairs.unpack(qsl)
    ends = jnp.where(r < num_reqs, pairs.clamp(pairs.U64(q.lo[1:], q.hi[1:]), num_tokens), num_tokens)
    row = jnp.clip(jnp.searchsorted(ends, t, side="right", method="scan_unrolled").astype(jnp.int32), 0, rows - 1)
    start = pairs.U64(q.lo[row], q.hi[row])
    pos = pairs.add(pairs.unpack(prefix[row]), pairs.sub(pairs.from_int32(t), start))
    slot = table.lookup(row, rpi[row], pairs.pack(pos))
    n_live = pairs.U64(q.lo[num_reqs], q.hi[num_reqs])
    return _where_pairs(pairs.lt(pairs.from_int32(t), n_live), slot, -1)


@functools.partial(jax.jit, static_argnames=("num_tokens",))
def _vllm_out_cache_loc(qsl, prefix, rpi, num_reqs, slot_mapping, table, *, num_tokens: int):
    if slot_mapping is None:
        return _token_slots(qsl, prefix, rpi, num_reqs, num_tokens, table)
    q = pairs.unpack(qsl)
    n_live = pairs.U64(q.lo[num_reqs], q.hi[num_reqs])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return _where_pairs(pairs.lt(pairs.from_int32(t), n_live), slot_mapping, -1)


# --- public API ------------------------------------------------------------------------------------------


def from_block_tables(
    *,
    input_ids: Any,
    positions: Any,
    query_start_loc: Any,
    seq_lens: Any,
    block_table: Any,
    block_size: int,
    num_reqs: Any = None,
    slot_mapping: Any = None,
    swa_block_table: Any = None,
    null_block: int | None = 0,
    expected_inputs: ExpectedInputs | None = None,
    expected_tokens: Any = None,
    expected_tokens_valid_lens: Any = None,
) -> CanaryBatch:
    """The canary batch of a vLLM-style batch: block tables, ``query_start_loc``, ``seq_lens``.

    The convention of vLLM (``vllm/v1/attention/backends/utils.py`` ``CommonAttentionMetadata``: padding slots
    ``PAD_SLOT_ID = -1``; ``vllm/v1/core/block_pool.py``: block 0 is the null block), tpu-inference
    (``tpu_inference/layers/common/attention_metadata.py`` ``AttentionMetadata``; ``tpu_inference/runner/
    tpu_runner.py`` ``_prepare_inputs`` pads ``seq_lens`` with 0 and ``query_start_loc`` past ``num_reqs`` with
    1, and keeps ``block_tables`` flat: reshape it to ``[max_num_reqs, -1]``) and EasyDeL eSurge
    (``RaggedPagesMetadata``: ``pages_tables``, ``context_lens``, ``query_start_loc``, ``num_seqs``,
    ``page_size``). Per row ``r < num_reqs``: extend ``E = query_start_loc[r + 1] - query_start_loc[r]``,
    prefix ``seq_lens[r] - E``, canary row ``r + 1``; rows from ``num_reqs`` on are padding (canary row 0).
    Slots come from the block table in the gather (:class:`~canary_jax.planning.slot_tables.BlockTable`); no
    ``req_to_token`` is built. Rows are this step's batch rows: a request may sit in another row next step.

    Jit-able (fixed shapes, jnp only; ``num_reqs`` may be a device scalar); called eagerly it runs small jitted
    programs, one per shape set.

    Args:
      input_ids, positions: int64-valued ``[T]``; tokens ``t >= query_start_loc[num_reqs]`` are padding.
      query_start_loc: int64-valued ``[num_rows + 1]`` cumulative new-token offsets (``[0] == 0``,
        non-decreasing over the live rows; values past ``num_reqs`` are ignored).
      seq_lens: int64-valued ``[num_rows]`` tokens in the KV after this step.
      block_table: ``int32[>= num_rows, max_blocks_per_req]`` physical block ids of each batch row.
      block_size: tokens per block (static).
      num_reqs: live rows: an int, or an integer array of shape () or (1,) (a device value is data: one program
        serves every count; outside ``[0, num_rows]`` it is clipped); None: every row.
      slot_mapping: int64-valued ``[T]`` slot each token writes (vLLM's; padding entries ignored), or None to
        compute it from the block table at position ``prefix + (t - query_start_loc[r])`` (where
        tpu-inference's ragged paged attention writes).
      swa_block_table: ``int32[>= num_rows, max_blocks]`` block table of the sliding-window KV-cache group (its
        blocks index the SWA pool), read for SWA canary groups instead of the LUT (see
        :class:`~canary_jax.planning.slot_tables.GroupSlotTables` and :func:`update_swa_lut`); None: SWA groups, if
        any, translate the full table through their LUT.
      null_block: the "no block" id, read as slot 0 (skipped by verify, like an evicted slot); None: none.
      expected_inputs: ExpectedInputs (int64-valued ``[T]``) for the write input assert.
      expected_tokens: ``int32[>= num_rows, max_model_len]`` token ids of each batch row (vLLM's
        ``InputBatch.token_ids_cpu``) for the verify-token assert, with ``expected_tokens_valid_lens``
        (int64-valued ``[num_rows]``: ``num_tokens`` per row); both or neither.

    Returns:
      A :class:`~canary_jax.runtime.state.CanaryBatch` (``num_rows`` rows, so ``num_rows <=
      write_req_capacity``) whose ``req_to_token`` is a BlockTable (or GroupSlotTables); build it with this
      function again rather than ``CanaryBatch.replace``.

    Raises:
      ValueError / TypeError: a field of the wrong rank, dtype or length (naming it, its shape and the expected
        one), ``block_size <= 0``, ``num_reqs`` outside ``[0, num_rows]``; with host ``query_start_loc`` (and
        ``num_reqs`` an int, numpy or None): ``query_start_loc`` decreasing over the live rows or ending past
        the tokens, and with host ``seq_lens`` too, a live row's ``seq_lens`` below its new-token count (a
        negative prefix), or a negative block id other than ``null_block`` in the blocks a live row reads
        (of a host ``block_table`` / ``swa_block_table``); all before tracing. On the device these are the
        caller's contract: a negative prefix verifies nothing and restarts the row's chain at the anchor, and a
        negative block id gives negative slots (verify reads them as empty records and flags them; writes skip
        them).
    """
    who = "from_block_tables"
    seq = _ints(seq_lens, who, "seq_lens", None, "[num_rows]")
    rows = int(seq.shape[0])
    qsl = _ints(query_start_loc, who, "query_start_loc", None, "[num_rows + 1]")
    if int(qsl.shape[0]) != rows + 1:
        bt_shape = tuple(np.shape(block_table)) if block_table is not None else ()
        if len(bt_shape) == 2 and bt_shape[0] == int(qsl.shape[0]) - 1:  # the block table sides with qsl
            raise ValueError(
                f"kv-canary: {who}: seq_lens must have shape ({bt_shape[0]},) [num_rows], got {_describe(seq_lens)} "
                f"(query_start_loc has {qsl.shape[0]} entries and block_table {bt_shape[0]} rows)"
            )
        raise ValueError(
            f"kv-canary: {who}: query_start_loc must have shape ({rows + 1},) [num_rows + 1], got "
            f"{_describe(query_start_loc)} (seq_lens has {rows} rows)"
        )
    ids = _ints(input_ids, who, "input_ids", None, "[num_tokens]")
    t = int(ids.shape[0])
    pos = _ints(positions, who, "positions", t, "[num_tokens]")
    bsz = ints.check_int(block_size, name=f"{who}: block_size")
    if bsz <= 0:
        raise ValueError(f"kv-canary: {who}: block_size must be positive, got {bsz}")
    dims = "[num_rows, max_blocks_per_req]"
    hint = " (tpu-inference keeps block_tables flat: reshape it to [max_num_reqs, -1])"
    if block_table is not None and len(np.shape(block_table)) == 1:
        dims += hint
    full = BlockTable(
        block_table=_table(block_table, who, "block_table", 2, dims, rows), block_size=bsz, null_block=null_block
    )
    table: Any = full
    if swa_block_table is not None:
        swa = BlockTable(
            block_table=_table(swa_block_table, who, "swa_block_table", 2, "[num_rows, max_blocks]", rows),
            block_size=bsz,
            null_block=null_block,
        )
        table = GroupSlotTables(full=full, swa=swa)
    n = _num_reqs(num_reqs, rows, who)
    _check_block_table_values(
        who,
        _host(query_start_loc, "query_start_loc"),
        _host(seq_lens, "seq_lens"),
        _host(block_table, "block_table"),
        _host(swa_block_table, "swa_block_table"),
        t,
        _host_num_reqs(num_reqs, rows),
        bsz,
        null_block,
    )
    sm = None if slot_mapping is None else _ints(slot_mapping, who, "slot_mapping", t, "[num_tokens]")
    ex = _expected_inputs(expected_inputs, who, t)
    pool, valid = _expected_tokens(expected_tokens, expected_tokens_valid_lens, None, who, rows)
    if pool is not None and int(pool.tokens.shape[0]) < rows:
        raise ValueError(
            f"kv-canary: {who}: expected_tokens must have at least {rows} rows [num_rows, max_model_len], got "
            f"{_describe(pool.tokens)}"
        )

    rpi, prefix, extend = _block_table_rows(qsl, seq, n)
    loc = _vllm_out_cache_loc(qsl, prefix, rpi, n, sm, full, num_tokens=t)
    passed = dict(input_ids=input_ids, positions=positions)  # their pairs: widened as given (the slots are derived)
    return _prechecked_batch((rpi, prefix, extend), ids, pos, loc, table, ex, (pool, valid), passed)
