"""A plan launch's inputs, checked once for every plan builder (SPEC 7's up-front errors, with SGLang's messages).

:func:`check_plan_inputs` takes :func:`canary_jax.planning.plan_builder.build_plans`' arguments, raises its errors
before anything is traced and returns the :class:`PlanInputs` both builders take: the jnp builder
(:mod:`canary_jax.planning.plan_builder`) and the backend's plan kernel (:func:`canary_jax.ops.plan_launch.build_plans`,
:mod:`pallas_kernels.plan`), so both see the same operands and refuse the same launches.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np

from canary_jax.contract import ints, validation
from canary_jax.planning.expected_tokens import ExpectedTokenTable
from canary_jax.planning.plans import VerifyPlan, WritePlan
from canary_jax.planning.slot_reads import _check_2d_int32, _unchecked
from canary_jax.planning.slot_tables import GroupSlotTables, ReqToTokenTable, SlotTable

__all__ = ["PlanInputs", "check_plan_inputs"]


class PlanInputs(NamedTuple):
    """A plan launch's checked operands (:func:`check_plan_inputs`): the old plans (None = fresh), the per-row
    int64 pairs ``rpi`` / ``prefix`` / ``extend`` (``uint32[bs, 2]``, or narrow ``int32[bs]`` with
    ``keep_int32``), the :class:`SlotTable`, the LUT (``uint32[L, 2]`` or None), the expected-token pool and its
    valid lengths (or None), the window ``w`` and ``k`` (``np.int32``), and the static capacities ``cap`` (C) and
    ``cw`` (Cw)."""

    verify_out: VerifyPlan | None
    write_out: WritePlan | None
    rpi: jax.Array
    prefix: jax.Array
    extend: jax.Array
    table: SlotTable
    lut: jax.Array | None
    pool: Any
    valid: jax.Array | None
    w: np.int32
    k: np.int32
    cap: int
    cw: int

    def widened(self) -> PlanInputs:
        """These inputs with ``rpi`` / ``prefix`` / ``extend`` as pairs where they are narrow (traced int32
        vectors that :func:`check_plan_inputs` kept with ``keep_int32``): what the jnp builder takes."""
        return self._replace(rpi=ints.widen(self.rpi), prefix=ints.widen(self.prefix), extend=ints.widen(self.extend))


def _resolve_table(req_to_token: Any, swa_window_size: int) -> tuple[SlotTable, bool]:
    """The group's :class:`SlotTable` and whether its slots are already SWA-pool slots (LUT not applied)."""
    if isinstance(req_to_token, GroupSlotTables):
        table, translated = req_to_token.select(swa_window_size)
        table.check()
        return table, translated
    if isinstance(req_to_token, SlotTable):
        req_to_token.check()
        return req_to_token, False
    r2t = _check_2d_int32(req_to_token, "req_to_token")
    if int(r2t.shape[1]) >= ints.INT32_MAX or int(r2t.shape[0]) >= ints.INT32_MAX:
        raise ValueError(f"kv-canary: req_to_token shape {tuple(r2t.shape)} is too large")
    return _unchecked(ReqToTokenTable, req_to_token=r2t), False


def _capacity(plan_out: Any, cls: type, name: str, capacity: int | None) -> int:
    """The capacity ``plan_out``'s shape fixes (after checking it is a ``cls``), else ``capacity`` checked
    positive; ``name`` is the argument (``verify_capacity`` / ``write_req_capacity``) in the messages.

    Raises:
      TypeError: ``plan_out`` not a ``cls``; ValueError: neither given, or a non-positive capacity.
    """
    field = "verify_slot_indices" if cls is VerifyPlan else "write_seed_slot_indices"
    out_name = "verify_plan_out" if cls is VerifyPlan else "write_plan_out"
    if plan_out is not None:
        if not isinstance(plan_out, cls):
            raise TypeError(f"kv-canary: {out_name} must be a {cls.__name__}, got {type(plan_out).__name__}")
        plan_out.check()
        return int(getattr(plan_out, field).shape[0])
    if capacity is None:
        raise ValueError(f"kv-canary: build_plans needs {name} or {out_name}")
    n = ints.check_int(int(capacity), name=f"{cls.__name__} {name}")
    if n <= 0:
        raise ValueError(f"kv-canary: {cls.__name__} {name} must be positive, got {capacity}")
    return n


def check_plan_inputs(
    *,
    req_pool_indices: Any,
    prefix_lens: Any,
    extend_seq_lens: Any,
    req_to_token: Any,
    verify_capacity: int | None = None,
    write_req_capacity: int | None = None,
    swa_window_size: int = 0,
    full_to_swa_index_mapping: Any = None,
    req_to_verify_expected_tokens: Any = None,
    req_to_verify_expected_tokens_valid_lens: Any = None,
    kv_token_id_vs_position_offset: int = 0,
    verify_plan_out: VerifyPlan | None = None,
    write_plan_out: WritePlan | None = None,
    keep_int32: bool = False,
) -> PlanInputs:
    """:func:`build_plans`' checks and conversions (arguments and errors as there): the operands every plan
    builder takes (this jnp one, and the plan kernels of :func:`canary_jax.ops.plan_launch.build_plans`). With
    ``keep_int32`` the per-row fields stay narrow where they are traced int32 vectors
    (:func:`canary_jax.contract.ints.as_int64_field`; :meth:`PlanInputs.widened` makes their pairs)."""
    w = int(swa_window_size)
    if w < 0:
        raise ValueError(f"kv-canary: swa_window_size must be non-negative, got {swa_window_size}")
    if w > ints.INT32_MAX:
        raise ValueError(f"kv-canary: swa_window_size must be < 2**31, got {swa_window_size}")
    table, translated = _resolve_table(req_to_token, w)

    # Capacities. Without ``*_plan_out`` the plans are fresh (``allocate()``'s zeros), which the builder writes as
    # constants: nothing is allocated here and no old plan is read.
    cap = _capacity(verify_plan_out, VerifyPlan, "verify_capacity", verify_capacity)
    cw = _capacity(write_plan_out, WritePlan, "write_req_capacity", write_req_capacity)
    if write_plan_out is not None and write_req_capacity is not None and int(write_req_capacity) != cw:
        raise ValueError(
            f"kv-canary: write_req_capacity={write_req_capacity} does not match "
            f"write_plan_out.write_seed_slot_indices.shape[0]={cw}"
        )
    if cap >= ints.INT32_MAX:
        raise ValueError(f"kv-canary: verify_capacity must be < 2**31 - 1, got {cap}")

    # Per-request inputs.
    field = ints.as_int64_field if keep_int32 else ints.as_int64_pairs
    rpi = field(req_pool_indices, name="req_pool_indices", shape=(None,))
    bs = int(rpi.shape[0])
    prefix = field(prefix_lens, name="prefix_lens", shape=(None,))
    extend = field(extend_seq_lens, name="extend_seq_lens", shape=(None,))
    for name, arr in (("prefix_lens", prefix), ("extend_seq_lens", extend)):
        if arr.shape[0] != bs:
            raise ValueError(f"kv-canary: {name} length must be {bs}, got {arr.shape[0]}")

    lut = None
    if full_to_swa_index_mapping is not None and not translated:
        lut = ints.as_int64_pairs(full_to_swa_index_mapping, name="full_to_swa_index_mapping", shape=(None,))
        if lut.shape[0] >= ints.INT32_MAX:
            raise ValueError(f"kv-canary: full_to_swa_index_mapping length {lut.shape[0]} is too large")

    pool = valid = None
    if req_to_verify_expected_tokens is not None:
        if isinstance(req_to_verify_expected_tokens, ExpectedTokenTable):
            req_to_verify_expected_tokens.check()
            pool = req_to_verify_expected_tokens
        else:
            pool = _check_2d_int32(req_to_verify_expected_tokens, "req_to_verify_expected_tokens")
    validation.check_plan_launch(  # SGLang's launch checks, shared with the torch launcher (kernel path)
        swa_window_size=w,
        has_lut=lut is not None or translated,
        lut_len=None if lut is None else int(lut.shape[0]),
        verify_capacity=None if verify_capacity is None else int(verify_capacity),
        plan_capacity=cap,
        bs=bs,
        write_req_capacity=cw,
        has_pool=pool is not None,
        has_valid_lens=req_to_verify_expected_tokens_valid_lens is not None,
    )
    if pool is not None:
        valid = ints.as_int64_pairs(
            req_to_verify_expected_tokens_valid_lens, name="req_to_verify_expected_tokens_valid_lens", shape=(bs,)
        )

    k = int(kv_token_id_vs_position_offset)
    if not ints.INT32_MIN <= k <= ints.INT32_MAX:
        raise ValueError(f"kv-canary: kv_token_id_vs_position_offset must fit int32, got {k}")
    return PlanInputs(
        verify_plan_out, write_plan_out, rpi, prefix, extend, table, lut, pool, valid, np.int32(w), np.int32(k), cap, cw
    )
