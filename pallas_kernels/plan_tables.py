"""The plan kernel's reads of a slot table, an expected-token pool and an SWA LUT, from flat refs.

:mod:`pallas_kernels.plan` gathers, per verify entry and per write seed, what the jnp builder
(:func:`canary_jax.planning.plan_builder.build_plans`) gathers with ``SlotTable._lookup64``, ``_gather_2d`` and
``_swa_translate``. Here each table is a static :class:`TableSpec` plus flat 1-D kernel operands (``int32`` table
words, int64 pairs as flat ``uint32[2 n]``), and each read is a masked pointer gather that never leaves its
operand, with the same answer for every input, in range or not (the decisions are the builder's: a read outside a
table is slot 0, an expected token outside the pool is -1, a slot past the LUT clamps to its last entry).

Supported: :class:`~canary_jax.planning.slot_tables.ReqToTokenTable`,
:class:`~canary_jax.planning.slot_tables.BlockTable`, :class:`~canary_jax.planning.slot_tables.RaggedSlotTable`,
SGLang's raw expected-token pool and :class:`~canary_jax.planning.expected_tokens.ExpectedTokenTable`, each
non-empty with fewer than ``2**31`` elements. :func:`table_operands` / :func:`pool_operands` return None for
anything else, and :func:`canary_jax.ops.plan_launch.build_plans` then runs the jnp builder (the same bytes, more
launches).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from canary_jax.contract import constants, pairs
from canary_jax.contract.pairs import U64
from canary_jax.planning.expected_tokens import ExpectedTokenTable
from canary_jax.planning.slot_tables import BlockTable, RaggedSlotTable, ReqToTokenTable
from pallas_kernels import refs

_FLAT_MAX = 2**31 - 1
PAD = constants.TOKEN_TO_KV_SLOT_PADDING


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """A slot table's static shape. ``kind``: ``req_to_token`` (``[rows, cols]`` addressed by
    ``req_pool_indices``), ``block`` (``[rows, cols]`` block ids, ``block_size`` / ``null_block``) or ``ragged``
    (``cols`` = ``len(cache_loc)``, ``rows`` = request rows of ``row_starts`` / ``row_lens``)."""

    kind: str
    rows: int
    cols: int
    block_size: int = 1
    null_block: int | None = None


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """An expected-token pool's static shape: ``[rows, cols]`` int32 tokens; ``by_rpi`` (SGLang's raw pool,
    rows = ``req_pool_indices``) or batch rows, through ``row_index`` (``index_rows`` entries) when given."""

    rows: int
    cols: int
    by_rpi: bool
    index_rows: int | None = None


def _flat_ok(shape) -> bool:
    n = 1
    for d in shape:
        n *= int(d)
    return 0 < n <= _FLAT_MAX and all(0 < int(d) < _FLAT_MAX for d in shape)


def table_operands(table: Any) -> tuple[TableSpec, dict[str, jax.Array]] | None:
    """``(spec, {name: flat operand})`` of a supported slot table, else None."""
    if isinstance(table, ReqToTokenTable) and _flat_ok(table.req_to_token.shape):
        rows, cols = table.req_to_token.shape
        return TableSpec("req_to_token", int(rows), int(cols)), {"table": table.req_to_token.reshape(-1)}
    if isinstance(table, BlockTable) and _flat_ok(table.block_table.shape):
        rows, cols = table.block_table.shape
        spec = TableSpec("block", int(rows), int(cols), table.block_size, table.null_block)
        return spec, {"table": table.block_table.reshape(-1)}
    if isinstance(table, RaggedSlotTable) and _flat_ok(table.cache_loc.shape) and table.row_starts.shape[0] > 0:
        spec = TableSpec("ragged", int(table.row_starts.shape[0]), int(table.cache_loc.shape[0]))
        ops = {
            "table": table.cache_loc,
            "row_starts": table.row_starts.reshape(-1),
            "row_lens": table.row_lens.reshape(-1),
        }
        return spec, ops
    return None


def pool_operands(pool: Any) -> tuple[PoolSpec, dict[str, jax.Array]] | None:
    """``(spec, {name: flat operand})`` of a supported expected-token pool, else None."""
    if isinstance(pool, ExpectedTokenTable):
        if not _flat_ok(pool.tokens.shape):
            return None
        rows, cols = (int(d) for d in pool.tokens.shape)
        if pool.row_index is None:
            return PoolSpec(rows, cols, by_rpi=False), {"pool": pool.tokens.reshape(-1)}
        if pool.row_index.shape[0] == 0:
            return None
        ops = {"pool": pool.tokens.reshape(-1), "pool_rows": pool.row_index.reshape(-1)}
        return PoolSpec(rows, cols, by_rpi=False, index_rows=int(pool.row_index.shape[0])), ops
    if isinstance(pool, jax.Array) and pool.ndim == 2 and _flat_ok(pool.shape):
        rows, cols = (int(d) for d in pool.shape)
        return PoolSpec(rows, cols, by_rpi=True), {"pool": pool.reshape(-1)}
    return None


def _gather_2d(ref, rows: int, cols: int, row: U64, col: U64, mask: jax.Array, fill: int):
    """``(ref[row * cols + col], ok)`` of a flat ``int32[rows * cols]`` ref; ``fill`` where out of range."""
    ok = mask & pairs.in_range(row, rows) & pairs.in_range(col, cols)
    idx = row.lo.astype(jnp.int32) * cols + col.lo.astype(jnp.int32)
    v = refs.load_vec(ref, idx, ok, fill)
    return jnp.where(ok, v, jnp.int32(fill)), ok


def lookup(spec: TableSpec, r: dict, batch_row: jax.Array, rpi: U64, pos: U64, mask: jax.Array) -> U64:
    """The slot of ``(batch_row, pos)``: ``SlotTable._lookup64`` of the table ``spec`` describes (0 outside it).

    ``batch_row``: ``int32[B]`` in ``[0, bs)``; ``rpi`` / ``pos``: int64 words ``[B]``; masked lanes load nothing.
    """
    if spec.kind == "req_to_token":
        v, _ = _gather_2d(r["table"], spec.rows, spec.cols, rpi, pos, mask, PAD)
        return pairs.from_int32(v)
    if spec.kind == "block":
        bsz = spec.block_size
        ok = mask & (batch_row < spec.rows) & pairs.in_range(pos, spec.cols * bsz)
        col = jnp.where(ok, pos.lo, jnp.uint32(0)).astype(jnp.int32)
        blk = refs.load_vec(r["table"], batch_row * spec.cols + jax.lax.div(col, jnp.int32(bsz)), ok, PAD)
        slot = pairs.add(
            pairs.mul_const(pairs.from_int32(blk), bsz), pairs.from_int32(jax.lax.rem(col, jnp.int32(bsz)))
        )
        dead = ~ok if spec.null_block is None else ~ok | (blk == spec.null_block)
        return pairs.where(dead, pairs.const(PAD, batch_row.shape), slot)
    # ragged: cache_loc[row_starts[r] + p] for 0 <= p < row_lens[r]
    ok_s = mask & (batch_row < spec.rows)
    start = refs.load_pair_flat(r["row_starts"], batch_row, ok_s)
    length = refs.load_pair_flat(r["row_lens"], batch_row, ok_s)
    col = pairs.add(start, pos)
    ok = ok_s & ~pairs.is_negative(pos) & pairs.lt(pos, length) & pairs.in_range(col, spec.cols)
    v = refs.load_vec(r["table"], col.lo.astype(jnp.int32), ok, PAD)
    return pairs.from_int32(jnp.where(ok, v, jnp.int32(PAD)))


def pool_token(spec: PoolSpec, r: dict, batch_row: jax.Array, rpi: U64, col: U64, mask: jax.Array):
    """``(int32 token, in_pool)``: the builder's ``_pool_lookup`` (-1 and False outside the pool)."""
    if spec.by_rpi:
        row = rpi
    elif spec.index_rows is None:
        row = pairs.from_int32(batch_row)
    else:
        ok = mask & (batch_row < spec.index_rows)
        row = pairs.where(ok, refs.load_pair_flat(r["pool_rows"], batch_row, ok), pairs.const(-1, batch_row.shape))
    return _gather_2d(r["pool"], spec.rows, spec.cols, row, col, mask, -1)


def translate(lut_ref, lut_len: int | None, s: U64, mask: jax.Array) -> U64:
    """SWA translation ``x < 0 -> x``, else ``LUT[min(x, len - 1)]`` (identity when ``lut_len`` is None)."""
    if lut_len is None:
        return s
    neg = pairs.is_negative(s)
    idx = jnp.where(neg | ~pairs.in_range(s, lut_len), lut_len - 1, s.lo.astype(jnp.int32))
    idx = jnp.where(neg, 0, idx)
    return pairs.where(neg, s, refs.load_pair_flat(lut_ref, idx, mask))
