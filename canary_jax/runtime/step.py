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

* called eagerly (concrete arrays): pads the batch to bucket shapes and runs
  one jitted program per (config, bucket) that donates the state's canary buffers (updated in place; use the
  returned state, not the one you passed). The violation log is not donated, so snapshots of it stay valid;
* called inside a caller's ``jit``: runs inline, unpadded (the caller's shapes are fixed; XLA updates in place).

Every call hands its batch to :func:`canary_jax.runtime.prepare.prepare_batch`, the one place that checks it
(statically; eagerly also the *values* of its host (numpy) fields, :func:`check_batch_values`: request rows,
lengths, extends against the tokens, written slots against the canary buffer) and pads it to bucket shapes
(:mod:`canary_jax.runtime.shapes`). Nothing syncs with the
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

from canary_jax.contract import validation
from canary_jax.ops import buckets
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime import phases, prepare, shapes, slot_coverage
from canary_jax.runtime.prepare import check_batch as _check_batch  # noqa: F401  (old name)
from canary_jax.runtime.prepare import check_batch_values
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


def _check_kv_state(kv_state: Any) -> None:
    if _has_deleted(kv_state):
        raise ValueError(
            "kv-canary: kv_state holds an array donated by an earlier call (canary_step donates kv_state when "
            "called eagerly); use the kv_state that call returned"
        )


def _check_plans(plans: Any, state: CanaryState) -> None:
    if not isinstance(plans, CanaryPlans):
        raise TypeError(f"kv-canary: plans must be CanaryPlans, got {type(plans).__name__}")
    if len(plans.per_group) != len(state.groups):
        raise ValueError(f"kv-canary: plans cover {len(plans.per_group)} groups but the state has {len(state.groups)}")


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
    """Builds every group's per-forward plans (:func:`canary_jax.planning.plan_builder.build_plans`).

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
    traced = shapes.is_traced(state, batch)
    prep = prepare.prepare_batch(state, batch, config, traced=traced)
    if traced:
        return phases.plan_impl(state, prep.launch, config)
    return phases.plan_jit(phases.split(state)[1], prep.launch, config=config)


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
    traced = shapes.is_traced(state, batch, plans)
    prep = prepare.prepare_batch(state, batch, config, traced=traced)
    if plans is not None:
        _check_plans(plans, state)
    if traced:
        return phases.head_impl(state, prep.launch, plans, None, config, reuse_chains=True)
    bufs, shell = phases.split(state)
    return phases.head_jit(bufs, shell, prep.launch, plans, prep.num_tokens, config=config)


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
      plans: the plans returned by :func:`canary_head` (with HEAD's long write chains, which TAIL reuses where
        its buffers agree: valid for this batch only).
      batch: the same batch.
      config: static :class:`CanaryStepConfig`.
      real_kv_sources: one ``(sources_k, sources_v)`` pair per group: tuples of
        :class:`~canary_jax.contract.sources.RealKvSource` viewing the KV pool *after* the model's write (e.g. its
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
    _check_plans(plans, state)
    srcs = phases.check_sources(real_kv_sources, state, config, "canary_tail")
    traced = shapes.is_traced(state, plans, batch, srcs)
    prep = prepare.prepare_batch(state, batch, config, traced=traced)
    validation.warn_unhashed_sources(srcs, config.real_kv_hash_mode, who="canary_tail")
    if traced:
        return phases.tail_impl(state, plans, prep.launch, srcs, None, config)
    checked = slot_coverage.check_tail(state, plans, batch, srcs, config)
    bufs, shell = phases.split(state)
    return phases.tail_jit(bufs, shell, plans, prep.launch, srcs, prep.num_tokens, config=config, slots_checked=checked)


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
    traced = shapes.is_traced(state, batch, kv_state)
    if not traced:
        _check_kv_state(kv_state)
    prep = prepare.prepare_batch(state, batch, config, traced=traced)
    if not callable(kv_write_fn):
        raise TypeError(f"kv-canary: kv_write_fn must be callable, got {type(kv_write_fn).__name__}")
    if traced:
        return phases.step_impl(state, prep.launch, kv_write_fn, kv_state, None, config)
    _count_kv_write_fn(kv_write_fn, config)
    bufs, shell = phases.split(state)
    return phases.step_jit(bufs, shell, prep.launch, kv_state, prep.num_tokens, kv_write_fn=kv_write_fn, config=config)


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
