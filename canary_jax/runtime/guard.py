"""The guard: a JAX serving stack's step function under the KV canary, one call per forward.

:class:`CanaryGuard` does for a JAX stack what SGLang's ``install_canary`` does for SGLang
(``python/sglang/srt/kv_canary/api.py``: capacities from the server's pool and batch sizes, the model's
``forward`` bracketed by HEAD and TAIL launches, then the host-side pump). You keep your jitted step; the
guard runs it inside one jitted program::

    guard = CanaryGuard(step_fn, num_slots=NUM_SLOTS, max_batch_size=MAX_BS, max_seq_len=MAX_LEN)
    for batch in batches:
        kv = guard.step(kv, req_pool_indices=..., prefix_lens=..., extend_seq_lens=..., input_ids=...,
                        positions=..., out_cache_loc=..., req_to_token=...)

Per call, on the device, in one program (:func:`canary_jax.runtime.guarded._guarded_program`: the step
phases of :func:`canary_jax.runtime.step.canary_step` plus a sweep):

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
(:class:`~canary_jax.runtime.step_inputs.CanaryCapacities`), and every batch is padded to bucket shapes
(:mod:`canary_jax.ops.buckets`: token count to a token bucket, rows to ``min(bucket(bs), max_batch_size)``), so a run
compiles one program per (token bucket, row bucket) whatever its token counts. Padding tokens have id 0, position 0
and slot 0 (SGLang's padding slot: never give slot 0 to a request); padding rows have ``req_pool_indices`` 0. The
canary never writes or counts them.

This module is :class:`CanaryGuard`, which prepares each batch (:func:`canary_jax.runtime.prepare.prepare_batch`:
checked, widened and padded once), dispatches the jitted program (:mod:`canary_jax.runtime.guarded`) and runs
the host pump. What the guard is sized by and what ``step_fn`` exchanges with it live in
:mod:`canary_jax.runtime.step_inputs`; :mod:`canary_jax.integration` and :mod:`canary_jax.runtime` re-export
them with the guard.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from canary_jax.contract import constants, ints
from canary_jax.ops import backends
from canary_jax.ops.buckets import Buckets
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime import prepare
from canary_jax.runtime.groups import CanaryBufferGroup, PoolKind
from canary_jax.runtime.guard_reports import GuardReports
from canary_jax.runtime.guarded import _box_for, _guarded_program
from canary_jax.runtime.report import (
    DEFAULT_STATS_EVERY_N_STEPS,
    HEALTH_CHECK_EVERY_N_STEPS,
    EnableWarner,
    HealthChecker,
    StatsLogger,
    ViolationMonitor,
    ViolationReporter,
    validate_mode,
)
from canary_jax.runtime.state import CanaryBatch, CanaryState, CanaryStepConfig, StepSummary, active_tags
from canary_jax.runtime.step_inputs import (
    CanaryCapacities,
    StepInputs,
    _table_signature,
    parse_real_kv_hash_mode,
)
from canary_jax.runtime.sweep import SweepSchedule, sweep_source_plans

__all__ = ["CanaryGuard"]

logger = logging.getLogger("canary_jax")


# --- the guard -------------------------------------------------------------------------------------------
class CanaryGuard(GuardReports):
    """Runs a serving stack's step function under the KV canary, one call per forward (SGLang's
    ``install_canary`` + ``CanaryManager`` for JAX).

    Args:
      step_fn: your model step, ``step_fn(kv_state, inputs) -> (kv_state, real_kv_sources)`` or
        ``-> (kv_state, real_kv_sources, outputs)``. ``inputs`` is a :class:`StepInputs` (int32, padded to the
        step's bucket); ``step_fn`` must write the KV of ``inputs.out_cache_loc`` (the padding slot 0 included,
        as SGLang's padded batches do) and return the real-KV sources viewing the pool after its write
        (:class:`~canary_jax.contract.sources.RealKvSource`: one, a tuple for a single group's K half, or one
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
        :class:`~canary_jax.runtime.sweep.SweepEntries`, a :class:`~canary_jax.planning.plans.VerifyPlan` (single
        group), a sequence with one of these (or None) per group, or None (nothing to sweep this time).
      ring_capacity: violation ring rows (SGLang's ``SGLANG_KV_CANARY_RING_CAPACITY``, default 1024).
      stats_every_n_steps: the stats line's period at INFO (SGLang's default 100; 0 turns it off).
      health_every_n_steps: the kernel-counter health check's period (SGLang's 100, from step 100; 0 turns it
        off).
      collapse: report a violation row identical to one already reported (the same fault seen by a later step)
        once, counting the repeats (:meth:`repeats`); False reports every row like SGLang.
      on_violations: called on the host with ``(records, step=i)``: the
        :class:`~canary_jax.contract.decode.ViolationRecord` s recorded by step ``i`` (0-based), one step late (e.g.
        :meth:`canary_jax.tools.faults.FaultCampaign.observe`).
      enable_write_input_assert, enable_verify_token_assert: the token-oracle checks (the batch then carries
        ``expected_inputs`` / the expected-token pool, see :class:`~canary_jax.runtime.state.CanaryBatch`).
      enable_v_half: also launch the V halves (then ``has_v_half`` groups and V sources).
      has_v_half: allocate V-half canary buffers in the default group.
      groups: your own :class:`~canary_jax.runtime.groups.CanaryBufferGroup` s (e.g. a FULL and an SWA group)
        instead of the default one FULL group of ``num_slots`` slots.
      capacities: explicit :class:`CanaryCapacities` instead of :meth:`CanaryCapacities.from_pool`.
      backend: ``"reference"`` / ``"pallas"`` / ``"pallas_tpu"`` / None
        (:func:`canary_jax.ops.backends.resolve_backend`; None picks ``pallas_tpu`` on a TPU host).
      buckets: the :class:`~canary_jax.ops.buckets.Buckets` policy (default: powers of two from 16).
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
        limits = prepare.GuardLimits(max_seq_len=self.max_seq_len, table_signature=self._r2t_shape)
        prep = prepare.prepare_batch(self._state, batch, self.config, traced=False, fields=fields, guard=limits)
        schedule = copy.copy(self._sweep)
        plans, do_sweep = self._sweep_inputs(schedule)
        groups, log, kv_state, outputs, summary = _guarded_program(
            self._state.groups,
            self._state.log,
            kv_state,
            prep.launch,
            prep.num_tokens,
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
        self._last_batch = prep.batch
        self._r2t_shape = _table_signature(prep.batch.req_to_token)
        self.last_summary = summary
        self.step_index += 1
        try:
            self._pump(log, summary)
        except RuntimeError as e:  # a violation (raise mode) or the health check: this step's results ride along
            e.kv_state, e.outputs = kv_state, outputs
            raise
        return (kv_state, outputs) if self._box.form == 3 else kv_state

    __call__ = step

    def _sweep_inputs(self, schedule: SweepSchedule) -> tuple[Any, Any]:
        """``(sweep_plans, do_sweep)`` for the program: None, None without sweeps; the idle plans and all-False
        flags on other steps; the source's plans at sweep steps."""
        if self._idle_sweep is None:
            return None, None
        g = len(self._idle_sweep)
        if not schedule.due(self.step_index):
            return self._idle_sweep, np.zeros((g,), np.bool_)
        plans = sweep_source_plans(
            self._sweep_source(), self._state.groups, self._luts, capacity=self.capacities.sweep_capacity
        )
        do = np.array([p is not None for p in plans], np.bool_)
        return tuple(p if p is not None else idle for p, idle in zip(plans, self._idle_sweep)), do
