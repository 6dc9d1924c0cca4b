"""The expected-token pool of the verify-token assert: filling it and reading it by batch row.

:func:`scatter_req_token_ids` fills SGLang's pool (SPEC 7.4; SGLang ``scatter_req_token_ids.py``), and
:class:`ExpectedTokenTable` lets :func:`canary_jax.planning.plan_builder.build_plans` read a pool addressed by batch row
or by an explicit row per request (a raw ``int32`` pool is SGLang's, rows = ``req_pool_indices``). Reads outside
the pool give -1 (token check skipped); the pool is never read outside its bounds. Both are re-exported from
their historical homes, :mod:`canary_jax.planning.slot_tables` and :mod:`canary_jax.planning.plan_builder`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import ints, pairs
from canary_jax.planning.slot_reads import (
    _check_2d_int32,
    _check_pairs,
    _check_table_array,
    _gather_2d,
    _register_table,
    _row_gather,
)

__all__ = ["ExpectedTokenTable", "scatter_req_token_ids"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedTokenTable:
    """An expected-token pool addressed by batch row or by an explicit row per request (verify-token assert).

    ``token(r, p) = tokens[row(r), p]`` with ``row(r) = row_index[r]`` if given, else the batch row ``r``
    (vLLM's ``InputBatch.token_ids_cpu`` is per batch row and moves with it). A raw ``int32`` pool passed to
    ``build_plans`` is SGLang's, addressed by ``req_pool_indices[r]``. Reads outside the pool give -1 (no token
    check), like SGLang's pool.

    Fields:
      tokens: ``int32[rows, max_context_len]`` token ids (prompt + output) per row.
      row_index: int64-valued ``[bs]`` pool row of each batch row (e.g. sglang-jax's 0-based
        ``req_pool_indices``), or None for the batch row itself.

    Raises:
      TypeError / ValueError: ``tokens`` not 2-D int32 (numpy data outside int32 refused), ``row_index`` not a
        1-D integer array.
    """

    tokens: Any
    row_index: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", _check_2d_int32(self.tokens, "expected tokens"))
        if self.row_index is not None:
            object.__setattr__(
                self, "row_index", ints.as_int64_pairs(self.row_index, name="expected token row_index", shape=(None,))
            )
        self.check()

    def check(self) -> None:
        _check_table_array(self.tokens, "expected tokens", 2, "a 2-D int32 array [rows, max_context_len]")
        if self.row_index is not None:
            _check_pairs(self.row_index, "expected token row_index", "int64-valued [bs]")
        if max(self.tokens.shape) >= ints.INT32_MAX:
            raise ValueError(f"kv-canary: expected tokens shape {tuple(self.tokens.shape)} is too large")

    def lookup(self, batch_row: jax.Array, rpi: jax.Array, col: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(int32 token, in_pool)`` for int64-pair ``col``; -1 where the read falls outside the pool."""
        return self._lookup64(batch_row, pairs.unpack(rpi), pairs.unpack(col))

    def _lookup64(self, batch_row: jax.Array, rpi: pairs.U64, col: pairs.U64) -> tuple[jax.Array, jax.Array]:
        del rpi
        if self.row_index is None:
            row = pairs.from_int32(batch_row)
        else:
            row, ok = _row_gather(self.row_index, batch_row)
            row = pairs.where(ok, pairs.unpack(row), pairs.const(-1, batch_row.shape))
        return _gather_2d(self.tokens, row, col, -1)


_register_table(ExpectedTokenTable, ("tokens", "row_index"))


# --- scatter_req_token_ids -------------------------------------------------------------------------------
@jax.jit
def _scatter_impl(flat: jax.Array, offsets: jax.Array, rpi: jax.Array, pool: jax.Array) -> jax.Array:
    n_tok = flat.shape[0]
    bs = rpi.shape[0]
    rows, width = pool.shape
    cols = min(width, n_tok)
    if bs == 0 or n_tok == 0 or cols == 0 or rows == 0:
        return pool
    start, end = offsets[:-1], offsets[1:]
    seg = pairs.sub(pairs.unpack(end), pairs.unpack(start))  # int64 segment length
    write_len = pairs.clamp(seg, cols)  # min(seg, width) where seg > 0; columns past n_tok never load
    col = jnp.arange(cols, dtype=jnp.int32)
    flat_idx = pairs.add(pairs.unpack(start[:, None, :]), pairs.from_int32(col[None, :]))  # [bs, cols]
    row_ok = pairs.in_range(pairs.unpack(rpi), rows)
    mask = (col[None, :] < write_len[:, None]) & pairs.in_range(flat_idx, n_tok) & row_ok[:, None]
    vals = flat[jnp.where(mask, flat_idx.lo, 0).astype(jnp.int32), 0]
    vals = jax.lax.bitcast_convert_type(vals, jnp.int32)  # int64 -> int32 keeps the low word (torch .to)
    row = jnp.where(row_ok, rpi[:, 0], 0).astype(jnp.int32)
    # Deterministic "later request wins" for duplicate rows: the highest request index per cell.
    req = jnp.broadcast_to(jnp.arange(bs, dtype=jnp.int32)[:, None], (bs, cols))
    r_b = jnp.broadcast_to(row[:, None], (bs, cols))
    c_b = jnp.broadcast_to(col[None, :], (bs, cols))
    winner = jnp.full((rows, cols), -1, jnp.int32)
    winner = winner.at[jnp.where(mask, r_b, rows), c_b].max(req, mode="drop")
    win = mask & (winner[r_b, c_b] == req)
    return pool.at[jnp.where(win, r_b, rows), c_b].set(vals, mode="drop")


def _check_1d_int(x: Any, name: str) -> jax.Array:
    shape = tuple(np.shape(x))
    dt = np.dtype(getattr(x, "dtype", np.asarray(x).dtype))
    is_pairs = len(shape) == 2 and shape[-1] == 2 and dt in (np.dtype(np.uint32), np.dtype(np.int32))
    if len(shape) != 1 and not is_pairs:
        raise ValueError(f"kv-canary: scatter_req_token_ids {name} must be 1-D, got shape {shape}")
    if dt.kind not in "iu":
        raise TypeError(f"kv-canary: scatter_req_token_ids {name} must be int64/int32, got {dt}")
    return ints.as_int64_pairs(x, name=name, shape=(None,))


def scatter_req_token_ids(*, flat_in: Any, offsets: Any, req_pool_indices: Any, pool_out: Any) -> jax.Array:
    """Scatters each request's token ids into its expected-token pool row (SPEC 7.4).

    ``for r in range(bs): n = min(off[r+1] - off[r], L); pool[rpi[r], :n] = int32(flat_in[off[r] : off[r] + n])``
    with loads masked to valid ``flat_in`` indices (SGLang's Triton kernel); other cells are unchanged.

    Args:
      flat_in: int64-valued ``[num_tokens]`` (int32, int64, or ``uint32[num_tokens, 2]`` pairs): every
        request's ``origin_input_ids + output_ids``, concatenated in request order. Values are stored as
        int32 (low 32 bits, like ``torch .to(int32)``).
      offsets: int64-valued ``[bs + 1]`` exclusive prefix sums into ``flat_in``.
      req_pool_indices: int64-valued ``[bs]`` pool rows.
      pool_out: ``int32[rows, max_context_len]`` expected-token pool.

    Returns:
      The new ``int32[rows, max_context_len]`` pool (functional; jit-able).

    Decisions: a row outside ``[0, rows)`` writes nothing (CUDA: out of bounds; torch reference: negative
    rows wrap); two requests naming the same row: the later request wins per cell (Triton: a race).

    Raises:
      ValueError: wrong ranks, or ``len(offsets) != bs + 1`` (SGLang's messages).
      TypeError: non-integer inputs, or ``pool_out`` not int32.
    """
    flat = _check_1d_int(flat_in, "flat_in")
    off = _check_1d_int(offsets, "offsets")
    rpi = _check_1d_int(req_pool_indices, "req_pool_indices")
    pshape = tuple(np.shape(pool_out))
    if len(pshape) != 2:
        raise ValueError(f"kv-canary: scatter_req_token_ids pool_out must be 2-D, got shape {pshape}")
    pdt = np.dtype(pool_out.dtype) if hasattr(pool_out, "dtype") else np.asarray(pool_out).dtype
    if pdt != np.dtype(np.int32):
        raise TypeError(f"kv-canary: scatter_req_token_ids pool_out must be int32, got {pdt}")
    bs = int(rpi.shape[0])
    if int(off.shape[0]) != bs + 1:
        raise ValueError(f"kv-canary: scatter_req_token_ids offsets length {off.shape[0]} != bs+1 ({bs + 1})")
    pool = pool_out if isinstance(pool_out, jax.Array) else jnp.asarray(np.asarray(pool_out, np.int32))
    return _scatter_impl(flat, off, rpi, pool)
