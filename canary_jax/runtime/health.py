"""Is the canary checking at all: the kernel-counter health check and the verify-overflow warning.

* :class:`HealthChecker` (SGLang ``KernelRunCounterHealthChecker``): every 100 steps from step 100, every
  expected tag's kernel_run_counter must have grown since the previous check, else RuntimeError
  (:func:`expected_health_tags` says which tags are expected).
  It also refuses a log whose launch ticket is not zero (:func:`check_launch_ticket`).
* :class:`EnableWarner` (SGLang ``CanaryEnableWarner``): one step late, SGLang's warning when a per-forward
  verify plan overflowed its capacity and the verify was skipped.

Host-side, one step late like SGLang (``delayed``); re-exported by :mod:`canary_jax.runtime.report`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

from canary_jax.contract import constants, ints, layout
from canary_jax.runtime.snapshots import _snapshot

logger = logging.getLogger("canary_jax")

__all__ = ["EnableWarner", "HealthChecker", "check_launch_ticket", "expected_health_tags"]

HEALTH_CHECK_EVERY_N_STEPS = 100
HEALTH_CHECK_WARMUP_STEPS = 100


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


def check_launch_ticket(ticket: Any, *, step: int) -> None:
    """The log's launch ticket (host ``int32[1]``) is zero between launches, as every one-launch phase
    (:mod:`pallas_kernels.phase`) leaves it and needs it: with another value its last program is misjudged, and
    phases finish early (rows from unfinished counts) or never (nothing recorded, nothing written).

    Raises:
      RuntimeError: ``kv-canary: launch_ticket is V between launches at step=S (expected 0): ...``.
    """
    v = int(np.asarray(ticket).reshape(-1)[0])
    if v != 0:
        raise RuntimeError(
            f"kv-canary: launch_ticket is {v} between launches at step={step} (expected 0): the one-launch HEAD / "
            "TAIL phases cannot tell their last program; the log was built or changed by hand, or memory is "
            "corrupt. Zero it (dataclasses.replace(log, launch_ticket=jnp.zeros((1,), jnp.int32)))"
        )


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
            tags=[...] at step=S; canary path is not executing``; or the log's launch ticket is not zero
            (:func:`check_launch_ticket`).
        """
        snap = None
        if self.due(step):
            ticket = None if log.launch_ticket is None else _snapshot(log.launch_ticket)
            snap = (_snapshot(log.kernel_run_counters), ticket)
        if self.delayed:
            snap, self._pending = self._pending, snap
        if snap is not None:
            counters, ticket = snap
            self.check(ints.pairs_to_int64_np(np.asarray(counters)), step=step, launch_ticket=ticket)

    def check(self, kernel_run_counters: Any, *, step: int, launch_ticket: Any = None) -> None:
        """Compares host counters (int64 ``[12]``, or a ViolationLog) with the previous check, after the launch
        ticket (``launch_ticket``, or the log's; None: none to check) is checked to be zero.

        Raises:
          RuntimeError: as :meth:`step`.
        """
        if isinstance(kernel_run_counters, layout.ViolationLog):
            launch_ticket = kernel_run_counters.launch_ticket
            kernel_run_counters = kernel_run_counters.counters()[1]
        if launch_ticket is not None:
            check_launch_ticket(launch_ticket, step=step)
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
