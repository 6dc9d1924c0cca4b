"""Real-KV source coverage: which slots a launch hashes, and whether every source holds them.

SGLang's launchers accept a real-KV source shorter than the canary buffer (``rows * page_size`` slots below the
buffer's ``num_slots``) and hash the source's bytes at each slot the launch writes or verifies; a slot past the
source's end is undefined there (CUDA reads past the tensor, the torch reference raises ``IndexError``). canary-jax
never reads outside a source, and a slot past it must not hash as zero bytes in silence. So (README, "Where
canary-jax departs from SGLang"):

* Where the launch's slots are known on the host (eager launches: :func:`canary_jax.verify` /
  :func:`canary_jax.write` outside ``jit``, the torch launchers outside a CUDA-graph capture, the step API's eager
  ``canary_tail`` / ``canary_sweep``), only a slot that the launch hashes past a source's coverage is refused, naming
  the slot, the entry, the source and its coverage (:func:`check_slots`). A shorter source is accepted otherwise,
  with SGLang's bytes. Reading the slots costs one device-to-host copy of the launch's slot arrays, paid only when a
  hashing source is short (a source covering the whole buffer needs no look at the slots).
* Where they are not (inside a caller's ``jit``, inside a CUDA-graph capture or replay, the sources a traced step
  function returns to ``canary_step`` / ``CanaryGuard``), every hashing source must cover the whole canary buffer
  (:func:`check_whole_buffer`), the rule of earlier releases: the kernels cannot refuse a slot, and a ring reason
  for it would be a row SGLang never writes.

A launch hashes a slot only when its real-KV hash mode is PARTIAL or ALL. Verify hashes the live entries
(``i < min(num_valid, C)``, ``enable != 0``) whose slot is neither 0 (skipped) nor outside ``[0, num_slots)``
(which reads as a zero record and expects hash 0 without reading a source). Write hashes the entries of live
request rows (``r < min(num_valid_reqs, Cw)``, entries ``[off[r], off[r+1])`` clamped to ``[0, T]``) whose slot is in
``[0, num_slots)``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np


class Coverage(NamedTuple):
    """The slots one hashing source holds: slots ``[0, slots)``, ``slots = rows * page_size``."""

    index: int  # the source's position in real_kv_sources
    slots: int
    rows: int  # rows (dim 0) that hold slots
    page_size: int

    def describe(self) -> str:
        return (
            f"real_kv_sources[{self.index}] covers {self.slots} slots ({self.rows} rows x page_size {self.page_size})"
        )


def coverage(index: int, *, rows: int, page_size: int) -> Coverage:
    """The :class:`Coverage` of source ``index`` holding ``rows`` rows of ``page_size`` slots."""
    return Coverage(int(index), int(rows) * int(page_size), int(rows), int(page_size))


def short(coverages: Sequence[Coverage], num_slots: int) -> tuple[Coverage, ...]:
    """The sources among ``coverages`` that hold fewer than ``num_slots`` slots (empty: nothing to check)."""
    return tuple(c for c in coverages if c.slots < int(num_slots))


def check_whole_buffer(coverages: Sequence[Coverage], num_slots: int, *, why: str | None = None) -> None:
    """Every source covers every slot of the canary buffer (the rule where slots are not known on the host).

    Raises:
      ValueError: ``kv-canary: real_kv_sources[{i}] covers {n} slots ({rows} rows x page_size {p}) but canary_buf
        has {num_slots} slots``, then ``; {why}`` when given.
    """
    for c in short(coverages, num_slots):
        tail = f"; {why}" if why else ""
        raise ValueError(f"kv-canary: {c.describe()} but canary_buf has {int(num_slots)} slots{tail}")


def check_slots(coverages: Sequence[Coverage], entries: np.ndarray, slots: np.ndarray, *, op: str, name: str) -> None:
    """Every hashed slot lies inside every source (:func:`verify_hashed` / :func:`write_hashed` give them).

    Args:
      coverages: the launch's hashing sources.
      entries, slots: ``int64[K]``: the entries (positions in ``name``) the launch hashes and their slots.
      op: ``"verify"`` / ``"write"``, for the message.
      name: the array the slots come from (``plan.verify_slot_indices``, ``out_cache_loc``).

    Raises:
      ValueError: ``kv-canary: {op} hashes slot {s} ({name}[{i}]) but real_kv_sources[{j}] covers {n} slots ({rows}
        rows x page_size {p})``, for the first such entry and the first source that lacks it.
    """
    for c in coverages:
        past = np.nonzero(slots >= c.slots)[0]
        if past.size:
            k = int(past[0])
            raise ValueError(
                f"kv-canary: {op} hashes slot {int(slots[k])} ({name}[{int(entries[k])}]) but {c.describe()}"
            )


def verify_hashed(slot_indices: np.ndarray, num_valid: int, enable: int, num_slots: int) -> tuple[np.ndarray, ...]:
    """``(entries, slots)`` a verify launch hashes (module docstring), from host ``int64[C]`` slot indices."""
    if int(enable) == 0:
        return np.zeros((0,), np.int64), np.zeros((0,), np.int64)
    n = min(max(int(num_valid), 0), slot_indices.shape[0])
    live = np.asarray(slot_indices[:n], np.int64)
    keep = np.nonzero((live > 0) & (live < int(num_slots)))[0]
    return keep.astype(np.int64), live[keep]


def write_hashed(
    offsets: np.ndarray, num_valid_reqs: int, out_cache_loc: np.ndarray, num_slots: int
) -> tuple[np.ndarray, ...]:
    """``(entries, slots)`` a write launch hashes (module docstring), from host ``int64`` offsets
    (``[Cw + 1]``) and ``out_cache_loc`` (``[T]``)."""
    t = out_cache_loc.shape[0]
    rows = min(max(int(num_valid_reqs), 0), offsets.shape[0] - 1)
    off = np.clip(np.asarray(offsets, np.int64), 0, t)
    live = np.zeros((t,), bool)
    for r in range(rows):
        live[off[r] : off[r + 1]] = True
    loc = np.asarray(out_cache_loc, np.int64)
    keep = np.nonzero(live & (loc >= 0) & (loc < int(num_slots)))[0]
    return keep.astype(np.int64), loc[keep]


TRACED = (
    "inside jit (or a CUDA-graph capture) the launch's slots are not known on the host, so every hashing source "
    "must cover the canary buffer (canary-jax's rule; outside jit only the slots a launch hashes must be covered)"
)
"""Why the whole-buffer rule applies, appended to its message."""


# --- the step API's eager programs ----------------------------------------------------------------------------
_STATE = threading.local()


@contextlib.contextmanager
def checked_on_host(checked: bool = True) -> Iterator[None]:
    """While tracing a program whose caller checked the launch's hashed slots on the host (:func:`check_slots`),
    the launches inside it skip the whole-buffer rule. The caller must make ``checked`` a static argument of its
    ``jit`` (so a program traced this way is never reused for a call that was not checked)."""
    before = getattr(_STATE, "checked", False)
    _STATE.checked = bool(checked)
    try:
        yield
    finally:
        _STATE.checked = before


def host_checked() -> bool:
    """Whether the program being traced had its hashed slots checked on the host (:func:`checked_on_host`)."""
    return getattr(_STATE, "checked", False)
