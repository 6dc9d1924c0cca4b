"""Launch shapes padded to buckets (:mod:`canary_jax.ops.buckets`): padded entries are never written, never counted.

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
real-KV sources are never copied. The copies are made on the host with numpy and transferred to the launch's
device (the canary buffer's): an input that already lives on a device is read back first (a small
device-to-host copy that waits for it). No XLA program is ever compiled here, on any platform, so the programs a
serving loop compiles are exactly its launch programs, one per bucket (an eager jitted pad would compile one per
input length on an accelerator).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from canary_jax.contract import ints
from canary_jax.planning.plans import VerifyPlan, WritePlan

Placement = jax.Device | jax.sharding.Sharding | None
"""Where padded arrays go: a device, a sharding, or None for the default device."""


def _fill_row(fill: int, pair: bool) -> np.ndarray:
    if not pair:
        return np.array(fill, np.int32)
    v = int(fill) & 0xFFFFFFFFFFFFFFFF
    return np.array([v & 0xFFFFFFFF, v >> 32], np.uint32)


def pad_rows(x: Any, rows: int, *, fill: int = 0, edge: bool = False, device: Placement = None) -> jax.Array:
    """``x`` (``uint32[n, 2]`` int64 pairs or ``int32[n]``) grown to ``rows`` rows.

    Args:
      x: numpy or JAX array, ``n <= rows`` (``n >= 1`` when ``edge``).
      rows: the padded length.
      fill: the int64 (pairs) or int32 value of the new rows.
      edge: repeat the last row instead of ``fill``.
      device: the launch's device (see :func:`canary_jax.contract.ints.to_device`).

    Returns:
      A JAX array of ``rows`` rows (``x`` itself, moved to the device, when ``n == rows``).
    """
    n = int(x.shape[0])
    if n == rows:
        return ints.to_device(x, device)
    h = np.asarray(x)
    tail = np.broadcast_to(h[-1:] if edge else _fill_row(fill, h.ndim == 2), (rows - n,) + h.shape[1:])
    return ints.to_device(np.concatenate([h, tail.astype(h.dtype)], axis=0), device)


def _clamp_pairs(x: Any, n: int) -> np.ndarray:
    """int64 pairs clamped into ``[0, n]`` (the kernels' offset clamp), as host pairs."""
    h = np.asarray(x)
    v = np.ascontiguousarray(h.astype(np.uint32), dtype="<u4").view("<i8").reshape(h.shape[:-1])
    v = np.clip(v, 0, n).astype("<i8")
    return v.view("<u4").reshape(h.shape).astype(np.uint32)


def _placed(plan: Any, device: Placement) -> Any:
    return jax.tree_util.tree_map(lambda a: ints.to_device(a, device), plan)


def _min_i32(x: Any, cap: int, device: Placement) -> jax.Array:
    """``int32[1]`` ``min(x, cap)`` (negative values kept: the kernels clip them to 0)."""
    return ints.to_device(np.minimum(np.asarray(x), np.int32(cap)).astype(np.int32), device)


def pad_verify_plan(plan: VerifyPlan, capacity: int, *, device: Placement = None) -> VerifyPlan:
    """``plan`` with capacity ``capacity >= C``; entries past ``C`` dead (see the module docstring). New arrays
    go to ``device`` (the launch's).

    Returns ``plan`` with its arrays placed on ``device`` (:func:`canary_jax.contract.ints.to_device`) when
    ``capacity == C``.
    """
    c = plan.verify_capacity
    if capacity == c:
        return _placed(plan, device)
    return VerifyPlan(
        verify_slot_indices=pad_rows(plan.verify_slot_indices, capacity, device=device),
        verify_expected_tokens=pad_rows(plan.verify_expected_tokens, capacity, fill=-1, device=device),
        verify_expected_positions=pad_rows(plan.verify_expected_positions, capacity, device=device),
        verify_prev_slot_indices=pad_rows(plan.verify_prev_slot_indices, capacity, device=device),
        verify_num_valid=_min_i32(plan.verify_num_valid, c, device),
        enable=ints.to_device(plan.enable, device),
    )


def pad_write_plan(
    plan: WritePlan, req_capacity: int, *, num_tokens: int, padded_tokens: int, device: Placement = None
) -> WritePlan:
    """``plan`` with ``req_capacity >= Cw`` request rows for a launch of ``num_tokens`` tokens padded to
    ``padded_tokens`` (see the module docstring); new arrays go to ``device`` (the launch's). Returns ``plan``
    with its arrays placed on ``device`` when neither size changes."""
    cw = plan.write_req_capacity
    if req_capacity == cw and padded_tokens == num_tokens:
        return _placed(plan, device)
    off = plan.write_offsets
    if padded_tokens != num_tokens:
        off = _clamp_pairs(off, num_tokens)
    return WritePlan(
        write_offsets=pad_rows(off, req_capacity + 1, edge=True, device=device),
        write_seed_slot_indices=pad_rows(plan.write_seed_slot_indices, req_capacity, fill=-1, device=device),
        write_num_valid_reqs=_min_i32(plan.write_num_valid_reqs, cw, device),
    )
