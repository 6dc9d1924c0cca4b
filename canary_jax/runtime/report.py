"""Host-side reporting: violation log/raise, summary statistics and the kernel-counter health check (SPEC 9).

Everything here reads device arrays back to the host, so it runs outside the jitted step, between steps.
SGLang pumps one step late so the device never waits for the host; :class:`ViolationMonitor`,
:class:`HealthChecker` and :class:`StatsLogger` do the same with ``copy_to_host_async`` snapshots taken at
step ``s`` and read at step ``s + 1`` (pass ``delayed=False`` to read immediately, e.g. in tests or at shutdown).

* :class:`ViolationReporter` (SGLang ``violation_reporter.py``): formats ring rows
  ``[last_logged, min(write_index, R))`` in SGLang's frozen text (:func:`canary_jax.decode.format_violation`);
  ``log`` mode warns once per row, ``raise`` mode raises one RuntimeError with all rows joined by newlines
  and then never again, ``none`` does nothing.
* :class:`ViolationMonitor` (SGLang ``ViolationManager``): the delayed ``write_index > 0`` pump that calls the
  reporter.
* :func:`canary_stats` / :class:`CanaryStats` / :class:`StatsLogger`: ``[canary] step=%d protected_tokens=%d
  sweep_passes=%d violations=%d launch_tags_active=%d/%d`` with protected tokens = sum of slot_run_counters.
* :class:`HealthChecker` (SGLang ``KernelRunCounterHealthChecker``): every 100 steps from step 100, every
  expected tag's kernel_run_counter must have grown since the previous check, else RuntimeError.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np

from canary_jax import constants, decode, ints, layout

logger = logging.getLogger("canary_jax")

__all__ = [
    "CanaryStats",
    "HealthChecker",
    "validate_mode",
    "StatsLogger",
    "ViolationMonitor",
    "ViolationReporter",
    "canary_stats",
    "expected_health_tags",
    "format_stats",
]

MODES = ("none", "log", "raise")
HEALTH_CHECK_EVERY_N_STEPS = 100
HEALTH_CHECK_WARMUP_STEPS = 100
DEFAULT_STATS_EVERY_N_STEPS = 100


def validate_mode(mode: str) -> str:
    """Validates a mode string (``none`` / ``log`` / ``raise``; SGLang ``--kv-canary``).

    Raises:
      ValueError: ``kv-canary: kv_canary must be one of none/log/raise, got '{x}'``.
    """
    m = str(mode).lower()
    if m not in MODES:
        raise ValueError(f"kv-canary: kv_canary must be one of none/log/raise, got '{mode}'")
    return m


def _snapshot(x: Any) -> Any:
    """Starts a device-to-host copy (non-blocking) and returns the array to read later."""
    if isinstance(x, jax.Array):
        try:
            x.copy_to_host_async()
        except Exception:  # pragma: no cover - backends without async copies
            pass
    return x


class ViolationReporter:
    """Formats new ring rows and logs or raises them (SGLang ``ViolationReporter``).

    Args:
      mode: ``log`` (one WARNING per row, keep running), ``raise`` (one RuntimeError with every new row,
        once) or ``none``.
      log: the ``logging.Logger`` to warn on (default ``logging.getLogger("canary_jax")``).
    """

    def __init__(self, mode: str = "log", *, log: logging.Logger | None = None) -> None:
        self.mode = validate_mode(mode)
        self._logger = log or logger
        self._last_logged = 0
        self._raised = False

    @property
    def is_raised(self) -> bool:
        return self._raised

    @property
    def last_logged(self) -> int:
        """Ring rows already reported (SGLang's ``_last_logged_write_index``)."""
        return self._last_logged

    def messages(self, log_or_ring: Any, write_index: Any | None = None, *, step: int = 0) -> list[str]:
        """Formats the not-yet-reported rows and advances the cursor (no logging, no raising)."""
        rows = decode.format_violations(log_or_ring, write_index, start=self._last_logged, step_when_pumped=step)
        self._last_logged += len(rows)
        return rows

    def log_or_raise(self, log_or_ring: Any, write_index: Any | None = None, *, step: int = 0) -> list[str]:
        """Reports rows ``[last_logged, min(write_index, R))``.

        Args:
          log_or_ring: a :class:`~canary_jax.layout.ViolationLog` (or a ring plus ``write_index``, see
            :func:`canary_jax.decode.decode_violations`).
          step: the outer step, printed as ``step_when_pumped``.

        Returns:
          The formatted messages (empty in ``none`` mode or when nothing is new).

        Raises:
          RuntimeError: in ``raise`` mode, once, with the messages joined by newlines.
        """
        if self.mode == "none" or self._raised:
            return []
        msgs = self.messages(log_or_ring, write_index, step=step)
        if not msgs:
            return []
        if self.mode == "log":
            for m in msgs:
                self._logger.warning(m)
            return msgs
        self._raised = True
        raise RuntimeError("\n".join(msgs))


class ViolationMonitor:
    """SGLang's violation pump: each step, check ``write_index > 0`` as snapshotted one step earlier and, if
    set, let the reporter log or raise the rows recorded so far.

    Args:
      reporter: the :class:`ViolationReporter` (its mode decides log / raise / none).
      delayed: read the previous step's snapshot (True, non-blocking like SGLang) or the current log (False).
    """

    def __init__(self, reporter: ViolationReporter, *, delayed: bool = True) -> None:
        self.reporter = reporter
        self.delayed = bool(delayed)
        self._pending = None

    def step(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Pumps once (call after every outer step). Returns the messages reported now.

        Raises:
          RuntimeError: in raise mode, on the first pump that sees violations.
        """
        if self.delayed:
            prev, self._pending = self._pending, _snapshot(log.write_index)
            if prev is None:
                return []
            errored = int(np.asarray(prev).reshape(-1)[0]) > 0
        else:
            errored = int(np.asarray(log.write_index).reshape(-1)[0]) > 0
        if not errored or self.reporter.is_raised:
            return []
        return self.reporter.log_or_raise(log, step=step)

    def flush(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Reports whatever the current log holds (e.g. at shutdown), without the one-step delay."""
        if self.reporter.is_raised or log.num_violations() == 0:
            return []
        return self.reporter.log_or_raise(log, step=step)


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
    wi = log.num_violations()
    return CanaryStats(
        step=int(step),
        protected_tokens=int(slot_runs.sum()),
        sweep_passes=int(sweep_passes),
        violations=wi,
        ring_overflow=wi > log.ring_capacity,
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
        slot_runs = ints.pairs_to_int64_np(np.asarray(slot_p))
        nviol = int(np.asarray(wi).reshape(-1)[0])
        stats = CanaryStats(
            step=s,
            protected_tokens=int(slot_runs.sum()),
            sweep_passes=int(sweep_passes),
            violations=nviol,
            ring_overflow=nviol > cap,
            launch_tags_active=len(self.active_tags),
            num_tags=constants.NUM_LAUNCH_TAGS,
            kernel_runs=ints.pairs_to_int64_np(np.asarray(krc)),
            slot_runs=slot_runs,
        )
        line = format_stats(stats)
        self._logger.info(line)
        return line


def expected_health_tags(
    active_tags: Iterable[int], *, sweep_interval: int = 0, enable_v_half: bool = False
) -> tuple[constants.CanaryLaunchTag, ...]:
    """Active tags minus SWEEP tags when ``sweep_interval <= 0`` and minus V-half tags unless
    ``enable_v_half`` (SGLang's ``_expected_active_tags_for_health_check``)."""
    out = []
    for t in active_tags:
        tag = constants.CanaryLaunchTag(int(t))
        if tag.is_sweep and sweep_interval <= 0:
            continue
        if tag.is_v_half and not enable_v_half:
            continue
        out.append(tag)
    return tuple(out)


class HealthChecker:
    """Checks that every expected tag's kernel_run_counter keeps growing (SGLang
    ``KernelRunCounterHealthChecker``): a silently skipped canary path must not look like a clean run.

    Args:
      active_tags: tags the manager launches (e.g. :func:`canary_jax.runtime.state.active_tags`).
      sweep_interval: 0 = no sweeps (SWEEP tags are not expected).
      enable_v_half: V-half tags are expected only when on.
      every_n_steps, warmup_steps: check at steps ``s >= warmup_steps`` with ``s % every_n_steps == 0``.
      delayed: compare a snapshot taken at the previous call (SGLang's delayed D2H) instead of now.
    """

    def __init__(
        self,
        active_tags: Iterable[int],
        *,
        sweep_interval: int = 0,
        enable_v_half: bool = False,
        every_n_steps: int = HEALTH_CHECK_EVERY_N_STEPS,
        warmup_steps: int = HEALTH_CHECK_WARMUP_STEPS,
        delayed: bool = False,
    ) -> None:
        self.active_tags = tuple(constants.CanaryLaunchTag(int(t)) for t in active_tags)
        self.expected_tags = expected_health_tags(
            self.active_tags, sweep_interval=sweep_interval, enable_v_half=enable_v_half
        )
        self.every_n_steps = int(every_n_steps)
        self.warmup_steps = int(warmup_steps)
        self.delayed = bool(delayed)
        self._prev = np.zeros((constants.NUM_LAUNCH_TAGS,), np.int64)
        self._pending = None

    def due(self, step: int) -> bool:
        return (
            bool(self.active_tags)
            and self.every_n_steps > 0
            and step >= self.warmup_steps
            and step % self.every_n_steps == 0
        )

    def step(self, log: layout.ViolationLog, *, step: int) -> None:
        """Call once per outer step.

        Raises:
          RuntimeError: ``kv-canary: kernel_run_counter did not increase since previous check for
            tags=[...] at step=S; canary path is not executing``.
        """
        snap = _snapshot(log.kernel_run_counters) if self.due(step) else None
        if self.delayed:
            snap, self._pending = self._pending, snap
        if snap is not None:
            self.check(ints.pairs_to_int64_np(np.asarray(snap)), step=step)

    def check(self, kernel_run_counters: Any, *, step: int) -> None:
        """Compares host counters (int64 ``[12]``, or a ViolationLog) with the previous check.

        Raises:
          RuntimeError: as :meth:`step`.
        """
        if isinstance(kernel_run_counters, layout.ViolationLog):
            kernel_run_counters = kernel_run_counters.counters()[1]
        cur = np.asarray(kernel_run_counters, np.int64).reshape(-1)
        delta = cur - self._prev[: cur.shape[0]] if cur.shape[0] <= self._prev.shape[0] else cur
        self._prev = cur.copy()
        stalled = [t for t in self.expected_tags if int(t) >= cur.shape[0] or int(delta[int(t)]) == 0]
        if stalled:
            names = ", ".join(t.name for t in stalled)
            raise RuntimeError(
                f"kv-canary: kernel_run_counter did not increase since previous check for tags=[{names}] "
                f"at step={step}; canary path is not executing"
            )
