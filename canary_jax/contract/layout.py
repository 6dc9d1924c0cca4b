"""Canary buffer and violation log: allocation, in-jit views, and host-side decoding.

Layout (SPEC 1.1, 1.2; SGLang ``verify.py`` / ``state.py``):

* canary buffer: ``uint8[num_slots, slot_stride_bytes]``, ``slot_stride_bytes >= 32`` and a multiple of 8.
  Slot ``s`` starts at byte ``s * slot_stride_bytes``; its first 32 bytes are four little-endian int64
  fields ``[token, position, prev_hash, real_kv_hash]``; bytes 32.. are never touched.
* violation ring: SGLang's ``int64[R, 8]`` held as ``uint32[R, 8, 2]`` (same bytes), fill-once.
* write index: ``int32[1]``; per-tag counters: SGLang's ``int64[12]`` held as ``uint32[12, 2]``;
  chain-position assert flag: ``int32[1]``.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants, ints, pairs, validation


# --- canary buffer -----------------------------------------------------------------------------------------
def check_canary_buffer(canary_buf, *, name: str = "canary_buf") -> None:
    """:func:`canary_jax.contract.validation.check_canary_buffer` on a JAX / numpy array (works on tracers)."""
    validation.check_canary_buffer(validation.array_facts(canary_buf), name=name)


def allocate_canary_buffer(
    num_slots: int, slot_stride_bytes: int = constants.CANARY_SLOT_BYTES, *, device=None
) -> jax.Array:
    """Zero-initialised ``uint8[num_slots, slot_stride_bytes]`` canary buffer.

    Raises:
      ValueError: ``num_slots < 1`` or an invalid stride (see :func:`check_canary_buffer`).
    """
    num_slots = ints.check_int(num_slots, name="num_slots")
    slot_stride_bytes = ints.check_int(slot_stride_bytes, name="slot_stride_bytes")
    if num_slots < 1:
        raise ValueError(f"kv-canary: num_slots must be positive, got {num_slots}")
    check_canary_buffer(jax.ShapeDtypeStruct((num_slots, slot_stride_bytes), jnp.uint8))
    buf = jnp.zeros((num_slots, slot_stride_bytes), jnp.uint8)
    return jax.device_put(buf, device) if device is not None else buf


def canary_words(canary_buf: jax.Array) -> jax.Array:
    """``uint8[N, S]`` -> ``uint32[N, S // 4]`` (a bitcast inside ``jit``)."""
    n, s = canary_buf.shape
    return jax.lax.bitcast_convert_type(canary_buf.reshape(n, s // 4, 4), jnp.uint32)


def canary_bytes(words: jax.Array) -> jax.Array:
    """Inverse of :func:`canary_words`."""
    n, w = words.shape
    return jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(n, w * 4)


class SlotRecord(NamedTuple):
    """The four int64 fields of one canary slot, as Python ints (hashes signed, as SGLang stores them)."""

    token: int
    position: int
    prev_hash: int
    real_kv_hash: int


def read_slot(canary_buf, slot: int) -> SlotRecord:
    """Reads slot ``slot``'s four fields on the host (a device-to-host copy of one row)."""
    row = np.asarray(canary_buf[int(slot), : constants.CANARY_SLOT_BYTES]).astype(np.uint8)
    vals = row.view("<i8")
    return SlotRecord(*(int(v) for v in vals))


def read_all_slots(canary_buf) -> np.ndarray:
    """All slots' four fields as ``int64[num_slots, 4]`` (host copy of the whole buffer)."""
    arr = np.ascontiguousarray(np.asarray(canary_buf)[:, : constants.CANARY_SLOT_BYTES])
    return arr.view("<i8").reshape(arr.shape[0], 4).astype(np.int64)


# --- 64-bit counters as pairs ------------------------------------------------------------------------------
# --- violation log -----------------------------------------------------------------------------------------
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ViolationLog:
    """Device state shared by every launch of one canary manager (SGLang ``CanaryDeviceState``).

    Fields:
      ring: ``uint32[R, 8, 2]``: SGLang's ``int64[R, 8]`` violation ring, fill-once; row ``k`` is the
        ``k``-th violation ever recorded; rows past ``write_index`` are zeros. Columns (SPEC 1.2):
        kernel_kind, slot_idx, position, stored_token, expected_token, stored_chain_hash, expected_aux,
        fail_reason_bits; verify and write rows fill them differently (see
        :class:`~canary_jax.contract.decode.ViolationRecord`).
      write_index: ``int32[1]``: number of violations ever recorded (keeps growing past ``R``).
      slot_run_counters: ``uint32[num_tags, 2]``: per-tag int64 count of entries processed, indexed by
        ``CanaryLaunchTag`` value (as are the kernel counters).
      kernel_run_counters: ``uint32[num_tags, 2]``: per-tag int64 count of launches.
      enable_chain_position_assert: ``int32[1]``: write-kernel chain-position assert gate (1 = on).
      launch_ticket: ``int32[1]``, zero between launches, or None. Not SGLang state: the arrival counter of the
        Pallas backend's one-launch HEAD / TAIL (:mod:`pallas_kernels.phase`), whose last verify program to arrive
        writes the rows and runs the write, then zeroes it. A log without one (built from SGLang's tensors, say)
        runs a phase as separate verify and write launches, with the same bytes.
    """

    ring: jax.Array
    write_index: jax.Array
    slot_run_counters: jax.Array
    kernel_run_counters: jax.Array
    enable_chain_position_assert: jax.Array
    launch_ticket: jax.Array | None = None

    @classmethod
    def allocate(
        cls,
        *,
        ring_capacity: int = constants.DEFAULT_RING_CAPACITY,
        num_tags: int = constants.NUM_LAUNCH_TAGS,
        enable_chain_position_assert: bool = True,
    ) -> ViolationLog:
        """Zeroed ring, index, counters and launch ticket; the assert flag starts at 1 as in SGLang.

        Raises:
          ValueError: ``ring_capacity <= 0`` or ``num_tags <= 0`` (SGLang's messages).
        """
        ring_capacity = ints.check_int(ring_capacity, name="ViolationLog ring_capacity")
        num_tags = ints.check_int(num_tags, name="CanaryDeviceState num_tags")
        if int(ring_capacity) <= 0:
            raise ValueError(f"kv-canary: ViolationLog ring_capacity must be positive, got {ring_capacity}")
        if int(num_tags) <= 0:
            raise ValueError(f"kv-canary: CanaryDeviceState num_tags must be positive, got {num_tags}")
        return cls(
            ring=jnp.zeros((int(ring_capacity), constants.VIOLATION_FIELDS, 2), jnp.uint32),
            write_index=jnp.zeros((1,), jnp.int32),
            slot_run_counters=jnp.zeros((int(num_tags), 2), jnp.uint32),
            kernel_run_counters=jnp.zeros((int(num_tags), 2), jnp.uint32),
            enable_chain_position_assert=jnp.full((1,), 1 if enable_chain_position_assert else 0, jnp.int32),
            launch_ticket=jnp.zeros((1,), jnp.int32),
        )

    @property
    def ring_capacity(self) -> int:
        return int(self.ring.shape[0])

    def check(self) -> None:
        """Static dtype/shape checks (works on tracers).

        Raises:
          TypeError / ValueError naming the field.
        """
        names = validation.JAX_DTYPES
        fact = validation.array_facts
        validation.check_ring(fact(self.ring), names)
        validation.check_array(fact(self.write_index), "violation_write_index", "int32", (1,))
        validation.check_array(fact(self.slot_run_counters), "slot_run_counters", "uint32", (None, 2))
        validation.check_array(fact(self.kernel_run_counters), "kernel_run_counters", "uint32", (None, 2))
        validation.check_array(fact(self.enable_chain_position_assert), "enable_chain_position_assert", "int32", (1,))
        if self.launch_ticket is not None:
            validation.check_array(fact(self.launch_ticket), "launch_ticket", "int32", (1,))
        if self.slot_run_counters.shape != self.kernel_run_counters.shape:
            raise ValueError(
                f"kv-canary: slot_run_counters shape {self.slot_run_counters.shape} != kernel_run_counters shape "
                f"{self.kernel_run_counters.shape}"
            )

    # --- host-side readers (device-to-host copies; never call on the hot path) ---
    def num_violations(self) -> int:
        """``write_index[0]`` as a Python int."""
        return int(np.asarray(self.write_index)[0])

    def ring_rows(self) -> np.ndarray:
        """Recorded rows ``int64[min(write_index, R), 8]``."""
        n = max(0, min(self.num_violations(), self.ring_capacity))
        return ints.pairs_to_int64_np(np.asarray(self.ring))[:n]

    def slot_run_counter(self, tag: int) -> int:
        return int(ints.pairs_to_int64_np(np.asarray(self.slot_run_counters))[int(tag)])

    def kernel_run_counter(self, tag: int) -> int:
        return int(ints.pairs_to_int64_np(np.asarray(self.kernel_run_counters))[int(tag)])

    def counters(self) -> tuple[np.ndarray, np.ndarray]:
        """``(slot_run_counters, kernel_run_counters)`` as int64 numpy arrays."""
        return (
            ints.pairs_to_int64_np(np.asarray(self.slot_run_counters)),
            ints.pairs_to_int64_np(np.asarray(self.kernel_run_counters)),
        )


def append_violation_rows(log: ViolationLog, rows: jax.Array, record: jax.Array) -> ViolationLog:
    """Appends the flagged rows to the fill-once ring, in row order (SGLang's torch-reference order).

    Args:
      log: the violation log.
      rows: ``uint32[K, 8, 2]`` candidate rows.
      record: ``bool[K]``; row ``k`` is recorded iff ``record[k]``.

    Returns:
      The new log: recorded row ``j`` (0-based among flagged rows) lands at ring index
      ``write_index + j`` if that is below ``R``, else it is dropped; ``write_index += sum(record)``.
    """
    rec = record.astype(jnp.int32)
    rank = jnp.cumsum(rec) - rec  # exclusive prefix count
    base = log.write_index[0]
    dest = base + rank
    cap = log.ring.shape[0]
    keep = record & (dest >= 0) & (dest < cap)
    dest = jnp.where(keep, dest, cap)  # cap is out of bounds -> dropped
    ring = log.ring.at[dest].set(rows, mode="drop")
    write_index = log.write_index + jnp.sum(rec).astype(jnp.int32)
    return dataclasses.replace(log, ring=ring, write_index=write_index)


def bump_counters(log: ViolationLog, tag: int, slots: jax.Array) -> ViolationLog:
    """``kernel_run_counters[tag] += 1`` and ``slot_run_counters[tag] += slots`` (uint32 scalar)."""
    krc = log.kernel_run_counters.at[tag].set(_add_count(log.kernel_run_counters[tag], jnp.uint32(1)))
    src = log.slot_run_counters.at[tag].set(_add_count(log.slot_run_counters[tag], slots))
    return dataclasses.replace(log, kernel_run_counters=krc, slot_run_counters=src)


def _add_count(counter: jax.Array, delta: jax.Array) -> jax.Array:
    """An int64 counter ``uint32[2]`` plus a non-negative uint32 ``delta``, mod 2**64."""
    delta = jnp.asarray(delta).astype(jnp.uint32)
    return pairs.pack(pairs.add(pairs.unpack(counter), pairs.U64(delta, jnp.zeros_like(delta))))
