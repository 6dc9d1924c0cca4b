"""Checks and shared pieces of the batch adapters (:mod:`canary_jax.adapters.batches`).

The one job here is turning a stack's batch fields into checked canary inputs before anything is traced: rank,
dtype and length checks that name the adapter, the field, its shape and what was expected (``ValueError`` /
``TypeError``), exact int64 ``uint32[n, 2]`` pairs and int32 tables, the host reads of fields given as host
data (JAX arrays are never read on the host), ``num_reqs`` as a device scalar, and the two steps every adapter
ends with: a pairs ``where`` and the :class:`~canary_jax.runtime.state.CanaryBatch` of the converted fields.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import ints, pairs
from canary_jax.planning.slot_reads import _dtype_of
from canary_jax.planning.slot_tables import ExpectedTokenTable
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.state import CanaryBatch


def _describe(x: Any) -> str:
    return f"shape {tuple(np.shape(x))} dtype {_dtype_of(x)}"


def _ints(x: Any, who: str, name: str, length: int | None, dims: str) -> Any:
    """An int64-valued 1-D field as exact ``uint32[n, 2]`` pairs (JAX), checked before tracing.

    Raises:
      ValueError: ``x`` is None, not 1-D, or not ``length`` long.
      TypeError: not integer data.
    """
    if x is None:
        raise ValueError(f"kv-canary: {who}: {name} is required (an integer array {dims})")
    shape = tuple(np.shape(x))
    dt = _dtype_of(x)
    if dt.kind not in "iu":
        raise TypeError(f"kv-canary: {who}: {name} must be an integer array {dims}, got {_describe(x)}")
    if len(shape) != 1:
        raise ValueError(f"kv-canary: {who}: {name} must be a 1-D integer array {dims}, got {_describe(x)}")
    if length is not None and shape[0] != length:
        raise ValueError(f"kv-canary: {who}: {name} must have shape ({length},) {dims}, got {_describe(x)}")
    return ints.as_int64_pairs(x, name=f"{who}: {name}", shape=(shape[0],))


def _table(x: Any, who: str, name: str, ndim: int, dims: str, min_rows: int | None = None) -> jax.Array:
    """An int32 table (``req_to_token``-like) of rank ``ndim``, checked before tracing.

    Raises:
      ValueError: wrong rank, too few rows, or numpy values outside int32.
      TypeError: a JAX array that is not int32, or non-integer data.
    """
    if x is None:
        raise ValueError(f"kv-canary: {who}: {name} is required (an int32 array {dims})")
    shape = tuple(np.shape(x))
    if len(shape) != ndim:
        raise ValueError(f"kv-canary: {who}: {name} must be a {ndim}-D int32 array {dims}, got {_describe(x)}")
    dt = _dtype_of(x)
    if dt.kind not in "iu" or (isinstance(x, jax.Array) and dt != np.dtype(np.int32)):
        raise TypeError(f"kv-canary: {who}: {name} must be a {ndim}-D int32 array {dims}, got {_describe(x)}")
    if min_rows is not None and shape[0] < min_rows:
        raise ValueError(f"kv-canary: {who}: {name} must have at least {min_rows} rows {dims}, got {_describe(x)}")
    return ints.as_int32(x, name=f"{who}: {name}")


def _expected_inputs(ex: Any, who: str, t: int) -> ExpectedInputs | None:
    if ex is None:
        return None
    if not isinstance(ex, ExpectedInputs):
        raise TypeError(f"kv-canary: {who}: expected_inputs must be an ExpectedInputs, got {type(ex).__name__}")
    return ExpectedInputs(
        tokens=_ints(ex.tokens, who, "expected_inputs.tokens", t, "[num_tokens]"),
        positions=_ints(ex.positions, who, "expected_inputs.positions", t, "[num_tokens]"),
    )


def _expected_tokens(tokens: Any, valid_lens: Any, row_index: Any, who: str, bs: int):
    """``(ExpectedTokenTable, valid_lens pairs)`` or ``(None, None)``; both or neither must be given."""
    if tokens is None and valid_lens is None:
        return None, None
    if tokens is None or valid_lens is None:
        raise ValueError(f"kv-canary: {who}: expected_tokens and expected_tokens_valid_lens go together")
    table = _table(tokens, who, "expected_tokens", 2, "[rows, max_context_len]")
    valid = _ints(valid_lens, who, "expected_tokens_valid_lens", bs, "[num_rows]")
    return ExpectedTokenTable(tokens=table, row_index=row_index), valid


def _host(x: Any, name: str) -> np.ndarray | None:
    """A checked integer field's exact int64 values when it is host data (numpy, lists), else None: JAX
    arrays and tracers are never read on the host (no sync); their values are the caller's contract."""
    if x is None or isinstance(x, jax.Array):
        return None
    return ints.exact_int64_np(x, name=name)


def _host_num_reqs(num_reqs: Any, rows: int) -> int | None:
    """The live row count when it is known on the host (an int, numpy, or None = every row), else None."""
    if num_reqs is None:
        return rows
    if isinstance(num_reqs, jax.Array):
        return None
    return int(np.asarray(num_reqs).reshape(()))


def _num_reqs(num_reqs: Any, rows: int, who: str) -> jax.Array:
    """``num_reqs`` as an ``int32[]`` device scalar (data, so each count shares one program); a device value
    outside ``[0, rows]`` is clipped (host values are checked)."""
    if num_reqs is None:
        return jnp.int32(rows)
    if isinstance(num_reqs, (jax.Array, np.ndarray)):
        if num_reqs.shape not in ((), (1,)) or _dtype_of(num_reqs).kind not in "iu":
            raise ValueError(
                f"kv-canary: {who}: num_reqs must be an int or an integer array of shape () or (1,), got "
                f"{_describe(num_reqs)}"
            )
        if isinstance(num_reqs, jax.Array):
            return jnp.clip(num_reqs.reshape(()), 0, rows).astype(jnp.int32)
        num_reqs = num_reqs.reshape(()).item()
    n = ints.check_int(num_reqs, name=f"{who}: num_reqs", minimum=0, maximum=rows)
    return jnp.int32(n)


def _where_pairs(pred: jax.Array, a: jax.Array, b: int | jax.Array) -> jax.Array:
    if isinstance(b, int):
        b = pairs.pack(pairs.const(b, pred.shape))
    return jnp.where(pred[..., None], a, b)


def _prechecked_batch(
    rows: tuple, ids, pos, loc, table: Any, ex, expected: tuple, passed: dict | None = None
) -> CanaryBatch:
    """The CanaryBatch of fields converted and checked here: ``rows`` = ``(req_pool_indices, prefix_lens,
    extend_seq_lens)`` (canary rows, ``uint32[bs, 2]`` pairs), the per-token ``input_ids`` / ``positions`` /
    ``out_cache_loc`` pairs, the slot table, the expected inputs, and ``expected`` = ``(ExpectedTokenTable,
    valid_lens pairs)`` or ``(None, None)``. ``passed``: the stack's own arrays of the fields whose pairs are
    exactly their widening (field name -> array), which the launches may read as they are when they are traced
    int32 vectors (:meth:`CanaryBatch.operand`)."""
    rpi, prefix, extend = rows
    pool, valid = expected
    return CanaryBatch.prechecked(
        int32_fields=passed,
        req_pool_indices=rpi,
        prefix_lens=prefix,
        extend_seq_lens=extend,
        input_ids=ids,
        positions=pos,
        out_cache_loc=loc,
        req_to_token=table,
        expected_inputs=ex,
        req_to_verify_expected_tokens=pool,
        req_to_verify_expected_tokens_valid_lens=valid,
    )
