"""Per-forward plan building: batch metadata -> VerifyPlan + WritePlan (SPEC 7), and the expected-token scatter.

``build_plans`` is SGLang's ``launch_canary_plan_kernels`` (reference ``plan_ref.py``:
``launch_canary_plan_kernels_torch_reference``) as one jit-able jnp function with fixed capacities. No host
sync and no Python loop over requests or entries: per-request counts go through a scan, each verify entry
finds its request with an unrolled ``searchsorted`` and gathers from ``req_to_token``.

Semantics, for request row ``r`` with ``rpi = req_pool_indices[r]``, ``P = prefix_lens[r]``,
``E = extend_seq_lens[r]`` and the window ``W = swa_window_size``::

    verify:  skip r if rpi == 0 (padding row); ws = max(0, P - W) if W > 0 else 0
             for p in [ws, P): slot = T(req_to_token[rpi, p]); prev = -1 if p == 0 else T(req_to_token[rpi, p-1])
                               position = p; token = pool[rpi, p + k] if 0 <= p + k < valid_lens[r] else -1
             total = sum of entries; total > C -> enable = 0, num_valid = C (entries not written)
                                     otherwise   enable = 1, num_valid = total
    write:   wlen[r] = E if rpi != 0 and E > 0 else 0; write_offsets = exclusive cumsum (tail zero)
             seed[r] = -1 if rpi == 0 or E <= 0 or P <= 0 else T(req_to_token[rpi, min(P - 1, max(L - 1, 0))])
             write_num_valid_reqs = bs

``T`` is the SWA translation ``x -> x if x < 0 else LUT[x]`` (identity without a LUT). SWA windows do not
reset the chain: the window's first entry points at its real predecessor.

Decisions where SGLang's reference and kernels differ or are undefined (SPEC 13 b, c; tests pin each):

* SWA slot ``x >= len(LUT)``: the reference raises, the Triton/CUDA kernels clamp. canary-jax clamps to
  ``LUT[len - 1]`` like the kernels SGLang runs in production (an error is impossible inside ``jit``), so the
  LUT is never read outside its bounds; in-range inputs are byte-identical to the reference.
* Seed column: the reference clamps ``P - 1`` to ``max_seq_len - 1``; canary-jax does the same.
* ``req_to_token`` reads outside the table (``rpi`` not in ``[0, max_reqs)`` or a column not in
  ``[0, max_seq_len)``; the reference raises ``IndexError`` or wraps negative rows) read as
  ``TOKEN_TO_KV_SLOT_PADDING`` (0), then go through the LUT like any slot value. A verify slot 0 is skipped
  and a prev slot 0 disables the chain check, so such entries stay quiet in the FULL group.
* Expected-token reads outside the pool (row or column out of range while ``p + k < valid_lens[r]``) give
  -1 (token check skipped); the pool is never read outside its bounds.
* ``bs > write_req_capacity`` raises the kernel path's ValueError (the reference silently caps); SGLang's
  ``bs <= 4096`` limit of the Triton offsets kernel does not apply (there is no block size here).
* Regions SGLang leaves untouched keep the values of ``verify_plan_out`` / ``write_plan_out`` (fresh
  ``allocate()`` plans when not given): entries past ``num_valid`` (all of them on overflow) and seeds past
  ``bs``. ``write_offsets`` past ``bs`` are zero, as in SGLang.

``req_to_token`` may be any slot table of :mod:`canary_jax.planning.slot_tables` instead of SGLang's dense array
(vLLM-style :class:`~canary_jax.planning.slot_tables.BlockTable`, sglang-jax's ragged
:class:`~canary_jax.planning.slot_tables.RaggedSlotTable`, per-group
:class:`~canary_jax.planning.slot_tables.GroupSlotTables`), and the expected-token pool an
:class:`~canary_jax.planning.slot_tables.ExpectedTokenTable`; every table is read only at the planned entries, and one
that agrees with SGLang's ``req_to_token`` on the positions read gives byte-identical plans. The tables and
:func:`~canary_jax.planning.slot_tables.swa_translate` live in :mod:`canary_jax.planning.slot_tables` and are
re-exported here.

``scatter_req_token_ids`` fills the expected-token pool (SPEC 7.4; SGLang ``scatter_req_token_ids.py``); it lives
in :mod:`canary_jax.planning.expected_tokens` and is re-exported here.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from canary_jax.contract import pairs
from canary_jax.planning.expected_tokens import scatter_req_token_ids  # re-exported: its historical home
from canary_jax.planning.plan_inputs import check_plan_inputs
from canary_jax.planning.plans import VerifyPlan, WritePlan
from canary_jax.planning.slot_reads import _gather_2d, _swa_translate
from canary_jax.planning.slot_tables import (  # re-exported: plan_builder is the tables' historical home
    BlockTable,
    ExpectedTokenTable,
    GroupSlotTables,
    RaggedSlotTable,
    ReqToTokenTable,
    SlotTable,
    swa_translate,
)

__all__ = [
    "BlockTable",
    "ExpectedTokenTable",
    "GroupSlotTables",
    "RaggedSlotTable",
    "ReqToTokenTable",
    "SlotTable",
    "build_plans",
    "scatter_req_token_ids",
    "swa_translate",
]


# --- build_plans ------------------------------------------------------------------------------------------
def _saturating_cumsum(x: jax.Array, bound: int) -> jax.Array:
    """Inclusive cumsum of non-negative int32 values, saturating at ``bound`` (``min(a + b, bound)`` is
    associative for non-negative operands, and ``2 * bound`` fits int32)."""
    if x.shape[0] == 0:
        return x
    return jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, bound), x)


def _pool_lookup(pool: Any, batch_row: jax.Array, rpi: pairs.U64, col: pairs.U64) -> tuple[jax.Array, jax.Array]:
    """``(int32 token, in_pool)`` from SGLang's raw pool (rows = ``req_pool_indices``) or an ExpectedTokenTable."""
    if isinstance(pool, ExpectedTokenTable):
        return pool._lookup64(batch_row, rpi, col)
    return _gather_2d(pool, rpi, col, -1)  # SGLang: rows are req_pool_indices


_VERIFY_FIELDS = (
    "verify_slot_indices",
    "verify_expected_tokens",
    "verify_expected_positions",
    "verify_prev_slot_indices",
)


def _entry_words(a: pairs.U64, live: jax.Array, old: jax.Array | None) -> jax.Array:
    """One verify field as packed ``uint32[C, 2]``: ``a`` at live entries, else ``old`` (0 when None).

    Written in one elementwise pass over ``[C, 2]`` (word ``w`` of entry ``i`` picks ``a.lo[i]`` or
    ``a.hi[i]``), so XLA fuses the whole field into the pass that writes it: no ``[C]`` word is stored first and
    no concatenate joins them. A fresh plan's dead entries are the constant 0, so it reads no old plan.
    """
    cap = live.shape[0]
    word = jax.lax.broadcasted_iota(jnp.int32, (cap, 2), 1)
    if old is None:
        a = pairs.where(live, a, pairs.const(0, (cap,)))
    packed = jnp.where(word == 0, a.lo[:, None], a.hi[:, None])
    return packed if old is None else jnp.where(live[:, None], packed, old)


@functools.partial(jax.jit, static_argnames=("cap", "cw"))
def _build_plans_impl(
    verify_out: VerifyPlan | None,  # None: a fresh plan (VerifyPlan.allocate's zeros), never materialised
    write_out: WritePlan | None,  # None: a fresh plan (WritePlan.allocate's zeros)
    rpi: jax.Array,  # u32[bs, 2]
    prefix: jax.Array,  # u32[bs, 2]
    extend: jax.Array,  # u32[bs, 2]
    table: SlotTable,  # slot of (request row, position): SGLang's req_to_token or another layout
    lut: jax.Array | None,  # u32[lut_len, 2]
    pool: jax.Array | ExpectedTokenTable | None,  # i32[rows, ctx] (rows = req_pool_indices) or a table
    valid_lens: jax.Array | None,  # u32[bs, 2]
    swa_window_size: jax.Array,  # i32[]: W (data, so each window size does not recompile)
    kv_token_id_vs_position_offset: jax.Array,  # i32[]: k
    *,
    cap: int,  # C, the verify capacity
    cw: int,  # Cw, the write request capacity
) -> tuple[VerifyPlan, WritePlan]:
    bs = rpi.shape[0]
    max_seq_len = table.max_seq_len
    w = swa_window_size

    is_pad = pairs.is_zero(pairs.unpack(rpi))  # REQ_POOL_IDX_PADDING == 0
    p_pos = pairs.is_positive(pairs.unpack(prefix))

    # --- verify counts and overflow -------------------------------------------------------------------
    # Exact whenever the plan does not overflow: every per-request count is then <= C < C + 1.
    bound = cap + 1
    count = pairs.clamp(pairs.unpack(prefix), bound)
    count = jnp.where(w > 0, jnp.minimum(count, w), count)
    count = jnp.where(is_pad | ~p_pos, 0, count).astype(jnp.int32)
    incl = _saturating_cumsum(count, bound)
    total = incl[-1] if bs > 0 else jnp.int32(0)
    overflow = total > cap
    enable = jnp.where(overflow, 0, 1).astype(jnp.int32)
    num_valid = jnp.where(overflow, cap, total).astype(jnp.int32)

    # --- verify entries -------------------------------------------------------------------------------
    # Everything per entry stays in U64 words and each field is packed once, in the pass that writes it.
    i = jnp.arange(cap, dtype=jnp.int32)
    live = i < jnp.where(overflow, 0, total)
    old = tuple(None if verify_out is None else getattr(verify_out, n) for n in _VERIFY_FIELDS)
    if bs > 0:
        # Unrolled binary search: one fused kernel. The default ("scan") is a while loop that copies its
        # C-sized state every iteration (about 53 us of a 524k-entry decode plan on the H200).
        r = jnp.searchsorted(incl, i, side="right", method="scan_unrolled")
        r = jnp.clip(r.astype(jnp.int32), 0, bs - 1)
        # Entry i of row r verifies position p = P - count + (i - excl) = (P - incl) + i (int64). Every per-row word
        # an entry needs (that base, the row's req_pool_index and its valid length) comes from one gather.
        base = pairs.sub(pairs.unpack(prefix), pairs.from_int32(incl))
        words = [base.lo, base.hi, rpi[:, 0], rpi[:, 1]] + (
            [] if pool is None else [valid_lens[:, 0], valid_lens[:, 1]]
        )
        at_r = jnp.stack(words, axis=1)[r]  # u32[C, 4 or 6]
        pos = pairs.add(
            pairs.U64(at_r[:, 0], at_r[:, 1]), pairs.U64(i.astype(jnp.uint32), jnp.zeros_like(r, jnp.uint32))
        )
        row = pairs.U64(at_r[:, 2], at_r[:, 3])
        slot = _swa_translate(table._lookup64(r, row, pos), lut)
        prev = _swa_translate(table._lookup64(r, row, pairs.sub(pos, pairs.const(1, (cap,)))), lut)
        prev = pairs.where(pairs.is_zero(pos), pairs.const(-1, (cap,)), prev)
        if pool is not None:
            k = pairs.from_int32(jnp.broadcast_to(kv_token_id_vs_position_offset, (cap,)))
            sot = pairs.add(pos, k)  # position + k: the expected token's column
            want = ~pairs.is_negative(sot) & pairs.lt(sot, pairs.U64(at_r[:, 4], at_r[:, 5]))
            tok, tok_ok = _pool_lookup(pool, r, row, sot)
            exp_tok = pairs.from_int32(jnp.where(want & tok_ok, tok, -1))
        else:
            exp_tok = pairs.const(-1, (cap,))
        fields = tuple(_entry_words(a, live, o) for a, o in zip((slot, exp_tok, pos, prev), old))
    else:  # no rows: every entry is dead
        fields = tuple(jnp.zeros((cap, 2), jnp.uint32) if o is None else o for o in old)

    verify = VerifyPlan(
        **dict(zip(_VERIFY_FIELDS, fields)),
        verify_num_valid=num_valid.reshape(1),
        enable=enable.reshape(1),
    )

    # --- write metadata -------------------------------------------------------------------------------
    e_pos = pairs.is_positive(pairs.unpack(extend))
    wlen = jnp.where((is_pad | ~e_pos)[..., None], jnp.uint32(0), extend)
    offsets = jnp.zeros((cw + 1, 2), jnp.uint32)
    seeds = jnp.zeros((cw, 2), jnp.uint32) if write_out is None else write_out.write_seed_slot_indices
    if bs > 0:
        offsets = offsets.at[1 : bs + 1].set(pairs.pack(pairs.cumsum(pairs.unpack(wlen))))
        seed_col = pairs.clamp(pairs.sub(pairs.unpack(prefix), pairs.const(1, (bs,))), max(max_seq_len - 1, 0))
        seed = _swa_translate(
            table._lookup64(jnp.arange(bs, dtype=jnp.int32), pairs.unpack(rpi), pairs.from_int32(seed_col)), lut
        )
        seed = pairs.where(is_pad | ~e_pos | ~p_pos, pairs.const(-1, (bs,)), seed)
        seeds = seeds.at[:bs].set(pairs.pack(seed))
    write = WritePlan(
        write_offsets=offsets,
        write_seed_slot_indices=seeds,
        write_num_valid_reqs=jnp.full((1,), bs, jnp.int32),
    )
    return verify, write


def build_plans(
    *,
    req_pool_indices: Any,
    prefix_lens: Any,
    extend_seq_lens: Any,
    req_to_token: Any,
    verify_capacity: int | None = None,
    write_req_capacity: int | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
    req_to_verify_expected_tokens: Any = None,
    req_to_verify_expected_tokens_valid_lens: Any = None,
    kv_token_id_vs_position_offset: int = 0,
    verify_plan_out: VerifyPlan | None = None,
    write_plan_out: WritePlan | None = None,
) -> tuple[VerifyPlan, WritePlan]:
    """Builds the per-forward VerifyPlan and WritePlan of one canary group (SPEC 7; see the module docstring).

    Jit-able: call it inside a jitted serving step (capacities and ``bs`` are static shapes), or eagerly
    (it is jitted internally, one compilation per shape set). Byte-identical with ``jax_enable_x64`` off
    and on, and to SGLang's plan reference on ``num_valid``, ``enable``, ``entries[:num_valid]`` when
    enabled, ``write_offsets[:bs + 1]``, ``seeds[:bs]`` and ``write_num_valid_reqs``.

    Args:
      req_pool_indices: int64-valued ``[bs]`` (int32, int64 or ``uint32[bs, 2]`` pairs; see
        :func:`canary_jax.contract.ints.as_int64_pairs`); 0 = padding row (must come after the real rows).
      prefix_lens: int64-valued ``[bs]``: tokens already written before this step.
      extend_seq_lens: int64-valued ``[bs]``: tokens written this step.
      req_to_token: where each (request row, position) lives: SGLang's ``int32[max_reqs, max_seq_len]`` table
        (rows = ``req_pool_indices``), or any :class:`SlotTable` (:class:`BlockTable` for vLLM-style block
        tables, :class:`RaggedSlotTable` for sglang-jax's ``cache_loc``; rows = batch rows), or a
        :class:`GroupSlotTables` with one table per group kind. The builder gathers only the entries it
        plans; a table equal to SGLang's ``req_to_token`` on every position read gives byte-identical plans.
      verify_capacity: C, the verify plan length (static). Optional when ``verify_plan_out`` is given; both
        given must agree.
      write_req_capacity: Cw, the write plan's request capacity (static; ``bs <= Cw``). Optional when
        ``write_plan_out`` is given.
      swa_window_size: W (static); 0 = FULL group, > 0 = SWA group (requires the LUT, unless
        ``req_to_token`` is a :class:`GroupSlotTables` with an ``swa`` table).
      full_to_swa_index_mapping: int64-valued ``[full_pool_size + 1]`` LUT (int32 or int64 forms), or None.
        Applied whenever given (also with W == 0), like SGLang, except to the ``swa`` table of a
        :class:`GroupSlotTables` (already SWA-pool slots). 0 in the LUT = evicted.
      req_to_verify_expected_tokens: ``int32[rows, max_context_len]`` expected-token pool (rows =
        ``req_pool_indices``, SGLang), or an :class:`ExpectedTokenTable` (rows = batch rows or its
        ``row_index``), or None (all expected tokens -1).
      req_to_verify_expected_tokens_valid_lens: int64-valued ``[bs]``; required iff the pool is given.
      kv_token_id_vs_position_offset: k (static): 0 for target pools, +1 for EAGLE-draft pools.
      verify_plan_out, write_plan_out: optional plans whose shapes fix the capacities and whose contents
        survive where SGLang leaves its in-place outputs untouched. Not modified (JAX is functional).

    Returns:
      ``(VerifyPlan, WritePlan)``.

    Raises:
      ValueError / TypeError: before tracing, with SGLang's messages: missing LUT for W > 0, capacity
        mismatch, missing valid lens, ``bs > write_req_capacity``, non-positive capacities, wrong dtypes
        or shapes.
    """
    checked = check_plan_inputs(
        req_pool_indices=req_pool_indices,
        prefix_lens=prefix_lens,
        extend_seq_lens=extend_seq_lens,
        req_to_token=req_to_token,
        verify_capacity=verify_capacity,
        write_req_capacity=write_req_capacity,
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
        req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset,
        verify_plan_out=verify_plan_out,
        write_plan_out=write_plan_out,
    )
    return _build_plans_impl(*checked[:-2], cap=checked.cap, cw=checked.cw)
