"""Checks of SGLang's launch objects (SPEC 4.2, 4.3, 7): the ``VerifyPlan`` and ``WritePlan`` fields and the
plan launch's own checks, in SGLang's order and with its messages. One of the three parts of
:mod:`canary_jax.contract.validation`.
"""

from __future__ import annotations

from canary_jax.contract.arrays import ArrayFacts, DtypeNames, check_array

# --- launch objects -------------------------------------------------------------------------------------------
VERIFY_PLAN_FIELDS = (
    "verify_slot_indices",
    "verify_expected_tokens",
    "verify_expected_positions",
    "verify_prev_slot_indices",
    "verify_num_valid",
    "enable",
)
"""SGLang's ``VerifyPlan`` fields, in order."""

WRITE_PLAN_FIELDS = ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")
"""SGLang's ``WritePlan`` fields, in order."""


def check_verify_plan(
    fields: dict[str, ArrayFacts], names: DtypeNames, *, prefix: str = "plan.", capacity: int | None = None
) -> None:
    """A verify plan: four int64 ``[C]`` arrays, ``verify_num_valid`` and ``enable`` int32 ``[1]`` (SPEC 4.2).

    Args:
      fields: facts per field name of :data:`VERIFY_PLAN_FIELDS`.
      names: the caller's dtype names.
      prefix: prepended to field names in messages.
      capacity: the required C, or None for ``verify_slot_indices``' own.

    Raises:
      TypeError / ValueError naming the field.
    """
    slots = fields["verify_slot_indices"].shape
    cap = capacity if capacity is not None else (slots[0] if len(slots) >= 1 else None)
    for f in VERIFY_PLAN_FIELDS[:4]:
        check_array(fields[f], prefix + f, names.i64, names.int64_shape(cap))
    check_array(fields["verify_num_valid"], prefix + "verify_num_valid", names.i32, (1,))
    check_array(fields["enable"], prefix + "enable", names.i32, (1,))


def check_write_plan(
    fields: dict[str, ArrayFacts], names: DtypeNames, *, prefix: str = "plan.", offsets_message: bool = True
) -> int:
    """A write plan: ``write_offsets`` int64 ``[Cw + 1]``, ``write_seed_slot_indices`` int64 ``[Cw]``,
    ``write_num_valid_reqs`` int32 ``[1]`` (SPEC 4.3).

    Args:
      fields: facts per field name of :data:`WRITE_PLAN_FIELDS`.
      names: the caller's dtype names.
      prefix: prepended to field names in messages.
      offsets_message: a wrong offsets length raises SGLang's CUDA message
        (``canary_write: write_offsets.size(0) must equal write_req_capacity + 1 ...``) rather than the
        generic shape message.

    Returns:
      ``Cw``, the write request capacity.

    Raises:
      TypeError / ValueError naming the field.
    """
    seeds, offsets = fields["write_seed_slot_indices"], fields["write_offsets"]
    check_array(seeds, prefix + "write_seed_slot_indices", names.i64, names.int64_shape(None))
    cw = seeds.shape[0]
    if offsets_message and (len(offsets.shape) != len(names.int64_shape(None)) or offsets.shape[0] != cw + 1):
        raise ValueError(
            f"canary_write: write_offsets.size(0) must equal write_req_capacity + 1 ({cw + 1}), "
            f"got {offsets.shape[0] if offsets.shape else 0}"
        )
    check_array(offsets, prefix + "write_offsets", names.i64, names.int64_shape(cw + 1))
    check_array(fields["write_num_valid_reqs"], prefix + "write_num_valid_reqs", names.i32, (1,))
    return cw


# --- plan launch ----------------------------------------------------------------------------------------------
PLAN_KERNEL_PATH = "kernel"
"""SGLang's kernel path of ``launch_canary_plan_kernels`` (CUDA tensors; canary-jax's ``build_plans``)."""

PLAN_REFERENCE_PATH = "reference"
"""SGLang's ``launch_canary_plan_kernels_torch_reference`` path (CPU tensors)."""


def check_plan_launch(
    *,
    swa_window_size: int,
    has_lut: bool,
    lut_len: int | None,
    verify_capacity: int | None,
    plan_capacity: int,
    bs: int,
    write_req_capacity: int,
    has_pool: bool,
    has_valid_lens: bool,
    path: str = PLAN_KERNEL_PATH,
    max_bs: int | None = None,
) -> None:
    """The launch checks of SGLang's ``launch_canary_plan_kernels`` (SPEC 7), shared by
    :func:`canary_jax.planning.plan_builder.build_plans` and the torch launcher, with SGLang's messages.

    Run after each argument's own dtype and shape checks (the facts below are then exact). The kernel path
    checks in SGLang's order: the SWA LUT, ``max_bs``, the verify capacity, the LUT length, ``bs`` against the
    write capacity, the expected-token valid lengths (``launch_plan_entries_kernel``). The reference path
    (SGLang's CPU reference) checks the SWA LUT, the verify capacity and the valid lengths in its order and
    messages, then the LUT length and ``bs`` (which SGLang's reference leaves unchecked: it raises on the first
    slot past the LUT and silently caps ``bs``).

    Args:
      swa_window_size: W; W > 0 needs the LUT.
      has_lut: ``full_to_swa_index_mapping`` was given (or the slots come SWA-translated already).
      lut_len: its length, or None when there is no LUT array to check (read only when ``has_lut``).
      verify_capacity: the requested C, or None when the caller did not give one (JAX's ``build_plans``).
      plan_capacity: the verify plan's C (its ``verify_slot_indices`` length).
      bs: the batch rows (``req_pool_indices`` length).
      write_req_capacity: the write plan's Cw.
      has_pool, has_valid_lens: the expected-token pool and its valid lengths were given.
      path: :data:`PLAN_KERNEL_PATH` or :data:`PLAN_REFERENCE_PATH`: whose messages (and order) apply.
      max_bs: the kernel path's ``bs`` limit (SGLang's Triton offsets kernel: 4096), or None for none.

    Raises:
      ValueError: the first check that fails.
    """
    if path not in (PLAN_KERNEL_PATH, PLAN_REFERENCE_PATH):
        raise ValueError(f"kv-canary: path must be {PLAN_KERNEL_PATH!r} or {PLAN_REFERENCE_PATH!r}, got {path!r}")
    kernel = path == PLAN_KERNEL_PATH
    if swa_window_size > 0 and not has_lut:
        raise ValueError(
            "kv-canary: launch_canary_plan_kernels requires full_to_swa_index_mapping when swa_window_size > 0"
        )
    if kernel and max_bs is not None and bs > max_bs:
        raise ValueError(
            f"kv-canary: launch_canary_plan_kernels supports at most bs={max_bs} reqs per launch, got bs={bs}. "
            "Bump _PLAN_BS_BLOCK_SIZE if real workloads need this."
        )
    if verify_capacity is not None and verify_capacity != plan_capacity:
        who = "launch_canary_plan_kernels" if kernel else "launch_canary_plan_kernels_torch_reference"
        raise ValueError(
            f"kv-canary: {who} verify_capacity={verify_capacity} does not match "
            f"verify_plan_out.verify_slot_indices.shape[0]={plan_capacity}"
        )
    # SGLang's reference checks the valid lengths right after the capacity; its kernel path, last.
    missing_lens = has_pool and not has_valid_lens
    if missing_lens and not kernel:
        raise ValueError(
            "kv-canary: launch_canary_plan_kernels_torch_reference requires req_to_verify_expected_tokens_valid_lens "
            "when req_to_verify_expected_tokens is set"
        )
    if has_lut and lut_len is not None and lut_len < 1:
        raise ValueError(f"kv-canary: lut_len must be positive when has_swa_lut is True, got {lut_len}")
    if bs > write_req_capacity:
        raise ValueError(f"kv-canary: bs={bs} exceeds write_req_capacity={write_req_capacity}")
    if missing_lens:
        raise ValueError(
            "kv-canary: launch_plan_entries_kernel requires req_to_verify_expected_tokens_valid_lens when "
            "req_to_verify_expected_tokens is set"
        )
