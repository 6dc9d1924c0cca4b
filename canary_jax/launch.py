"""Public verify / write entry points: validate before tracing, normalise int64 inputs, pick a backend.

``verify(...)`` and ``write(...)`` are what serving code calls. They

1. run every static check (dtypes, shapes, stride, sources <= 4, write-input-assert presence) and raise a
   clear ``TypeError`` / ``ValueError`` before anything is traced or mutated;
2. turn int64-valued inputs into uint32 pairs losslessly (:mod:`canary_jax.ints`);
3. dispatch to the ``reference`` (pure jnp) or ``pallas`` backend. ``backend=None`` reads the environment
   variable ``CANARY_JAX_BACKEND`` and otherwise picks ``pallas`` on GPU and ``reference`` elsewhere
   (``pallas`` on CPU runs the same kernels in interpret mode).

Outside ``jit`` the canary buffer (write only) and the violation log are donated to the launch, so the update
happens in place; do not reuse the arrays you passed in, use the returned context. Inside a caller's ``jit``
the calls trace inline and XLA updates in place.
"""

from __future__ import annotations

import functools
from typing import Any

import jax

from canary_jax import backends, ints, validation
from canary_jax.backends import resolve_backend
from canary_jax.plans import VerifyOrWriteContext, VerifyPlan, WritePlan, check_context
from canary_jax.sources import device_sources

try:  # public alias in the jax versions we support; fall back for safety
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover
    from jax._src.core import Tracer as _Tracer


def _is_tracing(*xs: Any) -> bool:
    return any(isinstance(x, _Tracer) for x in jax.tree_util.tree_leaves(xs))


# --- verify ----------------------------------------------------------------------------------------------
def verify(
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    *,
    check_verify_expected_token: bool = False,
    backend: str | None = None,
) -> VerifyOrWriteContext:
    """Runs one verify launch; semantics of :func:`canary_jax.reference.verify_reference` (SGLang's
    ``launch_canary_verify_kernel``; SPEC section 5).

    Args:
      context: :class:`~canary_jax.plans.VerifyOrWriteContext`: canary buffer ``uint8[N, S]``, launch tag,
        :class:`~canary_jax.layout.ViolationLog`, 0..4 real-KV sources and the hash mode.
      plan: :class:`~canary_jax.plans.VerifyPlan` (entries as ``uint32[C, 2]`` int64 pairs). Slot 0 entries are
        skipped but counted; slots outside ``[0, N)`` read as an all-zero record (so they fail and the row
        names the bad slot); a negative prev slot means chain head, 0 means "chain check skipped".
      check_verify_expected_token: when True, entries whose expected token is not -1 must match the stored
        token (bit 32); when False the expected-token array is not read and column 4 holds -1.
      backend: ``"reference"`` (jnp), ``"pallas"`` (compiled on GPU, interpreted on CPU), or None for
        ``$CANARY_JAX_BACKEND`` / the platform default.

    Returns:
      The context with the new violation log (the canary buffer is read-only for verify). Outside ``jit`` the
      log you passed is donated: reusing it afterwards raises JAX's "buffer has been deleted or donated".

    Raises:
      TypeError / ValueError: any static check (dtype, shape, stride, more than 4 sources, ...), before
      tracing; nothing is mutated.
    """
    check_context(context)
    context = context.replace(real_kv_sources=device_sources(context.real_kv_sources))
    if not isinstance(plan, VerifyPlan):
        raise TypeError(f"kv-canary: plan must be a VerifyPlan, got {type(plan).__name__}")
    plan.check()
    fn = backends.implementation("verify", resolve_backend(backend))
    if _is_tracing(context, plan):
        return fn(context, plan, check_verify_expected_token=bool(check_verify_expected_token))
    log = _verify_donating(fn, context, plan, bool(check_verify_expected_token))
    return context.replace(log=log)


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(2,))
def _verify_jit(fn, canary_buf, log, rest, check):
    sources, plan, kind, mode = rest[0], rest[1], rest[2], rest[3]
    ctx = VerifyOrWriteContext(
        canary_buf=canary_buf, kernel_kind=kind, log=log, real_kv_sources=sources, real_kv_hash_mode=mode
    )
    return fn(ctx, plan, check_verify_expected_token=check).log


def _verify_donating(fn, context, plan, check):
    rest = _Rest(context.real_kv_sources, plan, context.kernel_kind, context.real_kv_hash_mode)
    return _verify_jit(fn, context.canary_buf, context.log, rest, check)


# --- write -----------------------------------------------------------------------------------------------
def normalize_write_inputs(
    input_ids,
    positions,
    out_cache_loc,
    *,
    enable_write_input_assert: bool,
    expected_input_tokens=None,
    expected_input_positions=None,
):
    """Checks the token arrays and converts them to int64 pairs ``uint32[T, 2]``.

    Raises:
      ValueError: expected tensors present/absent against the flag (SGLang's messages), or lengths differ.
      TypeError: non-integer data.
    """
    validation.check_expected_inputs(
        enable_write_input_assert,
        has_tokens=expected_input_tokens is not None,
        has_positions=expected_input_positions is not None,
    )
    ids = ints.as_int64_pairs(input_ids, name="input_ids", shape=(None,))
    t = ids.shape[0]
    pos = ints.as_int64_pairs(positions, name="positions", shape=(t,))
    loc = ints.as_int64_pairs(out_cache_loc, name="out_cache_loc", shape=(t,))
    if enable_write_input_assert:
        et = ints.as_int64_pairs(expected_input_tokens, name="expected_input_tokens", shape=(t,))
        ep = ints.as_int64_pairs(expected_input_positions, name="expected_input_positions", shape=(t,))
    else:
        et = ep = None
    return ids, pos, loc, et, ep


def write(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids,
    positions,
    out_cache_loc,
    *,
    enable_write_input_assert: bool = False,
    expected_input_tokens=None,
    expected_input_positions=None,
    backend: str | None = None,
) -> VerifyOrWriteContext:
    """Runs one write launch; semantics of :func:`canary_jax.reference.write_reference` (SGLang's
    ``launch_canary_write_kernel``; SPEC section 6).

    Args:
      context: as for :func:`verify`; its canary buffer receives the stamps.
      plan: :class:`~canary_jax.plans.WritePlan`: request ``r`` owns entries ``[off[r], off[r+1])`` and its
        chain continues from seed slot ``seeds[r]`` (-1: chain head).
      input_ids, positions, out_cache_loc: int64-valued ``[T]`` arrays in any lossless form accepted by
        :func:`canary_jax.ints.as_int64_pairs` (int32, int64 with x64 on or numpy, or ``uint32[T, 2]``).
      expected_input_tokens, expected_input_positions: same forms, required iff
        ``enable_write_input_assert``.

      enable_write_input_assert: compare every written entry with the expected tensors (bits 8 / 16).
      backend: as for :func:`verify`.

    Ring rows (SPEC 6): ``[tag, slot, actual position, actual token, expected token, running prev_hash,
    expected position, bits]``. An input-assert row precedes the chain-position row of the same entry; the
    chain-position row (bit 16, ``expected token`` = the actual token, ``expected position`` = previous
    position + 1) fires when the request has a seed slot and ``log.enable_chain_position_assert`` is set.
    Entries with a slot outside ``[0, N)`` are skipped; a seed slot ``>= N`` reads as an all-zero record.

    Returns:
      The context with the new canary buffer and violation log. Outside ``jit`` both are donated: use the
      returned context, not the arrays you passed.

    Raises:
      TypeError / ValueError: any static check (dtype, shape, stride, more than 4 sources, expected tensors
      present without the assert or missing with it), before tracing; nothing is mutated.
    """
    check_context(context)
    context = context.replace(real_kv_sources=device_sources(context.real_kv_sources))
    if not isinstance(plan, WritePlan):
        raise TypeError(f"kv-canary: plan must be a WritePlan, got {type(plan).__name__}")
    plan.check()
    ids, pos, loc, et, ep = normalize_write_inputs(
        input_ids,
        positions,
        out_cache_loc,
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
    )
    fn = backends.implementation("write", resolve_backend(backend))
    flag = bool(enable_write_input_assert)
    if _is_tracing(context, plan, ids, pos, loc, et, ep):
        return fn(
            context,
            plan,
            ids,
            pos,
            loc,
            enable_write_input_assert=flag,
            expected_input_tokens=et,
            expected_input_positions=ep,
        )
    rest = _Rest(context.real_kv_sources, plan, context.kernel_kind, context.real_kv_hash_mode)
    buf, log = _write_jit(fn, context.canary_buf, context.log, rest, (ids, pos, loc, et, ep), flag)
    return context.replace(canary_buf=buf, log=log)


@functools.partial(jax.jit, static_argnums=(0, 5), donate_argnums=(1, 2))
def _write_jit(fn, canary_buf, log, rest, arrays, flag):
    sources, plan, kind, mode = rest[0], rest[1], rest[2], rest[3]
    ids, pos, loc, et, ep = arrays
    ctx = VerifyOrWriteContext(
        canary_buf=canary_buf, kernel_kind=kind, log=log, real_kv_sources=sources, real_kv_hash_mode=mode
    )
    out = fn(
        ctx, plan, ids, pos, loc, enable_write_input_assert=flag, expected_input_tokens=et, expected_input_positions=ep
    )
    return out.canary_buf, out.log


class _Rest(tuple):
    """(sources, plan, kernel_kind, mode) with the last two static, as a pytree."""

    def __new__(cls, sources, plan, kind, mode):
        return super().__new__(cls, (tuple(sources), plan, kind, mode))


jax.tree_util.register_pytree_node(
    _Rest,
    lambda r: ((r[0], r[1]), (r[2], r[3])),
    lambda aux, ch: _Rest(ch[0], ch[1], aux[0], aux[1]),
)
