"""Launch shapes padded to buckets (:mod:`canary_jax.buckets`): padded entries are never written, never counted.

:func:`canary_jax.verify` and :func:`canary_jax.write` call these outside ``jit`` (inside a caller's ``jit`` the
calls trace inline, unpadded), so the compiled programs see only bucket sizes:

* verify: the plan capacity ``C`` grows to ``Cp``; new entries are ``(slot 0, token -1, position 0, prev 0)``
  and ``verify_num_valid`` becomes ``min(num_valid, C)``, so entries past ``C`` stay dead even when
  ``num_valid > C`` (the counters see ``min(num_valid, C)``, as SGLang counts).
* write: the token arrays grow from ``T`` to ``Tp`` (ids 0, positions 0, slots -1); the request rows from
  ``Cw`` to ``Cwp`` (seed -1, the last offset repeated) and ``write_num_valid_reqs`` becomes
  ``min(num_valid_reqs, Cw)``. When ``T`` grows, every offset is clamped into ``[0, T]`` first, exactly what the
  kernels do with ``T`` (they clamp into ``[0, num_tokens]``), so no request reaches a padded token, even with
  out-of-contract offsets: the padded launch is byte-identical to the unpadded one.

What is copied: only these small read-only inputs (plan arrays ``C x 32`` or ``(2 Cw + 1) x 8`` bytes, token
arrays ``T x 8`` bytes each), and only when a size is not a bucket already; the canary buffer, the log and the
real-KV sources are never copied. Host data (numpy, lists) and CPU-resident JAX arrays are padded with numpy (no
compile); arrays on an accelerator with a small jitted pad, compiled per (length, bucket) and bounded by
``MAX_PAD_PROGRAMS`` (its cache is cleared past that).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import ints, pairs
from canary_jax.plans import VerifyPlan, WritePlan

MAX_PAD_PROGRAMS = 64
"""Compiled accelerator pad programs kept before their cache is cleared."""


def _host(x: Any) -> np.ndarray | None:
    """``x`` as numpy when that needs no device round trip (host data, CPU-resident JAX arrays), else None."""
    if isinstance(x, jax.Array):
        if all(d.platform == "cpu" for d in x.devices()):
            return np.asarray(x)
        return None
    return np.asarray(x)


def _fill_row(fill: int, pair: bool) -> np.ndarray:
    if not pair:
        return np.array(fill, np.int32)
    v = int(fill) & 0xFFFFFFFFFFFFFFFF
    return np.array([v & 0xFFFFFFFF, v >> 32], np.uint32)


@jax.jit
def _i64_clamp(x: jax.Array, n: jax.Array) -> jax.Array:
    c = pairs.clamp(pairs.unpack(x), 2**31 - 1)  # int32 in [0, 2**31 - 1]
    c = jnp.minimum(c, n).astype(jnp.uint32)
    return jnp.stack([c, jnp.zeros_like(c)], axis=-1)


def _pad_device(x: jax.Array, rows: int, fill: np.ndarray, edge: bool) -> jax.Array:
    if _pad_device_jit._cache_size() > MAX_PAD_PROGRAMS:
        _pad_device_jit.clear_cache()
    return _pad_device_jit(x, rows, tuple(np.asarray(fill).reshape(-1).tolist()), edge)


def _pad_device_body(x, rows, fill, edge):
    extra = rows - x.shape[0]
    if edge:
        tail = jnp.broadcast_to(x[-1:], (extra,) + x.shape[1:])
    else:
        tail = jnp.broadcast_to(jnp.asarray(fill, x.dtype).reshape(x.shape[1:]), (extra,) + x.shape[1:])
    return jnp.concatenate([x, tail], axis=0)


_pad_device_jit = jax.jit(_pad_device_body, static_argnums=(1, 2, 3))


def pad_rows(x: Any, rows: int, *, fill: int = 0, edge: bool = False) -> jax.Array:
    """``x`` (``uint32[n, 2]`` int64 pairs or ``int32[n]``) grown to ``rows`` rows.

    Args:
      x: numpy or JAX array, ``n <= rows`` (``n >= 1`` when ``edge``).
      rows: the padded length.
      fill: the int64 (pairs) or int32 value of the new rows.
      edge: repeat the last row instead of ``fill``.

    Returns:
      A JAX array of ``rows`` rows (``x`` itself, moved to the device, when ``n == rows``).
    """
    n = int(x.shape[0])
    pair = x.ndim == 2
    if n == rows:
        return ints.to_device(x)
    h = _host(x)
    if h is None:
        return _pad_device(x, rows, _fill_row(fill, pair), edge)
    tail = np.broadcast_to(h[-1:] if edge else _fill_row(fill, pair), (rows - n,) + h.shape[1:])
    return ints.to_device(np.concatenate([h, tail.astype(h.dtype)], axis=0))


def _clamp_pairs(x: Any, n: int) -> jax.Array:
    """int64 pairs clamped into ``[0, n]`` (the kernels' offset clamp), as pairs."""
    h = _host(x)
    if h is None:
        if _i64_clamp._cache_size() > MAX_PAD_PROGRAMS:
            _i64_clamp.clear_cache()
        return _i64_clamp(x, jnp.int32(n))
    v = np.ascontiguousarray(h.astype(np.uint32), dtype="<u4").view("<i8").reshape(h.shape[:-1])
    v = np.clip(v, 0, n).astype("<i8")
    return v.view("<u4").reshape(h.shape).astype(np.uint32)


def _min_i32(x: Any, cap: int) -> jax.Array:
    """``int32[1]`` ``min(x, cap)`` (negative values kept: the kernels clip them to 0)."""
    h = _host(x)
    if h is None:
        return jnp.minimum(x, jnp.int32(cap))
    return ints.to_device(np.minimum(h, np.int32(cap)).astype(np.int32))


def pad_verify_plan(plan: VerifyPlan, capacity: int) -> VerifyPlan:
    """``plan`` with capacity ``capacity >= C``; entries past ``C`` dead (see the module docstring).

    Returns ``plan`` itself when ``capacity == C``.
    """
    c = plan.verify_capacity
    if capacity == c:
        return plan
    return VerifyPlan(
        verify_slot_indices=pad_rows(plan.verify_slot_indices, capacity),
        verify_expected_tokens=pad_rows(plan.verify_expected_tokens, capacity, fill=-1),
        verify_expected_positions=pad_rows(plan.verify_expected_positions, capacity),
        verify_prev_slot_indices=pad_rows(plan.verify_prev_slot_indices, capacity),
        verify_num_valid=_min_i32(plan.verify_num_valid, c),
        enable=ints.to_device(plan.enable),
    )


def pad_write_plan(plan: WritePlan, req_capacity: int, *, num_tokens: int, padded_tokens: int) -> WritePlan:
    """``plan`` with ``req_capacity >= Cw`` request rows for a launch of ``num_tokens`` tokens padded to
    ``padded_tokens`` (see the module docstring). Returns ``plan`` itself when neither size changes."""
    cw = plan.write_req_capacity
    if req_capacity == cw and padded_tokens == num_tokens:
        return plan
    off = plan.write_offsets
    if padded_tokens != num_tokens:
        off = _clamp_pairs(off, num_tokens)
    return WritePlan(
        write_offsets=pad_rows(off, req_capacity + 1, edge=True),
        write_seed_slot_indices=pad_rows(plan.write_seed_slot_indices, req_capacity, fill=-1),
        write_num_valid_reqs=_min_i32(plan.write_num_valid_reqs, cw),
    )
