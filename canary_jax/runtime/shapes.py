"""Launch shapes of the step API: eager calls pad the batch and sweep plans to buckets (``../shared/PITFALLS.md``).

A serving engine's token count and batch size change every step, and every new shape is a new compiled
program. :mod:`canary_jax.runtime.step` therefore pads, before its jitted functions see them:

* token arrays ``[T]`` to ``bucket_size(T)`` (:mod:`canary_jax.ops.buckets`): ids 0, positions 0, out_cache_loc 0
  (the padding slot, as SGLang's padded batches). The padded entries are owned by no request, and the canary
  launches also see them as out_cache_loc -1 (:func:`mask_unowned`), so they are never written and never
  counted, even when a malformed batch's extends run past its T real tokens;
* batch rows ``[bs]`` to ``min(bucket_size(bs), write_req_capacity)`` with padding rows
  (``req_pool_indices`` 0, zero lengths), which plan no verify entry and write nothing;
* a sweep VerifyPlan of capacity C to ``bucket_size(C)`` with zero entries past the live ones
  (``verify_num_valid`` clamped to C first, as the kernels would clamp it).

Host (numpy) fields are padded on the host; JAX arrays with ``jnp.pad`` (no host sync; a small XLA program per
distinct input shape, no kernel). Inside a caller's ``jit`` nothing is padded: the caller's shapes are already fixed.
The results are byte-identical to the unpadded launch (canary buffers, ring, counters).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.ops import buckets as buckets_lib
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.state import CanaryBatch, CanaryStepConfig

try:  # public alias in the jax versions we support
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover
    from jax._src.core import Tracer as _Tracer

__all__ = ["is_traced", "mask_unowned", "pad_batch", "pad_verify_plan", "padded_batch_shape"]


def is_traced(*trees: Any) -> bool:
    """True if any leaf of ``trees`` is a tracer (the call runs inside a caller's transformation)."""
    return any(isinstance(x, _Tracer) for x in jax.tree_util.tree_leaves(trees))


def padded_batch_shape(batch: CanaryBatch, config: CanaryStepConfig) -> tuple[int, int]:
    """``(T_padded, bs_padded)`` for ``batch`` under ``config.buckets`` (rows capped at write_req_capacity)."""
    policy = config.buckets or buckets_lib.default_buckets()
    t = buckets_lib.bucket_size(batch.num_tokens, policy)
    bs = batch.batch_size
    rows = max(bs, min(buckets_lib.bucket_size(bs, policy), int(config.write_req_capacity)))
    return t, rows


def _pad(x: Any, n: int) -> Any:
    """Zero-pads dim 0 of ``x`` (pairs ``[m, 2]``) to ``n``."""
    if x is None or x.shape[0] == n:
        return x
    widths = [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
    return np.pad(x, widths) if isinstance(x, np.ndarray) else jnp.pad(x, widths)


def pad_batch(batch: CanaryBatch, *, num_tokens: int, num_rows: int) -> CanaryBatch:
    """``batch`` with its ``[T]`` fields zero-padded to ``num_tokens`` and its ``[bs]`` fields to ``num_rows``.

    Row padding is padding rows (``req_pool_indices`` 0, zero lengths); token padding is owned by no request.
    The tables (``req_to_token``, the expected-token pool) keep their shapes.
    """
    ex = batch.expected_inputs
    if ex is not None:
        ex = ExpectedInputs(tokens=_pad(ex.tokens, num_tokens), positions=_pad(ex.positions, num_tokens))
    return CanaryBatch.prechecked(
        req_pool_indices=_pad(batch.req_pool_indices, num_rows),
        prefix_lens=_pad(batch.prefix_lens, num_rows),
        extend_seq_lens=_pad(batch.extend_seq_lens, num_rows),
        input_ids=_pad(batch.input_ids, num_tokens),
        positions=_pad(batch.positions, num_tokens),
        out_cache_loc=_pad(batch.out_cache_loc, num_tokens),
        req_to_token=batch.req_to_token,
        expected_inputs=ex,
        req_to_verify_expected_tokens=batch.req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=_pad(batch.req_to_verify_expected_tokens_valid_lens, num_rows),
    )


def mask_unowned(out_cache_loc: jax.Array, num_tokens: jax.Array | None) -> jax.Array:
    """``out_cache_loc`` (``uint32[T, 2]`` pairs) with entries ``>= num_tokens`` set to -1 (never written).

    Args:
      num_tokens: ``int32[]`` count of real tokens (data, so one program serves every count), or None
        (no padding: returned unchanged).
    """
    if num_tokens is None:
        return out_cache_loc
    live = jnp.arange(out_cache_loc.shape[0], dtype=jnp.int32) < num_tokens
    return jnp.where(live[:, None], out_cache_loc, jnp.uint32(0xFFFFFFFF))


def pad_verify_plan(plan: VerifyPlan, capacity: int) -> VerifyPlan:
    """A concrete VerifyPlan padded to ``capacity`` entries (zeros past the live ones), on the host for numpy
    fields and on the device for JAX ones (no host sync).

    ``verify_num_valid`` is first clamped to the plan's own capacity, so the padded plan reads exactly the
    entries the unpadded one would.

    The launch-side twin, :func:`canary_jax.ops.padding.pad_verify_plan`, pads on the host and places the result
    on the launch's device (reading device fields back first), so that the public ``verify`` never compiles a
    pad; this one keeps device fields on the device (``jnp.pad``): the step API's plans come out of its own
    programs and must not be waited for.
    """
    cap = plan.verify_capacity
    if capacity == cap:
        return plan
    xp = np if isinstance(plan.verify_num_valid, np.ndarray) else jnp
    return VerifyPlan(
        verify_slot_indices=_pad(plan.verify_slot_indices, capacity),
        verify_expected_tokens=_pad(plan.verify_expected_tokens, capacity),
        verify_expected_positions=_pad(plan.verify_expected_positions, capacity),
        verify_prev_slot_indices=_pad(plan.verify_prev_slot_indices, capacity),
        verify_num_valid=xp.minimum(plan.verify_num_valid, np.int32(cap)).astype(np.int32),
        enable=plan.enable,
    )
