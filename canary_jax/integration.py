"""One-call integration: guard a JAX serving stack's step function with the KV canary.

:class:`CanaryGuard` does for a JAX stack what SGLang's ``install_canary`` does for SGLang
(``python/sglang/srt/kv_canary/api.py``: capacities from the server's pool and batch sizes, the model's
``forward`` bracketed by HEAD and TAIL launches, then the host-side pump). You keep your jitted step; the
guard runs it inside one jitted program::

    guard = CanaryGuard(step_fn, num_slots=NUM_SLOTS, max_batch_size=MAX_BS, max_seq_len=MAX_LEN)
    for batch in batches:
        kv = guard.step(kv, req_pool_indices=..., prefix_lens=..., extend_seq_lens=..., input_ids=...,
                        positions=..., out_cache_loc=..., req_to_token=...)

Per call, on the device, in one program (:func:`canary_jax.runtime.step.canary_step` plus a sweep):

1. plan every buffer group's verify and write entries (SPEC 7);
2. HEAD verify + write (the bookkeeping, before the model touches the KV);
3. your ``step_fn(kv_state, inputs)``: the model writes this batch's KV and returns the real-KV sources, views
   of the pool *now* (and optionally its outputs, e.g. logits);
4. TAIL verify + write with the same plans, fingerprinting the real KV bytes;
5. at sweep steps (every ``sweep_interval`` steps) the SWEEP verify of the prefix cache ``sweep_source``
   describes, against the same sources.

Then on the host, never waiting for the step just dispatched (SGLang's ``CanaryManager`` post-forward order):
the violation pump reads the *previous* step's log (log or raise, SGLang's text; one step late), the overflow
warner, the kernel-counter health check and the periodic stats line.

Fixed capacities, a fixed set of programs: the canary buffers, ring and plans have fixed sizes
(:class:`~canary_jax.step_inputs.CanaryCapacities`), and every batch is padded to bucket shapes
(:mod:`canary_jax.buckets`: token count to a token bucket, rows to ``min(bucket(bs), max_batch_size)``), so a run
compiles one program per (token bucket, row bucket) whatever its token counts. Padding tokens have id 0, position 0
and slot 0 (SGLang's padding slot: never give slot 0 to a request); padding rows have ``req_pool_indices`` 0. The
canary never writes or counts them.

This module is the guard: the jitted guarded program (:func:`_guarded_program`, one trace per bucket shape and
shared by guards with the same ``step_fn`` and config) and :class:`CanaryGuard`, which checks each batch, pads it,
dispatches the program and runs the host pump. What the guard is sized by and what ``step_fn`` exchanges with it
(:class:`~canary_jax.step_inputs.CanaryCapacities`, :class:`~canary_jax.step_inputs.StepInputs`,
:func:`~canary_jax.step_inputs.normalize_sources`, :func:`~canary_jax.step_inputs.parse_real_kv_hash_mode`)
live in :mod:`canary_jax.step_inputs` and are re-exported here, so ``canary_jax.integration.CanaryCapacities``
and the rest keep working.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from canary_jax import backends, constants, decode, ints, validation
from canary_jax.buckets import Buckets
from canary_jax.plans import VerifyPlan
from canary_jax.runtime import phases, shapes
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.report import (
    DEFAULT_STATS_EVERY_N_STEPS,
    HEALTH_CHECK_EVERY_N_STEPS,
    CanaryStats,
    CanaryViolationError,
    EnableWarner,
    HealthChecker,
    StatsLogger,
    ViolationMonitor,
    ViolationReporter,
    canary_stats,
    validate_mode,
)
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig, StepSummary, active_tags
from canary_jax.runtime.step import canary_step, canary_sweep, check_batch_values
from canary_jax.runtime.sweep import SweepEntries, SweepSchedule, build_sweep_plan_from_radix, sweep_entries_to_plan
from canary_jax.step_inputs import (
    VERIFY_CAPACITY_POOL_FACTOR,  # noqa: F401  (re-exported: its first home)
    CanaryCapacities,
    StepInputs,
    _check_host_int32,
    _dense_req_to_token,
    _describe_signature,
    _table_signature,
    normalize_sources,
    parse_real_kv_hash_mode,
)

__all__ = [
    "CanaryCapacities",
    "CanaryGuard",
    "StepInputs",
    "normalize_sources",
    "parse_real_kv_hash_mode",
]

logger = logging.getLogger("canary_jax")

_BATCH_FIELDS = tuple(f.name for f in dataclasses.fields(CanaryBatch))


# --- the guarded program ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _TraceBox:
    """Host-side facts recorded while tracing (one trace per compiled program)."""

    traces: int = 0
    form: int | None = None  # 2: (kv_state, sources); 3: (kv_state, sources, outputs)


def _guarded_body(groups, log, kv_state, batch, num_tokens, sweep_plans, do_sweep, *, step_fn, config, box):
    """One guarded step: canary_step (plan, HEAD, ``step_fn``, TAIL) then the per-group sweeps under
    ``lax.cond`` (a sweep that does not run launches nothing and counts nothing)."""
    state = CanaryState(groups=groups, log=log)
    inputs = StepInputs.of(batch, num_tokens)
    fields = {n: getattr(batch, n) for n in _BATCH_FIELDS}
    fields["out_cache_loc"] = shapes.mask_unowned(batch.out_cache_loc, num_tokens)  # padding: never written
    canary_batch = CanaryBatch.prechecked(**fields)
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
            srcs = None  # checked above; NONE hashes nothing (and canary_step need not warn again)
        captured.append((srcs, len(res)))
        return (res[0], res[2] if len(res) == 3 else None), srcs

    state, (kv_state, outputs), summary = canary_step(state, canary_batch, kv_write, (kv_state, None), config=config)
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


# --- the guard -------------------------------------------------------------------------------------------
class CanaryGuard:
    """Runs a serving stack's step function under the KV canary, one call per forward (SGLang's
    ``install_canary`` + ``CanaryManager`` for JAX).

    Args:
      step_fn: your model step, ``step_fn(kv_state, inputs) -> (kv_state, real_kv_sources)`` or
        ``-> (kv_state, real_kv_sources, outputs)``. ``inputs`` is a :class:`StepInputs` (int32, padded to the
        step's bucket); ``step_fn`` must write the KV of ``inputs.out_cache_loc`` (the padding slot 0 included,
        as SGLang's padded batches do) and return the real-KV sources viewing the pool after its write
        (:class:`~canary_jax.sources.RealKvSource`: one, a tuple for a single group's K half, or one
        ``(sources_k, sources_v)`` pair per group; None with ``real_kv_hash_mode`` NONE). Build the sources
        from the returned pool inside ``step_fn`` (``tensor=pool[0]`` there is a view, not a copy). It is traced
        once per bucket shape, inside the guard's jitted program (a jitted ``step_fn`` is inlined).
      num_slots: the KV pool's slots (the canary buffers' rows; slot 0 is the padding slot).
      max_batch_size: the most rows a step may carry (SGLang's ``req_to_token_pool_size``).
      max_seq_len: ``req_to_token``'s width (every step's ``req_to_token`` must have exactly this many columns
        and keep one shape).
      real_kv_hash_mode: NONE / PARTIAL / ALL (or ``"none"`` / ``"partial"`` / ``"all"``): what TAIL and SWEEP
        fingerprint of the real KV. Default ALL: the first ``read_bytes`` bytes of each slot, as each source
        says. PARTIAL hashes 16 bytes (SGLang's production default); NONE checks bookkeeping only.
      mode: ``"raise"`` (default: a :class:`~canary_jax.runtime.report.CanaryViolationError` one step after the
        step that recorded violations, carrying that step's ``kv_state`` and ``outputs``), ``"log"`` (one
        WARNING per violation, SGLang's text; the guard keeps running) or ``"none"`` (run the checks, report
        nothing; read :meth:`violations`).
      sweep_interval: steps between sweeps (0 = none; SGLang's ``--kv-canary-sweep-interval``). The first
        sweep runs at step 0.
      sweep_source: required when ``sweep_interval > 0``: a callable, called on the host at each sweep step,
        that returns what to sweep: a radix-tree root (anything :func:`canary_jax.runtime.sweep.walk_radix_tree`
        walks; SWA groups translate it through their LUT and skip SWA tombstones), a
        :class:`~canary_jax.runtime.sweep.SweepEntries`, a :class:`~canary_jax.plans.VerifyPlan` (single
        group), a sequence with one of these (or None) per group, or None (nothing to sweep this time).
      ring_capacity: violation ring rows (SGLang's ``SGLANG_KV_CANARY_RING_CAPACITY``, default 1024).
      stats_every_n_steps: the stats line's period at INFO (SGLang's default 100; 0 turns it off).
      health_every_n_steps: the kernel-counter health check's period (SGLang's 100, from step 100; 0 turns it
        off).
      collapse: report a violation row identical to one already reported (the same fault seen by a later step)
        once, counting the repeats (:meth:`repeats`); False reports every row like SGLang.
      on_violations: called on the host with ``(records, step=i)``: the
        :class:`~canary_jax.decode.ViolationRecord` s recorded by step ``i`` (0-based), one step late (e.g.
        :meth:`canary_jax.faults.FaultCampaign.observe`).
      enable_write_input_assert, enable_verify_token_assert: the token-oracle checks (the batch then carries
        ``expected_inputs`` / the expected-token pool, see :class:`~canary_jax.runtime.state.CanaryBatch`).
      enable_v_half: also launch the V halves (then ``has_v_half`` groups and V sources).
      has_v_half: allocate V-half canary buffers in the default group.
      groups: your own :class:`~canary_jax.runtime.groups.CanaryBufferGroup` s (e.g. a FULL and an SWA group)
        instead of the default one FULL group of ``num_slots`` slots.
      capacities: explicit :class:`CanaryCapacities` instead of :meth:`CanaryCapacities.from_pool`.
      backend: ``"reference"`` / ``"pallas"`` / None (:func:`canary_jax.backends.resolve_backend`).
      buckets: the :class:`~canary_jax.buckets.Buckets` policy (default: powers of two from 16).
      log: the logger for warnings and stats (default ``canary_jax``).

    Raises:
      TypeError: ``step_fn`` or ``sweep_source`` not callable, a wrong kind of argument.
      ValueError: bad sizes, mode or hash mode, ``sweep_interval > 0`` without ``sweep_source``, or
        ``enable_v_half`` without a V half; naming the argument.
    """

    def __init__(
        self,
        step_fn: Callable[[Any, StepInputs], tuple],
        *,
        num_slots: int,
        max_batch_size: int,
        max_seq_len: int,
        real_kv_hash_mode: Any = constants.RealKvHashMode.ALL,
        mode: str = "raise",
        sweep_interval: int = 0,
        sweep_source: Callable[[], Any] | None = None,
        ring_capacity: int = constants.DEFAULT_RING_CAPACITY,
        stats_every_n_steps: int = DEFAULT_STATS_EVERY_N_STEPS,
        health_every_n_steps: int = HEALTH_CHECK_EVERY_N_STEPS,
        collapse: bool = True,
        on_violations: Callable[..., None] | None = None,
        enable_write_input_assert: bool = False,
        enable_verify_token_assert: bool = False,
        enable_v_half: bool = False,
        has_v_half: bool = False,
        groups: Sequence[CanaryBufferGroup] | None = None,
        capacities: CanaryCapacities | None = None,
        backend: str | None = None,
        buckets: Buckets | None = None,
        log: logging.Logger | None = None,
    ) -> None:
        if not callable(step_fn):
            raise TypeError(f"kv-canary: step_fn must be callable, got {type(step_fn).__name__}")
        self.mode = validate_mode(mode)
        self.max_seq_len = ints.check_int(max_seq_len, name="max_seq_len")
        if capacities is None:
            capacities = CanaryCapacities.from_pool(
                num_slots=num_slots, max_batch_size=max_batch_size, max_seq_len=max_seq_len
            )
        elif not isinstance(capacities, CanaryCapacities):
            raise TypeError(f"kv-canary: capacities must be a CanaryCapacities, got {type(capacities).__name__}")
        self.capacities = capacities
        interval = ints.check_int(sweep_interval, name="sweep_interval")
        if interval < 0:
            raise ValueError(f"kv-canary: sweep_interval must be non-negative, got {sweep_interval}")
        if interval > 0 and sweep_source is None:
            raise ValueError(
                f"kv-canary: sweep_interval={interval} needs a sweep_source (a callable returning the prefix "
                "cache's radix root, SweepEntries or VerifyPlan); pass sweep_interval=0 to run no sweep"
            )
        if sweep_source is not None and not callable(sweep_source):
            raise TypeError(f"kv-canary: sweep_source must be callable, got {type(sweep_source).__name__}")
        if on_violations is not None and not callable(on_violations):
            raise TypeError(f"kv-canary: on_violations must be callable, got {type(on_violations).__name__}")
        self.backend = backends.resolve_backend(backend)
        self.config = CanaryStepConfig(
            verify_capacity=capacities.verify_capacity,
            write_req_capacity=capacities.write_req_capacity,
            real_kv_hash_mode=parse_real_kv_hash_mode(real_kv_hash_mode),
            enable_write_input_assert=bool(enable_write_input_assert),
            enable_verify_token_assert=bool(enable_verify_token_assert),
            enable_v_half=bool(enable_v_half),
            backend=self.backend,
            buckets=buckets,
        )
        if groups is None:
            groups = (CanaryBufferGroup.allocate(kind=PoolKind.FULL, num_slots=num_slots, has_v_half=has_v_half),)
        self._state = CanaryState.create(tuple(groups), ring_capacity=ring_capacity)
        if self.config.enable_v_half and not any(g.has_v_half for g in self._state.groups):
            raise ValueError(
                "kv-canary: enable_v_half=True but no buffer group has a V half; pass has_v_half=True (or groups "
                "with V buffers), or leave enable_v_half off"
            )
        self._luts = tuple(
            None if g.swa_index_lut is None else ints.pairs_to_int64_np(np.asarray(g.swa_index_lut))
            for g in self._state.groups
        )
        self.sweep_interval = interval
        self._sweep_source = sweep_source
        self._sweep = SweepSchedule(interval)
        self._idle_sweep = None
        if interval > 0:
            cap = capacities.sweep_capacity
            empty = VerifyPlan.from_entries(slots=[], positions=[], prev_slots=[], verify_capacity=cap)
            self._idle_sweep = tuple(empty for _ in self._state.groups)
        self._on_violations = on_violations
        self._logger = log or logger
        self.reporter = ViolationReporter(self.mode, log=self._logger, collapse=collapse)
        self._monitor = ViolationMonitor(self.reporter, delayed=True)
        self._warner = EnableWarner(verify_capacity=capacities.verify_capacity, log=self._logger)
        self.active_tags = active_tags(self._state, sweep=interval > 0, enable_v_half=self.config.enable_v_half)
        self._health = (
            HealthChecker(
                self.active_tags,
                sweep_interval=interval,
                enable_v_half=self.config.enable_v_half,
                every_n_steps=health_every_n_steps,
                warmup_steps=health_every_n_steps,
                delayed=True,
            )
            if health_every_n_steps > 0
            else None
        )
        self._stats = StatsLogger(
            active_tags=self.active_tags, every_n_steps=stats_every_n_steps, delayed=True, log=self._logger
        )
        self._step_fn = step_fn
        self._box = _box_for(step_fn, self.config)
        self._traces_before = self._box.traces
        self._r2t_shape: tuple | None = None
        self._last_batch: CanaryBatch | None = None
        self.step_index = 0
        self.last_summary: StepSummary | None = None

    # --- state -------------------------------------------------------------------------------------------
    @property
    def state(self) -> CanaryState:
        """The canary state after the latest step (its buffers are donated by the next step)."""
        return self._state

    @property
    def sweep_passes(self) -> int:
        return self._sweep.sweep_passes

    @property
    def num_compiles(self) -> int:
        """Programs this guard's steps traced (compiled): at most one per (token bucket, row bucket) its batches
        had. Guards with the same ``step_fn`` and config share their programs, so a later guard may need none."""
        return self._box.traces - self._traces_before

    # --- one step ----------------------------------------------------------------------------------------
    def step(self, kv_state: Any, batch: CanaryBatch | Mapping | None = None, **fields) -> Any:
        """Runs one guarded forward.

        Args:
          kv_state: what ``step_fn`` threads (a pytree of KV arrays). Donated: use the returned one.
          batch: a :class:`~canary_jax.runtime.state.CanaryBatch` (or a mapping of its fields), or None and the
            fields as keywords: ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens`` (``[bs]``, padding
            rows last), ``input_ids``, ``positions``, ``out_cache_loc`` (``[T]``, request order),
            ``req_to_token`` (``int32[max_reqs, max_seq_len]`` holding this step's slots); numpy or JAX,
            int32 or exact int64.

        Returns:
          The new ``kv_state``, or ``(kv_state, outputs)`` when ``step_fn`` returns outputs (padded to the
          step's token bucket: rows ``[:T]`` are the batch's).

        Raises:
          TypeError / ValueError: a bad batch (naming the field), more rows than ``max_batch_size``, a
            ``req_to_token`` of another width or shape, host values outside int32 in a field ``step_fn``
            receives as int32, host values that break SGLang's batch contract
            (:func:`~canary_jax.runtime.step.check_batch_values`: request rows outside the table, negative
            lengths on request rows, extends past the tokens, a written slot past the pool), a ``step_fn`` that
            returns the wrong form or sources that do not fit the hashing mode (naming ``step_fn``); all before
            anything runs, and nothing changes. Fields given as JAX arrays are not read on the host: their
            values are the caller's contract.
          CanaryViolationError: raise mode, one step after the step that recorded violations (``.kv_state`` and
            ``.outputs`` hold this step's results: the guard's state is already advanced).
          RuntimeError: the health check found a launch tag whose kernels stopped running (SGLang's message;
            ``.kv_state`` / ``.outputs`` as above).
        """
        batch = self._as_batch(batch, fields)
        self._check_batch(batch)
        t, rows = shapes.padded_batch_shape(batch, self.config)
        padded = shapes.pad_batch(batch, num_tokens=t, num_rows=rows)
        schedule = copy.copy(self._sweep)
        plans, do_sweep = self._sweep_inputs(schedule)
        groups, log, kv_state, outputs, summary = _guarded_program(
            self._state.groups,
            self._state.log,
            kv_state,
            padded,
            np.int32(batch.num_tokens),
            plans,
            do_sweep,
            step_fn=self._step_fn,
            config=self.config,
        )
        # Dispatched: from here on the step has happened.
        self._state = CanaryState(groups=groups, log=log)
        self._sweep = schedule
        if do_sweep is not None and bool(np.any(do_sweep)):
            self._sweep.mark_done(self.step_index)
        self._last_batch = batch
        self._r2t_shape = _table_signature(batch.req_to_token)
        self.last_summary = summary
        self.step_index += 1
        try:
            self._pump(log, summary)
        except RuntimeError as e:  # a violation (raise mode) or the health check: this step's results ride along
            e.kv_state, e.outputs = kv_state, outputs
            raise
        return (kv_state, outputs) if self._box.form == 3 else kv_state

    __call__ = step

    def _as_batch(self, batch: Any, fields: dict) -> CanaryBatch:
        if batch is None:
            return CanaryBatch(**fields)
        if fields:
            raise TypeError("kv-canary: pass the batch either as a CanaryBatch / mapping or as keywords, not both")
        if isinstance(batch, CanaryBatch):
            return batch
        if isinstance(batch, Mapping):
            return CanaryBatch(**batch)
        raise TypeError(
            f"kv-canary: batch must be a CanaryBatch or a mapping of its fields, got {type(batch).__name__}"
        )

    def _check_batch(self, batch: CanaryBatch) -> None:
        if batch.batch_size > self.capacities.write_req_capacity:
            raise ValueError(
                f"kv-canary: the batch has {batch.batch_size} rows but max_batch_size (write_req_capacity) is "
                f"{self.capacities.write_req_capacity}"
            )
        table = batch.req_to_token
        if getattr(table, "ndim", None) == 2 and table.shape[1] != self.max_seq_len:
            raise ValueError(
                f"kv-canary: req_to_token has {table.shape[1]} columns but the guard was built with "
                f"max_seq_len={self.max_seq_len}"
            )
        sig = _table_signature(table)
        if self._r2t_shape is not None and sig != self._r2t_shape:
            raise ValueError(
                "kv-canary: req_to_token must keep one shape (fixed capacities): got "
                f"{_describe_signature(sig)} after {_describe_signature(self._r2t_shape)}"
            )
        _check_host_int32(batch)
        check_batch_values(self._state, batch)

    def _sweep_inputs(self, schedule: SweepSchedule) -> tuple[Any, Any]:
        """``(sweep_plans, do_sweep)`` for the program: None, None without sweeps; the idle plans and all-False
        flags on other steps; the source's plans at sweep steps."""
        if self._idle_sweep is None:
            return None, None
        g = len(self._idle_sweep)
        if not schedule.due(self.step_index):
            return self._idle_sweep, np.zeros((g,), np.bool_)
        plans = self._sweep_plans(self._sweep_source())
        do = np.array([p is not None for p in plans], np.bool_)
        return tuple(p if p is not None else idle for p, idle in zip(plans, self._idle_sweep)), do

    def _sweep_plans(self, src: Any) -> tuple:
        g = len(self._state.groups)
        cap = self.capacities.sweep_capacity
        if src is None:
            return (None,) * g
        per_group = tuple(src) if isinstance(src, (list, tuple)) and not isinstance(src, SweepEntries) else None
        if per_group is not None and len(per_group) != g:
            raise ValueError(f"kv-canary: sweep_source returned {len(per_group)} entries for {g} groups")
        out = []
        for i, grp in enumerate(self._state.groups):
            item = per_group[i] if per_group is not None else src
            lut = self._luts[i]
            if item is None:
                out.append(None)
            elif isinstance(item, VerifyPlan):
                if per_group is None and g > 1:
                    raise ValueError("kv-canary: a VerifyPlan sweep source fits one group; return one per group")
                if item.verify_capacity > cap:
                    raise ValueError(
                        f"kv-canary: the sweep plan has capacity {item.verify_capacity} but sweep_capacity is {cap}"
                    )
                out.append(shapes.pad_verify_plan(item, cap))
            elif isinstance(item, SweepEntries):
                out.append(sweep_entries_to_plan(item, verify_capacity=cap, full_to_swa_index_mapping=lut))
            elif hasattr(item, "children"):
                out.append(
                    build_sweep_plan_from_radix(
                        item,
                        verify_capacity=cap,
                        full_to_swa_index_mapping=lut,
                        swa_resident_only=grp.kind is PoolKind.SWA,
                    )
                )
            else:
                raise TypeError(
                    "kv-canary: sweep_source must return a radix root, SweepEntries, a VerifyPlan, one of these "
                    f"per group, or None; got {type(item).__name__}"
                )
        return tuple(out)

    def _pump(self, log: Any, summary: StepSummary) -> None:
        """The host side after a dispatched step, in SGLang's order (violations, health, stats); every read is
        of the previous step's snapshots."""
        outer = self.step_index  # SGLang's outer step counter, incremented before the pump
        try:
            self._monitor.step(log, step=outer)
        except CanaryViolationError as e:
            e.recorded_step = outer - 2  # 0-based index of the step whose log held the rows
            self._deliver(e.records, e.recorded_step)
            raise
        if self._monitor.last_records:
            self._deliver(self._monitor.last_records, outer - 2)
        self._warner.tick(summary.verify_enable)
        if self._health is not None:
            self._health.step(log, step=outer)
        self._stats.step(log, step=outer, sweep_passes=self.sweep_passes)

    def _deliver(self, records: list, step: int) -> None:
        if self._on_violations is not None and records:
            self._on_violations(list(records), step=step)

    # --- reading back (host syncs: off the hot path) -----------------------------------------------------
    def flush(self) -> list[str]:
        """Reports what the current log holds and the previous steps have not reported yet (e.g. at shutdown
        or at the end of a test): no one-step delay, a host sync.

        Returns:
          The messages reported now (SGLang's text; repeats left out with ``collapse``).

        Raises:
          CanaryViolationError: raise mode, when there are unreported rows.
        """
        step = self.step_index
        try:
            msgs = self._monitor.flush(self._state.log, step=step)
        except CanaryViolationError as e:
            e.recorded_step = step - 1
            self._deliver(e.records, step - 1)
            raise
        if self._monitor.last_records:
            self._deliver(self._monitor.last_records, step - 1)
        return msgs

    def violations(self) -> list[decode.ViolationRecord]:
        """Every row the ring holds (a host read of the current log)."""
        return decode.decode_violations(self._state.log)

    def repeats(self) -> list[decode.CollapsedViolation]:
        """Every distinct violation reported so far, with how often and at which steps (``first`` / ``last``
        are SGLang's ``step_when_pumped``)."""
        return self.reporter.collapsed

    def stats(self) -> CanaryStats:
        """The counters now (a host read): SGLang's stats fields."""
        return canary_stats(
            self._state.log, step=self.step_index, sweep_passes=self.sweep_passes, active_tags=self.active_tags
        )

    def stats_line(self) -> str:
        """``[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d launch_tags_active=%d/%d``
        (SGLang's stats line), now."""
        return self.stats().line()

    @property
    def overflowed_steps(self) -> int:
        """Steps whose per-forward verify overflowed its capacity and checked nothing (read one step late)."""
        return self._warner.overflow_count_total

    def dump(self, path: str, *, real_kv_sources: Any = None) -> str:
        """Saves the canary state, the last batch's request metadata and (optionally) the real KV to ``path``
        (:func:`canary_jax.dump.save_dump`; ``canary-jax verify-dump`` reads it). A host sync.

        Args:
          path: the ``.npz`` file to write.
          real_kv_sources: the KV as the sources see it now (the short forms of :func:`normalize_sources`), so
            verify-dump can recompute the real-KV fingerprints; None saves no KV.

        Returns:
          ``path``.

        Raises:
          OSError: the file cannot be written.
        """
        from canary_jax import dump

        b = self._last_batch
        meta = {}
        if b is not None:
            rpi = ints.pairs_to_int64_np(np.asarray(b.req_pool_indices))
            lens = ints.pairs_to_int64_np(np.asarray(b.prefix_lens)) + ints.pairs_to_int64_np(
                np.asarray(b.extend_seq_lens)
            )
            r2t = _dense_req_to_token(b.req_to_token, rpi, lens)
            meta = dict(req_to_token=r2t, req_pool_indices=rpi, seq_lens=lens)
        return dump.save_dump(
            path,
            self._state,
            real_kv_sources=normalize_sources(real_kv_sources, len(self._state.groups)),
            real_kv_hash_mode=self.config.real_kv_hash_mode,
            step=self.step_index,
            **meta,
        )
