"""Host side of the sharded canary (:mod:`canary_jax.runtime.sharded`): one report over every shard.

:class:`ShardedViolationReporter` / :class:`ShardedViolationMonitor` read each *addressable* shard's log
(``jax.Array.addressable_shards``), tag every record with its shard ``(dp, tp)``, and print SGLang's text with
`` shard=(dp,tp)`` appended. In a multi-process run (``jax.distributed``) a process reads only the shards its
devices hold, so each violation is reported exactly once, by its owner. :func:`sharded_stats` and
:class:`ShardedHealthChecker` give stats and the counter health check per shard and in total.

Everything here reads device arrays back to the host, between steps (as :mod:`canary_jax.runtime.report`). The
shard reads are :mod:`canary_jax.runtime.sharded_logs`, the stats and health check
:mod:`canary_jax.runtime.sharded_stats` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from canary_jax.contract import decode, layout
from canary_jax.runtime.report import (
    CanaryViolationError,
    ViolationReporter,
    _snapshot,  # noqa: F401  (importable from here, as before)
    _take_pending,
    log_or_raise_messages,
    validate_mode,
)
from canary_jax.runtime.sharded_layout import Shard
from canary_jax.runtime.sharded_logs import _by_shard, shard_logs
from canary_jax.runtime.sharded_logs import _shard_of as _shard_of
from canary_jax.runtime.sharded_stats import ShardedHealthChecker, ShardedStats, sharded_stats

logger = logging.getLogger("canary_jax")

__all__ = [
    "ShardedHealthChecker",
    "ShardedStats",
    "ShardedViolationMonitor",
    "ShardedViolationRecord",
    "ShardedViolationReporter",
    "format_sharded_violation",
    "shard_logs",
    "sharded_stats",
]


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedViolationRecord:
    """One ring row of one shard. Reads every :class:`~canary_jax.contract.decode.ViolationRecord` field and property
    (``slot_idx``, ``tag``, ``reasons``, ...) through to ``record``, so it stands in for one (e.g. in
    :attr:`~canary_jax.runtime.report.CanaryViolationError.records`) while naming its shard.

    Fields:
      shard: ``(dp, tp)``.
      record: the decoded :class:`~canary_jax.contract.decode.ViolationRecord` (its ``index`` is the shard's ring row).
    """

    shard: Shard
    record: decode.ViolationRecord

    def __getattr__(self, name: str) -> Any:
        """The record's fields and properties (``slot_idx``, ``tag``, ``reasons``, ...), read through."""
        if name in ("shard", "record") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.record, name)

    def as_dict(self) -> dict[str, Any]:
        d = self.record.as_dict()
        d["shard"] = list(self.shard)
        return d


def format_sharded_violation(
    rec: ShardedViolationRecord, *, total: int, ring_overflow: bool, step_when_pumped: int
) -> str:
    """SGLang's text (:func:`canary_jax.contract.decode.format_violation`, unchanged, as the prefix) with
    `` shard=(dp,tp)`` appended to its last line; ``total`` and ``ring_overflow`` are the shard's."""
    text = decode.format_violation(
        rec.record, total=total, ring_overflow=ring_overflow, step_when_pumped=step_when_pumped
    )
    return f"{text} shard=({rec.shard[0]},{rec.shard[1]})"


class ShardedViolationReporter:
    """:class:`~canary_jax.runtime.report.ViolationReporter` over every addressable shard: one cursor per
    shard, every message SGLang's text with the shard appended.

    Args:
      mode: ``none`` / ``log`` / ``raise`` (raise: one :class:`~canary_jax.runtime.report.CanaryViolationError`
        with every new message of every shard, once).
      collapse: count a row equal (all 8 columns) to one already reported *on the same shard* instead of
        reporting it again.
      log: the logger (default ``canary_jax``).

    Attributes:
      last_records: the :class:`ShardedViolationRecord` s decoded by the latest call (repeats included).

    Raises:
      ValueError: a bad mode.
    """

    def __init__(self, mode: str = "log", *, collapse: bool = False, log: logging.Logger | None = None) -> None:
        self.mode = validate_mode(mode)
        self.collapse = bool(collapse)
        self._logger = log or logger
        self._per_shard: dict[Shard, ViolationReporter] = {}
        self._raised = False
        self.last_records: list[ShardedViolationRecord] = []

    @property
    def is_raised(self) -> bool:
        return self._raised

    def _reporter(self, shard: Shard) -> ViolationReporter:
        r = self._per_shard.get(shard)
        if r is None:
            r = self._per_shard[shard] = ViolationReporter("none", collapse=self.collapse, log=self._logger)
        return r

    def messages(self, log: layout.ViolationLog | dict[Shard, layout.ViolationLog], *, step: int) -> list[str]:
        """Formats the not-yet-reported rows of every addressable shard (shard order, then ring order) and
        advances each shard's cursor; no logging, no raising.

        Args:
          log: the sharded log (leaves ``[dp, tp, ...]``), or :func:`shard_logs`' result.
        """
        logs = shard_logs(log) if isinstance(log, layout.ViolationLog) else log
        out: list[str] = []
        self.last_records = []
        for shard, slog in sorted(logs.items()):
            r = self._reporter(shard)
            ring, wi = decode.ring_and_index(slog)
            r.messages(slog, step=step)  # advances the shard's cursor; its collapse mode picks r.last_shown
            overflow = wi > ring.shape[0] or wi < 0
            self.last_records.extend(ShardedViolationRecord(shard, rec) for rec in r.last_records)
            for rec in r.last_shown:
                srec = ShardedViolationRecord(shard, rec)
                out.append(format_sharded_violation(srec, total=wi, ring_overflow=overflow, step_when_pumped=step))
        return out

    def log_or_raise(self, log: layout.ViolationLog | dict[Shard, layout.ViolationLog], *, step: int = 0) -> list[str]:
        """Reports every addressable shard's new rows (log: one warning each; raise: one error, once).

        Returns:
          The messages reported (empty in none mode or when nothing is new).

        Raises:
          CanaryViolationError: raise mode, once, every message joined by newlines; its ``records`` are the
            :class:`ShardedViolationRecord` s (each with its ``shard``).
        """
        if self._raised:
            return []
        msgs = self.messages(log, step=step)
        if self.mode == "none" or not msgs:
            return []
        self._raised = self.mode == "raise"
        return log_or_raise_messages(self.mode, self._logger, msgs, list(self.last_records), step=step)

    def report_disagreement(self, disagreement: jax.Array, *, step: int = 0) -> list[str]:
        """Reports every addressable shard whose head-shard peers disagree (:meth:`ShardedCanary.consistency`):
        ``kv_canary shard disagreement: token/position/chain fields differ from N of T head shards of dp row D
        step=S shard=(dp,tp)``, logged (log mode) or raised (raise mode) like violations.

        Returns:
          The messages (one per disagreeing addressable shard).
        """
        host = jax.device_get(_by_shard(disagreement))
        msgs = []
        for (d, t), v in sorted(host.items()):
            n = int(np.asarray(v).reshape(-1)[0])
            if n:
                tp = int(disagreement.shape[1])
                msgs.append(
                    f"kv_canary shard disagreement: token/position/chain fields differ from {n} of {tp} head "
                    f"shards of dp row {d} step={step} shard=({d},{t})"
                )
        if msgs and self.mode == "log":
            for m in msgs:
                self._logger.warning(m)
        elif msgs and self.mode == "raise":
            self._raised = True
            raise CanaryViolationError(msgs, [], step=step)
        return msgs


class ShardedViolationMonitor:
    """SGLang's violation pump over every addressable shard (:class:`~canary_jax.runtime.report.ViolationMonitor`
    per shard, one report).

    Delayed (default), :meth:`step` keeps the log with a non-blocking snapshot of its write indices and reads
    them at the next call, so the host never waits for the step in flight.

    Args:
      reporter: the :class:`ShardedViolationReporter`.
      delayed: read the previous step's log (True) or the current one (False).

    Attributes:
      last_records: the :class:`ShardedViolationRecord` s read by the latest pump.
      last_recorded_step: the step whose log held them.
    """

    def __init__(self, reporter: ShardedViolationReporter, *, delayed: bool = True) -> None:
        self.reporter = reporter
        self.delayed = bool(delayed)
        self._pending = None
        self._seen: dict[Shard, int] = {}
        self.last_records: list[ShardedViolationRecord] = []
        self.last_recorded_step: int | None = None

    def step(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Pumps once (after every outer step). Returns the messages reported now.

        Raises:
          CanaryViolationError: raise mode, on the first pump that sees violations (``recorded_step`` set).
        """
        taken = _take_pending(self, log, step)
        if taken is None:
            return []
        log, wi, recorded = taken
        return self._report(log, wi, step=step, recorded=recorded)

    def flush(self, log: layout.ViolationLog, *, step: int) -> list[str]:
        """Reports whatever the current log holds, without the delay (e.g. at shutdown)."""
        self._pending = None
        self.last_records = []
        return self._report(log, log.write_index, step=step, recorded=int(step))

    def _report(self, log: layout.ViolationLog, wi: jax.Array, *, step: int, recorded: int) -> list[str]:
        idx = {s: int(np.asarray(v).reshape(-1)[0]) for s, v in jax.device_get(_by_shard(wi)).items()}
        if all(self._seen.get(s, 0) == n for s, n in idx.items()) or self.reporter.is_raised:
            return []
        self._seen.update(idx)
        try:
            msgs = self.reporter.log_or_raise(log, step=step)
        except CanaryViolationError as e:
            e.recorded_step = recorded
            self.last_records, self.last_recorded_step = list(self.reporter.last_records), recorded
            raise
        self.last_records, self.last_recorded_step = list(self.reporter.last_records), recorded
        return msgs
