"""Summary statistics of a canary run: SGLang's periodic stats line.

:func:`canary_stats` / :class:`CanaryStats` / :class:`StatsLogger`: ``[canary] step=%d protected_tokens=%d
sweep_passes=%d violations=%d launch_tags_active=%d/%d`` with protected tokens = sum of slot_run_counters
(SGLang ``PeriodicCanaryStatsLogger``). Host-side: it reads device counters back, outside the jitted step.
Re-exported by :mod:`canary_jax.runtime.report`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import numpy as np

from canary_jax.contract import constants, ints, layout
from canary_jax.runtime.snapshots import _first, _snapshot

logger = logging.getLogger("canary_jax")

__all__ = ["CanaryStats", "StatsLogger", "canary_stats", "format_stats"]

DEFAULT_STATS_EVERY_N_STEPS = 100


@dataclasses.dataclass(frozen=True, slots=True)
class CanaryStats:
    """Summary statistics of a canary run (SGLang's periodic stats line, plus a few extras).

    Fields:
      step: the outer step.
      protected_tokens: sum over tags of slot_run_counters (entries verified + slots written).
      sweep_passes: completed sweep passes (host count, e.g.
        :attr:`canary_jax.runtime.sweep.SweepSchedule.sweep_passes`).
      violations: the ring's write index (all violations ever recorded).
      ring_overflow: violations beyond the ring capacity were dropped.
      launch_tags_active: tags the manager launches; ``num_tags`` = 12.
      kernel_runs: per-tag kernel_run_counters (int64 numpy ``[12]``).
      slot_runs: per-tag slot_run_counters (int64 numpy ``[12]``).
    """

    step: int
    protected_tokens: int
    sweep_passes: int
    violations: int
    ring_overflow: bool
    launch_tags_active: int
    num_tags: int
    kernel_runs: np.ndarray
    slot_runs: np.ndarray

    def line(self) -> str:
        return format_stats(self)


def canary_stats(
    log: layout.ViolationLog, *, step: int = 0, sweep_passes: int = 0, active_tags: Sequence[int] = ()
) -> CanaryStats:
    """Reads the log's counters back and summarises them (one device-to-host copy)."""
    slot_runs, kernel_runs = log.counters()
    return _stats(int(step), slot_runs, kernel_runs, log.num_violations(), log.ring_capacity, sweep_passes, active_tags)


def _stats(
    step: int,
    slot_runs: np.ndarray,
    kernel_runs: np.ndarray,
    violations: int,
    ring_capacity: int,
    sweep_passes: int,
    active_tags: Sequence[int],
) -> CanaryStats:
    """The CanaryStats of host counters (int64 ``[12]`` each) and the ring's write index and capacity."""
    return CanaryStats(
        step=step,
        protected_tokens=int(slot_runs.sum()),
        sweep_passes=int(sweep_passes),
        violations=violations,
        ring_overflow=violations > ring_capacity,
        launch_tags_active=len(tuple(active_tags)),
        num_tags=constants.NUM_LAUNCH_TAGS,
        kernel_runs=kernel_runs,
        slot_runs=slot_runs,
    )


def format_stats(stats: CanaryStats) -> str:
    """``[canary] step=%d protected_tokens=%d sweep_passes=%d violations=%d launch_tags_active=%d/%d``."""
    return (
        f"[canary] step={stats.step} protected_tokens={stats.protected_tokens} "
        f"sweep_passes={stats.sweep_passes} violations={stats.violations} "
        f"launch_tags_active={stats.launch_tags_active}/{stats.num_tags}"
    )


class StatsLogger:
    """Logs :func:`format_stats` at INFO every ``every_n_steps`` outer steps, skipping step 0 (SGLang
    ``PeriodicCanaryStatsLogger``; ``every_n_steps <= 0`` disables it). Reads a snapshot taken one call
    earlier when ``delayed``.
    """

    def __init__(
        self,
        *,
        active_tags: Sequence[int] = (),
        every_n_steps: int = DEFAULT_STATS_EVERY_N_STEPS,
        delayed: bool = False,
        log: logging.Logger | None = None,
    ) -> None:
        self.active_tags = tuple(active_tags)
        self.every_n_steps = int(every_n_steps)
        self.delayed = bool(delayed)
        self._logger = log or logger
        self._pending = None

    def step(self, log: layout.ViolationLog, *, step: int, sweep_passes: int = 0) -> str | None:
        """Returns the logged line, if any."""
        due = self.every_n_steps > 0 and step != 0 and step % self.every_n_steps == 0
        snap = (
            (
                int(step),
                _snapshot(log.slot_run_counters),
                _snapshot(log.write_index),
                _snapshot(log.kernel_run_counters),
                log.ring_capacity,
            )
            if due
            else None
        )
        if self.delayed:
            snap, self._pending = self._pending, snap
        if snap is None:
            return None
        s, slot_p, wi, krc, cap = snap
        slot_runs, kernel_runs = ints.pairs_to_int64_np(np.asarray(slot_p)), ints.pairs_to_int64_np(np.asarray(krc))
        stats = _stats(s, slot_runs, kernel_runs, _first(wi), cap, sweep_passes, self.active_tags)
        line = format_stats(stats)
        self._logger.info(line)
        return line
