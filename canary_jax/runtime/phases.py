"""The traced bodies of the step API and the jitted programs its eager calls run (see
:mod:`canary_jax.runtime.step`, the public wrappers that validate, convert and pad before calling these).

Each ``*_impl`` is the step phase on already-checked arguments and runs inline inside a caller's ``jit``.
Each ``*_jit`` is the program an eager call runs: one per (config, bucket shapes). The per-forward programs
donate the state's canary buffers (argument 0), so the update happens in place; the violation log is not
donated (host snapshots of it, as :mod:`canary_jax.runtime.report` takes, stay valid), and no program returns
KV data except the ``kv_state`` that :func:`step_jit` threads (also donated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants, coverage, sources, validation
from canary_jax.ops import chain_hints
from canary_jax.ops.plan_launch import build_plans
from canary_jax.runtime import prepare, shapes
from canary_jax.runtime.endpoints import launch_group, split_sources
from canary_jax.runtime.groups import PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig, StepSummary

_BUFFERS = ("k_head", "k_tail", "v_head", "v_tail")


def check_sources(real_kv_sources: Any, state: CanaryState, config: CanaryStepConfig, who: str) -> tuple:
    """One ``(sources_k, sources_v)`` tuple pair per group, checked
    (:func:`canary_jax.contract.sources.check_real_kv_sources`).

    Raises:
      ValueError: a hashing mode without real_kv_sources, or without a source for a half it launches (naming
        the group and the mode); not one pair per group; any source check.
      TypeError: a pair or source of the wrong kind.
    """
    mode = config.real_kv_hash_mode
    hashing = mode != constants.RealKvHashMode.NONE
    if real_kv_sources is None:
        if hashing:
            raise ValueError(
                f"kv-canary: real_kv_hash_mode={mode.name} hashes the real KV, but {who} got no real_kv_sources; "
                "pass one (sources_k, sources_v) pair per group viewing the KV pool now"
            )
        return tuple(((), ()) for _ in state.groups)
    real_kv_sources = tuple(real_kv_sources)
    if len(real_kv_sources) != len(state.groups):
        raise ValueError(
            f"kv-canary: real_kv_sources has {len(real_kv_sources)} entries for {len(state.groups)} groups"
        )
    out = []
    for i, (g, pair) in enumerate(zip(state.groups, real_kv_sources)):
        k, v = split_sources(pair, g)
        halves = [("K", k)] + ([("V", v)] if config.enable_v_half and g.has_v_half else [])
        for half, srcs in halves:
            if hashing and not srcs:
                raise ValueError(
                    f"kv-canary: real_kv_hash_mode={mode.name} hashes the real KV, but group {i} ({g.kind.name}) "
                    f"has no real-KV source for its {half} half in {who}'s real_kv_sources"
                )
        for srcs in (k, v):
            sources.check_real_kv_sources(srcs, mode)
        out.append((k, v))
    return tuple(out)


# --- the jitted programs (eager calls) -------------------------------------------------------------------
def split(state: CanaryState) -> tuple[tuple, CanaryState]:
    """``(buffers, shell)``: every group's canary buffers, and the state with those set to None."""
    bufs = tuple(tuple(getattr(g, n) for n in _BUFFERS) for g in state.groups)
    groups = tuple(g.with_buffers(**dict.fromkeys(_BUFFERS)) for g in state.groups)
    return bufs, state.replace(groups=groups)


def join(bufs: tuple, shell: CanaryState) -> CanaryState:
    groups = tuple(g.with_buffers(**dict(zip(_BUFFERS, b))) for g, b in zip(shell.groups, bufs))
    return shell.replace(groups=groups)


def eager_batch(batch: CanaryBatch, config: CanaryStepConfig) -> tuple[CanaryBatch, np.ndarray]:
    """``(padded batch, np.int32 num_tokens)``: :func:`canary_jax.runtime.prepare.pad_eager` (kept for callers
    of this name; the step API prepares its batches through :func:`~canary_jax.runtime.prepare.prepare_batch`)."""
    return prepare.pad_eager(batch, config)


def plan_impl(state: CanaryState, batch: CanaryBatch, config: CanaryStepConfig) -> CanaryPlans:
    per_group = []
    use_pool = config.enable_verify_token_assert
    for g in state.groups:
        swa = g.kind is PoolKind.SWA
        vp, wp = build_plans(
            req_pool_indices=batch.operand("req_pool_indices"),
            prefix_lens=batch.operand("prefix_lens"),
            extend_seq_lens=batch.operand("extend_seq_lens"),
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
            backend=config.backend,
        )
        per_group.append((vp, wp))
    return CanaryPlans(per_group=tuple(per_group), write_index_at_head=state.log.write_index)


def _launch_phase(state, plans, batch, phase, config, num_tokens, real_kv_sources=None, *, emit=False):
    """``(state, chain hints)`` after one phase's launches of every group. Each group's write launches share
    one chain scope (:mod:`canary_jax.ops.chain_hints`) when ``emit`` or ``plans`` carries hints (HEAD's, for
    TAIL); the hints are then the scopes' (None per group without one), else None."""
    log = state.log
    groups = []
    loc = batch.operand("out_cache_loc") if num_tokens is None else shapes.mask_unowned(batch.out_cache_loc, num_tokens)
    pairs = real_kv_sources if real_kv_sources is not None else (None,) * len(state.groups)
    scoped = emit or plans.chain_hints is not None
    hints_in = plans.chain_hints if plans.chain_hints is not None else (None,) * len(state.groups)
    hints = []
    for g, (vp, wp), pair, hint in zip(state.groups, plans.per_group, pairs, hints_in):
        with chain_hints.chain_scope(hint) if scoped else contextlib.nullcontext() as scope:
            g, log = _launch_group(g, phase, vp, wp, log, pair, batch, loc, config)
        hints.append(None if scope is None else scope.hint)
        groups.append(g)
    hints = tuple(hints) if scoped and any(h is not None for h in hints) else None
    return state.replace(groups=tuple(groups), log=log), hints


def _launch_group(g, phase, vp, wp, log, pair, batch, loc, config):
    return launch_group(
        g,
        phase,
        verify_plan=vp,
        violation_log=log,
        enable_v_half=config.enable_v_half,
        real_kv_sources=pair,
        write_plan=wp,
        input_ids=batch.operand("input_ids"),
        positions=batch.operand("positions"),
        out_cache_loc=loc,
        enable_write_input_assert=config.enable_write_input_assert,
        enable_verify_token_assert=config.enable_verify_token_assert,
        expected_inputs=batch.expected_inputs if config.enable_write_input_assert else None,
        real_kv_hash_mode=config.real_kv_hash_mode,
        backend=config.backend,
    )


def head_impl(state, batch, plans, num_tokens, config, reuse_chains=False):
    """HEAD; with ``reuse_chains`` the plans it returns carry its write chains for TAIL (the step API's HEAD;
    a caller that lays plans out itself, as the sharded HEAD, keeps them as :func:`plan_impl` makes them)."""
    if plans is None:
        plans = plan_impl(state, batch, config)
    plans = dataclasses.replace(plans, chain_hints=None)
    state, hints = _launch_phase(state, plans, batch, "head", config, num_tokens, emit=reuse_chains)
    return state, dataclasses.replace(plans, chain_hints=hints)


def tail_impl(state, plans, batch, real_kv_sources, num_tokens, config):
    state, _ = _launch_phase(state, plans, batch, "tail", config, num_tokens, real_kv_sources)
    total = state.log.write_index[0]
    summary = StepSummary(
        verify_enable=jnp.concatenate([vp.enable for vp, _ in plans.per_group]),
        verify_num_valid=jnp.concatenate([vp.verify_num_valid for vp, _ in plans.per_group]),
        violations_total=total,
        new_violations=total - plans.write_index_at_head[0],
    )
    return state, summary


def step_impl(state, batch, kv_write_fn, kv_state, num_tokens, config):
    state, plans = head_impl(state, batch, None, num_tokens, config, reuse_chains=True)
    kv_state, srcs = validation.check_kv_write_result(kv_write_fn(kv_state, batch))
    srcs = check_sources(srcs, state, config, "kv_write_fn's result")
    validation.warn_unhashed_sources(srcs, config.real_kv_hash_mode, who="canary_step")
    state, summary = tail_impl(state, plans, batch, srcs, num_tokens, config)
    return state, kv_state, summary


def sweep_impl(state, sweep_plans, real_kv_sources, config):
    log = state.log
    for g, vp, pair in zip(state.groups, sweep_plans, real_kv_sources):
        if vp is not None:
            _, log = launch_group(
                g,
                "sweep",
                verify_plan=vp,
                violation_log=log,
                enable_v_half=config.enable_v_half,
                real_kv_sources=pair,
                real_kv_hash_mode=config.real_kv_hash_mode,
                backend=config.backend,
            )
    return log


@functools.partial(jax.jit, static_argnames=("config",))
def plan_jit(shell, batch, *, config):
    return plan_impl(shell, batch, config)


@functools.partial(jax.jit, static_argnames=("config",), donate_argnums=(0,))
def head_jit(bufs, shell, batch, plans, num_tokens, *, config):
    return head_impl(join(bufs, shell), batch, plans, num_tokens, config, reuse_chains=True)


@functools.partial(jax.jit, static_argnames=("config", "slots_checked"), donate_argnums=(0,))
def tail_jit(bufs, shell, plans, batch, real_kv_sources, num_tokens, *, config, slots_checked=False):
    with coverage.checked_on_host(slots_checked):  # slot_coverage.check_tail ran: a short source may pass
        return tail_impl(join(bufs, shell), plans, batch, real_kv_sources, num_tokens, config)


@functools.partial(jax.jit, static_argnames=("kv_write_fn", "config"), donate_argnums=(0, 3))
def step_jit(bufs, shell, batch, kv_state, num_tokens, *, kv_write_fn, config):
    return step_impl(join(bufs, shell), batch, kv_write_fn, kv_state, num_tokens, config)


@functools.partial(jax.jit, static_argnames=("config", "slots_checked"))
def sweep_jit(state, sweep_plans, real_kv_sources, *, config, slots_checked=False):
    with coverage.checked_on_host(slots_checked):  # slot_coverage.check_sweep ran
        return sweep_impl(state, sweep_plans, real_kv_sources, config)
