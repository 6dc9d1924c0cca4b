"""Stats and the kernel-counter health check of the sharded canary (:mod:`canary_jax.runtime.sharded`), per
addressable shard and in total: :func:`sharded_stats` / :class:`ShardedStats` and :class:`ShardedHealthChecker`,
over :mod:`canary_jax.runtime.report`'s :class:`~canary_jax.runtime.report.CanaryStats` and
:class:`~canary_jax.runtime.report.HealthChecker`. :mod:`canary_jax.runtime.sharded_report` re-exports them.

Everything here reads device arrays back to the host, between steps
(:func:`~canary_jax.runtime.sharded_logs.shard_logs`, or one ``process_allgather`` of the small counters with
``all_processes=True``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from canary_jax.contract import constants, ints, layout
from canary_jax.runtime.report import CanaryStats, HealthChecker, format_stats
from canary_jax.runtime.sharded_layout import Shard
from canary_jax.runtime.sharded_logs import shard_logs


@dataclasses.dataclass(frozen=True, slots=True)
class ShardedStats:
    """Stats per addressable shard and their total.

    Fields:
      per_shard: ``{(dp, tp): CanaryStats}`` for this process's shards.
      total: the sum over them (protected tokens, violations, counters; ``ring_overflow`` if any shard's
        overflowed). In a multi-process run it covers this process's shards only unless built with
        ``all_processes=True``.
    """

    per_shard: dict
    total: CanaryStats

    def lines(self) -> list[str]:
        """SGLang's stats line per shard (`` shard=(dp,tp)`` appended) and the total (`` shards=N``)."""
        out = [f"{format_stats(s)} shard=({d},{t})" for (d, t), s in sorted(self.per_shard.items())]
        out.append(f"{format_stats(self.total)} shards={len(self.per_shard)}")
        return out


def sharded_stats(
    log: layout.ViolationLog,
    *,
    step: int = 0,
    sweep_passes: int = 0,
    active_tags: Sequence[int] = (),
    all_processes: bool = False,
) -> ShardedStats:
    """Per-shard :class:`~canary_jax.runtime.report.CanaryStats` and their total (host reads of the small logs).

    Args:
      log: the sharded log (leaves ``[dp, tp, ...]``, e.g. ``state.log`` of a :class:`ShardedCanary` state).
      step: the outer step printed in each stats line.
      sweep_passes: sweep passes run so far (reported as given; the log does not count them).
      active_tags: the launch tags the canary runs (:func:`~canary_jax.runtime.state.active_tags`); only their
        number is reported (``launch_tags_active``).
      all_processes: in a multi-process run, first gather every shard's small counters and write index to every
        process (``jax.experimental.multihost_utils.process_allgather``, ``[dp, tp, 12, 2]`` words; a
        collective: every process must call it), so the total covers the whole mesh.

    Returns:
      A :class:`ShardedStats`: ``per_shard`` ``{(dp, tp): CanaryStats}`` (this process's shards, or every shard
      with ``all_processes``) and their ``total``; ``.lines()`` formats them.

    Raises:
      ValueError: a log whose leaves are not laid out ``[dp, tp, ...]``.
    """
    if all_processes and jax.process_count() > 1:
        from jax.experimental import multihost_utils

        wi, slot, kern = (
            np.asarray(multihost_utils.process_allgather(x, tiled=True))
            for x in (log.write_index, log.slot_run_counters, log.kernel_run_counters)
        )
        cap = int(log.ring.shape[2])
        parts = {
            (d, t): (int(wi[d, t, 0]), slot[d, t], kern[d, t]) for d in range(wi.shape[0]) for t in range(wi.shape[1])
        }
    else:
        cap = int(log.ring.shape[2])
        parts = {
            s: (sl.num_violations(), sl.slot_run_counters, sl.kernel_run_counters) for s, sl in shard_logs(log).items()
        }
    per = {}
    ntags = len(tuple(active_tags))
    for s, (n, slot_p, kern_p) in parts.items():
        slot_runs = ints.pairs_to_int64_np(np.asarray(slot_p))
        kernel_runs = ints.pairs_to_int64_np(np.asarray(kern_p))
        per[s] = CanaryStats(
            step=int(step),
            protected_tokens=int(slot_runs.sum()),
            sweep_passes=int(sweep_passes),
            violations=n,
            ring_overflow=n > cap or n < 0,
            launch_tags_active=ntags,
            num_tags=constants.NUM_LAUNCH_TAGS,
            kernel_runs=kernel_runs,
            slot_runs=slot_runs,
        )
    zeros = np.zeros((constants.NUM_LAUNCH_TAGS,), np.int64)
    total = CanaryStats(
        step=int(step),
        protected_tokens=sum(s.protected_tokens for s in per.values()),
        sweep_passes=int(sweep_passes),
        violations=sum(s.violations for s in per.values()),
        ring_overflow=any(s.ring_overflow for s in per.values()),
        launch_tags_active=ntags,
        num_tags=constants.NUM_LAUNCH_TAGS,
        kernel_runs=functools.reduce(np.add, (s.kernel_runs for s in per.values()), zeros),
        slot_runs=functools.reduce(np.add, (s.slot_runs for s in per.values()), zeros),
    )
    return ShardedStats(per_shard=per, total=total)


class ShardedHealthChecker:
    """SGLang's kernel-counter health check (:class:`~canary_jax.runtime.report.HealthChecker`) on every
    addressable shard: a shard whose canary path stopped running fails even when the others run.

    Args: as :class:`~canary_jax.runtime.report.HealthChecker` (``delayed`` not supported: checks read now).

    Raises:
      ValueError: ``delayed=True`` (at construction).
      RuntimeError (from :meth:`step`): HealthChecker's text with `` shard=(dp,tp)`` appended, for the first
        stalled shard, or the first whose launch ticket is not zero
        (:func:`~canary_jax.runtime.health.check_launch_ticket`).
    """

    def __init__(self, active_tags: Sequence[int], **kw: Any) -> None:
        if kw.get("delayed"):
            raise ValueError(
                "kv-canary: ShardedHealthChecker does not support delayed=True (each check reads the shards' "
                "counters now); leave delayed out"
            )
        kw.pop("delayed", None)
        self._kw = dict(active_tags=tuple(active_tags), **kw)
        self._per_shard: dict[Shard, HealthChecker] = {}

    def step(self, log: layout.ViolationLog, *, step: int) -> None:
        probe = HealthChecker(**self._kw)
        if not probe.due(step):
            return
        for s, slog in shard_logs(log).items():
            hc = self._per_shard.setdefault(s, HealthChecker(**self._kw))
            try:
                hc.check(slog, step=step)
            except RuntimeError as e:
                raise RuntimeError(f"{e} shard=({s[0]},{s[1]})") from None
