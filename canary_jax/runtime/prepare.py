"""Preparing a step batch: the one place that checks, widens and pads the batch of every step-API entry point.

:func:`prepare_batch` is called once per call by :func:`~canary_jax.runtime.step.canary_plan`,
:func:`~canary_jax.runtime.step.canary_head`, :func:`~canary_jax.runtime.step.canary_tail`,
:func:`~canary_jax.runtime.step.canary_step` and :meth:`~canary_jax.runtime.guard.CanaryGuard.step`. In order:

1. widen: a mapping or keywords become a :class:`~canary_jax.runtime.state.CanaryBatch` (the guard only), whose
   construction converts every int64-valued field exactly to ``uint32[..., 2]`` pairs and the int32 tables
   through :func:`canary_jax.contract.ints.as_int32` (host data outside int32 refused);
2. static checks (:func:`check_batch`): the type, the token-oracle fields the config's asserts need, the rows
   against ``write_req_capacity``; the guard adds ``req_to_token``'s width and fixed signature and the host
   int32 rule of :class:`~canary_jax.runtime.step_inputs.StepInputs` (:func:`check_host_int32`);
3. eagerly only, the values of the host (numpy) fields (:func:`check_batch_values`) and the padding to bucket
   shapes (:func:`pad_eager`, :mod:`canary_jax.runtime.shapes`).

Inside a caller's ``jit`` (``traced=True``) only steps 1-2 run: nothing is read on the host, nothing is padded
(the caller's shapes are fixed). Fields held as JAX arrays are never read on the host (no sync): their values
are the caller's contract.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from canary_jax.contract import ints, validation
from canary_jax.runtime import shapes
from canary_jax.runtime.groups import PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig
from canary_jax.runtime.step_inputs import _STEP_INPUT_INT32_FIELDS, _describe_signature, _table_signature

__all__ = [
    "GuardLimits",
    "PreparedBatch",
    "as_batch",
    "check_batch",
    "check_batch_values",
    "check_host_int32",
    "pad_eager",
    "prepare_batch",
]


@dataclasses.dataclass(frozen=True, slots=True)
class PreparedBatch:
    """A checked batch and what the programs launch on.

    Fields:
      batch: the converted, checked :class:`~canary_jax.runtime.state.CanaryBatch` as given (unpadded).
      launch: eagerly, ``batch`` padded to bucket shapes; traced, ``batch`` itself.
      num_tokens: eagerly, ``np.int32`` T (the live tokens of ``launch``); traced, None (nothing padded).
    """

    batch: CanaryBatch
    launch: CanaryBatch
    num_tokens: np.int32 | None


@dataclasses.dataclass(frozen=True, slots=True)
class GuardLimits:
    """What :class:`~canary_jax.runtime.guard.CanaryGuard` checks beyond the step API.

    Fields:
      max_seq_len: the columns a dense ``req_to_token`` must have.
      table_signature: ``req_to_token``'s signature at the previous step (None before the first).
    """

    max_seq_len: int
    table_signature: tuple | None


def as_batch(batch: Any, fields: Mapping) -> CanaryBatch:
    """A :class:`CanaryBatch` from the guard's arguments: a CanaryBatch, a mapping of its fields, or None and
    the fields as keywords (converted by the constructor).

    Raises:
      TypeError: both a batch and keywords, or a batch of another kind; the constructor's errors.
    """
    if batch is None:
        return CanaryBatch(**fields)
    if fields:
        raise TypeError("kv-canary: pass the batch either as a CanaryBatch / mapping or as keywords, not both")
    if isinstance(batch, CanaryBatch):
        return batch
    if isinstance(batch, Mapping):
        return CanaryBatch(**batch)
    raise TypeError(f"kv-canary: batch must be a CanaryBatch or a mapping of its fields, got {type(batch).__name__}")


def check_batch(batch: Any, config: CanaryStepConfig, *, rows_limit: str = "write_req_capacity") -> None:
    """The static checks of a step batch (before anything is traced).

    Args:
      rows_limit: how the rows error names ``config.write_req_capacity``.

    Raises:
      TypeError: not a CanaryBatch.
      ValueError: ``expected_inputs`` missing or present against ``enable_write_input_assert``; the
        expected-token pool or its valid lengths missing with ``enable_verify_token_assert``; more rows than
        ``write_req_capacity``.
    """
    if not isinstance(batch, CanaryBatch):
        raise TypeError(f"kv-canary: batch must be a CanaryBatch, got {type(batch).__name__}")
    if config.enable_write_input_assert:
        has = batch.expected_inputs is not None
        validation.check_expected_inputs(True, has_tokens=has, has_positions=has)
    if config.enable_verify_token_assert and (
        batch.req_to_verify_expected_tokens is None or batch.req_to_verify_expected_tokens_valid_lens is None
    ):
        raise ValueError(
            "kv-canary: enable_verify_token_assert=True requires batch.req_to_verify_expected_tokens "
            "(and req_to_verify_expected_tokens_valid_lens)"
        )
    if batch.batch_size > config.write_req_capacity:
        raise ValueError(
            f"kv-canary: the batch has {batch.batch_size} rows but {rows_limit} is {config.write_req_capacity}"
        )


def _check_guard_table(batch: CanaryBatch, guard: GuardLimits) -> None:
    """The guard's fixed ``req_to_token``: ``max_seq_len`` columns, one signature across steps."""
    table = batch.req_to_token
    if getattr(table, "ndim", None) == 2 and table.shape[1] != guard.max_seq_len:
        raise ValueError(
            f"kv-canary: req_to_token has {table.shape[1]} columns but the guard was built with "
            f"max_seq_len={guard.max_seq_len}"
        )
    sig = _table_signature(table)
    if guard.table_signature is not None and sig != guard.table_signature:
        raise ValueError(
            "kv-canary: req_to_token must keep one shape (fixed capacities): got "
            f"{_describe_signature(sig)} after {_describe_signature(guard.table_signature)}"
        )


def _host_int64(x: Any) -> np.ndarray | None:
    """A batch field's exact int64 values when it is host data (numpy pairs), else None (JAX arrays and
    tracers: their values are never read on the host)."""
    return ints.pairs_to_int64_np(x) if isinstance(x, np.ndarray) else None


def check_host_int32(batch: CanaryBatch) -> None:
    """Refuses host (numpy) values outside int32 in the fields
    :class:`~canary_jax.runtime.step_inputs.StepInputs` narrows to int32.

    Fields held as JAX arrays are not read (no host sync): that they fit is the caller's contract.

    Raises:
      ValueError: the first such value, naming the field and its index.
    """
    for name in _STEP_INPUT_INT32_FIELDS:
        v = _host_int64(getattr(batch, name))
        if v is None:  # a JAX array: not read on the host (see StepInputs)
            continue
        bad = np.flatnonzero((v < ints.INT32_MIN) | (v > ints.INT32_MAX))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"kv-canary: {name}[{i}] = {int(v[i])} is outside int32, but step_fn receives {name} as int32 "
                "(StepInputs); refusing to truncate"
            )


def _slot_limit(state: CanaryState) -> tuple[int, str]:
    """The exclusive bound of ``out_cache_loc`` over the state's groups, and which group sets it: a FULL group's
    canary slots, an SWA group's LUT length (``out_cache_loc`` holds full-pool slots, translated through it)."""
    limits = []
    for i, g in enumerate(state.groups):
        if g.kind is PoolKind.SWA:
            limits.append((int(g.swa_index_lut.shape[0]), f"the length of group {i}'s (SWA) swa_index_lut"))
        else:
            limits.append((int(g.k_head.shape[0]), f"num_slots of group {i}'s ({g.kind.name}) canary buffers"))
    return min(limits, key=lambda e: e[0])


def check_batch_values(state: CanaryState | None, batch: CanaryBatch) -> None:
    """Checks the *values* of a batch's host (numpy) fields against SGLang's contract and the state (None: every
    check but ``out_cache_loc``'s bound, which needs the state's groups).

    Runs on host data only, before anything is traced or changed (eager calls of the step API and
    :class:`~canary_jax.runtime.guard.CanaryGuard`); a field held as a JAX array or tracer is not read (no host
    sync), so inside a ``jit`` (or with device fields) these are the caller's contract, and the kernels then
    behave as SGLang's production kernels (:mod:`canary_jax.ops.reference`, :mod:`canary_jax.planning.plan_builder`): a
    write slot ``>= num_slots`` is skipped (not written, not counted: that token is not protected), a
    negative extend writes nothing and a negative prefix verifies nothing (the row's chain restarts at the
    anchor), extends past the token arrays read tokens owned by no request, and a ``req_to_token`` row outside
    the table reads as slot 0 (verify skips it).

    Accepted, as SGLang accepts them: padding rows (``req_pool_indices`` 0) with any lengths; tokens past the
    non-padding rows' extends (owned by no request, never written); negative ``out_cache_loc`` entries (the
    write kernel skips them: SGLang's ``slot < 0`` rule, sglang-jax's padding -1); ``out_cache_loc`` 0 (the
    padding slot).

    Raises:
      ValueError: naming the field, the index, the value and the limit: ``req_pool_indices`` negative or
        ``>=`` the rows of a dense ``req_to_token``; ``prefix_lens`` / ``extend_seq_lens`` negative on a
        non-padding row; the non-padding rows' ``extend_seq_lens`` summing to more than the batch's tokens;
        ``out_cache_loc`` of a token a request writes ``>=`` the canary buffer's slots (a FULL group's
        ``num_slots``, an SWA group's LUT length).
    """
    rpi = _host_int64(batch.req_pool_indices)
    if rpi is None:
        return
    neg = np.flatnonzero(rpi < 0)
    if neg.size:
        i = int(neg[0])
        raise ValueError(
            f"kv-canary: req_pool_indices[{i}] = {int(rpi[i])} is negative; 0 is the padding row "
            "(SGLang's REQ_POOL_IDX_PADDING) and request rows start at 1"
        )
    table = batch.req_to_token
    if getattr(table, "ndim", None) == 2:
        rows = int(table.shape[0])
        big = np.flatnonzero(rpi >= rows)
        if big.size:
            i = int(big[0])
            raise ValueError(
                f"kv-canary: req_pool_indices[{i}] = {int(rpi[i])} is outside req_to_token's {rows} rows "
                f"(request rows 1..{rows - 1}; 0 is the padding row)"
            )
    live = rpi != 0
    lens = {}
    for name in ("prefix_lens", "extend_seq_lens"):
        v = _host_int64(getattr(batch, name))
        lens[name] = v
        if v is None:
            continue
        bad = np.flatnonzero(live & (v < 0))
        if bad.size:
            i = int(bad[0])
            raise ValueError(
                f"kv-canary: {name}[{i}] = {int(v[i])} is negative on a non-padding row "
                f"(req_pool_indices[{i}] = {int(rpi[i])})"
            )
    extend = lens["extend_seq_lens"]
    if extend is None:
        return
    owned_per_row = [int(e) if ok else 0 for e, ok in zip(extend.tolist(), live.tolist())]
    total, t = sum(owned_per_row), batch.num_tokens
    if total > t:
        raise ValueError(
            f"kv-canary: the non-padding rows' extend_seq_lens sum to {total} but the batch has {t} tokens "
            "(input_ids, positions, out_cache_loc)"
        )
    loc = _host_int64(batch.out_cache_loc)
    if loc is None or total == 0 or state is None:
        return
    limit, what = _slot_limit(state)
    bad = np.flatnonzero(loc[:total] >= limit)
    if bad.size:
        i = int(bad[0])
        r = int(np.searchsorted(np.cumsum(owned_per_row), i, side="right"))
        raise ValueError(
            f"kv-canary: out_cache_loc[{i}] = {int(loc[i])} is outside [0, {limit}) ({what}); token {i} is "
            f"written by row {r} (req_pool_indices[{r}] = {int(rpi[r])}). Negative entries skip the write "
            "(SGLang's padding); slots past the canary buffer are refused"
        )


def pad_eager(batch: CanaryBatch, config: CanaryStepConfig) -> tuple[CanaryBatch, np.int32]:
    """``(padded, num_tokens)``: ``batch`` padded to ``config.buckets``'s shapes
    (:func:`~canary_jax.runtime.shapes.padded_batch_shape`, :func:`~canary_jax.runtime.shapes.pad_batch`:
    host fields on the host, JAX fields with ``jnp.pad``, no host sync) and its live tokens as ``np.int32``."""
    t, rows = shapes.padded_batch_shape(batch, config)
    return shapes.pad_batch(batch, num_tokens=t, num_rows=rows), np.int32(batch.num_tokens)


def prepare_batch(
    state: CanaryState,
    batch: Any,
    config: CanaryStepConfig,
    *,
    traced: bool,
    fields: Mapping | None = None,
    guard: GuardLimits | None = None,
) -> PreparedBatch:
    """Checks, widens and (eagerly) pads one step batch: the single entry of every step call.

    Args:
      state: the canary state the batch runs against (its groups bound ``out_cache_loc``).
      batch: a :class:`CanaryBatch`; with ``guard``, also a mapping of its fields, or None and ``fields``.
      config: the step's :class:`CanaryStepConfig` (asserts, ``write_req_capacity``, ``buckets``).
      traced: the call runs inside a caller's transformation: no host value check, no padding.
      fields: with ``guard``, the batch's fields as keywords.
      guard: the guard's extra limits (mapping / keyword batches, ``req_to_token``'s fixed width and
        signature, host int32 values), or None for the step API.

    Returns:
      A :class:`PreparedBatch`.

    Raises:
      TypeError / ValueError: as :func:`as_batch` (guard), :func:`check_batch`, the guard's table checks
        (naming ``max_seq_len`` or the two signatures), :func:`check_host_int32` (guard) and, eagerly,
        :func:`check_batch_values`; before anything is traced or changed.
    """
    if guard is not None:
        batch = as_batch(batch, fields or {})
        check_batch(batch, config, rows_limit="max_batch_size (write_req_capacity)")
        _check_guard_table(batch, guard)
        check_host_int32(batch)
    else:
        check_batch(batch, config)
    if traced:
        return PreparedBatch(batch=batch, launch=batch, num_tokens=None)
    check_batch_values(state, batch)
    launch, n = pad_eager(batch, config)
    return PreparedBatch(batch=batch, launch=launch, num_tokens=n)
