"""The step API's eager source-coverage check: a source shorter than a group's canary buffer is accepted when
every slot the call hashes lies inside it (:mod:`canary_jax.contract.coverage`).

``canary_tail`` and ``canary_sweep`` called eagerly know their plans and batch on the host; they run
:func:`check_tail` / :func:`check_sweep` before their jitted program, and trace it under
:func:`canary_jax.contract.coverage.checked_on_host` when a source was short (a static argument of the program, so a
program traced that way never serves a call that was not checked). Traced calls (inside a caller's ``jit``) and
``canary_step`` / ``CanaryGuard``, whose sources a traced step function returns, keep the whole-buffer rule.
"""

from __future__ import annotations

from collections.abc import Sequence

from canary_jax.contract import constants, coverage, ints, sources
from canary_jax.ops import launch_coverage
from canary_jax.planning.slot_tables import swa_translate
from canary_jax.runtime.groups import PoolKind
from canary_jax.runtime.state import CanaryBatch, CanaryPlans, CanaryState, CanaryStepConfig


def _halves(state: CanaryState, srcs: Sequence, config: CanaryStepConfig):
    """``(group index, group, half, short coverages, num_slots)`` for each launched half with a short source."""
    if config.real_kv_hash_mode == constants.RealKvHashMode.NONE:
        return
    for i, (g, (k, v)) in enumerate(zip(state.groups, srcs)):
        n = int(g.k_tail.shape[0])
        halves = [("K", k)] + ([("V", v)] if config.enable_v_half and g.has_v_half else [])
        for half, half_srcs in halves:
            covs = coverage.short(sources.coverages(half_srcs), n)
            if covs:
                yield i, g, half, covs, n


def _verify(covs, vp, n: int, what: str) -> None:
    entries, slots = launch_coverage.verify_plan_hashed(vp, n)
    coverage.check_slots(covs, entries, slots, op=f"{what} verify", name="plan.verify_slot_indices")


def check_tail(state: CanaryState, plans: CanaryPlans, batch: CanaryBatch, srcs: Sequence, config) -> bool:
    """Checks the slots an eager ``canary_tail`` hashes against its short sources (a host copy of the plans, paid
    only then); whether any source was short (the program is then traced under ``checked_on_host``).

    Raises:
      ValueError: ``kv-canary: group {i} {half} TAIL {verify|write} hashes slot {s} ({array}[{entry}]) but
        real_kv_sources[{j}] covers ...``.
    """
    checked = False
    for i, g, half, covs, n in _halves(state, srcs, config):
        checked = True
        vp, wp = plans.per_group[i]
        _verify(covs, vp, n, f"group {i} {half} TAIL")
        loc = ints.pairs_to_int64_np(batch.out_cache_loc)[: batch.num_tokens]
        if g.kind is PoolKind.SWA:
            loc = ints.pairs_to_int64_np(swa_translate(ints.as_int64_pairs(loc, name="out_cache_loc"), g.swa_index_lut))
        entries, slots = launch_coverage.write_plan_hashed(wp, loc, n)
        coverage.check_slots(covs, entries, slots, op=f"group {i} {half} TAIL write", name="out_cache_loc")
    return checked


def check_sweep(state: CanaryState, sweep_plans: Sequence, srcs: Sequence, config: CanaryStepConfig) -> bool:
    """As :func:`check_tail` for an eager ``canary_sweep`` (verify only, the groups with a plan)."""
    checked = False
    for i, _, half, covs, n in _halves(state, srcs, config):
        if sweep_plans[i] is not None:
            checked = True
            _verify(covs, sweep_plans[i], n, f"group {i} {half} SWEEP")
    return checked
