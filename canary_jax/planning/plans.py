"""Launch objects: VerifyPlan, WritePlan and the verify/write launch context (SPEC section 4).

All three are frozen dataclasses registered as pytrees, so they cross ``jit``. SGLang's int64 arrays are held
as ``uint32[..., 2]`` little-endian pairs (see :mod:`canary_jax.contract.ints`), which keeps the bytes identical with
``jax_enable_x64`` off and on. Capacities are fixed at allocation; ``*_num_valid`` says how much is live, and
entries past it are unspecified and never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants, ints, layout, sources, validation


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyPlan:
    """Flat verify entries (SGLang ``VerifyPlan``).

    Fields (C = verify_capacity):
      verify_slot_indices: ``uint32[C, 2]`` (int64): slot to check, already SWA-translated; 0 = skipped.
      verify_expected_tokens: ``uint32[C, 2]`` (int64): expected token, -1 = skip the token check.
      verify_expected_positions: ``uint32[C, 2]`` (int64): expected position.
      verify_prev_slot_indices: ``uint32[C, 2]`` (int64): predecessor slot; negative = chain head (anchor);
        0 = unreachable (chain check skipped).
      verify_num_valid: ``int32[1]``: live prefix length (clamped to C by the kernels).
      enable: ``int32[1]``: 1 run, 0 skip the whole launch (plan overflow).
    """

    verify_slot_indices: jax.Array
    verify_expected_tokens: jax.Array
    verify_expected_positions: jax.Array
    verify_prev_slot_indices: jax.Array
    verify_num_valid: jax.Array
    enable: jax.Array

    @staticmethod
    def allocation_bytes(verify_capacity: int) -> int:
        """SGLang's byte count: ``4 * C * 8 + 2 * 4``."""
        return 4 * int(verify_capacity) * 8 + 2 * 4

    @classmethod
    def allocate(cls, *, verify_capacity: int) -> VerifyPlan:
        """Zeroed entries, ``num_valid = 0``, ``enable = 1`` (SGLang allocates enable as ones).

        Raises:
          ValueError: ``verify_capacity <= 0`` (SGLang's message).
        """
        c = ints.check_int(verify_capacity, name="VerifyPlan verify_capacity")
        if c <= 0:
            raise ValueError(f"kv-canary: VerifyPlan verify_capacity must be positive, got {verify_capacity}")
        z = jnp.zeros((c, 2), jnp.uint32)
        return cls(
            verify_slot_indices=z,
            verify_expected_tokens=z,
            verify_expected_positions=z,
            verify_prev_slot_indices=z,
            verify_num_valid=jnp.zeros((1,), jnp.int32),
            enable=jnp.ones((1,), jnp.int32),
        )

    @classmethod
    def from_entries(
        cls,
        *,
        slots: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        prev_slots: Sequence[int] | np.ndarray,
        expected_tokens: Sequence[int] | np.ndarray | None = None,
        verify_capacity: int | None = None,
        enable: int = 1,
        num_valid: int | None = None,
    ) -> VerifyPlan:
        """Builds a plan on the host from int64 entry lists (tests, sweeps, tools).

        Args:
          slots, positions, prev_slots: int64 sequences of equal length n.
          expected_tokens: int64 sequence of length n, or None for all -1.
          verify_capacity: C >= n (default n, at least 1); the tail is zero-filled.
          enable: the enable flag.
          num_valid: defaults to n.

        Raises:
          ValueError: mismatched lengths or n > C.
        """
        slots = ints.exact_int64_np(slots, name="slots").reshape(-1)
        n = slots.shape[0]
        positions = ints.exact_int64_np(positions, name="positions").reshape(-1)
        prev_slots = ints.exact_int64_np(prev_slots, name="prev_slots").reshape(-1)
        tokens = (
            np.full((n,), -1, np.int64)
            if expected_tokens is None
            else ints.exact_int64_np(expected_tokens, name="expected_tokens").reshape(-1)
        )
        for name, a in (("positions", positions), ("prev_slots", prev_slots), ("expected_tokens", tokens)):
            if a.shape[0] != n:
                raise ValueError(f"kv-canary: {name} has length {a.shape[0]}, slots has {n}")
        cap = max(1, n) if verify_capacity is None else ints.check_int(verify_capacity, name="verify_capacity")
        if cap <= 0:
            raise ValueError(f"kv-canary: VerifyPlan verify_capacity must be positive, got {cap}")
        if n > cap:
            raise ValueError(f"kv-canary: {n} verify entries exceed verify_capacity={cap}")

        def pad(a, fill=0):
            out = np.full((cap,), fill, np.int64)
            out[:n] = a
            return ints.to_device(ints.int64_to_pairs_np(out))

        return cls(
            verify_slot_indices=pad(slots),
            verify_expected_tokens=pad(tokens, -1),
            verify_expected_positions=pad(positions),
            verify_prev_slot_indices=pad(prev_slots),
            verify_num_valid=ints.to_device(
                np.array(
                    [
                        n
                        if num_valid is None
                        else ints.check_int(num_valid, name="num_valid", minimum=ints.INT32_MIN, maximum=ints.INT32_MAX)
                    ],
                    np.int32,
                )
            ),
            enable=ints.to_device(
                np.array(
                    [ints.check_int(enable, name="enable", minimum=ints.INT32_MIN, maximum=ints.INT32_MAX)], np.int32
                )
            ),
        )

    @property
    def verify_capacity(self) -> int:
        return int(self.verify_slot_indices.shape[0])

    def check(self) -> None:
        """Static dtype/shape checks (works on tracers).

        Raises:
          TypeError / ValueError naming the field.
        """
        validation.check_verify_plan(_facts(self, validation.VERIFY_PLAN_FIELDS), validation.JAX_DTYPES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class WritePlan:
    """Per-request write metadata (SGLang ``WritePlan``).

    Fields (Cw = write_req_capacity):
      write_offsets: ``uint32[Cw + 1, 2]`` (int64): exclusive prefix sum into the token arrays; request r owns
        entries ``[off[r], off[r+1])``. Must be non-decreasing over the live rows.
      write_seed_slot_indices: ``uint32[Cw, 2]`` (int64): slot holding position prefix_len - 1, or -1.
      write_num_valid_reqs: ``int32[1]``: live request rows (clamped to Cw by the kernels).
    """

    write_offsets: jax.Array
    write_seed_slot_indices: jax.Array
    write_num_valid_reqs: jax.Array

    @staticmethod
    def allocation_bytes(write_req_capacity: int) -> int:
        """SGLang's byte count: ``(2 * Cw + 1) * 8 + 4``."""
        return (2 * int(write_req_capacity) + 1) * 8 + 4

    @classmethod
    def allocate(cls, *, write_req_capacity: int) -> WritePlan:
        """Zeroed plan.

        Raises:
          ValueError: ``write_req_capacity <= 0`` (SGLang's message).
        """
        c = ints.check_int(write_req_capacity, name="WritePlan write_req_capacity")
        if c <= 0:
            raise ValueError(f"kv-canary: WritePlan write_req_capacity must be positive, got {write_req_capacity}")
        return cls(
            write_offsets=jnp.zeros((c + 1, 2), jnp.uint32),
            write_seed_slot_indices=jnp.zeros((c, 2), jnp.uint32),
            write_num_valid_reqs=jnp.zeros((1,), jnp.int32),
        )

    @classmethod
    def from_requests(
        cls,
        *,
        counts: Sequence[int],
        seed_slots: Sequence[int],
        write_req_capacity: int | None = None,
        num_valid_reqs: int | None = None,
    ) -> WritePlan:
        """Builds a plan on the host from per-request entry counts and seed slots.

        Raises:
          ValueError: mismatched lengths, negative counts, or more requests than capacity.
        """
        counts = ints.exact_int64_np(counts, name="counts").reshape(-1)
        seeds = ints.exact_int64_np(seed_slots, name="seed_slots").reshape(-1)
        if counts.shape != seeds.shape:
            raise ValueError(f"kv-canary: counts has length {counts.shape[0]}, seed_slots has {seeds.shape[0]}")
        if (counts < 0).any():
            raise ValueError("kv-canary: request entry counts must be non-negative")
        bs = counts.shape[0]
        cap = (
            max(1, bs) if write_req_capacity is None else ints.check_int(write_req_capacity, name="write_req_capacity")
        )
        if cap <= 0:
            raise ValueError(f"kv-canary: WritePlan write_req_capacity must be positive, got {cap}")
        if bs > cap:
            raise ValueError(f"kv-canary: bs={bs} exceeds write_req_capacity={cap}")
        off = np.zeros((cap + 1,), np.int64)
        off[1 : bs + 1] = np.cumsum(counts)
        seed_arr = np.zeros((cap,), np.int64)
        seed_arr[:bs] = seeds
        return cls(
            write_offsets=ints.to_device(ints.int64_to_pairs_np(off)),
            write_seed_slot_indices=ints.to_device(ints.int64_to_pairs_np(seed_arr)),
            write_num_valid_reqs=ints.to_device(
                np.array(
                    [
                        bs
                        if num_valid_reqs is None
                        else ints.check_int(
                            num_valid_reqs, name="num_valid_reqs", minimum=ints.INT32_MIN, maximum=ints.INT32_MAX
                        )
                    ],
                    np.int32,
                )
            ),
        )

    @property
    def write_req_capacity(self) -> int:
        return int(self.write_seed_slot_indices.shape[0])

    def check(self) -> None:
        """Static dtype/shape checks (works on tracers).

        Raises:
          TypeError / ValueError naming the field; SGLang's CUDA message for a wrong offsets length.
        """
        validation.check_write_plan(_facts(self, validation.WRITE_PLAN_FIELDS), validation.JAX_DTYPES)


def _facts(plan: Any, fields: Sequence[str]) -> dict[str, validation.ArrayFacts]:
    return {f: validation.array_facts(getattr(plan, f)) for f in fields}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOrWriteContext:
    """What one verify or write launch works on (SGLang ``VerifyOrWriteContext``).

    Fields:
      canary_buf: ``uint8[num_slots, slot_stride_bytes]``.
      kernel_kind: the launch tag stamped in column 0 and indexing the counters (static).
      log: the shared :class:`~canary_jax.contract.layout.ViolationLog` (ring, write index, per-tag counters, and the
        chain-position assert flag that SGLang passes as ``enable_chain_position_assert``).
      real_kv_sources: tuple of 0..4 :class:`~canary_jax.contract.sources.RealKvSource`; its tensors are read-only.
      real_kv_hash_mode: NONE / PARTIAL / ALL (static).

    Registered as a pytree: arrays are leaves, ``kernel_kind`` and ``real_kv_hash_mode`` are static.
    """

    canary_buf: Any
    kernel_kind: constants.CanaryLaunchTag
    log: layout.ViolationLog
    real_kv_sources: tuple = ()
    real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE

    def replace(self, **kw) -> VerifyOrWriteContext:
        return dataclasses.replace(self, **kw)


def _ctx_flatten(c: VerifyOrWriteContext):
    return (c.canary_buf, c.log, tuple(c.real_kv_sources)), (
        constants.CanaryLaunchTag(int(c.kernel_kind)),
        constants.RealKvHashMode(int(c.real_kv_hash_mode)),
    )


def _ctx_unflatten(aux, children) -> VerifyOrWriteContext:
    obj = object.__new__(VerifyOrWriteContext)
    object.__setattr__(obj, "canary_buf", children[0])
    object.__setattr__(obj, "log", children[1])
    object.__setattr__(obj, "real_kv_sources", tuple(children[2]))
    object.__setattr__(obj, "kernel_kind", aux[0])
    object.__setattr__(obj, "real_kv_hash_mode", aux[1])
    return obj


jax.tree_util.register_pytree_node(VerifyOrWriteContext, _ctx_flatten, _ctx_unflatten)


def check_context(context: VerifyOrWriteContext) -> tuple[sources.SourceDescriptor, ...]:
    """Every static check of a launch context, before tracing; returns the source descriptors.

    Coverage of the canary buffer's slots by the sources is the launch's to check against the slots it hashes
    (:mod:`canary_jax.contract.coverage`; :func:`canary_jax.ops.launch.verify` and :func:`canary_jax.ops.launch.write`
    do).

    Raises:
      TypeError / ValueError naming the argument (see the checks of each part).
    """
    if not isinstance(context, VerifyOrWriteContext):
        raise TypeError(f"kv-canary: context must be a VerifyOrWriteContext, got {type(context).__name__}")
    validation.check_kernel_kind(context.kernel_kind)
    layout.check_canary_buffer(context.canary_buf)
    if not isinstance(context.log, layout.ViolationLog):
        raise TypeError(f"kv-canary: context.log must be a ViolationLog, got {type(context.log).__name__}")
    context.log.check()
    if int(context.kernel_kind) >= context.log.kernel_run_counters.shape[0]:
        raise ValueError(
            f"kv-canary: kernel_kind={int(context.kernel_kind)} is outside the counter arrays of length "
            f"{context.log.kernel_run_counters.shape[0]}"
        )
    return sources.check_real_kv_sources(context.real_kv_sources, context.real_kv_hash_mode)
