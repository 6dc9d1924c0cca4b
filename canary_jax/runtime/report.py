"""Host-side reporting: violation log/raise, summary statistics and the kernel-counter health check (SPEC 9).

Everything here reads device arrays back to the host, so it runs outside the jitted step, between steps.
SGLang pumps one step late so the device never waits for the host; :class:`ViolationMonitor`,
:class:`HealthChecker`, :class:`StatsLogger` and :class:`EnableWarner` do the same with ``copy_to_host_async``
snapshots taken at step ``s`` and read at step ``s + 1`` (pass ``delayed=False`` to read immediately, e.g. in
tests or at shutdown).

* :class:`ViolationReporter` (SGLang ``violation_reporter.py``): formats ring rows
  ``[last_logged, min(write_index, R))`` in SGLang's frozen text (:func:`canary_jax.decode.format_violation`);
  ``log`` mode warns once per row, ``raise`` mode raises one :class:`CanaryViolationError` (a RuntimeError
  whose text is SGLang's: all rows joined by newlines) and then never again, ``none`` does nothing. With
  ``collapse=True`` (a canary-jax addition, off by default) a row identical in all 8 columns to one already
  reported is counted instead of reported again (:attr:`ViolationReporter.collapsed`).
* :class:`ViolationMonitor` (SGLang ``ViolationManager``): the delayed ``write_index`` pump that calls the
  reporter. Delayed, it reads the rows from the log of the previous step (complete once its snapshot is read),
  never the current one, so even log mode never waits for the step in flight.
* :class:`EnableWarner` (SGLang ``CanaryEnableWarner``): one step late, SGLang's warning when a per-forward
  verify plan overflowed its capacity and the verify was skipped.
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
    "CanaryViolationError",
    "EnableWarner",
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


def _first(x: Any) -> int:
    """``x.reshape(-1)[0]`` as a Python int (a device-to-host read when ``x`` is a device array)."""
    return int(np.asarray(x).reshape(-1)[0])


class CanaryViolationError(RuntimeError):
    """What raise mode raises: ``str(error)`` is SGLang's text (every new row's message joined by newlines).

    Attributes:
      messages: the formatted messages, one per reported row.
      records: the :class:`~canary_jax.decode.ViolationRecord` of each reported row.
      step: the outer step the rows were pumped at (SGLang's ``step_when_pumped``).
      recorded_step: the step whose log held the rows (one step before ``step`` when pumped late), or None.
      kv_state, outputs: set by :class:`canary_jax.integration.CanaryGuard` to what the step that raised
        returned (its input was donated), else None.
    """

    def __init__(self, messages: Sequence[str], records: Sequence[decode.ViolationRecord], *, step: int) -> None:
        super().__init__("\n".join(messages))
        self.messages = list(messages)
        self.records = list(records)
        self.step = int(step)
        self.recorded_step: int | None = None
        self.kv_state: Any = None
        self.outputs: Any = None


def log_or_raise_messages(mode: str, logger: logging.Logger, msgs: list[str], records: Any, *, step: int) -> list[str]:
    """Report new messages the way ``mode`` says: ``log`` warns each and returns them, ``raise`` raises
    :class:`CanaryViolationError` (``msgs`` and ``records``, at ``step``). Callers handle ``none`` mode and an
    empty ``msgs`` first, and mark themselves raised before calling in ``raise`` mode."""
    if mode == "log":
        for m in msgs:
            logger.warning(m)
        return msgs
    raise CanaryViolationError(msgs, records, step=step)


class ViolationReporter:
    """Formats new ring rows and logs or raises them (SGLang ``ViolationReporter``).

    Args:
      mode: ``log`` (one WARNING per row, keep running), ``raise`` (one :class:`CanaryViolationError` with
        every new row, once) or ``none``.
      log: the ``logging.Logger`` to warn on (default ``logging.getLogger("canary_jax")``).
      collapse: report a row only the first time its 8 columns are seen; later identical rows (the same fault
        seen again by a later step: same tag, slot, fields and fail bits) only count, in :attr:`collapsed`
        (canary-jax addition; SGLang reports every row). The first report's text is SGLang's, unchanged.

    Attributes:
      last_records: the rows decoded by the latest :meth:`messages` call (repeats included).
      last_shown: the rows whose messages that call returned, one per message, in order (``last_records``
        less the repeats left out by ``collapse``).
    """

    def __init__(self, mode: str = "log", *, log: logging.Logger | None = None, collapse: bool = False) -> None:
        self.mode = validate_mode(mode)
        self._logger = log or logger
        self._last_logged = 0
        self._raised = False
        self.collapse = bool(collapse)
        self._seen: dict[tuple[int, ...], decode.CollapsedViolation] = {}
        self.last_records: list[decode.ViolationRecord] = []
        self.last_shown: list[decode.ViolationRecord] = []

    @property
    def is_raised(self) -> bool:
        return self._raised

    @property
    def last_logged(self) -> int:
        """Ring rows already reported (SGLang's ``_last_logged_write_index``)."""
        return self._last_logged

    @property
    def collapsed(self) -> list[decode.CollapsedViolation]:
        """Every distinct row seen so far (in first-seen order) with its count and the first / last step it was
        pumped at (``first`` / ``last``). Kept with ``collapse`` on or off."""
        return list(self._seen.values())

    def repeat_lines(self) -> list[str]:
        """One line per distinct row seen more than once (:func:`canary_jax.decode.format_repeat`)."""
        return [decode.format_repeat(c, unit="step") for c in self._seen.values() if c.count > 1]

    def messages(self, log_or_ring: Any, write_index: Any | None = None, *, step: int = 0) -> list[str]:
        """Formats the not-yet-reported rows and advances the cursor (no logging, no raising).

        With ``collapse``, rows already seen are counted and left out. :attr:`last_records` holds the decoded
        rows (repeats included), :attr:`last_shown` the rows of the returned messages.
        """
        ring, wi = decode.ring_and_index(log_or_ring, write_index)
        records = decode.decode_violations(ring, np.array([wi]), start=self._last_logged)
        overflow = wi > ring.shape[0] or wi < 0
        self._last_logged += len(records)
        self.last_records = records
        self.last_shown = []
        out = []
        for r in records:
            seen = self._seen.get(r.key)
            if seen is None:
                self._seen[r.key] = decode.CollapsedViolation(record=r, count=1, first=int(step), last=int(step))
            else:
                self._seen[r.key] = dataclasses.replace(seen, count=seen.count + 1, last=int(step))
                if self.collapse:
                    continue
            self.last_shown.append(r)
            out.append(decode.format_violation(r, total=wi, ring_overflow=overflow, step_when_pumped=step))
        return out

    def log_or_raise(self, log_or_ring: Any, write_index: Any | None = None, *, step: int = 0) -> list[str]:
        """Reports rows ``[last_logged, min(write_index, R))``.

        Args:
          log_or_ring: a :class:`~canary_jax.layout.ViolationLog` (or a ring plus ``write_index``, see
            :func:`canary_jax.decode.decode_violations`).
          step: the outer step, printed as ``step_when_pumped``.

        Returns:
          The formatted messages (empty in ``none`` mode or when nothing is new; with ``collapse``, repeats are
          logged at DEBUG and left out). ``none`` mode still decodes the rows (:attr:`last_records`,
          :attr:`collapsed`), it only reports nothing.

        Raises:
          CanaryViolationError: in ``raise`` mode, once, with the messages joined by newlines (a RuntimeError,
            as SGLang's).
        """
        if self._raised:
            return []
        msgs = self.messages(log_or_ring, write_index, step=step)  # none mode too: last_records, collapsed
        if self.mode == "none":
            return []
        if self.collapse and len(msgs) < len(self.last_records):
            self._logger.debug(
                "kv-canary: %d violation rows repeat rows already reported (step %d)",
                len(self.last_records) - len(msgs),
                step,
            )
        if not msgs:
            return []
        self._raised = self.mode == "raise"
        return log_or_raise_messages(self.mode, self._logger, msgs, self.last_records, step=step)


class ViolationMonitor:
    """SGLang's violation pump: each step, check the write index as snapshotted one step earlier and, when it
    grew, let the reporter log or raise the rows recorded since.

    Delayed, :meth:`step` keeps the log it is given with a non-blocking snapshot of its write index, and at the
    next call reads that snapshot and, when it grew, the rows of that same (previous) log: the host waits only
    for the previous step, which has finished by then, never for the step in flight (SGLang's reporter reads
    the current ring once the delayed flag is set, so its ``total_violations`` can include rows of the step in
    flight; here it is the write index of the step that recorded the rows). Not delayed, it reads the log now.

    Args:
      reporter: the :class:`ViolationReporter` (its mode decides log / raise / none).
      delayed: read the previous step's log (True, non-blocking like SGLang) or the current log (False).

    Attributes:
      last_records: the rows read by the latest pump (repeats included), or [].
      last_recorded_step: the ``step`` the latest pump's rows were recorded at: the previous call's ``step``
        when delayed, else this call's; None before any rows were read.
    """

    def __init__(self, reporter: ViolationReporter, *, delayed: bool = True) -> None:
        self.reporter = reporter
        self.delayed = bool(delayed)
        self._pending = None
        self._seen_index = 0
        self.last_records: list[decode.ViolationRecord] = []
        self.last_recorded_step: int | None = None

    def step(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Pumps once (call after every outer step). Returns the messages reported now.

        Args:
          log: the log after this step (kept until the next call when delayed; never donated by the step API).
          step: this outer step (printed as ``step_when_pumped``).

        Raises:
          CanaryViolationError: in raise mode, on the first pump that sees violations (``recorded_step`` set).
        """
        self.last_records = []
        if self.delayed:
            prev, self._pending = self._pending, (log, _snapshot(log.write_index), int(step))
            if prev is None:
                return []
            log, wi, recorded = prev
            n = _first(wi)
        else:
            n, recorded = _first(log.write_index), int(step)
        return self._report(log, n, step=step, recorded=recorded)

    def _report(self, log: layout.ViolationLog, n: int, *, step: int, recorded: int) -> list[str]:
        if n == self._seen_index or self.reporter.is_raised:
            return []
        self._seen_index = n
        try:
            msgs = self.reporter.log_or_raise(log, step=step)
        except CanaryViolationError as e:
            e.recorded_step = recorded
            self.last_records, self.last_recorded_step = e.records, recorded
            raise
        self.last_records, self.last_recorded_step = self.reporter.last_records, recorded
        return msgs

    def flush(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Reports whatever the current log holds (e.g. at shutdown), without the one-step delay.

        Raises:
          CanaryViolationError: in raise mode, when there are rows not yet reported.
        """
        self._pending = None
        self.last_records = []
        return self._report(log, log.num_violations(), step=step, recorded=int(step))


class EnableWarner:
    """SGLang's ``CanaryEnableWarner``: when a per-forward verify plan overflowed (``enable == 0``: the verify was
    skipped, nothing was checked that step), warn once per such step, one step late.

    The warning is SGLang's text: ``kv-canary: per-forward verify skipped this step due to overflow (total=%d,
    capacity=%d); check ServerArgs / pool sizing``, where ``total`` counts the overflowed steps so far.

    Args:
      verify_capacity: the per-forward verify capacity (printed).
      delayed: read the previous step's snapshot (True) or the current flags (False).
      log: the logger (default ``canary_jax``).

    Attributes:
      overflow_count_total: steps seen with a skipped verify.
    """

    def __init__(self, *, verify_capacity: int, delayed: bool = True, log: logging.Logger | None = None) -> None:
        self.verify_capacity = int(verify_capacity)
        self.delayed = bool(delayed)
        self._logger = log or logger
        self._pending = None
        self.overflow_count_total = 0

    def tick(self, verify_enable: Any) -> bool:
        """Call once per step with the step's ``StepSummary.verify_enable`` (``int32[G]``, one flag per group).

        Returns:
          True if the step read now (the previous one when delayed) skipped its verify.
        """
        if self.delayed:
            verify_enable, self._pending = self._pending, _snapshot(verify_enable)
            if verify_enable is None:
                return False
        if int(np.asarray(verify_enable).min()) != 0:
            return False
        self.overflow_count_total += 1
        self._logger.warning(
            "kv-canary: per-forward verify skipped this step due to overflow "
            "(total=%d, capacity=%d); check ServerArgs / pool sizing",
            self.overflow_count_total,
            self.verify_capacity,
        )
        return True


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
