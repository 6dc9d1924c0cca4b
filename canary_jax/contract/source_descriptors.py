"""Static source descriptors: a source's byte facts and the hashable :class:`SourceDescriptor` a launch bakes into
its traced program (one row of SGLang's ``int32[4, 3]`` params table plus the sizes and chunk geometry a kernel
needs).

:func:`source_descriptors` describes sources that passed
:func:`canary_jax.contract.sources.check_real_kv_sources` and checks nothing; it reads only shapes and dtypes, so
it works on tracers. :mod:`canary_jax.contract.sources` re-exports every name here (their first home).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from canary_jax.contract import constants, validation
from canary_jax.contract.source_hash import element_bits


# --- facts ----------------------------------------------------------------------------------
def source_facts(tensor: Any) -> validation.ArrayFacts:
    """:func:`canary_jax.contract.validation.array_facts` of a source tensor, in bytes.

    A packed sub-byte tensor (``int4``, ``float4_e2m1fn``, ...) is described as the uint8 array of its packed
    bytes (last dim ``shape[-1] * bits / 8``), so the row width is its real byte width.

    Raises:
      TypeError: ``tensor`` is not an array (no ``shape`` / ``dtype``).
      ValueError: a sub-byte tensor's last dim does not fill whole bytes.
    """
    if not (hasattr(tensor, "shape") and hasattr(tensor, "dtype")):
        raise TypeError(
            f"kv-canary: RealKvSource.tensor must be an array (a JAX or numpy array of the KV pool), "
            f"got {type(tensor).__name__}"
        )
    bits = element_bits(tensor.dtype)
    if bits >= 8:
        return validation.array_facts(tensor)
    shape = tuple(int(d) for d in tensor.shape)
    if not shape or (shape[-1] * bits) % 8:
        raise ValueError(
            f"kv-canary: RealKvSource.tensor of {bits}-bit dtype {np.dtype(tensor.dtype)} must hold whole bytes "
            f"along its last dim (a multiple of {8 // bits} elements), got shape {shape}"
        )
    packed = shape[:-1] + (shape[-1] * bits // 8,)
    contiguous = bool(tensor.flags.c_contiguous) if isinstance(tensor, np.ndarray) else True
    name = f"{np.dtype(tensor.dtype)} (packed, {8 // bits} per byte)"
    return validation.ArrayFacts(packed, name, 1, validation.dense_strides_bytes(packed, 1), contiguous)


def _rows_of(facts: validation.ArrayFacts) -> tuple[int, int]:
    """``(num_rows, row_bytes)`` of a source viewed as ``uint8[shape[0], rest]``."""
    return facts.shape[0], math.prod(facts.shape[1:]) * facts.itemsize


# --- descriptors ------------------------------------------------------------------------------------------------
class SourceDescriptor(NamedTuple):
    """Static description of one source for a launch (one row of SGLang's ``int32[4, 3]`` params table,
    plus the derived sizes a kernel needs, plus the chunk geometry of a chunked source).

    A dense (SGLang) source has ``chunk_bytes == 0`` and every chunk field at its default; a chunked source
    stores its :class:`SlotChunks` strides and offset split into whole rows and the bytes within a row (the
    split is exact because no chunk crosses a row).
    """

    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    effective_read_bytes: int  # 16 in PARTIAL, read_bytes in ALL
    row_bytes: int  # uint8 width of one row (== row stride for dense arrays)
    num_rows: int
    chunk_bytes: int = 0  # 0: SGLang's dense slot (the slot's first effective_read_bytes bytes)
    num_chunks: int = 1
    chunk_stride_rows: int = 0
    chunk_stride_cols: int = 0  # bytes
    offset_rows: int = 0
    offset_cols: int = 0  # bytes
    row_limit: int = 0  # SlotChunks.slot_rows, 0 = none

    @property
    def dense(self) -> bool:
        """SGLang's slot layout: the hashed bytes are the leading bytes of the slot's own run."""
        return self.chunk_bytes == 0

    @property
    def slot_rows(self) -> int:
        """Rows holding slots whose chunks all lie inside the source: slots ``< slot_rows * page_size`` hash,
        the others read as zero bytes."""
        fit = self.num_rows - self.offset_rows - (self.num_chunks - 1) * self.chunk_stride_rows
        return min(fit, self.row_limit) if self.row_limit else fit

    @property
    def slot_bytes(self) -> int:
        """Bytes of a slot's sequence before padding (``num_bytes_per_token`` for a dense source)."""
        return self.num_bytes_per_token if self.dense else self.num_chunks * self.chunk_bytes

    def word_address(self, k: int) -> tuple[int, int, bool]:
        """``(row_delta, col_word_delta, in_sequence)`` of word ``k`` (static) of a slot's sequence, relative to
        the slot's ``(row, first word)``; words past the sequence are padding (zero)."""
        if self.dense:
            return 0, k, True
        cw = self.chunk_bytes // 4
        c, w = divmod(k, cw)
        if c >= self.num_chunks:
            return 0, 0, False
        return (
            self.offset_rows + c * self.chunk_stride_rows,
            (self.offset_cols + c * self.chunk_stride_cols) // 4 + w,
            True,
        )


def _descriptor(s: Any, mode: constants.RealKvHashMode) -> SourceDescriptor:
    facts = source_facts(s.tensor)
    num_rows, row_bytes = _rows_of(facts)
    eff = constants.PARTIAL_READ_BYTES if mode == constants.RealKvHashMode.PARTIAL else int(s.read_bytes)
    base = SourceDescriptor(
        page_size=int(s.page_size),
        num_bytes_per_token=int(s.num_bytes_per_token),
        read_bytes=int(s.read_bytes),
        effective_read_bytes=int(eff),
        row_bytes=row_bytes,
        num_rows=num_rows,
    )
    ch = s.chunks
    if ch is None:
        return base
    if _is_dense_equivalent(s, row_bytes):
        return base._replace(row_limit=ch.slot_rows or 0)
    off_rows, off_cols = divmod(ch.offset_bytes, row_bytes)
    stride_rows, stride_cols = divmod(ch.chunk_stride_bytes, row_bytes) if ch.num_chunks > 1 else (0, 0)
    return base._replace(
        chunk_bytes=ch.chunk_bytes,
        num_chunks=ch.num_chunks,
        chunk_stride_rows=stride_rows,
        chunk_stride_cols=stride_cols,
        offset_rows=off_rows,
        offset_cols=off_cols,
        row_limit=ch.slot_rows or 0,
    )


def _is_dense_equivalent(s: Any, row_bytes: int) -> bool:
    """A chunked source whose sequence is the leading bytes of each slot's SGLang run (one chunk at offset 0,
    SGLang's 16-byte alignment): it gets SGLang's dense descriptor, hence the very same program."""
    ch = s.chunks
    nbpt = int(s.num_bytes_per_token)
    return (
        ch.num_chunks == 1
        and ch.offset_bytes == 0
        and ch.chunk_bytes % 16 == 0
        and ch.chunk_bytes <= nbpt
        and nbpt % 16 == 0
        and row_bytes % 16 == 0
    )


def source_descriptors(sources: Sequence[Any], mode: constants.RealKvHashMode | int) -> tuple[SourceDescriptor, ...]:
    """The static descriptor array of sources that passed :func:`check_real_kv_sources` (checks nothing).

    Works on tracers (only shapes and dtypes are read). Empty when ``mode`` is NONE or there are no sources
    (nothing is hashed then; the tensors are never read).
    """
    mode = constants.RealKvHashMode(int(mode))
    if mode == constants.RealKvHashMode.NONE or not sources:
        return ()
    return tuple(_descriptor(s, mode) for s in sources)
