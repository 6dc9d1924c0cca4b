"""The per-forward canary step for JAX serving stacks (SPEC 8.3), as functions a serving loop or its jitted
step can call.

A serving step does::

    state, plans = canary_head(state, batch, config=cfg)        # plan + HEAD verify/write, per group
    kv_pool = model_forward(kv_pool, ...)                       # writes the real KV
    state, summary = canary_tail(state, plans, batch, config=cfg,
                                 real_kv_sources=sources_of(kv_pool))   # TAIL verify/write, same plans
    state = canary_sweep(state, sweep_plans, config=cfg,        # every few steps: the cached prefixes
                         real_kv_sources=sources_of(kv_pool))

or, in one call, ``state, kv_state, summary = canary_step(state, batch, kv_write_fn, kv_state, config=cfg)``.

The canary state holds only the canary's own buffers and log, never KV data: the real-KV sources (views of the
pool *now*) are an argument of every call that hashes them, and a hashing mode (PARTIAL / ALL) without a source
for a launched half is refused.

Each public function is a thin wrapper: it validates everything static (raising ``TypeError`` / ``ValueError``
before anything is traced or changed), then

* called eagerly (concrete arrays): pads the batch to bucket shapes (:mod:`canary_jax.runtime.shapes`) and runs
  one jitted program per (config, bucket) that donates the state's canary buffers (updated in place; use the
  returned state, not the one you passed). The violation log is not donated, so snapshots of it stay valid;
* called inside a caller's ``jit``: runs inline, unpadded (the caller's shapes are fixed; XLA updates in place).

Eagerly, the *values* of the batch's host (numpy) fields are checked too (:func:`check_batch_values`: request
rows, lengths, extends against the tokens, written slots against the canary buffer). Nothing syncs with the
host to read device data and nothing raises on device data: inside a ``jit`` (or for fields held as JAX
arrays) those values are the caller's contract, violations land in the ring, plan overflow clears
``summary.verify_enable``. The types live in :mod:`canary_jax.runtime.state`; host-side reporting (ring decode,
log/raise, stats, health) in :mod:`canary_jax.runtime.report`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from canary_jax import buckets, ints, validation
from canary_jax.plans import VerifyPlan
from canary_jax.runtime import phases, shapes, slot_coverage
from canary_jax.runtime.groups import PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig, StepSummary

__all__ = [
    "canary_head",
    "canary_plan",
    "canary_step",
    "canary_sweep",
    "canary_tail",
    "check_batch_values",
]

MAX_KV_WRITE_FNS_PER_CONFIG = 8
"""Distinct ``kv_write_fn`` objects one config may see eagerly before :func:`canary_step` warns that each new
one compiles a new program (it is a static argument)."""


# --- static checks (before tracing) ----------------------------------------------------------------------
def _check_config(config: Any) -> CanaryStepConfig:
    if not isinstance(config, CanaryStepConfig):
        raise TypeError(f"kv-canary: config must be a CanaryStepConfig, got {type(config).__name__}")
    return config


def _check_state(state: Any) -> CanaryState:
    if not isinstance(state, CanaryState):
        raise TypeError(f"kv-canary: state must be a CanaryState, got {type(state).__name__}")
    if _has_deleted(state):
        raise ValueError(
            "kv-canary: the state's canary buffers were donated by an earlier call (canary_head, canary_tail and "
            "canary_step donate them when called eagerly); use the state that call returned"
        )
    return state


def _has_deleted(tree: Any) -> bool:
    """Whether a concrete JAX array of ``tree`` was deleted (donated); tracers and host data never are."""
    return any(
        isinstance(x, jax.Array) and not shapes.is_traced(x) and x.is_deleted() for x in jax.tree_util.tree_leaves(tree)
    )


def _check_batch(batch: Any, config: CanaryStepConfig) -> None:
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
            f"kv-canary: the batch has {batch.batch_size} rows but write_req_capacity is {config.write_req_capacity}"
        )


def _check_plans(plans: Any, state: CanaryState) -> None:
    if not isinstance(plans, CanaryPlans):
        raise TypeError(f"kv-canary: plans must be CanaryPlans, got {type(plans).__name__}")
    if len(plans.per_group) != len(state.groups):
        raise ValueError(f"kv-canary: plans cover {len(plans.per_group)} groups but the state has {len(state.groups)}")


def _host_int64(x: Any) -> np.ndarray | None:
    """A batch field's exact int64 values when it is host data (numpy pairs), else None (JAX arrays and
    tracers: their values are never read on the host)."""
    return ints.pairs_to_int64_np(x) if isinstance(x, np.ndarray) else None


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


def check_batch_values(state: CanaryState, batch: CanaryBatch) -> None:
    """Checks the *values* of a batch's host (numpy) fields against SGLang's contract and the state.

    Runs on host data only, before anything is traced or changed (eager calls of the step API and
    :class:`~canary_jax.integration.CanaryGuard`); a field held as a JAX array or tracer is not read (no host
    sync), so inside a ``jit`` (or with device fields) these are the caller's contract, and the kernels then
    behave as SGLang's production kernels (:mod:`canary_jax.reference`, :mod:`canary_jax.plan_builder`): a
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
    if loc is None or total == 0:
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


_KV_WRITE_FNS: dict = {}  # config -> hashes of the kv_write_fns it has seen eagerly (None once warned)


def _count_kv_write_fn(kv_write_fn: Any, config: CanaryStepConfig) -> None:
    """Warns (once per config) when eager :func:`canary_step` calls with one config have seen more than
    :data:`MAX_KV_WRITE_FNS_PER_CONFIG` distinct ``kv_write_fn`` objects (compared as ``jit`` compares static
    arguments: by hash and equality; only hashes are kept, so no function is kept alive)."""
    seen = _KV_WRITE_FNS.setdefault(config, set())
    if seen is None:
        return
    try:
        seen.add(hash(kv_write_fn))
    except TypeError:
        return  # unhashable: jit refuses it with its own message
    if len(seen) > MAX_KV_WRITE_FNS_PER_CONFIG:
        _KV_WRITE_FNS[config] = None
        warnings.warn(
            f"kv-canary: canary_step has been called with {len(seen)} distinct kv_write_fn objects under one "
            "config; kv_write_fn is a static argument, so each new object (a lambda or functools.partial made per "
            "step) compiles a new program. Define it once (e.g. a module-level function) and pass the same object "
            "every step",
            UserWarning,
            stacklevel=3,
        )


# --- public API ------------------------------------------------------------------------------------------
def canary_plan(state: CanaryState, batch: CanaryBatch, *, config: CanaryStepConfig) -> CanaryPlans:
    """Builds every group's per-forward plans (:func:`canary_jax.plan_builder.build_plans`).

    FULL groups plan with W = 0 and no LUT; SWA groups with their ``swa_window_size`` and LUT. The
    expected-token pool is passed only when ``config.enable_verify_token_assert``. Called eagerly, the batch
    is padded to bucket shapes first (padding rows plan nothing; ``write_num_valid_reqs`` counts them).

    Returns:
      :class:`CanaryPlans` (one (VerifyPlan, WritePlan) per group, and the current write index).

    Raises:
      TypeError / ValueError: bad config, state or batch (more rows than ``write_req_capacity``; eagerly, its
      host values: :func:`check_batch_values`), before tracing.
    """
    config = _check_config(config)
    _check_state(state)
    _check_batch(batch, config)
    if shapes.is_traced(state, batch):
        return phases.plan_impl(state, batch, config)
    check_batch_values(state, batch)
    batch, _ = phases.eager_batch(batch, config)
    return phases.plan_jit(phases.split(state)[1], batch, config=config)


def canary_head(
    state: CanaryState,
    batch: CanaryBatch,
    *,
    config: CanaryStepConfig,
    plans: CanaryPlans | None = None,
) -> tuple[CanaryState, CanaryPlans]:
    """Pre-forward half of the step: plan, then each group's HEAD endpoints (verify, then write).

    HEAD buffers carry no real-KV fingerprint (hash 0), so HEAD checks the bookkeeping (req_to_token, chain,
    positions, tokens) before the model touches the KV; it reads no KV data.

    Args:
      state: the canary state. Eagerly, its canary buffers are donated: use the returned state.
      batch: this forward's :class:`CanaryBatch`.
      config: static :class:`CanaryStepConfig`.
      plans: prebuilt plans (from :func:`canary_plan`), or None to build them here.

    Returns:
      ``(state, plans)``; pass ``plans`` unchanged to :func:`canary_tail`.

    Raises:
      TypeError / ValueError: bad config, state (or one whose buffers an earlier call donated), batch (its
      host values too: :func:`check_batch_values`) or plans, before tracing; nothing is changed.
    """
    config = _check_config(config)
    _check_state(state)
    _check_batch(batch, config)
    if plans is not None:
        _check_plans(plans, state)
    if shapes.is_traced(state, batch, plans):
        return phases.head_impl(state, batch, plans, None, config)
    check_batch_values(state, batch)
    batch, n = phases.eager_batch(batch, config)
    bufs, shell = phases.split(state)
    return phases.head_jit(bufs, shell, batch, plans, n, config=config)


def canary_tail(
    state: CanaryState,
    plans: CanaryPlans,
    batch: CanaryBatch,
    *,
    config: CanaryStepConfig,
    real_kv_sources: Sequence | None = None,
) -> tuple[CanaryState, StepSummary]:
    """Post-forward half of the step: each group's TAIL endpoints with the same plans as HEAD.

    TAIL verifies the prefix including the real-KV fingerprint of the (now current) KV bytes, then writes the
    new tokens with the freshly written KV's fingerprint.

    Args:
      state: the state returned by :func:`canary_head` (eagerly, its canary buffers are donated).
      plans: the plans returned by :func:`canary_head`.
      batch: the same batch.
      config: static :class:`CanaryStepConfig`.
      real_kv_sources: one ``(sources_k, sources_v)`` pair per group: tuples of
        :class:`~canary_jax.sources.RealKvSource` viewing the KV pool *after* the model's write (e.g. its
        layer-0 K array); ``None`` or ``()`` for a half without sources. Required (a source for K, and for V
        when ``enable_v_half`` and the group has a V half) unless ``real_kv_hash_mode`` is NONE. Read by this
        call only: the state never keeps them.

    Returns:
      ``(state, summary)``.

    Raises:
      TypeError / ValueError: bad config, state, batch or plans; a hashing mode without a source (naming the
      group and the mode), ``real_kv_sources`` not one pair per group, or a bad source; eagerly, the batch's
      host values (:func:`check_batch_values`); all before tracing, and nothing is changed.

    Warns:
      UserWarning: sources while ``real_kv_hash_mode`` is NONE, which hashes nothing (once per process).
    """
    config = _check_config(config)
    _check_state(state)
    _check_batch(batch, config)
    _check_plans(plans, state)
    srcs = phases.check_sources(real_kv_sources, state, config, "canary_tail")
    if shapes.is_traced(state, plans, batch, srcs):
        validation.warn_unhashed_sources(srcs, config.real_kv_hash_mode, who="canary_tail")
        return phases.tail_impl(state, plans, batch, srcs, None, config)
    check_batch_values(state, batch)
    validation.warn_unhashed_sources(srcs, config.real_kv_hash_mode, who="canary_tail")
    checked = slot_coverage.check_tail(state, plans, batch, srcs, config)
    batch, n = phases.eager_batch(batch, config)
    bufs, shell = phases.split(state)
    return phases.tail_jit(bufs, shell, plans, batch, srcs, n, config=config, slots_checked=checked)


def canary_step(
    state: CanaryState,
    batch: CanaryBatch,
    kv_write_fn: Callable[[Any, CanaryBatch], tuple[Any, Sequence | None]],
    kv_state: Any,
    *,
    config: CanaryStepConfig,
) -> tuple[CanaryState, Any, StepSummary]:
    """One whole canary-protected forward: plan + HEAD, the model's KV write, then TAIL.

    Args:
      state: the canary state. Eagerly, its canary buffers are donated: use the returned state.
      batch: this forward's :class:`CanaryBatch`.
      kv_write_fn: ``kv_write_fn(kv_state, batch) -> (kv_state, real_kv_sources)`` runs the model / writes the
        real KV; ``real_kv_sources`` is one ``(sources_k, sources_v)`` pair per group viewing the new KV (see
        :func:`canary_tail`; None only in NONE mode). It is traced with the batch as the canary sees it:
        int64-valued fields as ``uint32[..., 2]`` pairs and, eagerly, padded to bucket shapes (padding tokens
        have id 0, position 0 and out_cache_loc 0, the padding slot). Eagerly it is a static argument: it must
        be hashable, and each new object compiles a new program, so define it once (a module-level function)
        rather than a lambda or ``functools.partial`` per step (a warning says so after
        :data:`MAX_KV_WRITE_FNS_PER_CONFIG` distinct objects under one config). It must return the pair
        ``(kv_state, real_kv_sources)``.
      kv_state: whatever ``kv_write_fn`` threads (a pytree: KV pool arrays, ...). Eagerly it is donated.
      config: static :class:`CanaryStepConfig`.

    Returns:
      ``(state, kv_state, summary)``: the outputs are the canary state, the KV state and the small summary,
      nothing else (no second copy of the pool).

    Raises:
      TypeError / ValueError: as :func:`canary_head`; a ``kv_state`` donated by an earlier call;
      ``kv_write_fn`` returning anything but a pair (TypeError naming it), its sources as :func:`canary_tail`
      (raised while tracing, before anything runs: nothing is changed).

    Warns:
      UserWarning: sources while ``real_kv_hash_mode`` is NONE (once per process); many distinct
      ``kv_write_fn`` objects under one config (once per config).
    """
    config = _check_config(config)
    _check_state(state)
    _check_batch(batch, config)
    if not callable(kv_write_fn):
        raise TypeError(f"kv-canary: kv_write_fn must be callable, got {type(kv_write_fn).__name__}")
    if shapes.is_traced(state, batch, kv_state):
        return phases.step_impl(state, batch, kv_write_fn, kv_state, None, config)
    if _has_deleted(kv_state):
        raise ValueError(
            "kv-canary: kv_state holds an array donated by an earlier call (canary_step donates kv_state when "
            "called eagerly); use the kv_state that call returned"
        )
    check_batch_values(state, batch)
    _count_kv_write_fn(kv_write_fn, config)
    batch, n = phases.eager_batch(batch, config)
    bufs, shell = phases.split(state)
    return phases.step_jit(bufs, shell, batch, kv_state, n, kv_write_fn=kv_write_fn, config=config)


def canary_sweep(
    state: CanaryState,
    sweep_plans: Sequence[VerifyPlan | None],
    *,
    config: CanaryStepConfig,
    real_kv_sources: Sequence | None = None,
) -> CanaryState:
    """Runs each group's SWEEP endpoints (verify only, token check off) on its sweep plan.

    Args:
      state: the canary state (read-only but for the log; nothing is donated).
      sweep_plans: one VerifyPlan per group (None skips that group), e.g. from
        :func:`canary_jax.runtime.sweep.build_sweep_plan_from_radix` with the group's LUT. Eagerly, each is
        padded to ``bucket_size(capacity)`` entries under ``config.buckets``.
      config: static :class:`CanaryStepConfig`.
      real_kv_sources: as for :func:`canary_tail`: the KV pool now.

    Returns:
      The state with the new log (sweeps never write canary buffers).

    Raises:
      TypeError / ValueError: bad config, state or plans (not one per group), or sources as
      :func:`canary_tail`; before tracing, and nothing is changed.
    """
    config = _check_config(config)
    _check_state(state)
    sweep_plans = tuple(sweep_plans)
    if len(sweep_plans) != len(state.groups):
        raise ValueError(f"kv-canary: sweep_plans has {len(sweep_plans)} entries for {len(state.groups)} groups")
    for vp in sweep_plans:
        if vp is not None:
            if not isinstance(vp, VerifyPlan):
                raise TypeError(f"kv-canary: sweep plans must be VerifyPlans or None, got {type(vp).__name__}")
            vp.check()
    srcs = phases.check_sources(real_kv_sources, state, config, "canary_sweep")
    validation.warn_unhashed_sources(srcs, config.real_kv_hash_mode, who="canary_sweep")
    if shapes.is_traced(state, sweep_plans, srcs):
        return state.replace(log=phases.sweep_impl(state, sweep_plans, srcs, config))
    policy = config.buckets or buckets.default_buckets()
    padded = tuple(
        None if vp is None else shapes.pad_verify_plan(vp, buckets.bucket_size(vp.verify_capacity, policy))
        for vp in sweep_plans
    )
    checked = slot_coverage.check_sweep(state, sweep_plans, srcs, config)
    return state.replace(log=phases.sweep_jit(state, padded, srcs, config=config, slots_checked=checked))
