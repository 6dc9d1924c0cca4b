"""The one validation layer: every static check of a launch, shared by the JAX entry points and the torch
launchers (SPEC 3, 4, 10).

Checks are written on framework-neutral facts about an array (:class:`ArrayFacts`: shape, a dtype name,
the itemsize, strides in bytes, contiguity), so :mod:`canary_jax` and :mod:`interop` call the very same code;
each side only turns its arrays into facts (:func:`array_facts` for numpy / JAX, ``interop.arguments`` for
torch). Dtype names are compared as given and printed as given, so torch callers keep torch's names in the
messages (``torch.int64``) and JAX callers numpy's (``uint32``). :class:`DtypeNames` says how each side
spells the dtypes of SGLang's tensors, and whether int64 arrays are held as ``uint32[..., 2]`` pairs.

Messages are SGLang's where SGLang has one (tests pin them). Every function raises ``TypeError`` for a wrong
kind or dtype and ``ValueError`` for a wrong value or shape, and returns nothing unless documented. Each
launch runs each check once: the entry points call these functions before tracing, and what runs after
(device transfer, backends) trusts them.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from canary_jax.contract import constants, coverage


# --- facts ---------------------------------------------------------------------------------------------------
class ArrayFacts(NamedTuple):
    """What the checks need to know about one array.

    Fields:
      shape: the array's shape.
      dtype: the dtype's display name (``"uint8"`` for numpy / JAX, ``"torch.uint8"`` for torch).
      itemsize: bytes per element.
      strides_bytes: strides in bytes (dense row-major for JAX arrays).
      contiguous: whether the elements are dense and row-major.
    """

    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    strides_bytes: tuple[int, ...]
    contiguous: bool = True


def dense_strides_bytes(shape: Sequence[int], itemsize: int) -> tuple[int, ...]:
    """Row-major strides in bytes of a dense array of ``shape``."""
    out, acc = [], int(itemsize)
    for d in reversed(tuple(shape)):
        out.append(acc)
        acc *= int(d)
    return tuple(reversed(out))


def array_facts(x: Any) -> ArrayFacts:
    """Facts of a numpy array, a JAX array or tracer, or a ``jax.ShapeDtypeStruct``.

    numpy arrays report their real strides and contiguity; everything else is dense and row-major.
    """
    dt = np.dtype(x.dtype)
    shape = tuple(int(d) for d in x.shape)
    if isinstance(x, np.ndarray):
        return ArrayFacts(shape, str(dt), dt.itemsize, tuple(int(s) for s in x.strides), bool(x.flags.c_contiguous))
    return ArrayFacts(shape, str(dt), dt.itemsize, dense_strides_bytes(shape, dt.itemsize))


class DtypeNames(NamedTuple):
    """How one side spells SGLang's dtypes, and how it holds int64 arrays.

    Fields:
      u8, i32, i64: dtype names of SGLang's uint8, int32 and int64 tensors on this side.
      int64_pairs: int64 arrays are held as ``u32[..., 2]`` pairs (``i64`` is then ``"uint32"``).
    """

    u8: str
    i32: str
    i64: str
    int64_pairs: bool

    def int64_shape(self, *logical: int | None) -> tuple[int | None, ...]:
        """The physical shape of an int64 array of logical shape ``logical``."""
        return logical + (2,) if self.int64_pairs else logical


JAX_DTYPES = DtypeNames(u8="uint8", i32="int32", i64="uint32", int64_pairs=True)
"""canary-jax's own arrays: int64 as ``uint32[..., 2]`` pairs."""


# --- arrays -------------------------------------------------------------------------------------------------
def shape_matches(got: Sequence[int], want: Sequence[int | None]) -> bool:
    """Whether ``got`` has ``want``'s rank and sizes (``None`` in ``want`` matches any size)."""
    got, want = tuple(got), tuple(want)
    return len(got) == len(want) and all(w is None or w == g for w, g in zip(want, got))


def format_shape(shape: Sequence[int | None]) -> str:
    """A shape as messages print it: ``[4, 2]``, ``[]`` for a scalar, ``*`` for a size that may be anything
    (``None``): ``[*, 8]``."""
    return "[" + ", ".join("*" if d is None else str(int(d)) for d in shape) + "]"


def check_shape(name: str, got: Sequence[int], want: Sequence[int | None]) -> None:
    """Raises ValueError ``kv-canary: {name} must have shape [4, *], got [4, 3, 2]`` on a mismatch (see
    :func:`format_shape`)."""
    if not shape_matches(got, want):
        raise ValueError(f"kv-canary: {name} must have shape {format_shape(want)}, got {format_shape(got)}")


def check_same_length(name: str, length: int, *, ref_name: str, ref_length: int) -> None:
    """``name`` has as many entries as ``ref_name`` (SGLang binds ``num_tokens`` to ``input_ids``, the first
    token array it checks, and matches the others against it).

    Raises:
      ValueError: ``kv-canary: input_ids (3 entries) is shorter than positions (5 entries); they must have
        the same length``: the shorter array is named first, whichever of the two it is.
    """
    if length != ref_length:
        (short, n_short), (long, n_long) = sorted(((ref_name, ref_length), (name, length)), key=lambda e: e[1])
        raise ValueError(
            f"kv-canary: {short} ({n_short} entries) is shorter than {long} ({n_long} entries); "
            "they must have the same length"
        )


def check_array(facts: ArrayFacts, name: str, dtype: str, shape: Sequence[int | None]) -> None:
    """Dtype, then shape.

    Raises:
      TypeError: ``kv-canary: {name} must have dtype {dtype}, got {facts.dtype}``.
      ValueError: wrong rank or size (see :func:`check_shape`).
    """
    if facts.dtype != dtype:
        raise TypeError(f"kv-canary: {name} must have dtype {dtype}, got {facts.dtype}")
    check_shape(name, facts.shape, shape)


def check_contiguous(facts: ArrayFacts, name: str) -> None:
    """SGLang's check and message: ``kv-canary: {name} must be contiguous`` (ValueError)."""
    if not facts.contiguous:
        raise ValueError(f"kv-canary: {name} must be contiguous")


# --- canary buffer --------------------------------------------------------------------------------------------
def check_canary_buffer(facts: ArrayFacts, *, name: str = "canary_buf", u8: str = "uint8") -> None:
    """A canary buffer ``uint8[num_slots, slot_stride_bytes]`` (SPEC 1.1).

    ``1 <= num_slots <= 2**31 - 1``. SGLang's matchers let an empty buffer through, but no launch can use
    one (every entry would address a slot outside it, which SGLang leaves undefined and canary-jax's jnp
    gathers cannot express), so both the JAX entry points and the torch launchers refuse it here, before
    anything runs. The stride is a multiple of 8 bytes (SGLang's references view the buffer as int64) holding
    at least the four int64 fields.

    Raises:
      TypeError: dtype is not ``u8``.
      ValueError: not 2-D; stride not a multiple of 8 bytes; stride below 32 bytes (SGLang's message, in
        int64 fields); no slots, or ``2**31`` slots or more.
    """
    if facts.dtype != u8:
        raise TypeError(f"kv-canary: {name} must have dtype {u8}, got {facts.dtype}")
    if len(facts.shape) != 2:
        raise ValueError(f"kv-canary: {name} must be 2-D [num_slots, slot_stride_bytes], got shape {facts.shape}")
    num_slots, stride = facts.shape
    if stride % 8 != 0:
        raise ValueError(f"kv-canary: {name} slot stride must be a multiple of 8 bytes, got {stride}")
    if stride < constants.CANARY_SLOT_BYTES:
        raise ValueError(f"kv-canary: canary_buf slot stride must hold at least 4 int64 fields, got {stride // 8}")
    if not 1 <= num_slots < 2**31:
        raise ValueError(f"kv-canary: {name} must have between 1 and 2**31 - 1 slots, got {num_slots}")


# --- launch statics -------------------------------------------------------------------------------------------
def check_kernel_kind(kernel_kind: Any) -> constants.CanaryLaunchTag:
    """The launch tag as a ``CanaryLaunchTag``.

    Raises:
      ValueError: ``kv-canary: kernel_kind must be a CanaryLaunchTag, got {kernel_kind!r}``.
    """
    return _enum_member(constants.CanaryLaunchTag, kernel_kind, "kernel_kind")


def check_hash_mode(mode: Any) -> constants.RealKvHashMode:
    """The real-KV hash mode as a ``RealKvHashMode``.

    Raises:
      ValueError: ``kv-canary: real_kv_hash_mode must be a RealKvHashMode, got {mode!r}``.
    """
    return _enum_member(constants.RealKvHashMode, mode, "real_kv_hash_mode")


def _enum_member(enum: type, value: Any, name: str) -> Any:
    try:
        return enum(int(value))
    except (TypeError, ValueError):
        raise ValueError(f"kv-canary: {name} must be a {enum.__name__}, got {value!r}") from None


def check_expected_inputs(enable_write_input_assert: bool, *, has_tokens: bool, has_positions: bool) -> None:
    """The write-input-assert presence rule (SGLang's ``write_ref`` messages).

    Raises:
      ValueError: an expected tensor missing with the assert on, or present with it off.
    """
    if enable_write_input_assert:
        if not (has_tokens and has_positions):
            raise ValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
    elif has_tokens or has_positions:
        raise ValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")


# --- real-KV sources ------------------------------------------------------------------------------------------
def check_source_count(count: int) -> None:
    """At most ``MAX_REAL_KV_SOURCES`` sources, checked first and in every hash mode (SGLang's message).

    Raises:
      ValueError: more than 4 sources.
    """
    if count > constants.MAX_REAL_KV_SOURCES:
        raise ValueError(
            f"kv-canary: at most {constants.MAX_REAL_KV_SOURCES} RealKvSource entries supported by the CUDA ABI, "
            f"got {count}"
        )


def check_source_fields(*, page_size: int, num_bytes_per_token: int, read_bytes: int, tensor: ArrayFacts) -> None:
    """SGLang's ``RealKvSource.__post_init__``, in its order and with its messages (all ValueError).

    Args:
      page_size, num_bytes_per_token, read_bytes: the source's ints.
      tensor: facts of the source tensor (any rank; the row stride is ``strides_bytes[0]``).

    Raises:
      ValueError: ``page_size < 1``; ``num_bytes_per_token`` or ``read_bytes`` not a positive multiple of 16
        (``read_bytes <= num_bytes_per_token``); tensor below 2-D; row stride not a multiple of 16 bytes.
    """
    if page_size < 1:
        raise ValueError(f"kv-canary: RealKvSource.page_size must be >= 1, got {page_size}")
    if num_bytes_per_token <= 0 or num_bytes_per_token % 16 != 0:
        raise ValueError(
            f"kv-canary: RealKvSource.num_bytes_per_token must be a positive multiple of 16, got {num_bytes_per_token}"
        )
    if read_bytes <= 0 or read_bytes > num_bytes_per_token or read_bytes % 16 != 0:
        raise ValueError(
            "kv-canary: RealKvSource.read_bytes must be a positive multiple of 16 in "
            f"(0, num_bytes_per_token={num_bytes_per_token}], got {read_bytes}"
        )
    if len(tensor.shape) < 2:
        raise ValueError(f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape {tensor.shape}")
    row_stride_bytes = tensor.strides_bytes[0]
    if row_stride_bytes % 16 != 0:
        strides = tuple(s // tensor.itemsize for s in tensor.strides_bytes)
        raise ValueError(
            "kv-canary: RealKvSource.tensor row stride must be a multiple of 16 bytes, "
            f"got {row_stride_bytes} bytes (shape={tensor.shape}, strides={strides}, dtype={tensor.dtype})"
        )


def check_source_layout(index: int, tensor: ArrayFacts, *, show_shape: bool = False) -> tuple[int, int]:
    """SGLang's ``_build_real_kv_source_abi`` checks of source ``index`` (every hash mode).

    Args:
      show_shape: append the tensor's shape and dtype (and how to fix it) to SGLang's 2-D message, which
        stays its prefix (the JAX entry points; the torch launchers keep SGLang's exact text).

    Returns:
      ``(num_rows, row_bytes)`` of the tensor viewed as ``uint8[num_rows, row_bytes]``.

    Raises:
      ValueError: not contiguous; not 2-D viewed as uint8.
    """
    check_contiguous(tensor, f"real_kv_sources[{index}].tensor")
    if len(tensor.shape) != 2:
        msg = f"kv-canary: real_kv_sources[{index}].tensor (viewed as uint8) must be 2-D, got {len(tensor.shape)}-D"
        if show_shape:
            msg += (
                f" (shape {tuple(tensor.shape)}, dtype {tensor.dtype}); view the pool as [rows, row_elems] "
                "(tensor.reshape(tensor.shape[0], -1)), or build the source with canary_jax.adapters.layouts"
            )
        raise ValueError(msg)
    return tensor.shape[0], tensor.shape[1] * tensor.itemsize


def check_kv_write_result(result: Any) -> tuple[Any, Any]:
    """``(kv_state, real_kv_sources)``: what the step API's ``kv_write_fn`` must return.

    Raises:
      TypeError: anything but a 2-tuple (or 2-list), naming ``kv_write_fn`` and what it returned.
    """
    if isinstance(result, (tuple, list)) and len(result) == 2:
        return result[0], result[1]
    got = f"a {type(result).__name__} of {len(result)}" if isinstance(result, (tuple, list)) else type(result).__name__
    raise TypeError(
        "kv-canary: kv_write_fn must return a pair (kv_state, real_kv_sources): the new KV state and one "
        f"(sources_k, sources_v) pair per group, or None with real_kv_hash_mode NONE; got {got}"
    )


_WARNED_UNHASHED: set = set()  # entry points that already warned about sources in NONE mode


def warn_unhashed_sources(real_kv_sources: Sequence, mode: Any, *, who: str) -> None:
    """Warns (``UserWarning``, once per process per entry point ``who``) that real-KV sources were given while
    ``mode`` is NONE, which hashes nothing: the call checks the bookkeeping only.

    Args:
      real_kv_sources: checked ``(sources_k, sources_v)`` pairs, one per group.
      mode: the call's real-KV hash mode.
      who: the entry point named in the message (``canary_tail``, ``CanaryGuard``, ...).
    """
    if check_hash_mode(mode) != constants.RealKvHashMode.NONE or who in _WARNED_UNHASHED:
        return
    count = sum(len(k) + len(v) for k, v in real_kv_sources)
    if count == 0:
        return
    _WARNED_UNHASHED.add(who)
    warnings.warn(
        f"kv-canary: {who} got {count} real-KV source(s) but real_kv_hash_mode is NONE, so the real KV is not "
        "hashed (only the bookkeeping is checked); set real_kv_hash_mode to PARTIAL or ALL to fingerprint it, or "
        "pass no sources",
        UserWarning,
        stacklevel=3,
    )


def check_source_row_width(row_bytes: int, *, page_size: int, num_bytes_per_token: int) -> None:
    """A row holds ``page_size`` slots of ``num_bytes_per_token`` bytes (SGLang ``verify_ref``; checked only
    when the launch hashes, as SGLang's reference reads sources only then).

    Raises:
      ValueError: the row is too narrow.
    """
    need = page_size * num_bytes_per_token
    if row_bytes < need:
        raise ValueError(
            "kv-canary: RealKvSource row is too narrow for its slot layout: "
            f"dim-1 is {row_bytes} bytes but page_size={page_size} x num_bytes_per_token={num_bytes_per_token} "
            f"needs {need}"
        )


def check_source_coverage(index: int, *, num_rows: int, page_size: int, num_slots: int) -> None:
    """Source ``index`` covers every slot of the canary buffer: ``num_rows * page_size >= num_slots``.

    The whole-buffer rule (:func:`canary_jax.contract.coverage.check_whole_buffer`): what a launch needs where its slots
    are not known on the host. Launches whose slots are known check only the slots they hash
    (:func:`canary_jax.contract.coverage.check_slots`).

    Args:
      index: the source's position in ``real_kv_sources``.
      num_rows: the source's rows (dim 0 of its 2-D uint8 view).
      page_size: the source's slots per row.
      num_slots: the canary buffer's slots (its dim 0).

    Raises:
      ValueError: ``kv-canary: real_kv_sources[{index}] covers {covered} slots ({num_rows} rows x page_size
        {page_size}) but canary_buf has {num_slots} slots``.
    """
    coverage.check_whole_buffer([coverage.coverage(index, rows=num_rows, page_size=page_size)], num_slots)


def check_source_chunks(
    name: str,
    *,
    page_size: int,
    num_bytes_per_token: int,
    read_bytes: int,
    chunk_bytes: int,
    num_chunks: int,
    chunk_stride_bytes: int,
    offset_bytes: int,
    slot_rows: int | None,
    num_rows: int,
    row_bytes: int,
    row_stride_bytes: int,
) -> None:
    """A chunked source (canary-jax's extension, ``canary_jax.contract.sources.SlotChunks``; not SGLang's contract).

    A slot's sequence is ``num_chunks`` chunks of ``chunk_bytes``, chunk ``c`` at ``offset_bytes + c *
    chunk_stride_bytes`` bytes after the slot's first byte, zero-padded to a multiple of 16 bytes. Sizes are
    multiples of 4 (the kernels read 4-byte words); no chunk of any slot of a row may cross the row's end
    (``offset % row_bytes + (num_chunks - 1) * (stride % row_bytes) + (page_size - 1) * num_bytes_per_token +
    chunk_bytes <= row_bytes``); at least one row of slots lies inside the tensor (at least ``slot_rows`` when
    given); rows and row words fit int32.

    Args:
      name: prefix of the messages (``RealKvSource``).
      page_size, num_bytes_per_token, read_bytes: the source's ints.
      chunk_bytes, num_chunks, chunk_stride_bytes, offset_bytes, slot_rows: the chunk layout.
      num_rows, row_bytes: the tensor viewed as ``uint8[num_rows, row_bytes]`` (rows = dim 0).
      row_stride_bytes: the tensor's dim-0 stride in bytes.

    Raises:
      ValueError: naming the field and its value.
    """
    if page_size < 1:
        raise ValueError(f"kv-canary: {name}.page_size must be >= 1, got {page_size}")
    if num_bytes_per_token <= 0 or num_bytes_per_token % 4 != 0:
        raise ValueError(
            f"kv-canary: {name}.num_bytes_per_token must be a positive multiple of 4 for a chunked source, "
            f"got {num_bytes_per_token}"
        )
    if chunk_bytes <= 0 or chunk_bytes % 4 != 0:
        raise ValueError(f"kv-canary: {name}.chunks.chunk_bytes must be a positive multiple of 4, got {chunk_bytes}")
    if num_chunks < 1:
        raise ValueError(f"kv-canary: {name}.chunks.num_chunks must be >= 1, got {num_chunks}")
    for field, value in (("chunk_stride_bytes", chunk_stride_bytes), ("offset_bytes", offset_bytes)):
        if value < 0 or value % 4 != 0:
            raise ValueError(f"kv-canary: {name}.chunks.{field} must be a non-negative multiple of 4, got {value}")
    padded = -(-num_chunks * chunk_bytes // 16) * 16
    if read_bytes <= 0 or read_bytes > padded or read_bytes % 16 != 0:
        raise ValueError(
            f"kv-canary: {name}.read_bytes must be a positive multiple of 16 in (0, {padded}] (the slot's "
            f"{num_chunks} x {chunk_bytes} chunk bytes rounded up to 16), got {read_bytes}"
        )
    if row_stride_bytes % 4 != 0 or row_bytes % 4 != 0:
        raise ValueError(
            f"kv-canary: {name}.tensor rows must be a multiple of 4 bytes for a chunked source, "
            f"got {row_bytes} bytes (row stride {row_stride_bytes})"
        )
    if row_bytes == 0 or num_rows == 0:
        raise ValueError(f"kv-canary: {name}.tensor holds no bytes (rows={num_rows}, row_bytes={row_bytes})")
    off_rows, off_cols = divmod(offset_bytes, row_bytes)
    stride_rows, stride_cols = divmod(chunk_stride_bytes, row_bytes) if num_chunks > 1 else (0, 0)
    end = off_cols + (num_chunks - 1) * stride_cols + (page_size - 1) * num_bytes_per_token + chunk_bytes
    if end > row_bytes:
        raise ValueError(
            f"kv-canary: {name} chunks cross the end of a row: the last slot of a row (page_size={page_size} x "
            f"num_bytes_per_token={num_bytes_per_token}) ends its chunks at byte {end} of a {row_bytes}-byte row "
            f"(chunk_bytes={chunk_bytes}, num_chunks={num_chunks}, chunk_stride_bytes={chunk_stride_bytes}, "
            f"offset_bytes={offset_bytes})"
        )
    fit = num_rows - off_rows - (num_chunks - 1) * stride_rows
    if fit < 1:
        raise ValueError(
            f"kv-canary: {name} chunks lie past the tensor's {num_rows} rows for every slot "
            f"(offset_bytes={offset_bytes}, chunk_stride_bytes={chunk_stride_bytes}, row_bytes={row_bytes})"
        )
    if slot_rows is not None and not 1 <= slot_rows <= fit:
        raise ValueError(
            f"kv-canary: {name}.chunks.slot_rows must be in [1, {fit}] (the rows whose chunks lie inside the "
            f"tensor), got {slot_rows}"
        )
    if num_rows >= 2**31 or row_bytes // 4 >= 2**31:
        raise ValueError(
            f"kv-canary: {name}.tensor of {num_rows} rows x {row_bytes} bytes exceeds the int32 row / word range"
        )


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


def check_ring(facts: ArrayFacts, names: DtypeNames, *, name: str = "violation_ring") -> None:
    """The violation ring: int64 ``[R, 8]`` with ``R >= 1`` (SPEC 1.2).

    Raises:
      TypeError / ValueError naming the ring.
    """
    check_array(facts, name, names.i64, names.int64_shape(None, constants.VIOLATION_FIELDS))
    if facts.shape[0] < 1:
        raise ValueError(f"kv-canary: {name} must have at least one row")


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
