"""The host-side fault campaign tracker: which faults were caught, how fast, and what fired falsely.

:class:`FaultCampaign` keeps episodes (one injected fault each, :class:`Episode`) and attributes each step's
recorded violations to the open episode or to the false positives; :meth:`FaultCampaign.report` aggregates them
per kind (:class:`KindReport`, :func:`kind_report`) into a :class:`CampaignReport` (what ``canary-jax demo``
prints). Re-exported by :mod:`canary_jax.tools.faults`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

from canary_jax.contract.decode import ViolationRecord

__all__ = ["CampaignReport", "Episode", "FaultCampaign", "KindReport", "kind_report", "reason_keys"]


def reason_keys(records: Sequence[ViolationRecord]) -> collections.Counter:
    """``"TAG:reason"`` -> rows, one count per (row, fail reason); rows without a reason count as ``none``."""
    out: collections.Counter = collections.Counter()
    for r in records:
        for reason in r.reasons or ["none"]:
            out[f"{r.tag}:{reason}"] += 1
    return out


@dataclasses.dataclass
class Episode:
    """One fault's run from injection to detection (or not).

    Fields:
      kind: the fault kind (any string; :data:`FAULT_KINDS` names the standard ones).
      label: a free label (e.g. ``"kv_flip_used#2"``).
      injected, inject_step: whether / at which step the fault was injected (the first step that ran with it).
      detected, detect_step, steps_to_detect: the first violation recorded at or after ``inject_step``; latency
        in steps (0 = the step the fault was injected before caught it).
      reasons: ``"TAG:reason"`` -> rows, over every violation after the injection.
      violations: rows recorded after the injection.
      false_positives: rows recorded before the injection (nothing was broken yet).
      details: what the injection said it broke.
      first_violation: the first record attributed to the fault.
    """

    kind: str
    label: str = ""
    injected: bool = False
    inject_step: int | None = None
    detected: bool = False
    detect_step: int | None = None
    steps_to_detect: int | None = None
    reasons: dict = dataclasses.field(default_factory=dict)
    violations: int = 0
    false_positives: int = 0
    details: dict = dataclasses.field(default_factory=dict)
    first_violation: ViolationRecord | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KindReport:
    """The campaign's row for one fault kind.

    Fields:
      kind: the fault kind; trials: episodes; injected / detected: how many.
      steps_to_detect: each detected episode's latency in steps; mean / max of them (None if none).
      fail_reasons: ``"TAG:reason"`` -> rows, summed over the kind's episodes.
    """

    kind: str
    trials: int
    injected: int
    detected: int
    steps_to_detect: tuple[int, ...]
    mean_steps_to_detect: float | None
    max_steps_to_detect: int | None
    fail_reasons: dict


def kind_report(kind: str, episodes: Sequence[Any]) -> KindReport:
    """Aggregates episodes (:class:`Episode`, or anything with ``injected``, ``detected``, ``steps_to_detect``
    and ``reasons``) of one kind."""
    lat = tuple(int(e.steps_to_detect) for e in episodes if e.steps_to_detect is not None)
    reasons: collections.Counter = collections.Counter()
    for e in episodes:
        reasons.update(e.reasons)
    return KindReport(
        kind=kind,
        trials=len(episodes),
        injected=sum(bool(e.injected) for e in episodes),
        detected=sum(bool(e.detected) for e in episodes),
        steps_to_detect=lat,
        mean_steps_to_detect=round(statistics.fmean(lat), 2) if lat else None,
        max_steps_to_detect=max(lat) if lat else None,
        fail_reasons=dict(sorted(reasons.items())),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignReport:
    """Detected per kind, steps to detection, false positives (what ``canary-jax demo`` prints).

    Fields:
      kinds: one :class:`KindReport` per kind, in first-injected order.
      false_positives: rows recorded while no fault was active (outside episodes, or before an episode's
        injection).
      false_positive_reasons: ``"TAG:reason"`` -> rows of those.
    """

    kinds: tuple[KindReport, ...]
    false_positives: int
    false_positive_reasons: dict

    @property
    def ok(self) -> bool:
        """Every injected fault detected and no false positive."""
        return self.false_positives == 0 and all(k.detected == k.injected for k in self.kinds)

    def lines(self) -> list[str]:
        """A plain-text table: kind, injected, detected, steps to detect, fail reasons; then the false
        positives."""
        head = ("fault kind", "injected", "detected", "steps to detect", "fail reasons")
        rows = [
            (
                k.kind,
                str(k.injected),
                str(k.detected),
                ",".join(str(x) for x in k.steps_to_detect) or "-",
                " ".join(k.fail_reasons) or "-",
            )
            for k in self.kinds
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [fmt(head)] + [fmt(r) for r in rows]
        out.append(f"false positives: {self.false_positives}")
        return out


class FaultCampaign:
    """Host-side bookkeeping of a fault campaign: episodes of one injected fault each, and the violations each
    step recorded.

    Usage::

        campaign = FaultCampaign()
        guard = CanaryGuard(step_fn, ..., mode="log", on_violations=campaign.observe)
        with campaign.episode("kv_flip_used"):
            ...                                             # clean steps: any violation is a false positive
            kv = flip_kv_bits(kv, slot)
            campaign.injected(step=guard.step_index, slot=slot)
            ...                                             # steps until the guard reports it
        print("\\n".join(campaign.report().lines()))

    Violations are attributed by the step that *recorded* them (:class:`~canary_jax.integration.CanaryGuard`
    reports them one step late, with that step): before the episode's injection step they are false positives,
    from it on the fault's detection.
    """

    def __init__(self) -> None:
        self.episodes: list[Episode] = []
        self.current: Episode | None = None
        self.false_positives = 0
        self.false_positive_reasons: collections.Counter = collections.Counter()

    def begin(self, kind: str, *, label: str = "") -> Episode:
        """Starts an episode for one fault of ``kind``.

        Raises:
          RuntimeError: an episode is still open (call :meth:`end` first).
        """
        if self.current is not None:
            raise RuntimeError(f"kv-canary: episode {self.current.label!r} is still open; end it first")
        self.current = Episode(kind=str(kind), label=label or str(kind))
        self.episodes.append(self.current)
        return self.current

    def injected(self, *, step: int, **details: Any) -> None:
        """Marks the open episode's fault as injected before step ``step`` (the first step that runs with it).

        Raises:
          RuntimeError: no open episode, or its fault was already injected.
        """
        ep = self.current
        if ep is None:
            raise RuntimeError("kv-canary: injected() outside an episode; call begin(kind) first")
        if ep.injected:
            raise RuntimeError(f"kv-canary: episode {ep.label!r} already injected its fault at step {ep.inject_step}")
        ep.injected, ep.inject_step, ep.details = True, int(step), dict(details)

    def observe(self, records: Sequence[ViolationRecord], *, step: int) -> None:
        """Attributes the violations recorded by step ``step`` (0-based; the guard's ``on_violations``)."""
        records = list(records)
        if not records:
            return
        ep = self.current
        if ep is None or not ep.injected or int(step) < ep.inject_step:
            if ep is None:
                self.false_positives += len(records)
            else:
                ep.false_positives += len(records)
            self.false_positive_reasons.update(reason_keys(records))
            return
        ep.violations += len(records)
        ep.reasons = dict(collections.Counter(ep.reasons) + reason_keys(records))
        if not ep.detected:
            ep.detected, ep.detect_step = True, int(step)
            ep.steps_to_detect = int(step) - ep.inject_step
            ep.first_violation = records[0]

    def end(self) -> Episode:
        """Closes the open episode and returns it.

        Raises:
          RuntimeError: no open episode.
        """
        if self.current is None:
            raise RuntimeError("kv-canary: end() without an open episode")
        ep, self.current = self.current, None
        return ep

    @contextlib.contextmanager
    def episode(self, kind: str, *, label: str = "") -> Iterator[Episode]:
        """``begin`` ... ``end`` as a context manager."""
        ep = self.begin(kind, label=label)
        try:
            yield ep
        finally:
            if self.current is ep:
                self.end()

    def report(self) -> CampaignReport:
        """Per kind (in first-seen order): injected, detected, steps to detect, fail reasons; false positives."""
        kinds: dict[str, list[Episode]] = {}
        for ep in self.episodes:
            kinds.setdefault(ep.kind, []).append(ep)
        return CampaignReport(
            kinds=tuple(kind_report(k, eps) for k, eps in kinds.items()),
            false_positives=self.false_positives + sum(ep.false_positives for ep in self.episodes),
            false_positive_reasons=dict(sorted(self.false_positive_reasons.items())),
        )
