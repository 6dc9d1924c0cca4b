"""Sweep plans: verify every slot a prefix cache (or the running requests) still holds (SPEC 9 "Sweep").

Per-forward HEAD/TAIL verify only the prefixes of the requests in the batch. A *sweep* periodically verifies
the slots of the radix (prefix) cache too, so corruption of cached-but-idle KV is caught before a later request
reuses it. SGLang walks the tree on the host (``radix_cache_walker.py``, ``sweep_plan_builder.py``):

* DFS from the root in child order; the root emits nothing; slot ``j`` of a node at depth ``d`` (tokens above
  it) gets position ``d + j`` and prev slot = the previous slot of the node, or the parent's last slot for
  ``j == 0`` (-1 at the top level). Node boundaries do not break the chain.
* SWA groups translate slot and prev through the LUT (negatives kept, evicted -> 0; a slot past the LUT
  clamps to the last entry, the canary-jax rule of :func:`canary_jax.planning.slot_tables.swa_translate`).
* The plan has ``num_valid = n``, ``enable = 1`` and expected tokens -1 (sweeps never check tokens).

Sweep plans are verified by the SWEEP endpoints (:func:`canary_jax.runtime.step.canary_sweep`), which read the TAIL
buffers. With a fixed ``verify_capacity`` the plan keeps one shape, so the sweep compiles once; more entries
than capacity raise SGLang's RuntimeError (sweeps run on the host, outside the jitted step).

:func:`build_sweep_plan_from_requests` covers running requests instead (their ``req_to_token`` rows), on
device and jit-able, through the plan builder (overflow -> ``enable = 0``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from canary_jax.contract import ints
from canary_jax.ops.plan_launch import build_plans
from canary_jax.planning.plans import VerifyPlan
from canary_jax.runtime import shapes
from canary_jax.runtime.groups import PoolKind

logger = logging.getLogger(__name__)

__all__ = [
    "RadixNode",
    "SweepEntries",
    "SweepSchedule",
    "build_sweep_plan_from_radix",
    "build_sweep_plan_from_requests",
    "sweep_entries_to_plan",
    "sweep_source_plans",
    "walk_radix_tree",
]

_SWEEP_PASS_LOG_EVERY = 100


@dataclasses.dataclass(eq=False)
class RadixNode:
    """A minimal radix-tree node (SGLang ``TreeNode``): the KV slots of its token run, and its children.

    Any object with ``value`` (slot sequence or None) and ``children`` (dict or sequence of nodes) works with
    :func:`walk_radix_tree`; ``lock_ref`` and ``swa_tombstone`` are read only by the optional filters.

    Fields:
      value: full-pool slot indices of this node's tokens, in order (the root usually has none).
      children: child nodes (a dict keyed like SGLang's, or a list), visited in iteration order.
      lock_ref: > 0 while a running request holds the node.
      swa_tombstone: True once the node's slots left the SWA window (SWA radix caches).
    """

    value: Sequence[int] | None = None
    children: Any = dataclasses.field(default_factory=list)
    lock_ref: int = 0
    swa_tombstone: bool = False

    def add(self, slots: Sequence[int], **kw) -> RadixNode:
        """Appends a child holding ``slots`` and returns it."""
        child = RadixNode(value=list(slots), **kw)
        if isinstance(self.children, dict):
            self.children[len(self.children)] = child
        else:
            self.children.append(child)
        return child


class SweepEntries(NamedTuple):
    """Flat sweep entries (int64 numpy arrays of one length n)."""

    slots: np.ndarray
    positions: np.ndarray
    prev_slots: np.ndarray


def _children(node: Any) -> list:
    ch = getattr(node, "children", None)
    if ch is None:
        return []
    if isinstance(ch, dict):
        return list(ch.values())
    return list(ch)


def _slots(node: Any) -> list[int]:
    v = getattr(node, "value", None)
    if v is None:
        return []
    return [int(s) for s in np.asarray(v).reshape(-1).tolist()]


def walk_radix_tree(root: Any, *, unlocked_only: bool = False, swa_resident_only: bool = False) -> SweepEntries:
    """Walks a radix tree like SGLang's ``walk_radix_cache_for_canary`` (pre-order DFS, child order).

    Args:
      root: the root node (emits nothing; its slots, if any, still count toward depth and chain).
      unlocked_only: skip nodes with ``lock_ref > 0`` (still walked through for depth and chain).
      swa_resident_only: skip nodes with ``swa_tombstone`` set.

    Returns:
      :class:`SweepEntries` with full-pool slots, positions and prev slots (-1 at the top level).
    """
    slots: list[int] = []
    positions: list[int] = []
    prevs: list[int] = []
    stack = [(root, 0, -1, True)]  # (node, depth, parent_last_slot, is_root); iterative: deep trees are fine
    while stack:
        node, depth, parent_last, is_root = stack.pop()
        node_slots = _slots(node)
        emit = not is_root
        if unlocked_only:
            emit = emit and int(getattr(node, "lock_ref", 0)) == 0
        if swa_resident_only:
            emit = emit and not bool(getattr(node, "swa_tombstone", False))
        last = parent_last
        for j, s in enumerate(node_slots):
            if emit:
                slots.append(s)
                positions.append(depth + j)
                prevs.append(parent_last if j == 0 else node_slots[j - 1])
            last = s
        child_depth = depth + len(node_slots)
        for child in reversed(_children(node)):
            stack.append((child, child_depth, last, False))
    as64 = lambda xs: np.asarray(xs, dtype=np.int64).reshape(-1)  # noqa: E731
    return SweepEntries(as64(slots), as64(positions), as64(prevs))


def _translate_host(x: np.ndarray, lut: np.ndarray) -> np.ndarray:
    n = lut.shape[0]
    idx = np.clip(x, 0, n - 1)
    return np.where(x < 0, x, lut[idx])


def sweep_entries_to_plan(
    entries: SweepEntries,
    *,
    verify_capacity: int | None = None,
    full_to_swa_index_mapping: Any = None,
) -> VerifyPlan:
    """Host-built sweep VerifyPlan from flat entries (SGLang ``fill_verify_plan_radix_sweep``).

    Args:
      entries: full-pool slots, positions and prev slots.
      verify_capacity: fixed plan length (keeps one compiled sweep), or None for ``max(1, n)`` as SGLang.
      full_to_swa_index_mapping: the group's LUT (any lossless int64 form) for SWA groups, or None.

    Returns:
      A VerifyPlan with ``num_valid = n``, ``enable = 1``, expected tokens -1.

    Raises:
      RuntimeError: more entries than ``verify_capacity`` (SGLang's message).
    """
    slots = np.asarray(entries.slots, np.int64).reshape(-1)
    prevs = np.asarray(entries.prev_slots, np.int64).reshape(-1)
    n = slots.shape[0]
    if full_to_swa_index_mapping is not None:
        lut = ints.pairs_to_int64_np(
            ints.as_int64_pairs(full_to_swa_index_mapping, name="full_to_swa_index_mapping", shape=(None,))
        )
        if lut.shape[0] < 1:
            raise ValueError("kv-canary: full_to_swa_index_mapping must not be empty")
        slots = _translate_host(slots, lut)
        prevs = _translate_host(prevs, lut)
    cap = max(1, n) if verify_capacity is None else int(verify_capacity)
    if cap <= 0:
        raise ValueError(f"kv-canary: VerifyPlan verify_capacity must be positive, got {cap}")
    if n > cap:
        raise RuntimeError(
            f"kv-canary: radix-walker emitted {n} sweep verify entries, exceeding pre-allocated "
            f"sweep_verify_capacity={cap}; raise the sweep capacity in CanaryLaunchCapacities.from_args"
        )
    return VerifyPlan.from_entries(slots=slots, positions=entries.positions, prev_slots=prevs, verify_capacity=cap)


def build_sweep_plan_from_radix(
    root: Any,
    *,
    verify_capacity: int | None = None,
    full_to_swa_index_mapping: Any = None,
    unlocked_only: bool = False,
    swa_resident_only: bool = False,
) -> VerifyPlan:
    """:func:`walk_radix_tree` then :func:`sweep_entries_to_plan` (host side; see both)."""
    entries = walk_radix_tree(root, unlocked_only=unlocked_only, swa_resident_only=swa_resident_only)
    return sweep_entries_to_plan(
        entries, verify_capacity=verify_capacity, full_to_swa_index_mapping=full_to_swa_index_mapping
    )


def build_sweep_plan_from_requests(
    *,
    req_to_token: Any,
    req_pool_indices: Any,
    seq_lens: Any,
    verify_capacity: int,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
) -> VerifyPlan:
    """Sweep VerifyPlan over running requests' written prefixes (device side, jit-able).

    For each row r (``req_pool_indices[r] == 0`` = padding, skipped): positions ``[ws, seq_lens[r])`` of
    ``req_to_token[rpi]`` with ``ws = max(0, seq_len - W)`` for SWA, prev = the real predecessor (-1 at
    position 0), LUT-translated when given. Exactly the verify half of
    :func:`canary_jax.planning.plan_builder.build_plans` with ``prefix_lens = seq_lens``; overflow -> ``enable = 0``.

    Args:
      req_to_token: ``int32[max_reqs, max_seq_len]``.
      req_pool_indices, seq_lens: int64-valued ``[bs]``.
      verify_capacity: C (static).
      swa_window_size, full_to_swa_index_mapping: as for :func:`~canary_jax.planning.plan_builder.build_plans`.
    """
    rpi = ints.as_int64_field(req_pool_indices, name="req_pool_indices", shape=(None,))  # traced int32: as it is
    bs = int(rpi.shape[0])
    vp, _ = build_plans(
        req_pool_indices=rpi,
        prefix_lens=seq_lens,
        extend_seq_lens=np.zeros((bs,), np.int32),
        req_to_token=req_to_token,
        verify_capacity=verify_capacity,
        write_req_capacity=max(1, bs),
        swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping,
    )
    return vp


class SweepSchedule:
    """When to sweep (SGLang ``SweepOrchestrator`` cadence): the first call with ``interval > 0`` sweeps, then
    whenever ``interval`` outer steps have passed since the last sweep. Counts passes and logs
    ``[canary] sweep succeeded %d times (last_step=%d)`` every 100 passes.

    Raises:
      ValueError: a negative interval.
    """

    def __init__(self, interval: int) -> None:
        if int(interval) < 0:
            raise ValueError(f"kv-canary: sweep_interval must be non-negative, got {interval}")
        self.interval = int(interval)
        self.sweep_passes = 0
        self._last_step = -1

    def due(self, step: int) -> bool:
        """True if a sweep should run at ``step`` (marks it as run)."""
        if self.interval == 0:
            return False
        if self._last_step >= 0 and step - self._last_step < self.interval:
            return False
        self._last_step = int(step)
        return True

    def mark_done(self, step: int) -> None:
        """Counts one completed sweep pass."""
        self.sweep_passes += 1
        if self.sweep_passes % _SWEEP_PASS_LOG_EVERY == 0:
            logger.info("[canary] sweep succeeded %d times (last_step=%d)", self.sweep_passes, int(step))


def sweep_source_plans(src: Any, groups: Sequence, luts: Sequence, *, capacity: int) -> tuple:
    """One sweep VerifyPlan (or None) per buffer group from what a guard's ``sweep_source`` returned.

    Args:
      src: a radix-tree root (anything :func:`walk_radix_tree` walks; SWA groups translate it through their LUT
        and skip SWA tombstones), :class:`SweepEntries`, a :class:`~canary_jax.planning.plans.VerifyPlan` (single group,
        padded to ``capacity``), a sequence with one of these (or None) per group, or None.
      groups: the state's :class:`~canary_jax.runtime.groups.CanaryBufferGroup` s.
      luts: each group's full-to-SWA LUT as host int64 (None for FULL groups).
      capacity: the sweep plans' entries (the guard's ``sweep_capacity``).

    Raises:
      ValueError: not one entry per group; a VerifyPlan for several groups or over ``capacity``.
      RuntimeError: radix or SweepEntries sources with more entries than ``capacity`` (SGLang's message).
      TypeError: anything else.
    """
    g = len(groups)
    cap = capacity
    if src is None:
        return (None,) * g
    per_group = tuple(src) if isinstance(src, (list, tuple)) and not isinstance(src, SweepEntries) else None
    if per_group is not None and len(per_group) != g:
        raise ValueError(f"kv-canary: sweep_source returned {len(per_group)} entries for {g} groups")
    out = []
    for i, grp in enumerate(groups):
        item = per_group[i] if per_group is not None else src
        lut = luts[i]
        if item is None:
            out.append(None)
        elif isinstance(item, VerifyPlan):
            if per_group is None and g > 1:
                raise ValueError("kv-canary: a VerifyPlan sweep source fits one group; return one per group")
            if item.verify_capacity > cap:
                raise ValueError(
                    f"kv-canary: the sweep plan has capacity {item.verify_capacity} but sweep_capacity is {cap}"
                )
            out.append(shapes.pad_verify_plan(item, cap))
        elif isinstance(item, SweepEntries):
            out.append(sweep_entries_to_plan(item, verify_capacity=cap, full_to_swa_index_mapping=lut))
        elif hasattr(item, "children"):
            out.append(
                build_sweep_plan_from_radix(
                    item,
                    verify_capacity=cap,
                    full_to_swa_index_mapping=lut,
                    swa_resident_only=grp.kind is PoolKind.SWA,
                )
            )
        else:
            raise TypeError(
                "kv-canary: sweep_source must return a radix root, SweepEntries, a VerifyPlan, one of these "
                f"per group, or None; got {type(item).__name__}"
            )
    return tuple(out)
