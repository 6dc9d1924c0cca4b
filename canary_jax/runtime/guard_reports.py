"""The guard's host side: the pump after each dispatched step and the reads back (:class:`GuardReports`).

After :meth:`~canary_jax.runtime.guard.CanaryGuard.step` dispatches its program, the pump runs on the host in
SGLang's ``CanaryManager`` post-forward order (violations one step late, the overflow warner, the kernel-counter
health check, the stats line; :mod:`canary_jax.runtime.report`), reading only the previous step's snapshots so
it never waits for the step just dispatched. The reads back (flush, violations, stats, dump) are host syncs, off
the hot path. :class:`GuardReports` is the guard's base class; it holds no state of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from canary_jax.contract import decode, ints
from canary_jax.runtime import dump
from canary_jax.runtime.report import CanaryStats, CanaryViolationError, canary_stats
from canary_jax.runtime.state import StepSummary
from canary_jax.runtime.step_inputs import _dense_req_to_token, normalize_sources


class GuardReports:
    """The pump and reads back of :class:`~canary_jax.runtime.guard.CanaryGuard` (its base class: what they
    read, the state, the monitor, warner, health checker and stats logger, the reporter, the step index, the
    last batch and the config, is set by the guard's constructor and step)."""

    # --- the host pump -----------------------------------------------------------------------------------
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
        (:func:`canary_jax.runtime.dump.save_dump`; ``canary-jax verify-dump`` reads it). A host sync.

        Args:
          path: the ``.npz`` file to write.
          real_kv_sources: the KV as the sources see it now (the short forms of :func:`normalize_sources`), so
            verify-dump can recompute the real-KV fingerprints; None saves no KV.

        Returns:
          ``path``.

        Raises:
          OSError: the file cannot be written.
        """
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
