"""The per-forward step's data types (SPEC 8.3): its static config, the batch it reads, the device state it
threads and what it returns.

* :class:`CanaryStepConfig`: static, hashable knobs (capacities, real-KV mode, asserts, backend).
* :class:`CanaryBatch`: what the canary reads from one forward batch (an argument of every call, never kept);
  its int64-valued fields are held as exact ``uint32[..., 2]`` pairs from the moment it is built.
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
import numpy as np

from canary_jax.contract import constants, ints, layout
from canary_jax.ops import buckets as buckets_lib
from canary_jax.planning import slot_tables
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
      backend: ``reference`` / ``pallas`` / ``pallas_tpu`` / None (see :func:`canary_jax.ops.backends.resolve_backend`).
      buckets: the :class:`canary_jax.ops.buckets.Buckets` policy that eager calls pad the batch's token count to
        (and its rows, capped at ``write_req_capacity``), or None for :func:`canary_jax.ops.buckets.default_buckets`
        at call time.

    Raises:
      ValueError: non-positive capacities.
      TypeError: ``buckets`` not a Buckets.
    """

    verify_capacity: int
    write_req_capacity: int
    real_kv_hash_mode: constants.RealKvHashMode = constants.RealKvHashMode.NONE
    enable_write_input_assert: bool = False
    enable_verify_token_assert: bool = False
    enable_v_half: bool = False
    backend: str | None = None
    buckets: buckets_lib.Buckets | None = None

    def __post_init__(self) -> None:
        for name in ("verify_capacity", "write_req_capacity"):
            if ints.check_int(getattr(self, name), name=name) <= 0:
                raise ValueError(f"kv-canary: {name} must be positive, got {getattr(self, name)}")
        if self.buckets is not None and not isinstance(self.buckets, buckets_lib.Buckets):
            raise TypeError(f"kv-canary: buckets must be a Buckets, got {type(self.buckets).__name__}")
        object.__setattr__(self, "real_kv_hash_mode", constants.RealKvHashMode(int(self.real_kv_hash_mode)))


_INDEX_FIELDS = (
    "req_pool_indices",
    "prefix_lens",
    "extend_seq_lens",
    "input_ids",
    "positions",
    "out_cache_loc",
)  # the int64-valued [bs] / [T] fields every step reads (StepInputs hands them to step_fn as int32)
_BATCH_FIELDS = (
    *_INDEX_FIELDS,
    "req_to_token",
    "expected_inputs",
    "req_to_verify_expected_tokens",
    "req_to_verify_expected_tokens_valid_lens",
)


def _pairs(x: Any, name: str, shape: tuple) -> Any:
    """An int64-valued field as exact ``uint32[*shape, 2]`` pairs: JAX arrays and tracers stay JAX (widened or
    bit-cast, never cut), host data stays numpy (so eager calls pad it on the host)."""
    out = ints.as_int64_pairs(x, name=name, shape=shape, host=True)  # host data: no device round trip
    return out if isinstance(x, jax.Array) else np.asarray(out)


def _originals(values) -> tuple:
    """``CanaryBatch.int32_fields`` from one value per int64-valued field (in ``_INDEX_FIELDS``' order): each traced
    int32 vector (:func:`canary_jax.contract.ints.is_traced_int32`), None for the others; ``()`` when none is."""
    narrow = tuple(x if ints.is_traced_int32(x) else None for x in values)
    return narrow if any(x is not None for x in narrow) else ()


class _Int32Slot:
    """The slot of :attr:`CanaryBatch.int32_fields`: outside the dataclass fields and the pytree, so a batch's
    structure does not depend on how it was built."""

    __slots__ = ("int32_fields",)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryBatch(_Int32Slot):
    """What the canary needs from one forward batch (SGLang ``PlanInput`` + ForwardBatch arrays).

    Fields (bs rows, padding rows with ``req_pool_indices == 0`` last; T tokens in request order, tokens past
    the rows' extends owned by no request):
      req_pool_indices: int64-valued ``[bs]``; 0 = padding row.
      prefix_lens: int64-valued ``[bs]``: tokens already in the KV before this step (decode: the position).
      extend_seq_lens: int64-valued ``[bs]``: tokens written this step (decode: 1).
      input_ids, positions: int64-valued ``[T]``.
      out_cache_loc: int64-valued ``[T]`` full-pool slots written this step (SWA groups translate them).
      req_to_token: ``int32[max_reqs, max_seq_len]``, already holding this step's slots (SGLang), or any
        :class:`~canary_jax.planning.slot_tables.SlotTable` / :class:`~canary_jax.planning.slot_tables.GroupSlotTables`
        (block tables, sglang-jax's ragged ``cache_loc``; see :mod:`canary_jax.adapters.batches`).
      expected_inputs: :class:`~canary_jax.runtime.endpoints.ExpectedInputs` (int64-valued ``[T]`` each) when
        ``enable_write_input_assert``; else None.
      req_to_verify_expected_tokens: ``int32[rows, max_context_len]`` token pool when
        ``enable_verify_token_assert`` (see :func:`canary_jax.planning.plan_builder.scatter_req_token_ids`), or an
        :class:`~canary_jax.planning.slot_tables.ExpectedTokenTable`; else None.
      req_to_verify_expected_tokens_valid_lens: int64-valued ``[bs]`` with the pool.

    Construction converts every int64-valued field, exactly, to ``uint32[..., 2]`` pairs (little-endian words,
    the bytes of the int64 array; see :mod:`canary_jax.contract.ints`): numpy int64 / uint64, Python ints, int32 and
    narrower (sign-extended), JAX int64 with x64 on, or pairs already. Host data stays numpy, JAX arrays and
    tracers stay JAX. So no value is cut to int32 when the batch crosses ``jit`` with x64 off. The int32 fields
    go through :func:`canary_jax.contract.ints.as_int32`: numpy data outside int32 is refused, JAX data must be int32.
    A pytree; unflattening does not convert again (safe inside transformations).

    Built while tracing, the batch also keeps each of the six int64-valued fields that it was given as an int32
    vector, as it is (``int32_fields``, :meth:`operand`): the step's Pallas plan and phase kernels read those
    narrow, so inside a caller's ``jit`` no widening op runs before them (their pairs, if nothing else reads them,
    compile to nothing). They are not part of the pytree: flattening (a ``jit`` boundary, a ``cond`` branch, a
    ``scan`` carry) leaves the pairs alone, which the launches then read instead (same bytes, more launches).

    Raises:
      TypeError: a non-integer field, JAX int32 fields of another dtype, or ``expected_inputs`` of the wrong
        type (naming the field).
      ValueError: a value outside int64 (int64 fields) or int32 (int32 fields), or shapes that disagree
        (``[bs]`` fields, ``[T]`` fields, 2-D tables), naming the field.
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

    def __post_init__(self) -> None:
        narrow = _originals(getattr(self, n) for n in _INDEX_FIELDS)
        rpi = _pairs(self.req_pool_indices, "req_pool_indices", (None,))
        bs = int(rpi.shape[0])
        ids = _pairs(self.input_ids, "input_ids", (None,))
        t = int(ids.shape[0])
        conv = {
            "req_pool_indices": rpi,
            "prefix_lens": _pairs(self.prefix_lens, "prefix_lens", (bs,)),
            "extend_seq_lens": _pairs(self.extend_seq_lens, "extend_seq_lens", (bs,)),
            "input_ids": ids,
            "positions": _pairs(self.positions, "positions", (t,)),
            "out_cache_loc": _pairs(self.out_cache_loc, "out_cache_loc", (t,)),
            "req_to_token": _slot_table(self.req_to_token),
        }
        ex = self.expected_inputs
        if ex is not None:
            if not isinstance(ex, ExpectedInputs):
                raise TypeError(f"kv-canary: expected_inputs must be an ExpectedInputs, got {type(ex).__name__}")
            conv["expected_inputs"] = ExpectedInputs(
                tokens=_pairs(ex.tokens, "expected_inputs.tokens", (t,)),
                positions=_pairs(ex.positions, "expected_inputs.positions", (t,)),
            )
        if self.req_to_verify_expected_tokens is not None:
            conv["req_to_verify_expected_tokens"] = _token_pool(self.req_to_verify_expected_tokens)
        if self.req_to_verify_expected_tokens_valid_lens is not None:
            conv["req_to_verify_expected_tokens_valid_lens"] = _pairs(
                self.req_to_verify_expected_tokens_valid_lens, "req_to_verify_expected_tokens_valid_lens", (bs,)
            )
        for name, value in conv.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "int32_fields", narrow)

    def operand(self, name: str) -> Any:
        """Field ``name`` (an int64-valued ``[bs]`` / ``[T]`` one) as the launches take it: the traced int32 vector
        the batch was built from (narrow; :func:`canary_jax.contract.ints.as_int64_field`), else its pairs."""
        narrow = self.int32_fields[_INDEX_FIELDS.index(name)] if self.int32_fields else None
        return getattr(self, name) if narrow is None else narrow

    @property
    def num_tokens(self) -> int:
        """T, the length of the token arrays."""
        return int(self.input_ids.shape[0])

    @property
    def batch_size(self) -> int:
        """bs, the number of rows (padding rows included)."""
        return int(self.req_pool_indices.shape[0])

    def replace(self, **kw) -> CanaryBatch:
        """A new batch with some fields replaced (converted like the constructor's); the narrow originals of the
        fields not replaced stay (:meth:`operand`)."""
        new = dataclasses.replace(self, **kw)
        if self.int32_fields:
            fresh = new.int32_fields or (None,) * len(_INDEX_FIELDS)
            kept = (f if n in kw else o for n, o, f in zip(_INDEX_FIELDS, self.int32_fields, fresh))
            object.__setattr__(new, "int32_fields", _originals(kept))
        return new

    @classmethod
    def prechecked(cls, *, int32_fields: dict | None = None, **fields) -> CanaryBatch:
        """A batch from fields that are already converted (pairs, int32 tables): no checks, no conversion.
        ``int32_fields`` maps field names to the int32 vectors their pairs were widened from, exactly (an adapter's
        pass-through fields); the traced ones are kept for :meth:`operand`."""
        batch = _batch_unflatten(None, [fields.get(n) for n in _BATCH_FIELDS])
        if int32_fields:
            object.__setattr__(batch, "int32_fields", _originals(int32_fields.get(n) for n in _INDEX_FIELDS))
        return batch


def _slot_table(table: Any) -> Any:
    """``req_to_token`` as the plan builder reads it: a checked :class:`~canary_jax.planning.slot_tables.SlotTable` or
    :class:`~canary_jax.planning.slot_tables.GroupSlotTables` as given, else SGLang's ``int32[max_reqs,
    max_seq_len]``."""
    if isinstance(table, slot_tables.GroupSlotTables):
        for t in (table.full, table.swa):
            if t is not None:
                t.check()
        return table
    if isinstance(table, slot_tables.SlotTable):
        table.check()
        return table
    return ints.as_int32(table, name="req_to_token", shape=(None, None), host=True)


def _token_pool(pool: Any) -> Any:
    """The expected-token pool: a checked :class:`~canary_jax.planning.slot_tables.ExpectedTokenTable` as given, else
    SGLang's ``int32[rows, max_context_len]`` addressed by ``req_pool_indices``."""
    if isinstance(pool, slot_tables.ExpectedTokenTable):
        pool.check()
        return pool
    return ints.as_int32(pool, name="req_to_verify_expected_tokens", shape=(None, None), host=True)


def _batch_unflatten(_, children) -> CanaryBatch:
    obj = object.__new__(CanaryBatch)
    for name, value in zip(_BATCH_FIELDS, children):
        object.__setattr__(obj, name, value)
    object.__setattr__(obj, "int32_fields", ())
    return obj


jax.tree_util.register_pytree_node(
    CanaryBatch, lambda b: (tuple(getattr(b, n) for n in _BATCH_FIELDS), None), _batch_unflatten
)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class CanaryState:
    """Device state of one canary manager: its buffer groups and the shared violation log (a pytree).

    Fields:
      groups: tuple of :class:`~canary_jax.runtime.groups.CanaryBufferGroup` (FULL first, then SWA if any).
      log: the shared :class:`~canary_jax.contract.layout.ViolationLog` (ring, write index, per-tag counters, the
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
      chain_hints: None, or (after the step API's HEAD on a backend that reuses chains) one
        :class:`~canary_jax.ops.chain_hints.ChainHint` or None per group: HEAD's write chains, which TAIL's
        writes reuse where their buffer gives the same chain start (the same bytes, the serial work once).
    """

    per_group: tuple
    write_index_at_head: jax.Array
    chain_hints: tuple | None = None


jax.tree_util.register_dataclass(
    CanaryPlans, data_fields=["per_group", "write_index_at_head", "chain_hints"], meta_fields=[]
)


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
