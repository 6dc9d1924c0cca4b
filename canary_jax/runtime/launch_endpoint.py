"""One launch endpoint: :class:`CanaryEndpoint` (a tag, its canary buffer, LUT and real-KV sources) and its
HEAD / TAIL and SWEEP launches, with :class:`ExpectedInputs` for the write-input assert (SPEC 8.2).

:mod:`canary_jax.runtime.endpoints` builds a group's endpoints and dispatches them;
:meth:`~canary_jax.runtime.groups.CanaryBufferGroup.with_endpoint` writes an endpoint's buffer back. Both
build on this module, which knows no group.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from canary_jax.contract import constants, ints, layout, validation
from canary_jax.ops import launch, phase_launch
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan
from canary_jax.planning.slot_tables import swa_translate

__all__ = [
    "CanaryEndpoint",
    "ExpectedInputs",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ExpectedInputs:
    """Expected per-token inputs for the write-input assert (SGLang ``ExpectedInputs``), pre-sliced to T.

    Fields:
      tokens: int64-valued ``[T]`` expected input ids.
      positions: int64-valued ``[T]`` expected positions.
    """

    tokens: Any
    positions: Any


jax.tree_util.register_dataclass(ExpectedInputs, data_fields=["tokens", "positions"], meta_fields=[])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryEndpoint:
    """One launch unit: a tag, its canary buffer, LUT and real-KV sources (SGLang ``CanaryEndpoint``).

    Fields:
      kernel_kind: the CanaryLaunchTag (stamped in column 0, indexes the counters).
      canary_buf: ``uint8[num_slots, slot_stride_bytes]`` this endpoint verifies / writes.
      full_to_swa_index_mapping: ``uint32[L, 2]`` LUT for SWA endpoints, None for FULL.
      real_kv_sources: 0..4 RealKvSource (empty for HEAD).
      buffer_name: which group buffer ``canary_buf`` is (``k_head`` / ``k_tail`` / ``v_head`` / ``v_tail``).
    """

    kernel_kind: constants.CanaryLaunchTag
    canary_buf: Any
    full_to_swa_index_mapping: Any
    real_kv_sources: tuple
    buffer_name: str

    @property
    def is_sweep(self) -> bool:
        return constants.CanaryLaunchTag(int(self.kernel_kind)).is_sweep

    def _context(self, log: layout.ViolationLog, mode) -> VerifyOrWriteContext:
        return VerifyOrWriteContext(
            canary_buf=self.canary_buf,
            kernel_kind=constants.CanaryLaunchTag(int(self.kernel_kind)),
            log=log,
            real_kv_sources=tuple(self.real_kv_sources),
            real_kv_hash_mode=constants.RealKvHashMode(int(mode)),
        )

    def launch_per_forward(
        self,
        *,
        verify_plan: VerifyPlan,
        write_plan: WritePlan,
        input_ids: Any,
        positions: Any,
        out_cache_loc: Any,
        violation_log: layout.ViolationLog,
        enable_write_input_assert: bool = False,
        enable_verify_token_assert: bool = False,
        expected_inputs: ExpectedInputs | None = None,
        real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
        backend: str | None = None,
    ) -> tuple[CanaryEndpoint, layout.ViolationLog]:
        """HEAD / TAIL launch: verify ``verify_plan``, then write the step's tokens (SPEC 8.2).

        (1) verify with the token check iff ``enable_verify_token_assert``; (2) SWA endpoints translate
        ``out_cache_loc`` through the LUT (negative stays negative = write skip; a slot past the LUT clamps
        to its last entry, never reading outside it); (3) write, with the expected tensors only when
        ``enable_write_input_assert``. Traced, the Pallas backend runs (1) and (3) as one launch where it can
        (:func:`canary_jax.ops.phase_launch.verify_then_write`); the bytes are the same.

        Args:
          input_ids, positions, out_cache_loc: int64-valued ``[T]`` ForwardBatch arrays (out_cache_loc in
            full-pool slots; padding tokens after the real rows).
          expected_inputs: required iff ``enable_write_input_assert``.

        Returns:
          ``(endpoint with the new canary_buf, new violation log)``.

        Raises:
          NotImplementedError: on a SWEEP endpoint ("kv-canary: launch_per_forward not supported on sweep
            endpoint SWEEP_K_FULL").
          ValueError: expected inputs missing while the write assert is on; any launch check.
        """
        tag = constants.CanaryLaunchTag(int(self.kernel_kind))
        if tag.is_sweep:
            raise NotImplementedError(f"kv-canary: launch_per_forward not supported on sweep endpoint {tag.name}")
        if enable_write_input_assert:
            has = expected_inputs is not None
            validation.check_expected_inputs(True, has_tokens=has, has_positions=has)
        loc = out_cache_loc
        if self.full_to_swa_index_mapping is not None:
            loc = swa_translate(
                ints.as_int64_pairs(out_cache_loc, name="out_cache_loc", shape=(None,)), self.full_to_swa_index_mapping
            )
        if enable_write_input_assert:
            et, ep = expected_inputs.tokens, expected_inputs.positions
        else:
            et = ep = None
        ctx = phase_launch.verify_then_write(
            self._context(violation_log, real_kv_hash_mode),
            verify_plan,
            write_plan,
            input_ids,
            positions,
            loc,
            check_verify_expected_token=bool(enable_verify_token_assert),
            enable_write_input_assert=bool(enable_write_input_assert),
            expected_input_tokens=et,
            expected_input_positions=ep,
            backend=backend,
        )
        return dataclasses.replace(self, canary_buf=ctx.canary_buf), ctx.log

    def launch_sweep(
        self,
        *,
        verify_plan: VerifyPlan,
        violation_log: layout.ViolationLog,
        real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE,
        backend: str | None = None,
    ) -> layout.ViolationLog:
        """SWEEP launch: verify only, token check off; the buffer is read-only.

        Raises:
          NotImplementedError: on a HEAD / TAIL endpoint ("kv-canary: launch_sweep not supported on
            non-sweep endpoint HEAD_K_FULL").
        """
        tag = constants.CanaryLaunchTag(int(self.kernel_kind))
        if not tag.is_sweep:
            raise NotImplementedError(f"kv-canary: launch_sweep not supported on non-sweep endpoint {tag.name}")
        ctx = launch.verify(
            self._context(violation_log, real_kv_hash_mode),
            verify_plan,
            check_verify_expected_token=False,
            backend=backend,
        )
        return ctx.log


jax.tree_util.register_pytree_node(
    CanaryEndpoint,
    lambda e: (
        (e.canary_buf, e.full_to_swa_index_mapping, tuple(e.real_kv_sources)),
        (constants.CanaryLaunchTag(int(e.kernel_kind)), e.buffer_name),
    ),
    lambda aux, ch: CanaryEndpoint(
        kernel_kind=aux[0],
        canary_buf=ch[0],
        full_to_swa_index_mapping=ch[1],
        real_kv_sources=tuple(ch[2]),
        buffer_name=aux[1],
    ),
)
