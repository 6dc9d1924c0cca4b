"""Checks of real-KV sources (SPEC 2.5, 10): SGLang's ``RealKvSource`` rules, the ABI's 2-D uint8 view, row
widths, coverage of the canary buffer's slots, canary-jax's chunked layouts, and the warning for sources given
with nothing to hash. One of the three parts of :mod:`canary_jax.contract.validation`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from canary_jax.contract import constants, coverage
from canary_jax.contract.arrays import ArrayFacts, check_contiguous, check_hash_mode


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
