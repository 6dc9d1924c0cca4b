"""Real-KV sources: which bytes of the live KV pool feed each slot's ``real_kv_hash`` (SPEC 2.5, 3).

A :class:`RealKvSource` names a view of a KV pool buffer and how slots map onto it: slot ``idx`` owns
``tensor_u8[idx // page_size, (idx % page_size) * num_bytes_per_token : + num_bytes_per_token]``, of which the
first ``read_bytes`` (ALL) or 16 (PARTIAL) are hashed. Row bytes beyond ``page_size * num_bytes_per_token``
are ignored. The validation order and messages are SGLang's (``verify.py``: ``RealKvSource.__post_init__``
and ``_build_real_kv_source_abi``; ``verify_ref.py``: the row-too-narrow check).

**Chunked sources (canary-jax's extension, not SGLang's contract).** With ``chunks=SlotChunks(...)`` a slot's
hashed bytes are the concatenation, in order, of ``num_chunks`` chunks of ``chunk_bytes`` each; chunk ``c``
starts ``offset_bytes + c * chunk_stride_bytes`` bytes after the slot's first byte (``row * row_bytes +
(idx % page_size) * num_bytes_per_token`` in the tensor's flat bytes, rows being dim 0). The sequence is
zero-padded to a multiple of 16 bytes; PARTIAL hashes its first 16 bytes, ALL its first ``read_bytes``. So a
heads-major pool ``[heads, pages, page_size, dim]`` hashes exactly the bytes, in the same order, of the
token-major ``[pages, page_size, heads, dim]`` pool holding the same values, and a fused K/V pool can hash its
K heads or its V heads alone. A chunked source may be N-D (rows are dim 0), needs only 4-byte alignment, and
with one chunk of ``num_bytes_per_token`` bytes at offset 0 (multiples of 16) it is exactly SGLang's dense
source (same descriptor, same program). :mod:`canary_jax.adapters.layouts` builds them for real pool layouts.

Element sizes come from the dtype's bit width, so packed sub-byte dtypes (``int4``, ``float4_e2m1fn``) are
hashed as their packed bytes (XLA's layout: element ``2i`` in the low nibble of byte ``i``); ml_dtypes reports
one byte per such element, which used to give twice the real row width.

JAX arrays are always dense and row-major, so the row stride of a source is its uint8 row width; numpy
sources are checked by their real ``strides[0]``. Launches see sources as a *static descriptor array* of at
most 4 :class:`SourceDescriptor` (hashable; baked into the traced program) plus the tensors as data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from canary_jax.contract import constants, coverage, validation
from canary_jax.contract.source_descriptors import (  # noqa: F401  (re-exported: their first home is here)
    SourceDescriptor,
    _descriptor,
    _is_dense_equivalent,
    _rows_of,
    source_descriptors,
    source_facts,
)
from canary_jax.contract.source_hash import (  # noqa: F401  (re-exported: their first home)
    element_bits,
    real_kv_hash_reference,
    source_words,
)


# --- the source -------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SlotChunks:
    """How a slot's hashed bytes are laid out in a chunked source (canary-jax's extension; see the module doc).

    A slot's byte sequence is ``num_chunks`` chunks of ``chunk_bytes``, chunk ``c`` starting
    ``offset_bytes + c * chunk_stride_bytes`` bytes after the slot's first byte in the tensor's flat bytes,
    zero-padded to a multiple of 16. Sizes are multiples of 4 (``chunk_bytes`` >= 4, ``num_chunks`` >= 1;
    strides and offsets >= 0). No chunk of any slot may cross the end of its row (dim 0).

    Fields:
      chunk_bytes: bytes per chunk.
      num_chunks: chunks per slot.
      chunk_stride_bytes: bytes between the starts of consecutive chunks (e.g. one head's plane, or two heads).
      offset_bytes: bytes from the slot's first byte to chunk 0 (e.g. a V half, or a layer of a stacked pool).
      slot_rows: rows holding slots, or None for every row whose chunks lie inside the tensor. Slots past
        ``slot_rows * page_size`` read as zero bytes (e.g. one layer of a stacked pool whose rows are layers).
    """

    chunk_bytes: int
    num_chunks: int = 1
    chunk_stride_bytes: int = 0
    offset_bytes: int = 0
    slot_rows: int | None = None

    def __post_init__(self) -> None:
        for field in ("chunk_bytes", "num_chunks", "chunk_stride_bytes", "offset_bytes", "slot_rows"):
            value = getattr(self, field)
            if value is None and field == "slot_rows":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"kv-canary: SlotChunks.{field} must be an int, got {value!r}")
            object.__setattr__(self, field, int(value))

    @property
    def slot_bytes(self) -> int:
        """Bytes of a slot's sequence before padding: ``num_chunks * chunk_bytes``."""
        return self.num_chunks * self.chunk_bytes


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RealKvSource:
    """One piece of real KV folded into the fingerprint.

    Fields:
      tensor: the KV buffer, any dtype (packed sub-byte dtypes count their packed bytes): rows (dim 0) are pages
        of ``page_size`` slots. A JAX array (inside your own ``jit`` always a JAX array), or a numpy array for
        host-side tests. Without ``chunks`` (SGLang's source) construction accepts any rank >= 2, as SGLang
        does, but a launch needs it exactly 2-D (``[num_pages, row_elems]``, SGLang's "viewed as uint8 must be
        2-D"); with ``chunks`` it may be N-D and is viewed as ``uint8[shape[0], row_bytes]`` inside the launch
        (no copy). PARTIAL mode hashes the first 16 bytes of each slot whatever ``read_bytes`` says.
      page_size: slots per row of dim 0, ``>= 1``.
      num_bytes_per_token: bytes between consecutive slots of a row; without ``chunks`` also the bytes each slot
        owns, a positive multiple of 16 (with ``chunks``: a positive multiple of 4).
      read_bytes: leading bytes of each slot's sequence hashed in ALL mode, a positive multiple of 16,
        ``<= num_bytes_per_token`` (with ``chunks``: ``<=`` the sequence rounded up to 16 bytes).
      chunks: None for SGLang's dense slot, or a :class:`SlotChunks` (canary-jax's extension).

    Raises (``__post_init__``, SGLang's order and messages, all ``ValueError``, for a source without chunks):
      page_size < 1; bad num_bytes_per_token; bad read_bytes; tensor below 2-D; row stride not a multiple of 16.
      With ``chunks``: :func:`canary_jax.contract.validation.check_source_chunks`. First, ``TypeError`` for a field of
      the wrong kind (``tensor`` that is not an array, ``chunks`` that is not a SlotChunks, a non-int size) and
      ``ValueError`` for a sub-byte tensor whose last dim does not fill whole bytes.
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    chunks: SlotChunks | None = None

    def __post_init__(self) -> None:
        for field in ("page_size", "num_bytes_per_token", "read_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"kv-canary: RealKvSource.{field} must be an int, got {value!r}")
        if self.chunks is not None and not isinstance(self.chunks, SlotChunks):
            raise TypeError(f"kv-canary: RealKvSource.chunks must be a SlotChunks or None, got {self.chunks!r}")
        facts = source_facts(self.tensor)
        if self.chunks is None:
            validation.check_source_fields(
                page_size=self.page_size,
                num_bytes_per_token=self.num_bytes_per_token,
                read_bytes=self.read_bytes,
                tensor=facts,
            )
            return
        if len(facts.shape) < 2:
            raise ValueError(f"kv-canary: RealKvSource.tensor must be at least 2-D, got shape {facts.shape}")
        num_rows, row_bytes = _rows_of(facts)
        validation.check_source_chunks(
            "RealKvSource",
            page_size=int(self.page_size),
            num_bytes_per_token=int(self.num_bytes_per_token),
            read_bytes=int(self.read_bytes),
            chunk_bytes=self.chunks.chunk_bytes,
            num_chunks=self.chunks.num_chunks,
            chunk_stride_bytes=self.chunks.chunk_stride_bytes,
            offset_bytes=self.chunks.offset_bytes,
            slot_rows=self.chunks.slot_rows,
            num_rows=num_rows,
            row_bytes=row_bytes,
            row_stride_bytes=facts.strides_bytes[0],
        )


def _source_flatten(s: RealKvSource):
    return (s.tensor,), (s.page_size, s.num_bytes_per_token, s.read_bytes, s.chunks)


def _source_unflatten(aux, children) -> RealKvSource:
    return prechecked_source(
        children[0], page_size=aux[0], num_bytes_per_token=aux[1], read_bytes=aux[2], chunks=aux[3]
    )


jax.tree_util.register_pytree_node(RealKvSource, _source_flatten, _source_unflatten)


def prechecked_source(
    tensor: Any, *, page_size: int, num_bytes_per_token: int, read_bytes: int, chunks: SlotChunks | None = None
) -> RealKvSource:
    """A :class:`RealKvSource` built without running its checks again.

    For fields that were already validated (a source's own fields, pytree unflattening inside
    transformations where ``tensor`` may be a sentinel, the torch launchers' sources after their launch-time
    checks). Never raises.
    """
    obj = object.__new__(RealKvSource)
    object.__setattr__(obj, "tensor", tensor)
    object.__setattr__(obj, "page_size", page_size)
    object.__setattr__(obj, "num_bytes_per_token", num_bytes_per_token)
    object.__setattr__(obj, "read_bytes", read_bytes)
    object.__setattr__(obj, "chunks", chunks)
    return obj


def check_real_kv_sources(
    sources: Sequence[RealKvSource], mode: constants.RealKvHashMode | int, *, num_slots: int | None = None
) -> tuple[SourceDescriptor, ...]:
    """Launch-time checks of the sources (SGLang ``_build_real_kv_source_abi``), then their descriptors.

    The checks are :mod:`canary_jax.contract.validation`'s, on each tensor's facts: the count (first, every mode),
    each source's kind, contiguity and 2-D uint8 view (every mode; a chunked source may be N-D), and, when the
    launch hashes, each row's width and, given ``num_slots`` (the canary buffer's slots), that it covers every
    slot (the whole-buffer rule, :func:`canary_jax.contract.coverage.check_whole_buffer`). A launch runs this once,
    before tracing, without ``num_slots``: it checks coverage against the slots it hashes where they are known on the
    host (:mod:`canary_jax.contract.coverage`); backends read :func:`source_descriptors`.

    Returns:
      ``source_descriptors(sources, mode)``: empty when ``mode`` is NONE or there are no sources.

    Raises:
      ValueError: more than 4 sources, a source that is not contiguous or not 2-D viewed as uint8, or (PARTIAL
        / ALL) a row narrower than ``page_size * num_bytes_per_token`` or a source whose slots
        (``slot_rows * page_size``) are fewer than ``num_slots``.
      TypeError: an entry that is not a RealKvSource.
    """
    sources = tuple(sources)
    validation.check_source_count(len(sources))
    for i, s in enumerate(sources):
        if not isinstance(s, RealKvSource):
            raise TypeError(f"kv-canary: real_kv_sources[{i}] must be a RealKvSource, got {type(s).__name__}")
    hashing_on = validation.check_hash_mode(mode) != constants.RealKvHashMode.NONE
    for i, s in enumerate(sources):
        facts = source_facts(s.tensor)
        if s.chunks is None:
            num_rows, row_bytes = validation.check_source_layout(i, facts, show_shape=True)
        else:
            validation.check_contiguous(facts, f"real_kv_sources[{i}].tensor")
            num_rows, row_bytes = _rows_of(facts)
        if hashing_on:
            if s.chunks is None:
                validation.check_source_row_width(
                    row_bytes, page_size=s.page_size, num_bytes_per_token=s.num_bytes_per_token
                )
    if hashing_on and num_slots is not None:
        coverage.check_whole_buffer(coverages(sources), num_slots)
    return source_descriptors(sources, mode)


def coverages(sources: Sequence[RealKvSource]) -> tuple[coverage.Coverage, ...]:
    """The slots each checked source holds (``slot_rows * page_size``; :mod:`canary_jax.contract.coverage`). Works on
    tracers (shapes only)."""
    out = []
    for i, s in enumerate(sources):
        d = _descriptor(s, constants.RealKvHashMode.ALL)
        out.append(coverage.coverage(i, rows=d.slot_rows, page_size=s.page_size))
    return tuple(out)


def device_sources(sources: Sequence[RealKvSource]) -> tuple[RealKvSource, ...]:
    """Sources ready to cross ``jit`` without losing a byte.

    numpy tensors become JAX ``uint8`` views of the same bytes: with ``jax_enable_x64`` off, ``jit`` would
    otherwise narrow 8-byte numpy dtypes (int64, float64) to 4 bytes. numpy sub-byte tensors (one element per
    byte in numpy) become packed JAX arrays of their dtype. JAX arrays pass unchanged. Call after
    :func:`check_real_kv_sources` (which checks the layout and contiguity).
    """
    out = []
    for s in sources:
        if isinstance(s.tensor, np.ndarray):
            t = np.ascontiguousarray(s.tensor)
            dev = jax.device_put(t) if element_bits(t.dtype) < 8 else jax.device_put(t.view(np.uint8))
            s = prechecked_source(
                dev,
                page_size=s.page_size,
                num_bytes_per_token=s.num_bytes_per_token,
                read_bytes=s.read_bytes,
                chunks=s.chunks,
            )
        out.append(s)
    return tuple(out)
