"""The per-forward canary step for JAX serving stacks (SPEC 8.3), as functions a jitted step can call.

A serving step does::

    state, plans = canary_head(state, batch, config=cfg)        # plan + HEAD verify/write, per group
    kv_pool = model_forward(kv_pool, batch)                     # writes the real KV
    state, summary = canary_tail(state, plans, batch, config=cfg,
                                 real_kv_sources=sources_of(kv_pool))   # TAIL verify/write, same plans

or, in one call, ``state, kv_state, summary = canary_step(state, batch, kv_write_fn, kv_state, config=cfg)``.
Every function is jitted with ``config`` (and ``kv_write_fn``) static, so it compiles once per set of
capacities and shapes, never syncs with the host and never raises on data: violations land in the ring,
overflow clears ``summary.verify_enable``. Inside an outer ``jit`` they simply inline.

The types they take and return (:class:`CanaryStepConfig`, :class:`CanaryBatch`, :class:`CanaryState`,
:class:`CanaryPlans`, :class:`StepSummary`) live in :mod:`canary_jax.runtime.state`. Host-side reporting
(ring decode, log/raise, stats, health) lives in :mod:`canary_jax.runtime.report`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from canary_jax import validation
from canary_jax.plan_builder import build_plans
from canary_jax.plans import VerifyPlan
from canary_jax.runtime.endpoints import launch_group
from canary_jax.runtime.groups import PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig, StepSummary

__all__ = [
    "canary_head",
    "canary_plan",
    "canary_step",
    "canary_sweep",
    "canary_tail",
]


def _check_config(config: Any) -> CanaryStepConfig:
    if not isinstance(config, CanaryStepConfig):
        raise TypeError(f"kv-canary: config must be a CanaryStepConfig, got {type(config).__name__}")
    return config


def _check_batch(batch: Any, config: CanaryStepConfig) -> None:
    if not isinstance(batch, CanaryBatch):
        raise TypeError(f"kv-canary: batch must be a CanaryBatch, got {type(batch).__name__}")
    if config.enable_write_input_assert:
        has = batch.expected_inputs is not None
        validation.check_expected_inputs(True, has_tokens=has, has_positions=has)
    if config.enable_verify_token_assert and batch.req_to_verify_expected_tokens is None:
        raise ValueError(
            "kv-canary: enable_verify_token_assert=True requires batch.req_to_verify_expected_tokens "
            "(and req_to_verify_expected_tokens_valid_lens)"
        )


@functools.partial(jax.jit, static_argnames=("config",))
def canary_plan(state: CanaryState, batch: CanaryBatch, *, config: CanaryStepConfig) -> CanaryPlans:
    """Builds every group's per-forward plans (:func:`canary_jax.plan_builder.build_plans`).

    FULL groups plan with W = 0 and no LUT; SWA groups with their ``swa_window_size`` and LUT. The
    expected-token pool is passed only when ``config.enable_verify_token_assert``.

    Returns:
      :class:`CanaryPlans` (one (VerifyPlan, WritePlan) per group, and the current write index).
    """
    config = _check_config(config)
    _check_batch(batch, config)
    per_group = []
    for g in state.groups:
        swa = g.kind is PoolKind.SWA
        use_pool = config.enable_verify_token_assert
        vp, wp = build_plans(
            req_pool_indices=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_seq_lens=batch.extend_seq_lens,
            req_to_token=batch.req_to_token,
            verify_capacity=config.verify_capacity,
            write_req_capacity=config.write_req_capacity,
            swa_window_size=g.swa_window_size if swa else 0,
            full_to_swa_index_mapping=g.swa_index_lut if swa else None,
            req_to_verify_expected_tokens=batch.req_to_verify_expected_tokens if use_pool else None,
            req_to_verify_expected_tokens_valid_lens=(
                batch.req_to_verify_expected_tokens_valid_lens if use_pool else None
            ),
            kv_token_id_vs_position_offset=g.kv_token_id_vs_position_offset,
        )
        per_group.append((vp, wp))
    return CanaryPlans(per_group=tuple(per_group), write_index_at_head=state.log.write_index)


def _launch_phase(
    state: CanaryState, plans: CanaryPlans, batch: CanaryBatch, phase: str, config: CanaryStepConfig
) -> CanaryState:
    if len(plans.per_group) != len(state.groups):
        raise ValueError(f"kv-canary: plans cover {len(plans.per_group)} groups but the state has {len(state.groups)}")
    log = state.log
    groups = []
    for g, (vp, wp) in zip(state.groups, plans.per_group):
        g, log = launch_group(
            g,
            phase,
            verify_plan=vp,
            violation_log=log,
            enable_v_half=config.enable_v_half,
            write_plan=wp,
            input_ids=batch.input_ids,
            positions=batch.positions,
            out_cache_loc=batch.out_cache_loc,
            enable_write_input_assert=config.enable_write_input_assert,
            enable_verify_token_assert=config.enable_verify_token_assert,
            expected_inputs=batch.expected_inputs if config.enable_write_input_assert else None,
            real_kv_hash_mode=config.real_kv_hash_mode,
            backend=config.backend,
        )
        groups.append(g)
    return state.replace(groups=tuple(groups), log=log)


@functools.partial(jax.jit, static_argnames=("config",))
def canary_head(
    state: CanaryState,
    batch: CanaryBatch,
    *,
    config: CanaryStepConfig,
    plans: CanaryPlans | None = None,
) -> tuple[CanaryState, CanaryPlans]:
    """Pre-forward half of the step: plan, then each group's HEAD endpoints (verify, then write).

    HEAD buffers carry no real-KV fingerprint (hash 0), so HEAD checks the bookkeeping (req_to_token, chain,
    positions, tokens) before the model touches the KV.

    Args:
      state: the canary state.
      batch: this forward's :class:`CanaryBatch`.
      config: static :class:`CanaryStepConfig`.
      plans: prebuilt plans (from :func:`canary_plan`), or None to build them here.

    Returns:
      ``(state, plans)``; pass ``plans`` unchanged to :func:`canary_tail`.

    Raises:
      TypeError / ValueError: bad config or batch, raised while tracing (the function is jitted), before any
      computation runs; nothing is mutated.

    In place: the state is not donated, because its groups hold the model's real-KV source arrays. Inside a
    caller's jitted step (the intended use) XLA updates the canary buffers and log in place; called eagerly,
    each call returns fresh buffers (a copy proportional to the pool size).
    """
    config = _check_config(config)
    _check_batch(batch, config)
    if plans is None:
        plans = canary_plan(state, batch, config=config)
    return _launch_phase(state, plans, batch, "head", config), plans


@functools.partial(jax.jit, static_argnames=("config",))
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
      state: the state returned by :func:`canary_head`.
      plans: the plans returned by :func:`canary_head`.
      batch: the same batch.
      config: static :class:`CanaryStepConfig`.
      real_kv_sources: None to keep each group's sources, or one ``(sources_k, sources_v)`` pair per group
        (tuples of :class:`~canary_jax.sources.RealKvSource` viewing the KV pool *after* the model's write;
        ``None`` inside a pair keeps that half). The state keeps the new sources.

    Returns:
      ``(state, summary)``.

    Raises:
      TypeError / ValueError: bad config or batch, or ``real_kv_sources`` not one pair per group; raised while
      tracing, before any computation runs. The state is not donated (see :func:`canary_head`).
    """
    config = _check_config(config)
    _check_batch(batch, config)
    if real_kv_sources is not None:
        real_kv_sources = tuple(real_kv_sources)
        if len(real_kv_sources) != len(state.groups):
            raise ValueError(
                f"kv-canary: real_kv_sources has {len(real_kv_sources)} entries for {len(state.groups)} groups"
            )
        groups = tuple(g.with_real_kv_sources(*pair) for g, pair in zip(state.groups, real_kv_sources))
        state = state.replace(groups=groups)
    state = _launch_phase(state, plans, batch, "tail", config)
    enables = jnp.concatenate([vp.enable for vp, _ in plans.per_group])
    num_valid = jnp.concatenate([vp.verify_num_valid for vp, _ in plans.per_group])
    total = state.log.write_index[0]
    summary = StepSummary(
        verify_enable=enables,
        verify_num_valid=num_valid,
        violations_total=total,
        new_violations=total - plans.write_index_at_head[0],
    )
    return state, summary


@functools.partial(jax.jit, static_argnames=("kv_write_fn", "config"))
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
      state: the canary state.
      batch: this forward's :class:`CanaryBatch`.
      kv_write_fn: static callable ``kv_write_fn(kv_state, batch) -> (kv_state, real_kv_sources)`` that runs
        the model / writes the real KV; ``real_kv_sources`` is None or one ``(sources_k, sources_v)`` pair per
        group viewing the new KV (see :func:`canary_tail`). Must be hashable (a module-level function).
      kv_state: whatever ``kv_write_fn`` threads (a pytree: KV pool arrays, ...).
      config: static :class:`CanaryStepConfig`.

    Returns:
      ``(state, kv_state, summary)``.
    """
    state, plans = canary_head(state, batch, config=config)
    kv_state, sources = kv_write_fn(kv_state, batch)
    state, summary = canary_tail(state, plans, batch, config=config, real_kv_sources=sources)
    return state, kv_state, summary


@functools.partial(jax.jit, static_argnames=("config",))
def canary_sweep(
    state: CanaryState, sweep_plans: Sequence[VerifyPlan | None], *, config: CanaryStepConfig
) -> CanaryState:
    """Runs each group's SWEEP endpoints (verify only, token check off) on its sweep plan.

    Args:
      sweep_plans: one VerifyPlan per group (None skips that group), e.g. from
        :func:`canary_jax.runtime.sweep.build_sweep_plan_from_radix` with the group's LUT.

    Returns:
      The state with the new log (sweeps never write canary buffers).
    """
    config = _check_config(config)
    sweep_plans = tuple(sweep_plans)
    if len(sweep_plans) != len(state.groups):
        raise ValueError(f"kv-canary: sweep_plans has {len(sweep_plans)} entries for {len(state.groups)} groups")
    log = state.log
    for g, vp in zip(state.groups, sweep_plans):
        if vp is None:
            continue
        _, log = launch_group(
            g,
            "sweep",
            verify_plan=vp,
            violation_log=log,
            enable_v_half=config.enable_v_half,
            real_kv_hash_mode=config.real_kv_hash_mode,
            backend=config.backend,
        )
    return state.replace(log=log)
