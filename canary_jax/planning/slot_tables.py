"""Slot tables: where each (request row, position) of a batch lives in the KV pool, read by the plan builder.

:func:`canary_jax.planning.plan_builder.build_plans` (SGLang's ``launch_canary_plan_kernels``) gathers a slot for every
verify entry (position ``p`` and its predecessor ``p - 1``) and for every write seed (position ``P - 1``), and an
expected token per verify entry when the verify-token assert is on. SGLang gathers from its dense
``req_to_token`` (SPEC 7.1) and its expected-token pool; the tables here generalise those gathers to the layouts
JAX serving stacks keep:

* :class:`ReqToTokenTable`: SGLang's dense ``int32[max_reqs, max_seq_len]`` ``req_to_token``, rows =
  ``req_pool_indices`` (the default: a raw ``int32`` array passed as ``req_to_token`` is read as one);
* :class:`BlockTable`: vLLM-style ``int32[num_rows, max_blocks_per_req]`` block tables, ``block_table[r, p //
  block_size] * block_size + p % block_size`` computed in the gather (tpu-inference, eSurge, vLLM); rows = batch
  rows;
* :class:`RaggedSlotTable`: sglang-jax's ragged per-token ``int32[N]`` ``cache_loc``; rows = batch rows;
* :class:`GroupSlotTables`: one table per buffer group (an SWA group's table holds SWA-pool slots);
* :class:`ExpectedTokenTable`: an ``int32[rows, max_context_len]`` expected-token pool addressed by batch row or
  an explicit row per request (a raw ``int32`` pool is SGLang's, rows = ``req_pool_indices``).

Every table is read only at the planned entries (work proportional to the entries, no dense table is built), and a
table that agrees with SGLang's ``req_to_token`` on the positions read gives byte-identical plans. Rows and
positions in, slots out, are int64 values held as ``uint32[n, 2]`` pairs (:mod:`canary_jax.contract.pairs`). Tables are
pytrees (arrays are leaves; ``BlockTable``'s ``block_size`` / ``null_block`` are static), so they pass through
``jit``; unflattening skips the constructor checks (safe on tracers). ``canary_jax.adapters.batches`` builds them
from each stack's batch.

Decisions where SGLang's reference and kernels differ or are undefined (SPEC 13 b, c; the full list of the plan
builder's decisions is in :mod:`canary_jax.planning.plan_builder`):

* A read outside a slot table (row or position out of range, a ragged read at or past the row's length, a
  ``BlockTable`` null block) gives ``TOKEN_TO_KV_SLOT_PADDING`` (0); SGLang's reference raises ``IndexError`` or
  wraps negative rows. Verify skips slot 0 and a predecessor slot 0 disables the chain check.
* An expected-token read outside the pool gives -1 (token check skipped); the pool is never read outside its
  bounds.
* :func:`swa_translate` clamps a slot ``x >= len(LUT)`` to ``LUT[len - 1]`` like SGLang's Triton/CUDA kernels
  (its Python reference raises; an error is impossible inside ``jit``).

Errors: constructors and ``check()`` (tracer-safe, static shapes and dtypes only) raise ``TypeError`` /
``ValueError`` with ``kv-canary:`` messages.

:class:`ExpectedTokenTable` lives in :mod:`canary_jax.planning.expected_tokens` and :func:`swa_translate` with the
bounds-safe gathers in :mod:`canary_jax.planning.slot_reads`; both are re-exported here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants, ints, pairs
from canary_jax.planning.expected_tokens import ExpectedTokenTable  # re-exported: slot_tables is its historical home
from canary_jax.planning.slot_reads import (  # the private names stay importable from here, their old home
    _INT32_MAX,  # noqa: F401  (the old private name; ints.INT32_MAX is the home)
    _check_2d_int32,
    _check_pairs,
    _check_table_array,
    _gather_2d,
    _register_table,
    _row_gather,
    swa_translate,
)
from canary_jax.planning.slot_reads import _swa_translate as _swa_translate

__all__ = [
    "BlockTable",
    "ExpectedTokenTable",
    "GroupSlotTables",
    "RaggedSlotTable",
    "ReqToTokenTable",
    "SlotTable",
    "swa_translate",
]


# --- slot tables: where (request row, position) lives ------------------------------------------------------
class SlotTable:
    """Where each (request row, position) of a batch lives in the KV pool: the plan builder's gather source.

    ``build_plans`` reads a slot for every verify entry (position ``p`` and its predecessor ``p - 1``) and for
    every write seed (position ``P - 1``), so its work is proportional to those entries, never to the table.
    Three layouts, one per serving-stack convention:

    * :class:`ReqToTokenTable`: SGLang's dense ``req_to_token[req_pool_indices[r], p]`` (the default: a raw
      ``int32`` array passed as ``req_to_token`` is wrapped in one);
    * :class:`BlockTable`: vLLM-style block tables, ``block_table[r, p // block_size] * block_size +
      p % block_size`` computed in the gather (tpu-inference, eSurge, vLLM);
    * :class:`RaggedSlotTable`: sglang-jax's ragged per-token ``cache_loc[row_start[r] + p]``.

    ``lookup(batch_row, rpi, pos)`` takes the batch row ``r`` (``int32[n]``), that row's
    ``req_pool_indices[r]`` and the position ``p`` (both int64 pairs ``uint32[n, 2]``), and returns the slot as
    int64 pairs ``uint32[n, 2]``; a read outside the table gives ``TOKEN_TO_KV_SLOT_PADDING`` (0), which verify
    skips (the decision of the module docstring for reads outside ``req_to_token``).
    """

    __slots__ = ()

    @property
    def max_seq_len(self) -> int:
        """Positions ``[0, max_seq_len)`` the table can hold (the seed column is clamped below it, like SGLang)."""
        raise NotImplementedError

    def check(self) -> None:
        """Static checks of dtypes and ranks (tracer-safe); raises ``TypeError`` / ``ValueError``."""
        raise NotImplementedError

    def lookup(self, batch_row: jax.Array, rpi: jax.Array, pos: jax.Array) -> jax.Array:
        """The slot of ``(batch_row, pos)`` as int64 pairs ``uint32[n, 2]`` (see the class docstring)."""
        if type(self)._lookup64 is SlotTable._lookup64:
            raise NotImplementedError(f"{type(self).__name__} must define lookup")
        return pairs.pack(self._lookup64(batch_row, pairs.unpack(rpi), pairs.unpack(pos)))

    def _lookup64(self, batch_row: jax.Array, rpi: pairs.U64, pos: pairs.U64) -> pairs.U64:
        """:meth:`lookup` on :class:`~canary_jax.contract.pairs.U64` words: what ``build_plans`` calls, so no
        entry-sized
        array is packed only to be unpacked. Tables that define only :meth:`lookup` get this wrapper."""
        return pairs.unpack(self.lookup(batch_row, pairs.pack(rpi), pairs.pack(pos)))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ReqToTokenTable(SlotTable):
    """SGLang's ``req_to_token``: ``slot(r, p) = req_to_token[req_pool_indices[r], p]`` (SPEC 7.1).

    Fields:
      req_to_token: ``int32[max_reqs, max_seq_len]`` full-pool slot of each (request pool row, position).

    Raises:
      TypeError / ValueError: not a 2-D int32 table (numpy data outside int32 is refused), or a dimension
        ``>= 2**31 - 1``.
    """

    req_to_token: Any

    def __post_init__(self) -> None:
        object.__setattr__(self, "req_to_token", _check_2d_int32(self.req_to_token, "req_to_token"))
        self.check()

    @property
    def max_seq_len(self) -> int:
        return int(self.req_to_token.shape[1])

    def check(self) -> None:
        _check_table_array(self.req_to_token, "req_to_token", 2, "a 2-D int32 table [max_reqs, max_seq_len]")
        if max(self.req_to_token.shape) >= ints.INT32_MAX:
            raise ValueError(f"kv-canary: req_to_token shape {tuple(self.req_to_token.shape)} is too large")

    def _lookup64(self, batch_row: jax.Array, rpi: pairs.U64, pos: pairs.U64) -> pairs.U64:
        del batch_row  # SGLang addresses rows by req_pool_indices
        v, _ = _gather_2d(self.req_to_token, rpi, pos, constants.TOKEN_TO_KV_SLOT_PADDING)
        return pairs.from_int32(v)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class BlockTable(SlotTable):
    """vLLM-style block table: ``slot(r, p) = block_table[r, p // block_size] * block_size + p % block_size``.

    The convention of vLLM's ``BlockTable`` / ``CommonAttentionMetadata.block_table_tensor``, tpu-inference's
    ``AttentionMetadata.block_tables`` (stored flat there: reshape it to ``[max_num_reqs, -1]``) and EasyDeL
    eSurge's ``RaggedPagesMetadata.pages_tables``. Rows are *batch rows* (the row a request occupies in this
    step's batch), not request ids: a request that moves to another row between steps is read from its new row.
    The slot is computed in int64 inside the gather (no dense table is built).

    Fields:
      block_table: ``int32[num_rows, max_blocks_per_req]`` physical block (page) ids.
      block_size: tokens per block (static; the page size of the KV pool).
      null_block: the block id a stack uses for "no block" (vLLM's null block, id 0, fills freed sliding-window
        blocks and padding), read as slot 0 (``TOKEN_TO_KV_SLOT_PADDING``: verify skips it and a predecessor
        slot 0 disables the chain check, like an evicted SWA slot); None if every id is a real block.

    Raises:
      TypeError / ValueError: a table that is not 2-D int32, ``block_size <= 0``, ``max_blocks_per_req *
        block_size >= 2**31``, or a ``null_block`` outside int32.
    """

    block_table: Any
    block_size: int
    null_block: int | None = 0

    def __post_init__(self) -> None:
        bs = ints.check_int(self.block_size, name="block_size")
        if bs <= 0:
            raise ValueError(f"kv-canary: block_size must be positive, got {bs}")
        object.__setattr__(self, "block_size", bs)
        if self.null_block is not None:
            nb = ints.check_int(self.null_block, name="null_block", minimum=ints.INT32_MIN, maximum=ints.INT32_MAX)
            object.__setattr__(self, "null_block", nb)
        if len(np.shape(self.block_table)) != 2:
            raise ValueError(
                "kv-canary: block_table must be a 2-D int32 array [num_rows, max_blocks_per_req], "
                f"got shape {tuple(np.shape(self.block_table))}"
            )
        object.__setattr__(self, "block_table", ints.as_int32(self.block_table, name="block_table"))
        self.check()

    @property
    def max_seq_len(self) -> int:
        return int(self.block_table.shape[1]) * self.block_size

    def check(self) -> None:
        _check_table_array(self.block_table, "block_table", 2, "a 2-D int32 array [num_rows, max_blocks_per_req]")
        rows, blocks = (int(d) for d in self.block_table.shape)
        if rows >= ints.INT32_MAX or blocks * self.block_size >= ints.INT32_MAX:
            raise ValueError(
                f"kv-canary: block_table shape {(rows, blocks)} with block_size {self.block_size} is too large "
                "(max_blocks_per_req * block_size must be < 2**31 - 1)"
            )

    def _lookup64(self, batch_row: jax.Array, rpi: pairs.U64, pos: pairs.U64) -> pairs.U64:
        del rpi  # block tables are addressed by batch row
        rows, blocks = self.block_table.shape
        bsz = self.block_size
        ok = (batch_row < rows) & pairs.in_range(pos, blocks * bsz)
        if rows == 0 or blocks == 0:
            return pairs.const(constants.TOKEN_TO_KV_SLOT_PADDING, batch_row.shape)
        col = jnp.where(ok, pos.lo, jnp.uint32(0)).astype(jnp.int32)
        blk = self.block_table[jnp.where(ok, batch_row, 0), col // bsz]
        slot = pairs.add(pairs.mul_const(pairs.from_int32(blk), bsz), pairs.from_int32(col % bsz))
        dead = ~ok if self.null_block is None else ~ok | (blk == self.null_block)
        return pairs.where(dead, pairs.const(constants.TOKEN_TO_KV_SLOT_PADDING, batch_row.shape), slot)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RaggedSlotTable(SlotTable):
    """A ragged per-token slot list: ``slot(r, p) = cache_loc[row_starts[r] + p]`` for ``0 <= p < row_lens[r]``.

    sglang-jax's ``ForwardBatch.cache_loc``: ``req_to_token[req_pool_indices[r], :seq_lens[r]]`` of every
    request, concatenated in batch order (each span padded to a multiple of the page size in its paged
    versions; ``sgl_jax/srt/managers/schedule_batch.py`` ``get_model_worker_batch``), because sglang-jax keeps
    ``req_to_token`` on the host. Rows are batch rows.

    Fields:
      cache_loc: ``int32[N]`` slots.
      row_starts: int64-valued ``[bs]`` offset of each batch row's span in ``cache_loc`` (any lossless int form;
        held as ``uint32[bs, 2]`` pairs).
      row_lens: int64-valued ``[bs]`` valid positions of each row's span (its ``seq_lens``); reads at or past
        it give slot 0.

    Raises:
      TypeError / ValueError: ``cache_loc`` not 1-D int32, row arrays not 1-D integers of one length, or
        ``N >= 2**31 - 1``.
    """

    cache_loc: Any
    row_starts: Any
    row_lens: Any

    def __post_init__(self) -> None:
        if len(np.shape(self.cache_loc)) != 1:
            raise ValueError(
                f"kv-canary: cache_loc must be a 1-D int32 array [N], got shape {tuple(np.shape(self.cache_loc))}"
            )
        object.__setattr__(self, "cache_loc", ints.as_int32(self.cache_loc, name="cache_loc"))
        starts = ints.as_int64_pairs(self.row_starts, name="row_starts", shape=(None,))
        lens = ints.as_int64_pairs(self.row_lens, name="row_lens", shape=(int(starts.shape[0]),))
        object.__setattr__(self, "row_starts", starts)
        object.__setattr__(self, "row_lens", lens)
        self.check()

    @property
    def max_seq_len(self) -> int:
        return int(self.cache_loc.shape[0])

    def check(self) -> None:
        _check_table_array(self.cache_loc, "cache_loc", 1, "a 1-D int32 array [N]")
        _check_pairs(self.row_starts, "row_starts", "int64-valued [bs]")
        _check_pairs(self.row_lens, "row_lens", "int64-valued [bs]")
        if self.row_starts.shape != self.row_lens.shape:
            raise ValueError(
                f"kv-canary: row_starts and row_lens must have one length, got {self.row_starts.shape[0]} and "
                f"{self.row_lens.shape[0]}"
            )
        if int(self.cache_loc.shape[0]) >= ints.INT32_MAX:
            raise ValueError(f"kv-canary: cache_loc length {self.cache_loc.shape[0]} is too large")

    def _lookup64(self, batch_row: jax.Array, rpi: pairs.U64, pos: pairs.U64) -> pairs.U64:
        del rpi  # ragged spans are in batch-row order
        n = self.cache_loc.shape[0]
        start, ok_s = _row_gather(self.row_starts, batch_row)
        length, _ = _row_gather(self.row_lens, batch_row)
        col = pairs.add(pairs.unpack(start), pos)
        ok = ok_s & ~pairs.is_negative(pos) & pairs.lt(pos, pairs.unpack(length)) & pairs.in_range(col, n)
        if n == 0:
            return pairs.const(constants.TOKEN_TO_KV_SLOT_PADDING, batch_row.shape)
        v = self.cache_loc[jnp.where(ok, col.lo, jnp.uint32(0)).astype(jnp.int32)]
        v = jnp.where(ok, v, jnp.int32(constants.TOKEN_TO_KV_SLOT_PADDING))
        return pairs.from_int32(v)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GroupSlotTables:
    """One slot table per buffer group, for stacks whose sliding-window layers have their own block tables
    (vLLM's hybrid KV-cache groups: one block table per ``kv_cache_group``).

    ``build_plans`` reads ``full`` for a FULL group (``swa_window_size == 0``) and ``swa`` for an SWA group. The
    ``swa`` table already holds SWA-pool slots, so the group's ``full_to_swa_index_mapping`` is **not** applied
    to what it reads (an SWA block freed out of the window should read as the null block, i.e. slot 0 =
    evicted). The LUT is still what the SWA endpoints apply to ``out_cache_loc`` when they write; see
    :func:`canary_jax.adapters.batches.update_swa_lut`.

    Fields:
      full: the FULL group's :class:`SlotTable` (full-pool slots).
      swa: the SWA group's :class:`SlotTable` (SWA-pool slots), or None (then SWA groups read ``full`` through
        the LUT, as SGLang).

    Raises:
      TypeError: a member that is not a SlotTable.
    """

    full: SlotTable
    swa: SlotTable | None = None

    def __post_init__(self) -> None:
        for name in ("full", "swa"):
            t = getattr(self, name)
            if not (t is None and name == "swa") and not isinstance(t, SlotTable):
                raise TypeError(f"kv-canary: GroupSlotTables.{name} must be a SlotTable, got {type(t).__name__}")

    def select(self, swa_window_size: int) -> tuple[SlotTable, bool]:
        """``(table, already_translated)`` for a group planned with window ``swa_window_size``."""
        if swa_window_size > 0 and self.swa is not None:
            return self.swa, True
        return self.full, False


_register_table(ReqToTokenTable, ("req_to_token",))
_register_table(BlockTable, ("block_table",), ("block_size", "null_block"))
_register_table(RaggedSlotTable, ("cache_loc", "row_starts", "row_lens"))
_register_table(GroupSlotTables, ("full", "swa"))
