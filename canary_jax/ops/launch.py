"""Public verify / write entry points: validate before tracing, normalise int64 inputs, pick a backend.

``verify(...)`` and ``write(...)`` are what serving code calls. They

1. run every static check (dtypes, shapes, stride, sources <= 4, write-input-assert presence) and raise a
   clear ``TypeError`` / ``ValueError`` before anything is traced or mutated;
2. turn int64-valued inputs into uint32 pairs losslessly (:mod:`canary_jax.contract.ints`);
3. dispatch to the ``reference`` (pure jnp), ``pallas`` (GPU kernels) or ``pallas_tpu`` (TPU verify, reference
   write) backend. ``backend=None`` reads the environment variable ``CANARY_JAX_BACKEND`` and otherwise picks
   ``pallas`` when the canary buffer lives on a GPU, ``pallas_tpu`` on a TPU and ``reference`` elsewhere; the
   Pallas kernels run compiled on their own platform's buffers and interpreted on any other
   (:mod:`canary_jax.ops.backends`: where the data is, not JAX's default backend).

Outside ``jit`` the canary buffer (write only) and the violation log are donated to the launch, so the update
happens in place; do not reuse the arrays you passed in, use the returned context. Inside a caller's ``jit``
the calls trace inline and XLA updates in place.

Launch shapes: outside ``jit`` the plan capacities (``C``, ``Cw``) and the token count ``T`` are padded up to
buckets (:mod:`canary_jax.ops.buckets`, :mod:`canary_jax.ops.padding`; padded entries are never written or counted,
the result is byte-identical), so a serving loop whose sizes change every step compiles one program per
bucket, not per size. Compiled programs are kept per op in a least-recently-used cache of at most
:data:`MAX_PROGRAMS_PER_OP` signatures; the oldest is dropped (its jit cache cleared) past that.
:func:`trace_count` and :func:`live_programs` let tests pin both.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable
from typing import Any

import jax

from canary_jax.contract import ints, sources, validation
from canary_jax.ops import backends, padding
from canary_jax.ops.backends import resolve_backend
from canary_jax.ops.buckets import Buckets, bucket_size
from canary_jax.ops.launch_coverage import check_coverage, verify_plan_hashed, write_plan_hashed
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan, check_context

try:  # public alias in the jax versions we support; fall back for safety
    _Tracer = jax.core.Tracer
except AttributeError:  # pragma: no cover
    from jax._src.core import Tracer as _Tracer


def is_tracing(*xs: Any) -> bool:
    """Whether any leaf of ``xs`` is a JAX tracer (the launch is being traced under a caller's ``jit``)."""
    return any(isinstance(x, _Tracer) for x in jax.tree_util.tree_leaves(xs))


# --- compiled programs -------------------------------------------------------------------------------------
MAX_PROGRAMS_PER_OP = 32
"""Compiled launch programs kept per op (least recently used dropped past it)."""

_LOCK = threading.Lock()
_PROGRAMS: dict[str, collections.OrderedDict] = {
    "verify": collections.OrderedDict(),
    "write": collections.OrderedDict(),
}
_TRACES = collections.Counter()


def trace_count(op: str | None = None) -> int:
    """How many launch programs ``op`` (``"verify"`` / ``"write"``, None: both) has traced in this process."""
    return sum(_TRACES.values()) if op is None else _TRACES[op]


def live_programs(op: str) -> int:
    """How many compiled programs of ``op`` are kept now (at most :data:`MAX_PROGRAMS_PER_OP`)."""
    return len(_PROGRAMS[op])


def _signature(statics: tuple, dynamic: Any) -> Hashable:
    leaves, tree = jax.tree_util.tree_flatten(dynamic)
    return (statics, tree, tuple((tuple(x.shape), str(x.dtype)) for x in leaves))


def _program(op: str, body: Callable, statics: tuple, dynamic: Any, *, donate_argnums: tuple) -> Callable:
    """The jitted program of ``op`` for this signature: a fresh closure per signature (so evicting it frees
    its caches), kept in an LRU of :data:`MAX_PROGRAMS_PER_OP`."""
    key = _signature(statics, dynamic)
    cache = _PROGRAMS[op]
    with _LOCK:
        fn = cache.get(key)
        if fn is not None:
            cache.move_to_end(key)
            return fn

        def traced(*args):
            _TRACES[op] += 1
            return body(*statics, *args)

        fn = cache[key] = jax.jit(traced, donate_argnums=donate_argnums)
        while len(cache) > MAX_PROGRAMS_PER_OP:
            _, old = cache.popitem(last=False)
            old.clear_cache()
        return fn


def _implementation(op: str, backend: str | None, context: VerifyOrWriteContext) -> Callable:
    """The backend's function for ``op``, chosen (and for Pallas, compiled or interpreted) by where the canary
    buffer lives (:mod:`canary_jax.ops.backends`; JAX's default backend for a traced buffer)."""
    platform = backends.array_platform(context.canary_buf)
    return backends.implementation(op, resolve_backend(backend, platform=platform), platform=platform)


def _placement(context: VerifyOrWriteContext) -> jax.sharding.Sharding | None:
    """Where a launch's padded inputs go: the device the canary buffer is committed to, else (None) the default
    device, uncommitted like the buffer (a compiled program is keyed on committedness too: mixing the two would
    compile a launch program twice)."""
    buf = context.canary_buf
    if isinstance(buf, jax.Array) and getattr(buf, "committed", False) and len(buf.devices()) == 1:
        return buf.sharding
    return None


# --- verify ----------------------------------------------------------------------------------------------
def verify(
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    *,
    check_verify_expected_token: bool = False,
    backend: str | None = None,
    buckets: Buckets | None = None,
) -> VerifyOrWriteContext:
    """Runs one verify launch; semantics of :func:`canary_jax.ops.reference.verify_reference` (SGLang's
    ``launch_canary_verify_kernel``; SPEC section 5).

    Args:
      context: :class:`~canary_jax.planning.plans.VerifyOrWriteContext`: canary buffer ``uint8[N, S]``, launch tag,
        :class:`~canary_jax.contract.layout.ViolationLog`, 0..4 real-KV sources and the hash mode.
      plan: :class:`~canary_jax.planning.plans.VerifyPlan` (entries as ``uint32[C, 2]`` int64 pairs). Slot 0 entries are
        skipped but counted; slots outside ``[0, N)`` read as an all-zero record (so they fail and the row
        names the bad slot); a negative prev slot means chain head, 0 means "chain check skipped".
      check_verify_expected_token: when True, entries whose expected token is not -1 must match the stored
        token (bit 32); when False the expected-token array is not read and column 4 holds -1.
      backend: ``"reference"`` (jnp), ``"pallas"`` (compiled when the canary buffer lives on a GPU, interpreted
        elsewhere), ``"pallas_tpu"`` (the TPU kernel, compiled on a TPU, TPU interpret mode elsewhere), or None
        for ``$CANARY_JAX_BACKEND`` / the default of the canary buffer's platform.
      buckets: the bucket policy for the plan capacity outside ``jit`` (default
        :func:`canary_jax.ops.buckets.default_buckets`); see :func:`canary_jax.ops.padding.pad_verify_plan`.

    Returns:
      The context with the new violation log (the canary buffer is read-only for verify). Outside ``jit`` the
      log you passed is donated: reusing it afterwards raises JAX's "buffer has been deleted or donated".

    Raises:
      TypeError / ValueError: any static check (dtype, shape, stride, more than 4 sources, ...), before
      tracing; nothing is mutated.
    """
    context, tracing = checked_verify(context, plan)
    return run_verify(context, plan, tracing, check=bool(check_verify_expected_token), backend=backend, buckets=buckets)


def run_verify(
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    tracing: bool,
    *,
    check: bool,
    backend: str | None,
    buckets: Buckets | None = None,
) -> VerifyOrWriteContext:
    """:func:`verify` after its checks (:func:`checked_verify`, which gave ``context`` and ``tracing``): the
    backend's kernel inline while tracing, else the padded launch program."""
    fn = _implementation("verify", backend, context)
    if tracing:
        return fn(context, plan, check_verify_expected_token=check)
    plan = padding.pad_verify_plan(plan, bucket_size(plan.verify_capacity, buckets), device=_placement(context))
    statics = (fn, check, context.kernel_kind, context.real_kv_hash_mode)
    dynamic = (context.canary_buf, context.log, tuple(context.real_kv_sources), plan)
    log = _program("verify", _verify_body, statics, dynamic, donate_argnums=(1,))(*dynamic)
    return context.replace(log=log)


def _checked_context(context: VerifyOrWriteContext, plan, kind: type, name: str) -> VerifyOrWriteContext:
    """The context's checks and the plan's (``kind``, named ``name``): the context with device sources."""
    check_context(context)
    context = context.replace(real_kv_sources=sources.device_sources(context.real_kv_sources))
    if not isinstance(plan, kind):
        raise TypeError(f"kv-canary: {name} must be a {kind.__name__}, got {type(plan).__name__}")
    plan.check()
    return context


def checked_verify(
    context: VerifyOrWriteContext, plan: VerifyPlan, *, name: str = "plan"
) -> tuple[VerifyOrWriteContext, bool]:
    """:func:`verify`'s checks before any tracing: ``(context with device sources, whether tracing)``; ``name``
    is the plan argument's name in the messages.

    Raises:
      TypeError / ValueError: as :func:`verify`.
    """
    context = _checked_context(context, plan, VerifyPlan, name)
    tracing = is_tracing(context, plan)
    check_coverage(
        context,
        tracing=tracing,
        op="verify",
        name="plan.verify_slot_indices",
        hashed=lambda n: verify_plan_hashed(plan, n),
    )
    return context, tracing


def _verify_body(fn, check, kind, mode, canary_buf, log, sources, plan):
    ctx = VerifyOrWriteContext(
        canary_buf=canary_buf, kernel_kind=kind, log=log, real_kv_sources=sources, real_kv_hash_mode=mode
    )
    return fn(ctx, plan, check_verify_expected_token=check).log


# --- write -----------------------------------------------------------------------------------------------
def normalize_write_inputs(
    input_ids,
    positions,
    out_cache_loc,
    *,
    enable_write_input_assert: bool,
    expected_input_tokens=None,
    expected_input_positions=None,
    host: bool = False,
    keep_int32: bool = False,
):
    """Checks the token arrays and converts them to int64 pairs ``uint32[T, 2]`` (host data stays numpy when
    ``host``, see :func:`canary_jax.contract.ints.as_int64_pairs`); with ``keep_int32`` traced int32 vectors stay
    narrow (:func:`canary_jax.contract.ints.as_int64_field`).

    Raises:
      ValueError: expected tensors present/absent against the flag (SGLang's messages), or lengths differ
        (naming the shorter array, see :func:`canary_jax.contract.validation.check_same_length`).
      TypeError: non-integer data.
    """
    validation.check_expected_inputs(
        enable_write_input_assert,
        has_tokens=expected_input_tokens is not None,
        has_positions=expected_input_positions is not None,
    )
    named = {"input_ids": input_ids, "positions": positions, "out_cache_loc": out_cache_loc}
    if enable_write_input_assert:
        named.update(expected_input_tokens=expected_input_tokens, expected_input_positions=expected_input_positions)
    convert = ints.as_int64_field if keep_int32 else ints.as_int64_pairs
    out = {}
    for name, x in named.items():  # SGLang's order: input_ids fixes T, the others must match it
        out[name] = convert(x, name=name, shape=(None,), host=host)
        t = int(out["input_ids"].shape[0])
        validation.check_same_length(name, int(out[name].shape[0]), ref_name="input_ids", ref_length=t)
    et, ep = out.get("expected_input_tokens"), out.get("expected_input_positions")
    return out["input_ids"], out["positions"], out["out_cache_loc"], et, ep


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
    buckets: Buckets | None = None,
) -> VerifyOrWriteContext:
    """Runs one write launch; semantics of :func:`canary_jax.ops.reference.write_reference` (SGLang's
    ``launch_canary_write_kernel``; SPEC section 6).

    Args:
      context: as for :func:`verify`; its canary buffer receives the stamps.
      plan: :class:`~canary_jax.planning.plans.WritePlan`: request ``r`` owns entries ``[off[r], off[r+1])`` and its
        chain continues from seed slot ``seeds[r]`` (-1: chain head).
      input_ids, positions, out_cache_loc: int64-valued ``[T]`` arrays in any lossless form accepted by
        :func:`canary_jax.contract.ints.as_int64_pairs` (int32, int64 with x64 on or numpy, or ``uint32[T, 2]``).
      expected_input_tokens, expected_input_positions: same forms, required iff
        ``enable_write_input_assert``.

      enable_write_input_assert: compare every written entry with the expected tensors (bits 8 / 16).
      backend: as for :func:`verify`.
      buckets: the bucket policy for ``T`` and ``Cw`` outside ``jit`` (default
        :func:`canary_jax.ops.buckets.default_buckets`); see :func:`canary_jax.ops.padding.pad_write_plan`.

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
    context, tracing, (ids, pos, loc, et, ep) = checked_write(
        context,
        plan,
        input_ids,
        positions,
        out_cache_loc,
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
    )
    return run_write(
        context,
        plan,
        tracing,
        (ids, pos, loc, et, ep),
        flag=bool(enable_write_input_assert),
        backend=backend,
        buckets=buckets,
    )


def run_write(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    tracing: bool,
    arrays: tuple,
    *,
    flag: bool,
    backend: str | None,
    buckets: Buckets | None = None,
) -> VerifyOrWriteContext:
    """:func:`write` after its checks (:func:`checked_write`, which gave ``tracing`` and ``arrays``: ids,
    positions, out_cache_loc, expected tokens, expected positions as int64 pairs): the backend's kernel inline
    while tracing, else the padded launch program. ``flag``: ``enable_write_input_assert``."""
    ids, pos, loc, et, ep = arrays
    fn = _implementation("write", backend, context)
    if tracing:
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
    t = int(ids.shape[0])
    tp = bucket_size(t, buckets)
    device = _placement(context)
    cwp = bucket_size(plan.write_req_capacity, buckets)
    plan = padding.pad_write_plan(plan, cwp, num_tokens=t, padded_tokens=tp, device=device)
    fills = (0, 0, -1, 0, 0)  # ids, positions, out_cache_loc (-1: skipped), expected tokens / positions
    arrays = tuple(
        None if a is None else padding.pad_rows(a, tp, fill=f, device=device)
        for a, f in zip((ids, pos, loc, et, ep), fills)
    )
    statics = (fn, flag, context.kernel_kind, context.real_kv_hash_mode)
    dynamic = (context.canary_buf, context.log, tuple(context.real_kv_sources), plan, arrays)
    buf, log = _program("write", _write_body, statics, dynamic, donate_argnums=(0, 1))(*dynamic)
    return context.replace(canary_buf=buf, log=log)


def checked_write(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids,
    positions,
    out_cache_loc,
    *,
    enable_write_input_assert: bool,
    expected_input_tokens,
    expected_input_positions,
    name: str = "plan",
    keep_int32: bool = False,
) -> tuple[VerifyOrWriteContext, bool, tuple]:
    """:func:`write`'s checks before any tracing: ``(context with device sources, whether tracing, the token
    arrays as int64 pairs: ids, positions, out_cache_loc, expected tokens, expected positions (None without the
    assert))``; ``name`` is the plan argument's name in the messages. With ``keep_int32`` traced int32 vectors
    stay narrow (:func:`normalize_write_inputs`).

    Raises:
      TypeError / ValueError: as :func:`write`.
    """
    context = _checked_context(context, plan, WritePlan, name)
    raw = (input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions)
    tracing = is_tracing(context, plan, *(x for x in raw if isinstance(x, jax.Array)))
    arrays = normalize_write_inputs(
        input_ids,
        positions,
        out_cache_loc,
        enable_write_input_assert=enable_write_input_assert,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
        host=not tracing,
        keep_int32=keep_int32,
    )
    loc = arrays[2]
    check_coverage(
        context,
        tracing=tracing,
        op="write",
        name="out_cache_loc",
        hashed=lambda n: write_plan_hashed(plan, ints.pairs_to_int64_np(loc), n),
    )
    return context, tracing, arrays


def _write_body(fn, flag, kind, mode, canary_buf, log, sources, plan, arrays):
    ids, pos, loc, et, ep = arrays
    ctx = VerifyOrWriteContext(
        canary_buf=canary_buf, kernel_kind=kind, log=log, real_kv_sources=sources, real_kv_hash_mode=mode
    )
    out = fn(
        ctx, plan, ids, pos, loc, enable_write_input_assert=flag, expected_input_tokens=et, expected_input_positions=ep
    )
    return out.canary_buf, out.log
