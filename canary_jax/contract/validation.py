"""The one validation layer: every static check of a launch, shared by the JAX entry points and the torch
launchers (SPEC 3, 4, 10), in one namespace.

Three parts, one job each: :mod:`~canary_jax.contract.arrays` (array facts, shapes, dtypes, the canary buffer,
the ring, the static enums), :mod:`~canary_jax.contract.source_checks` (real-KV sources) and
:mod:`~canary_jax.contract.plan_checks` (the plans and the plan launch). Every name they define is re-exported
here, private helpers included, so ``validation.check_array`` and the rest keep their one spelling.

Messages are SGLang's where SGLang has one (tests pin them). Every function raises ``TypeError`` for a wrong
kind or dtype and ``ValueError`` for a wrong value or shape, and returns nothing unless documented. Each
launch runs each check once: the entry points call these functions before tracing, and what runs after
(device transfer, backends) trusts them.
"""

from __future__ import annotations

from canary_jax.contract.arrays import (  # noqa: F401  (re-exported)
    JAX_DTYPES,
    ArrayFacts,
    DtypeNames,
    _enum_member,
    array_facts,
    check_array,
    check_canary_buffer,
    check_contiguous,
    check_expected_inputs,
    check_hash_mode,
    check_kernel_kind,
    check_ring,
    check_same_length,
    check_shape,
    dense_strides_bytes,
    format_shape,
    shape_matches,
)
from canary_jax.contract.plan_checks import (  # noqa: F401  (re-exported)
    PLAN_KERNEL_PATH,
    PLAN_REFERENCE_PATH,
    VERIFY_PLAN_FIELDS,
    WRITE_PLAN_FIELDS,
    check_plan_launch,
    check_verify_plan,
    check_write_plan,
)
from canary_jax.contract.source_checks import (  # noqa: F401  (re-exported)
    _WARNED_UNHASHED,
    check_kv_write_result,
    check_source_chunks,
    check_source_count,
    check_source_coverage,
    check_source_fields,
    check_source_layout,
    check_source_row_width,
    warn_unhashed_sources,
)

__all__ = [
    "ArrayFacts",
    "DtypeNames",
    "JAX_DTYPES",
    "PLAN_KERNEL_PATH",
    "PLAN_REFERENCE_PATH",
    "VERIFY_PLAN_FIELDS",
    "WRITE_PLAN_FIELDS",
    "array_facts",
    "check_array",
    "check_canary_buffer",
    "check_contiguous",
    "check_expected_inputs",
    "check_hash_mode",
    "check_kernel_kind",
    "check_kv_write_result",
    "check_plan_launch",
    "check_ring",
    "check_same_length",
    "check_shape",
    "check_source_chunks",
    "check_source_count",
    "check_source_coverage",
    "check_source_fields",
    "check_source_layout",
    "check_source_row_width",
    "check_verify_plan",
    "check_write_plan",
    "dense_strides_bytes",
    "format_shape",
    "shape_matches",
    "warn_unhashed_sources",
]
