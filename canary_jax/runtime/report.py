"""Host-side reporting: violation log/raise, summary statistics and the kernel-counter health check (SPEC 9).

Everything here reads device arrays back to the host, so it runs outside the jitted step, between steps.
SGLang pumps one step late so the device never waits for the host; :class:`ViolationMonitor`,
:class:`HealthChecker`, :class:`StatsLogger` and :class:`EnableWarner` do the same with ``copy_to_host_async``
snapshots taken at step ``s`` and read at step ``s + 1`` (pass ``delayed=False`` to read immediately, e.g. in
tests or at shutdown).

* :class:`ViolationReporter` (SGLang ``violation_reporter.py``): formats ring rows
  ``[last_logged, min(write_index, R))`` in SGLang's frozen text (:func:`canary_jax.contract.decode.format_violation`);
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

The stats live in :mod:`canary_jax.runtime.stats`, :class:`HealthChecker` and :class:`EnableWarner` in
:mod:`canary_jax.runtime.health` and the snapshots in :mod:`canary_jax.runtime.snapshots`; all are re-exported
here, which keeps the violation reporters.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

from canary_jax.contract import decode, layout
from canary_jax.runtime.health import HEALTH_CHECK_EVERY_N_STEPS as HEALTH_CHECK_EVERY_N_STEPS
from canary_jax.runtime.health import HEALTH_CHECK_WARMUP_STEPS as HEALTH_CHECK_WARMUP_STEPS
from canary_jax.runtime.health import EnableWarner, HealthChecker, expected_health_tags
from canary_jax.runtime.snapshots import _first, _snapshot
from canary_jax.runtime.stats import DEFAULT_STATS_EVERY_N_STEPS as DEFAULT_STATS_EVERY_N_STEPS
from canary_jax.runtime.stats import CanaryStats, StatsLogger, canary_stats, format_stats

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


def validate_mode(mode: str) -> str:
    """Validates a mode string (``none`` / ``log`` / ``raise``; SGLang ``--kv-canary``).

    Raises:
      ValueError: ``kv-canary: kv_canary must be one of none/log/raise, got '{x}'``.
    """
    m = str(mode).lower()
    if m not in MODES:
        raise ValueError(f"kv-canary: kv_canary must be one of none/log/raise, got '{mode}'")
    return m


class CanaryViolationError(RuntimeError):
    """What raise mode raises: ``str(error)`` is SGLang's text (every new row's message joined by newlines).

    Attributes:
      messages: the formatted messages, one per reported row.
      records: the :class:`~canary_jax.contract.decode.ViolationRecord` of each reported row.
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
        """One line per distinct row seen more than once (:func:`canary_jax.contract.decode.format_repeat`)."""
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
          log_or_ring: a :class:`~canary_jax.contract.layout.ViolationLog` (or a ring plus ``write_index``, see
            :func:`canary_jax.contract.decode.decode_violations`).
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


def _take_pending(monitor, log: layout.ViolationLog, step: int):
    """What a monitor's pump reads (clearing ``monitor.last_records``): ``(log, write index, recorded step)`` of
    the previous call when ``monitor.delayed`` (keeping this call's log and a snapshot of its write index for the
    next; None on the first call), else of this call."""
    monitor.last_records = []
    if monitor.delayed:
        prev, monitor._pending = monitor._pending, (log, _snapshot(log.write_index), int(step))
        return prev
    return log, log.write_index, int(step)


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
        taken = _take_pending(self, log, step)
        if taken is None:
            return []
        log, wi, recorded = taken
        return self._report(log, _first(wi), step=step, recorded=recorded)

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
