"""The per-forward step's data types (SPEC 8.3): its static config, the batch it reads, the device state it
threads and what it returns.

* :class:`CanaryStepConfig`: static, hashable knobs (capacities, real-KV mode, asserts, backend).
* :class:`CanaryBatch`: what the canary reads from one forward batch (an argument of every call, never kept).
* :class:`CanaryState`: the canary's own device state: buffer groups and the violation log they share.
* :class:`CanaryPlans`: one forward's plans, shared by HEAD and TAIL.
* :class:`StepSummary`: small device-side results of one step.
* :func:`active_tags`: the launch tags a state's step runs (what the health checker expects to grow).

All but the config are pytrees; the functions that take them live in :mod:`canary_jax.runtime.step`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from canary_jax import constants, layout
from canary_jax.runtime.endpoints import ExpectedInputs
from canary_jax.runtime.groups import CanaryBufferGroup

__all__ = [
    "CanaryBatch",
    "CanaryPlans",
    "CanaryState",
    "CanaryStepConfig",
    "StepSummary",
    "active_tags",
]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryStepConfig:
    """Static knobs of the per-forward step (hashable; pass as ``config=``; SGLang ``CanaryConfig`` +
    ``CanaryLaunchCapacities``).

    Fields:
      verify_capacity: per-forward VerifyPlan length C (SGLang: 3 x pool slots).
      write_req_capacity: WritePlan request capacity Cw (>= the batch's bs).
      real_kv_hash_mode: NONE / PARTIAL / ALL fingerprint of the real KV (TAIL and SWEEP launches).
      enable_write_input_assert: write kernel compares input ids / positions with ``batch.expected_inputs``.
      enable_verify_token_assert: verify checks tokens gathered from ``batch.req_to_verify_expected_tokens``.
      enable_v_half: also launch the V-half endpoints (SGLang's ``SGLANG_KV_CANARY_ENABLE_MHA_V``,
        default off there).
      backend: ``reference`` / ``pallas`` / None (see :func:`canary_jax.backends.resolve_backend`).

    Raises:
      ValueError: non-positive capacities.
    """

    verify_capacity: int
    write_req_capacity: int
    real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    enable_v_half: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        for name in ("verify_capacity", "write_req_capacity"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"kv-canary: {name} must be positive, got {getattr(self, name)}")
        object.__setattr__(self, "real_kv_hash_mode", constants.RealKvHashMode(int(self.real_kv_hash_mode)))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryBatch:
    """What the canary needs from one forward batch (SGLang ``PlanInput`` + ForwardBatch arrays).

    Fields (bs rows, padding rows with ``req_pool_indices == 0`` last; T tokens in request order):
      req_pool_indices: int64-valued ``[bs]`` (int32 / int64 / ``uint32[bs, 2]``); 0 = padding row.
      prefix_lens: int64-valued ``[bs]``: tokens already in the KV before this step (decode: the position).
      extend_seq_lens: int64-valued ``[bs]``: tokens written this step (decode: 1).
      input_ids, positions: int64-valued ``[T]``.
      out_cache_loc: int64-valued ``[T]`` full-pool slots written this step (SWA groups translate them).
      req_to_token: ``int32[max_reqs, max_seq_len]``, already holding this step's slots.
      expected_inputs: :class:`~canary_jax.runtime.endpoints.ExpectedInputs` (``[T]`` each) when
        ``enable_write_input_assert``; else None.
      req_to_verify_expected_tokens: ``int32[rows, max_context_len]`` token pool when
        ``enable_verify_token_assert`` (see :func:`canary_jax.plan_builder.scatter_req_token_ids`); else None.
      req_to_verify_expected_tokens_valid_lens: int64-valued ``[bs]`` with the pool.
    """

    req_pool_indices: Any
    prefix_lens: Any
    extend_seq_lens: Any
    input_ids: Any
    positions: Any
    out_cache_loc: Any
    req_to_token: Any
    expected_inputs: ExpectedInputs | None = None
    req_to_verify_expected_tokens: Any = None
    req_to_verify_expected_tokens_valid_lens: Any = None


jax.tree_util.register_dataclass(
    CanaryBatch,
    data_fields=[
        "req_pool_indices",
        "prefix_lens",
        "extend_seq_lens",
        "input_ids",
        "positions",
        "out_cache_loc",
        "req_to_token",
        "expected_inputs",
        "req_to_verify_expected_tokens",
        "req_to_verify_expected_tokens_valid_lens",
    ],
    meta_fields=[],
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryState:
    """Device state of one canary manager: its buffer groups and the shared violation log (a pytree).

    Fields:
      groups: tuple of :class:`~canary_jax.runtime.groups.CanaryBufferGroup` (FULL first, then SWA if any).
      log: the shared :class:`~canary_jax.layout.ViolationLog` (ring, write index, per-tag counters, the
        chain-position assert flag).
    """

    groups: tuple
    log: layout.ViolationLog

    @classmethod
    def create(
        cls,
        groups: Sequence[CanaryBufferGroup],
        *,
        ring_capacity: int = constants.DEFAULT_RING_CAPACITY,
        enable_chain_position_assert: bool = True,
    ) -> CanaryState:
        """Bundles ``groups`` with a fresh ViolationLog.

        Raises:
          ValueError: no groups, two groups of one kind, or a bad ring capacity.
        """
        groups = tuple(groups)
        if not groups:
            raise ValueError("kv-canary: CanaryState needs at least one CanaryBufferGroup")
        kinds = [g.kind for g in groups]
        if len(set(kinds)) != len(kinds):
            raise ValueError(f"kv-canary: CanaryState groups must have distinct kinds, got {[k.name for k in kinds]}")
        log = layout.ViolationLog.allocate(
            ring_capacity=ring_capacity, enable_chain_position_assert=enable_chain_position_assert
        )
        return cls(groups=groups, log=log)

    def replace(self, **kw) -> CanaryState:
        return dataclasses.replace(self, **kw)

    def with_chain_position_assert(self, enabled: bool) -> CanaryState:
        """SGLang zeroes the flag during warm-up and sets it in ``mark_init_finished()``."""
        flag = jnp.full((1,), 1 if enabled else 0, jnp.int32)
        return self.replace(log=dataclasses.replace(self.log, enable_chain_position_assert=flag))


jax.tree_util.register_dataclass(CanaryState, data_fields=["groups", "log"], meta_fields=[])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryPlans:
    """The plans of one forward, shared by HEAD and TAIL (a pytree).

    Fields:
      per_group: tuple with one ``(VerifyPlan, WritePlan)`` per state group, in group order.
      write_index_at_head: ``int32[1]``: the ring's write index before the HEAD launches.
    """

    per_group: tuple
    write_index_at_head: jax.Array


jax.tree_util.register_dataclass(CanaryPlans, data_fields=["per_group", "write_index_at_head"], meta_fields=[])


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class StepSummary:
    """Small device-side results of one step (read them back lazily, e.g. one step late).

    Fields (G = number of groups):
      verify_enable: ``int32[G]``: 0 where that group's verify plan overflowed (verify skipped).
      verify_num_valid: ``int32[G]``: verify entries of each group's plan (capacity on overflow).
      violations_total: ``int32[]``: the ring's write index after the step (all violations ever).
      new_violations: ``int32[]``: violations recorded since ``canary_head`` of this step.
    """

    verify_enable: jax.Array
    verify_num_valid: jax.Array
    violations_total: jax.Array
    new_violations: jax.Array


jax.tree_util.register_dataclass(
    StepSummary, data_fields=["verify_enable", "verify_num_valid", "violations_total", "new_violations"], meta_fields=[]
)


def active_tags(
    state: CanaryState, *, sweep: bool = False, enable_v_half: bool = False
) -> tuple[constants.CanaryLaunchTag, ...]:
    """Tags the step launches for ``state`` (HEAD and TAIL, plus SWEEP if ``sweep``; V halves only if
    ``enable_v_half`` and the group has them): what the health checker expects to see growing."""
    out = []
    for g in state.groups:
        for tag in constants.CanaryLaunchTag:
            if tag.group != g.kind.name:
                continue
            if tag.is_sweep and not sweep:
                continue
            if tag.is_v_half and not (enable_v_half and g.has_v_half):
                continue
            out.append(tag)
    return tuple(sorted(out))
