"""SGLang's kv-canary launch objects on torch tensors (SPEC 3, 4, 9): the dataclasses of
``python/sglang/kernels/ops/kv_canary/verify.py`` / ``write.py`` and ``CanaryDeviceState``.

Field names, shapes, dtypes, allocations and messages are SGLang's. :mod:`interop.sglang` re-exports all of
them next to the launchers; the launchers accept any object with these attribute names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from canary_jax.contract import constants, validation
from interop import arguments

CanaryLaunchTag = constants.CanaryLaunchTag
RealKvHashMode = constants.RealKvHashMode
FailReason = constants.FailReason
MAX_REAL_KV_SOURCES = constants.MAX_REAL_KV_SOURCES
CANARY_SLOT_BYTES = constants.CANARY_SLOT_BYTES

__all__ = [
    "CANARY_SLOT_BYTES",
    "CanaryDeviceState",
    "CanaryLaunchTag",
    "FailReason",
    "MAX_REAL_KV_SOURCES",
    "RealKvHashMode",
    "RealKvSource",
    "VerifyOrWriteContext",
    "VerifyPlan",
    "WritePlan",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RealKvSource:
    """One piece of real KV folded into the fingerprint (SGLang ``RealKvSource``; SPEC 3).

    Fields:
      tensor: torch tensor, any dtype, at least 2-D; a *view* of the live pool (never a copy). Slot ``idx``
        owns ``tensor.view(uint8)[idx // page_size, (idx % page_size) * num_bytes_per_token :][:nbpt]``.
      page_size: slots per row of dim 0, ``>= 1``.
      num_bytes_per_token: bytes per slot, a positive multiple of 16.
      read_bytes: leading bytes hashed in ALL mode, a positive multiple of 16, ``<= num_bytes_per_token``.

    Raises (``__post_init__``): SGLang's ValueErrors (page_size, num_bytes_per_token, read_bytes, rank, row
    stride), in SGLang's order.
    """

    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        validation.check_source_fields(
            page_size=int(self.page_size),
            num_bytes_per_token=int(self.num_bytes_per_token),
            read_bytes=int(self.read_bytes),
            tensor=arguments.facts(self.tensor),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOrWriteContext:
    """SGLang's shared verify/write launch context (SPEC 4.1).

    Fields:
      canary_buf: ``uint8 [num_slots, slot_stride_bytes]``, contiguous, stride >= 32.
      kernel_kind: ``CanaryLaunchTag`` stamped into column 0.
      violation_ring: ``int64 [ring_capacity, 8]`` fill-once sink.
      violation_write_index: ``int32 [1]``.
      slot_run_counter / kernel_run_counter: ``int64 [1]`` (usually ``counters[tag : tag + 1]`` views).
      real_kv_sources: tuple of 0..4 :class:`RealKvSource`.
      real_kv_hash_mode: ``RealKvHashMode``.
      enable_chain_position_assert: ``int32 [1]`` device flag (write only).
    """

    canary_buf: torch.Tensor
    kernel_kind: CanaryLaunchTag
    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counter: torch.Tensor
    kernel_run_counter: torch.Tensor
    real_kv_sources: tuple = ()
    real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE
    enable_chain_position_assert: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyPlan:
    """SGLang's ``VerifyPlan`` (SPEC 4.2): four ``int64 [C]`` arrays, ``verify_num_valid`` / ``enable``
    ``int32 [1]``. Entries past ``num_valid`` are unspecified and never read."""

    verify_slot_indices: torch.Tensor
    verify_expected_tokens: torch.Tensor
    verify_expected_positions: torch.Tensor
    verify_prev_slot_indices: torch.Tensor
    verify_num_valid: torch.Tensor
    enable: torch.Tensor

    @staticmethod
    def allocation_bytes(verify_capacity: int) -> int:
        return 4 * int(verify_capacity) * 8 + 2 * 4

    @classmethod
    def allocate(cls, *, verify_capacity: int, device: Any = "cpu") -> VerifyPlan:
        """``empty`` entries and ``num_valid``, ``enable = ones`` (SGLang's allocation).

        Raises:
          ValueError: ``verify_capacity <= 0`` (SGLang's message).
        """
        if verify_capacity <= 0:
            raise ValueError(f"kv-canary: VerifyPlan verify_capacity must be positive, got {verify_capacity}")
        e = lambda: torch.empty(verify_capacity, dtype=torch.int64, device=device)  # noqa: E731
        return cls(
            verify_slot_indices=e(),
            verify_expected_tokens=e(),
            verify_expected_positions=e(),
            verify_prev_slot_indices=e(),
            verify_num_valid=torch.empty(1, dtype=torch.int32, device=device),
            enable=torch.ones(1, dtype=torch.int32, device=device),
        )

    def zero_for_testing_(self) -> VerifyPlan:
        """SGLang's test helper: zero everything, expected tokens = -1."""
        self.verify_slot_indices.zero_()
        self.verify_expected_tokens.fill_(-1)
        self.verify_expected_positions.zero_()
        self.verify_prev_slot_indices.zero_()
        self.verify_num_valid.zero_()
        self.enable.zero_()
        return self


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WritePlan:
    """SGLang's ``WritePlan`` (SPEC 4.3): ``write_offsets int64 [Cw + 1]``, ``write_seed_slot_indices
    int64 [Cw]``, ``write_num_valid_reqs int32 [1]``."""

    write_offsets: torch.Tensor
    write_seed_slot_indices: torch.Tensor
    write_num_valid_reqs: torch.Tensor

    @staticmethod
    def allocation_bytes(write_req_capacity: int) -> int:
        return (2 * int(write_req_capacity) + 1) * 8 + 4

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device: Any = "cpu") -> WritePlan:
        """``empty`` tensors (SGLang's allocation).

        Raises:
          ValueError: ``write_req_capacity <= 0`` (SGLang's message).
        """
        if write_req_capacity <= 0:
            raise ValueError(f"kv-canary: WritePlan write_req_capacity must be positive, got {write_req_capacity}")
        return cls(
            write_offsets=torch.empty(write_req_capacity + 1, dtype=torch.int64, device=device),
            write_seed_slot_indices=torch.empty(write_req_capacity, dtype=torch.int64, device=device),
            write_num_valid_reqs=torch.empty(1, dtype=torch.int32, device=device),
        )

    def zero_for_testing_(self) -> WritePlan:
        self.write_offsets.zero_()
        self.write_seed_slot_indices.zero_()
        self.write_num_valid_reqs.zero_()
        return self


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryDeviceState:
    """Shared device state of one canary manager (SGLang ``CanaryDeviceState``, SPEC 9): ring, write index,
    per-tag counters and the chain-position assert flag, plus :meth:`context` to build launch contexts."""

    violation_ring: torch.Tensor
    violation_write_index: torch.Tensor
    slot_run_counters: torch.Tensor
    kernel_run_counters: torch.Tensor
    enable_chain_position_assert: torch.Tensor

    @classmethod
    def allocate(
        cls,
        *,
        ring_capacity: int = constants.DEFAULT_RING_CAPACITY,
        num_tags: int = constants.NUM_LAUNCH_TAGS,
        device: Any = "cpu",
    ) -> CanaryDeviceState:
        """Zeroed ring ``int64 [R, 8]``, index ``int32 [1]``, counters ``int64 [num_tags]``; flag = 1.

        Raises:
          ValueError: non-positive ``ring_capacity`` / ``num_tags`` (SGLang's messages).
        """
        if ring_capacity <= 0:
            raise ValueError(f"kv-canary: ViolationLog ring_capacity must be positive, got {ring_capacity}")
        if num_tags <= 0:
            raise ValueError(f"kv-canary: CanaryDeviceState num_tags must be positive, got {num_tags}")
        return cls(
            violation_ring=torch.zeros(ring_capacity, constants.VIOLATION_FIELDS, dtype=torch.int64, device=device),
            violation_write_index=torch.zeros(1, dtype=torch.int32, device=device),
            slot_run_counters=torch.zeros(num_tags, dtype=torch.int64, device=device),
            kernel_run_counters=torch.zeros(num_tags, dtype=torch.int64, device=device),
            enable_chain_position_assert=torch.ones(1, dtype=torch.int32, device=device),
        )

    def context(
        self,
        *,
        canary_buf: torch.Tensor,
        kernel_kind: CanaryLaunchTag,
        real_kv_sources: tuple = (),
        real_kv_hash_mode: RealKvHashMode = RealKvHashMode.NONE,
    ) -> VerifyOrWriteContext:
        """A launch context whose counters are ``counters[tag : tag + 1]`` views, as SGLang's endpoints build."""
        tag = int(kernel_kind)
        return VerifyOrWriteContext(
            canary_buf=canary_buf,
            kernel_kind=CanaryLaunchTag(tag),
            violation_ring=self.violation_ring,
            violation_write_index=self.violation_write_index,
            slot_run_counter=self.slot_run_counters[tag : tag + 1],
            kernel_run_counter=self.kernel_run_counters[tag : tag + 1],
            real_kv_sources=tuple(real_kv_sources),
            real_kv_hash_mode=RealKvHashMode(int(real_kv_hash_mode)),
            enable_chain_position_assert=self.enable_chain_position_assert,
        )
