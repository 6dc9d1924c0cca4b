"""Bounds-safe reads behind the slot tables: 2-D and row gathers, the SWA translation, static checks.

The one job here is reading a table at int64 ``(row, column)`` words without ever indexing outside it, and
checking a table's rank and dtype before it is read (tracer-safe: static shapes and dtypes only). The slot
tables (:mod:`canary_jax.planning.slot_tables`), the expected-token pool (:mod:`canary_jax.planning.expected_tokens`)
and the plan builder (:mod:`canary_jax.planning.plan_builder`) read through these; :func:`swa_translate` is re-exported
by both of those modules. Reads outside a table give the caller's fill value; checks raise ``TypeError`` /
``ValueError`` with ``kv-canary:`` messages.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import ints, pairs

_INT32_MAX = ints.INT32_MAX  # the old private name (slot_tables re-exports it); ints.INT32_MAX is the home

__all__ = ["swa_translate"]


def _gather_2d(table: jax.Array, row: pairs.U64, col: pairs.U64, fill: int) -> tuple[jax.Array, jax.Array]:
    """``table[row, col]`` for int64 ``row`` / ``col``; ``fill`` where either is out of range."""
    n_rows, n_cols = table.shape
    ok = pairs.in_range(row, n_rows) & pairs.in_range(col, n_cols)
    r = jnp.where(ok, row.lo, jnp.uint32(0)).astype(jnp.int32)
    c = jnp.where(ok, col.lo, jnp.uint32(0)).astype(jnp.int32)
    if n_rows == 0 or n_cols == 0:
        return jnp.full(r.shape, fill, table.dtype), ok
    if n_rows * n_cols < 2**31:  # a 1-D gather at a flat index: no index array joins row and column
        v = table.reshape(-1)[r * n_cols + c]
    else:
        v = table[r, c]
    return jnp.where(ok, v, jnp.asarray(fill, table.dtype)), ok


def _swa_translate(s: pairs.U64, lut: jax.Array | None) -> pairs.U64:
    """:func:`swa_translate` on :class:`~canary_jax.contract.pairs.U64` slots."""
    if lut is None:
        return s
    n = lut.shape[0]
    neg = pairs.is_negative(s)
    idx = jnp.where(neg | ~pairs.in_range(s, n), n - 1, s.lo.astype(jnp.int32))
    idx = jnp.where(neg, 0, idx)
    return pairs.where(neg, s, pairs.U64(lut[:, 0][idx], lut[:, 1][idx]))


def swa_translate(slots: jax.Array, lut: jax.Array | None) -> jax.Array:
    """SWA translation of int64-pair slots: ``x < 0 -> x``, else ``lut[min(x, len(lut) - 1)]``.

    Args:
      slots: ``uint32[..., 2]`` int64 full-pool slots.
      lut: ``uint32[L, 2]`` int64 ``full_to_swa_index_mapping`` (``L >= 1``), or None for the identity.

    Returns:
      ``uint32[..., 2]``: translated slots (0 = evicted from the SWA pool). Never reads outside the LUT: a
      slot ``>= L`` clamps to the last entry, like SGLang's kernels (its Python reference raises instead).
    """
    if lut is None:
        return slots
    return pairs.pack(_swa_translate(pairs.unpack(slots), lut))


# --- pytree registration and static checks -------------------------------------------------------------
def _register_table(cls, data_fields: tuple[str, ...], meta_fields: tuple[str, ...] = ()):
    """Registers ``cls`` as a pytree whose unflatten skips ``__post_init__`` (safe on tracers)."""

    def flatten(t):
        return tuple(getattr(t, n) for n in data_fields), tuple(getattr(t, n) for n in meta_fields)

    def unflatten(meta, children):
        obj = object.__new__(cls)
        for n, v in zip(data_fields, children):
            object.__setattr__(obj, n, v)
        for n, v in zip(meta_fields, meta):
            object.__setattr__(obj, n, v)
        return obj

    jax.tree_util.register_pytree_node(cls, flatten, unflatten)
    return cls


def _unchecked(cls, **fields):
    """An instance of a registered table class from already-checked fields (no ``__post_init__``)."""
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def _dtype_of(x: Any) -> np.dtype:
    dt = getattr(x, "dtype", None)  # tracers have one; never convert them
    return np.dtype(np.asarray(x).dtype if dt is None else dt)


def _check_table_array(x: Any, name: str, ndim: int, what: str) -> None:
    """Static check (works on tracers): ``x`` is an int32 array of rank ``ndim``."""
    shape = tuple(np.shape(x))
    if len(shape) != ndim:
        raise ValueError(f"kv-canary: {name} must be {what}, got shape {shape}")
    dt = _dtype_of(x)
    if dt != np.dtype(np.int32):
        raise TypeError(f"kv-canary: {name} must be {what} of dtype int32, got dtype {dt}")


def _check_pairs(x: Any, name: str, what: str) -> None:
    """Static check (works on tracers): ``x`` is an int64-valued ``uint32[n, 2]`` pairs array."""
    shape = tuple(np.shape(x))
    dt = _dtype_of(x)
    if len(shape) != 2 or shape[1] != 2 or dt != np.dtype(np.uint32):
        raise TypeError(f"kv-canary: {name} must be {what} as uint32[n, 2] pairs, got shape {shape} dtype {dt}")


def _check_2d_int32(x: Any, name: str) -> jax.Array:
    """``x`` as a 2-D int32 ``jax.Array`` (numpy data outside int32 refused); raises ``TypeError`` / ``ValueError``."""
    if x is None:
        raise TypeError(f"kv-canary: {name} must be an int32 array, got None")
    if len(np.shape(x)) != 2:
        raise ValueError(f"kv-canary: {name} must be 2-D, got shape {tuple(np.shape(x))}")
    return ints.as_int32(x, name=name, shape=(None, None))


def _row_gather(values: jax.Array, batch_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(values[batch_row], batch_row < len(values))`` for int32 ``batch_row >= 0`` (never out of bounds)."""
    n = values.shape[0]
    ok = batch_row < n
    if n == 0:
        return jnp.zeros(batch_row.shape + values.shape[1:], values.dtype), ok
    return values[jnp.where(ok, batch_row, 0)], ok
