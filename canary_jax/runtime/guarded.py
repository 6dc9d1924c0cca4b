"""The guard's jitted program: plan, HEAD, the user's ``step_fn``, TAIL and the sweeps, in one program.

:class:`~canary_jax.runtime.guard.CanaryGuard` prepares each batch on the host
(:func:`canary_jax.runtime.prepare.prepare_batch`: checked, widened, padded to bucket shapes) and dispatches
:func:`_guarded_program`: one trace per (``step_fn``, config, bucket shapes), shared by every guard with the
same ``step_fn`` and config. Inside it, ``step_fn`` sees the batch as
:class:`~canary_jax.runtime.step_inputs.StepInputs` (int32) and returns the real-KV sources the TAIL and sweep
launches hash; padding tokens (``>= num_tokens``) are never written (:func:`canary_jax.runtime.shapes.mask_unowned`).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any

import jax

from canary_jax.contract import constants, validation
from canary_jax.runtime import phases
from canary_jax.runtime.state import CanaryState, CanaryStepConfig
from canary_jax.runtime.step import canary_sweep
from canary_jax.runtime.step_inputs import StepInputs, normalize_sources


@dataclasses.dataclass
class _TraceBox:
    """Host-side facts recorded while tracing (one trace per compiled program)."""

    traces: int = 0
    form: int | None = None  # 2: (kv_state, sources); 3: (kv_state, sources, outputs)


def _guarded_body(groups, log, kv_state, batch, num_tokens, sweep_plans, do_sweep, *, step_fn, config, box):
    """One guarded step: the step phases (plan, HEAD, ``step_fn``, TAIL: :func:`canary_jax.runtime.phases.step_impl`
    on the prepared batch, padding tokens masked) then the per-group sweeps under ``lax.cond`` (a sweep that
    does not run launches nothing and counts nothing)."""
    state = CanaryState(groups=groups, log=log)
    inputs = StepInputs.of(batch, num_tokens)
    captured = []

    def kv_write(kv_and_outputs, _canary_batch):
        res = step_fn(kv_and_outputs[0], inputs)
        if not isinstance(res, tuple) or len(res) not in (2, 3):
            got = f"a tuple of {len(res)}" if isinstance(res, tuple) else type(res).__name__
            raise TypeError(
                "kv-canary: step_fn must return (kv_state, real_kv_sources) or (kv_state, real_kv_sources, "
                f"outputs), got {got}"
            )
        if box.form is not None and box.form != len(res):
            raise TypeError(f"kv-canary: step_fn returned {len(res)} values after returning {box.form} before")
        srcs = phases.check_sources(normalize_sources(res[1], len(groups)), state, config, "step_fn's result")
        validation.warn_unhashed_sources(srcs, config.real_kv_hash_mode, who="CanaryGuard")
        if config.real_kv_hash_mode == constants.RealKvHashMode.NONE:
            srcs = None  # checked above; NONE hashes nothing (and the step need not warn again)
        captured.append((srcs, len(res)))
        return (res[0], res[2] if len(res) == 3 else None), srcs

    # num_tokens masks the padding tokens' out_cache_loc to -1 in every launch: never written, never counted.
    state, (kv_state, outputs), summary = phases.step_impl(state, batch, kv_write, (kv_state, None), num_tokens, config)
    srcs, form = captured[0]
    if sweep_plans is not None:
        log = state.log
        for i, vp in enumerate(sweep_plans):
            plans = tuple(vp if j == i else None for j in range(len(sweep_plans)))

            def sweep(lg, plans=plans):
                return canary_sweep(state.replace(log=lg), plans, config=config, real_kv_sources=srcs).log

            log = jax.lax.cond(do_sweep[i], sweep, lambda lg: lg, log)
        state = state.replace(log=log)
    box.form = form  # committed only by a trace that got this far (a refused trace changes nothing)
    box.traces += 1
    return state.groups, state.log, kv_state, outputs, summary


_TRACE_BOXES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # step_fn -> {config: _TraceBox}
_STRONG_BOXES: dict = {}  # for step functions that cannot be weakly referenced


def _box_for(step_fn: Any, config: CanaryStepConfig) -> _TraceBox:
    try:
        per_fn = _TRACE_BOXES.setdefault(step_fn, {})
    except TypeError:
        per_fn = _STRONG_BOXES.setdefault(step_fn, {})
    return per_fn.setdefault(config, _TraceBox())


@functools.partial(jax.jit, static_argnames=("step_fn", "config"), donate_argnums=(0, 2))
def _guarded_program(groups, log, kv_state, batch, num_tokens, sweep_plans, do_sweep, *, step_fn, config):
    """The jitted guarded step: one program per (step_fn, config, shapes), shared by every guard with the same
    ``step_fn`` and config. Donates the canary buffers (``groups``) and ``kv_state``, not the log."""
    box = _box_for(step_fn, config)
    return _guarded_body(
        groups, log, kv_state, batch, num_tokens, sweep_plans, do_sweep, step_fn=step_fn, config=config, box=box
    )
