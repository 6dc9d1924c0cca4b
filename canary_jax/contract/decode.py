"""Violation ring rows to records and SGLang's report text (SPEC 9; SGLang ``violation_reporter.py``).

* :class:`ViolationRecord`, :func:`decode_violations`: ring rows (SGLang's ``int64[R, 8]``, or canary-jax's
  ``uint32[R, 8, 2]``) as records.
* :func:`format_violation`, :func:`format_violations`: SGLang's frozen report text, byte for byte.
* canary-jax additions, printed only as extra lines after SGLang's text, never inside it:
  :class:`CollapsedViolation` / :func:`collapse_violations` / :func:`format_repeat` (one record per distinct
  row with a count: the same fault seen again by later steps), and :class:`ViolationDetail` /
  :func:`format_detail` (what a ring row does not carry: the expected position of a verify row, the stored
  and the recomputed real-KV hash of its slot, where ``req_to_token`` maps the slot).

Host-side only: these read device arrays back (a device-to-host copy) and must stay off the hot path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from canary_jax.contract import constants, ints

_WRITE_BITS = int(constants.FailReason.WRITE_TOKEN_MISMATCH | constants.FailReason.WRITE_POSITION_MISMATCH)
_TOKEN_BITS = int(constants.FailReason.WRITE_TOKEN_MISMATCH | constants.FailReason.VERIFY_TOKEN_MISMATCH)


def reason_label(flag: constants.FailReason) -> str:
    """``VERIFY_CHAIN_HASH_MISMATCH`` -> ``verify_chain_hash`` (member name, lower case, minus ``_mismatch``)."""
    name = flag.name.lower()
    return name[: -len("_mismatch")] if name.endswith("_mismatch") else name


def reason_labels(bits: int) -> list[str]:
    """Labels of the set bits, in bit order; bits outside FailReason add ``unknown(0x...)`` (SGLang's
    reporter would drop them silently, which would hide a corrupted ring row)."""
    bits = int(bits)
    labels = [reason_label(f) for f in constants.FailReason if bits & int(f)]
    rest = (bits & constants.U64_MASK) & ~constants.FAIL_REASON_ALL_BITS
    if rest:
        labels.append(f"unknown({rest:#x})")
    return labels


def tag_label(kernel_kind: int) -> str:
    """Tag name, or ``unknown(n)`` for a value outside CanaryLaunchTag."""
    try:
        return constants.CanaryLaunchTag(int(kernel_kind)).name
    except ValueError:
        return f"unknown({int(kernel_kind)})"


def canary_kind_label(kernel_kind: int) -> str:
    """``per_forward_<tag lower>`` for HEAD/TAIL tags, ``sweep_*`` for sweep tags, else the tag label."""
    try:
        tag = constants.CanaryLaunchTag(int(kernel_kind))
    except ValueError:
        return tag_label(kernel_kind)
    return tag.name.lower() if tag.is_sweep else f"per_forward_{tag.name.lower()}"


@dataclasses.dataclass(frozen=True, slots=True)
class ViolationRecord:
    """One ring row, decoded (SPEC 1.2). Integer fields are signed int64 as stored; hashes print as uint64.

    Column meanings differ between the kernels:

    * verify rows: ``position`` is the *stored* position, ``stored_token`` the stored token,
      ``expected_token`` the plan's expected token or -1, ``stored_chain_hash`` the stored prev_hash,
      ``expected_aux`` the expected chain hash.
    * write rows (bits 8 / 16): ``position`` and ``stored_token`` are the *actual* inputs,
      ``stored_chain_hash`` the running prev_hash stored for the slot, and ``expected_aux`` the expected
      position (input assert: the expected input position; chain-position row: previous position + 1).
    """

    index: int
    kernel_kind: int
    slot_idx: int
    position: int
    stored_token: int
    expected_token: int
    stored_chain_hash: int
    expected_aux: int
    fail_reason_bits: int

    @property
    def tag(self) -> str:
        return tag_label(self.kernel_kind)

    @property
    def reasons(self) -> list[str]:
        return reason_labels(self.fail_reason_bits)

    @property
    def is_write(self) -> bool:
        """Rows of the write kernel carry write bits (8 / 16)."""
        return bool(self.fail_reason_bits & _WRITE_BITS)

    @property
    def key(self) -> tuple[int, ...]:
        """The row's 8 ring columns (``index`` left out): two reports of one fault have equal keys."""
        return (
            self.kernel_kind,
            self.slot_idx,
            self.position,
            self.stored_token,
            self.expected_token,
            self.stored_chain_hash,
            self.expected_aux,
            self.fail_reason_bits,
        )

    @classmethod
    def from_row(cls, index: int, row: Sequence[int]) -> ViolationRecord:
        return cls(index, *(int(v) for v in row))

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["tag"] = self.tag
        d["reasons"] = self.reasons
        return d


def ring_and_index(log_or_ring: Any, write_index: Any | None = None) -> tuple[np.ndarray, int]:
    """``(ring int64[R, 8], write_index)`` on the host from a ViolationLog, or from a bare ring and its index.

    Raises:
      TypeError / ValueError: as :func:`decode_violations`.
    """
    if write_index is None:
        if not (hasattr(log_or_ring, "ring") and hasattr(log_or_ring, "write_index")):
            raise TypeError("kv-canary: pass write_index together with a bare violation ring (or pass a ViolationLog)")
        ring, wi = log_or_ring.ring, log_or_ring.write_index
    else:
        ring, wi = log_or_ring, write_index
    ring = np.asarray(ring)
    if ring.ndim == 3:
        ring = ints.pairs_to_int64_np(ring)
    elif ring.ndim != 2 or ring.shape[1] != constants.VIOLATION_FIELDS or ring.dtype != np.int64:
        raise ValueError(
            "kv-canary: violation ring must be int64[R, 8] or uint32[R, 8, 2], "
            f"got shape {ring.shape} dtype {ring.dtype}"
        )
    wi_arr = np.asarray(wi).reshape(-1)
    if wi_arr.size != 1:
        raise ValueError(f"kv-canary: violation_write_index must hold one value, got shape {np.shape(wi)}")
    return ring, int(wi_arr[0])


def recorded_rows(write_index: int, ring_capacity: int) -> int:
    """Rows of the ring that hold violations: ``min(write_index, R)``. The index is SGLang's int32 counter;
    a negative value means it wrapped past 2**31 - 1 violations, so the ring is full."""
    return ring_capacity if write_index < 0 else min(write_index, ring_capacity)


def decode_violations(log_or_ring: Any, write_index: Any | None = None, *, start: int = 0) -> list[ViolationRecord]:
    """Decodes recorded rows ``[start, min(write_index, R))``.

    Args:
      log_or_ring: a :class:`~canary_jax.contract.layout.ViolationLog`, or a ring as ``int64[R, 8]`` (numpy, e.g. saved
        from SGLang) or ``uint32[R, 8, 2]``; then ``write_index`` must be given.
      write_index: ``int32[1]`` (or an int) when a bare ring is passed.
      start: first row to decode (SGLang's ``last_logged`` cursor).

    Raises:
      TypeError: a bare ring without ``write_index``, or a ring that is not 32-bit pairs / int64.
      ValueError: a ring of the wrong shape, or a ``write_index`` that is not one value.
    """
    ring, wi = ring_and_index(log_or_ring, write_index)
    n = recorded_rows(wi, ring.shape[0])
    return [ViolationRecord.from_row(i, ring[i]) for i in range(max(0, start), n)]


def format_violation(record: ViolationRecord, *, total: int, ring_overflow: bool, step_when_pumped: int) -> str:
    """SGLang's multi-line violation text (first line is the frozen key=value summary)."""
    mask = constants.U64_MASK
    reasons = record.reasons
    label = record.tag
    structured = (
        f"kv_canary violation: launch_tag={label} "
        f"fail_reason={'+'.join(reasons) if reasons else 'none'} "
        f"slot_idx={record.slot_idx} position={record.position} "
        f"stored_token={record.stored_token} expected_token={record.expected_token} "
        f"stored_chain_hash={record.stored_chain_hash & mask:#018x} "
        f"expected_aux={record.expected_aux & mask:#018x}"
    )
    header = (
        f"KV cache canary violation detected (kernel_kind={label}, slot_idx={record.slot_idx}, "
        f"position={record.position})"
    )
    kind_line = f"canary_kind:       {canary_kind_label(record.kernel_kind)}"
    reasons_line = f"  fail_reasons: {' '.join(reasons) if reasons else 'none'}"
    if record.is_write:
        body = [
            f"  actual:   token_id={record.stored_token}   position={record.position} "
            f"prev_hash={record.stored_chain_hash & mask:#018x}",
            f"  expected: token_id={record.expected_token}   position={record.expected_aux}",
        ]
    else:
        exp = record.expected_aux & mask
        body = [
            f"  stored:   token_id={record.stored_token}   position={record.position} "
            f"prev_hash={record.stored_chain_hash & mask:#018x}",
            f"  expected: token_id={record.expected_token} prev_hash={exp:#018x}"
            if record.fail_reason_bits & _TOKEN_BITS
            else f"  expected: prev_hash={exp:#018x}",
        ]
    footer = f"  total_violations={total} ring_overflow={ring_overflow} step_when_pumped={step_when_pumped}"
    return "\n".join([structured, header, kind_line, reasons_line, *body, footer])


def format_violations(
    log_or_ring: Any, write_index: Any | None = None, *, start: int = 0, step_when_pumped: int = 0
) -> list[str]:
    """One formatted message per recorded row from ``start`` (what SGLang's reporter logs or raises)."""
    ring, wi = ring_and_index(log_or_ring, write_index)
    overflow = wi > ring.shape[0] or wi < 0
    return [
        format_violation(r, total=wi, ring_overflow=overflow, step_when_pumped=step_when_pumped)
        for r in decode_violations(ring, np.array([wi]), start=start)
    ]


# --- canary-jax additions: collapsed repeats and debugging details (extra lines, after SGLang's text) ---------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CollapsedViolation:
    """One distinct ring row and how often it was reported.

    Fields:
      record: the first occurrence.
      count: occurrences (>= 1).
      first, last: the first and last step it was reported at (:class:`~canary_jax.runtime.report.ViolationReporter`),
        or ring row indices (:func:`collapse_violations` without ``steps``).
    """

    record: ViolationRecord
    count: int
    first: int
    last: int


def collapse_violations(
    records: Sequence[ViolationRecord], *, steps: Sequence[int] | None = None
) -> list[CollapsedViolation]:
    """Groups records with equal :attr:`ViolationRecord.key` (all 8 columns), in first-seen order.

    Args:
      records: decoded rows.
      steps: the step of each record (same length), or None to use each record's ring row index.

    Raises:
      ValueError: ``steps`` of another length than ``records``.
    """
    if steps is not None and len(steps) != len(records):
        raise ValueError(f"kv-canary: steps has {len(steps)} entries for {len(records)} records")
    out: dict[tuple[int, ...], CollapsedViolation] = {}
    for i, r in enumerate(records):
        at = int(steps[i]) if steps is not None else r.index
        c = out.get(r.key)
        out[r.key] = (
            CollapsedViolation(record=r, count=1, first=at, last=at)
            if c is None
            else dataclasses.replace(c, count=c.count + 1, last=at)
        )
    return list(out.values())


def format_repeat(c: CollapsedViolation, *, unit: str = "step") -> str:
    """``kv_canary violation repeated: launch_tag=T fail_reason=R slot_idx=S position=P count=N first_<unit>=A
    last_<unit>=B`` (canary-jax's line; SGLang logs every repeat in full)."""
    r = c.record
    return (
        f"kv_canary violation repeated: launch_tag={r.tag} fail_reason={'+'.join(r.reasons) or 'none'} "
        f"slot_idx={r.slot_idx} position={r.position} count={c.count} first_{unit}={c.first} last_{unit}={c.last}"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ViolationDetail:
    """What a debugger needs that SGLang's 8-column row does not carry (each field None / empty when unknown).

    Fields:
      expected_position: the position the failing verify entry expected (the row holds the *stored* one).
      stored_real_kv_hash: the slot's stored real-KV fingerprint (signed int64, as stored).
      recomputed_real_kv_hash: the fingerprint of the slot's KV bytes as dumped (signed int64).
      mapped_at: ``(req_pool_index, position)`` pairs where ``req_to_token`` maps the slot (live requests).
    """

    expected_position: int | None = None
    stored_real_kv_hash: int | None = None
    recomputed_real_kv_hash: int | None = None
    mapped_at: tuple[tuple[int, int], ...] = ()

    @property
    def empty(self) -> bool:
        return self.expected_position is None and self.stored_real_kv_hash is None and not self.mapped_at


def format_detail(detail: ViolationDetail) -> str:
    """The extra line printed after SGLang's text: ``  detail:   expected_position=P stored_real_kv_hash=0x...
    recomputed_real_kv_hash=0x... req_to_token=[(rpi, pos), ...]`` (only the known parts; "" if none)."""
    mask = constants.U64_MASK
    parts = []
    if detail.expected_position is not None:
        parts.append(f"expected_position={detail.expected_position}")
    if detail.stored_real_kv_hash is not None:
        parts.append(f"stored_real_kv_hash={detail.stored_real_kv_hash & mask:#018x}")
    if detail.recomputed_real_kv_hash is not None:
        parts.append(f"recomputed_real_kv_hash={detail.recomputed_real_kv_hash & mask:#018x}")
    if detail.mapped_at:
        parts.append("req_to_token=[" + ", ".join(f"({r}, {p})" for r, p in detail.mapped_at) + "]")
    return ("  detail:   " + " ".join(parts)) if parts else ""
