"""Real-KV sources: which bytes of the live KV pool feed each slot's ``real_kv_hash`` (SPEC 2.5, 3).

A :class:`RealKvSource` names a 2-D view of a KV pool buffer and how slots map onto it: slot ``idx`` owns
``tensor_u8[idx // page_size, (idx % page_size) * num_bytes_per_token : + num_bytes_per_token]``, of which the
first ``read_bytes`` (ALL) or 16 (PARTIAL) are hashed. Row bytes beyond ``page_size * num_bytes_per_token``
are ignored. The validation order and messages are SGLang's (``verify.py``: ``RealKvSource.__post_init__``
and ``_build_real_kv_source_abi``; ``verify_ref.py``: the row-too-narrow check).

JAX arrays are always dense and row-major, so the row stride of a source is its uint8 row width; numpy
sources are checked by their real ``strides[0]``. Launches see sources as a *static descriptor array* of at
most 4 :class:`SourceDescriptor` (hashable; baked into the traced program) plus the tensors as data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import constants, hashing, pairs, validation


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RealKvSource:
    """One piece of real KV folded into the fingerprint.

    Fields:
      tensor: the KV buffer, any dtype: rows (dim 0) are pages of ``page_size`` slots. Construction accepts
        any rank >= 2 (as SGLang does); a launch needs it exactly 2-D (``[num_pages, row_elems]``, SGLang's
        "viewed as uint8 must be 2-D"), so reshape a ``[pages, page_size, heads, dim]`` pool first. A JAX array
        (inside your own ``jit`` always a JAX array), or a numpy array for host-side tests.
        PARTIAL mode hashes the first 16 bytes of each slot whatever ``read_bytes`` says.
      page_size: slots per row of dim 0, ``>= 1``.
      num_bytes_per_token: bytes each slot owns in its row, a positive multiple of 16.
      read_bytes: leading bytes of each slot hashed in ALL mode, a positive multiple of 16,
        ``<= num_bytes_per_token``.

    Raises (``__post_init__``, SGLang's order and messages, all ``ValueError``):
      page_size < 1; bad num_bytes_per_token; bad read_bytes; tensor below 2-D; row stride not a multiple of 16.
    """

    tensor: Any
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    def __post_init__(self) -> None:
        for field in ("page_size", "num_bytes_per_token", "read_bytes"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"kv-canary: RealKvSource.{field} must be an int, got {value!r}")
        validation.check_source_fields(
            page_size=self.page_size,
            num_bytes_per_token=self.num_bytes_per_token,
            read_bytes=self.read_bytes,
            tensor=validation.array_facts(self.tensor),
        )


jax.tree_util.register_pytree_node(
    RealKvSource,
    lambda s: ((s.tensor,), (s.page_size, s.num_bytes_per_token, s.read_bytes)),
    lambda aux, ch: prechecked_source(ch[0], page_size=aux[0], num_bytes_per_token=aux[1], read_bytes=aux[2]),
)


def prechecked_source(tensor: Any, *, page_size: int, num_bytes_per_token: int, read_bytes: int) -> RealKvSource:
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
    return obj


class SourceDescriptor(NamedTuple):
    """Static description of one source for a launch (one row of SGLang's ``int32[4, 3]`` params table,
    plus the derived sizes a kernel needs)."""

    page_size: int
    num_bytes_per_token: int
    read_bytes: int
    effective_read_bytes: int  # 16 in PARTIAL, read_bytes in ALL
    row_bytes: int  # uint8 width of one row (== row stride for dense arrays)
    num_rows: int


def check_real_kv_sources(
    sources: Sequence[RealKvSource], mode: constants.RealKvHashMode | int, *, num_slots: int | None = None
) -> tuple[SourceDescriptor, ...]:
    """Launch-time checks of the sources (SGLang ``_build_real_kv_source_abi``), then their descriptors.

    The checks are :mod:`canary_jax.validation`'s, on each tensor's facts: the count (first, every mode),
    each source's kind, contiguity and 2-D uint8 view (every mode), and, when the launch hashes, each row's
    width and, given ``num_slots`` (the canary buffer's slots), that it covers every slot. A launch runs
    this once, before tracing (:func:`canary_jax.plans.check_context` passes ``num_slots``); backends read
    :func:`source_descriptors`.

    Returns:
      ``source_descriptors(sources, mode)``: empty when ``mode`` is NONE or there are no sources.

    Raises:
      ValueError: more than 4 sources, a source that is not contiguous or not 2-D viewed as uint8, or (PARTIAL
        / ALL) a row narrower than ``page_size * num_bytes_per_token`` or a source whose
        ``num_rows * page_size`` is below ``num_slots``.
      TypeError: an entry that is not a RealKvSource.
    """
    sources = tuple(sources)
    validation.check_source_count(len(sources))
    for i, s in enumerate(sources):
        if not isinstance(s, RealKvSource):
            raise TypeError(f"kv-canary: real_kv_sources[{i}] must be a RealKvSource, got {type(s).__name__}")
    hashing_on = validation.check_hash_mode(mode) != constants.RealKvHashMode.NONE
    for i, s in enumerate(sources):
        num_rows, row_bytes = validation.check_source_layout(i, validation.array_facts(s.tensor))
        if hashing_on:
            validation.check_source_row_width(
                row_bytes, page_size=s.page_size, num_bytes_per_token=s.num_bytes_per_token
            )
            if num_slots is not None:
                validation.check_source_coverage(i, num_rows=num_rows, page_size=s.page_size, num_slots=num_slots)
    return source_descriptors(sources, mode)


def source_descriptors(
    sources: Sequence[RealKvSource], mode: constants.RealKvHashMode | int
) -> tuple[SourceDescriptor, ...]:
    """The static descriptor array of sources that passed :func:`check_real_kv_sources` (checks nothing).

    Works on tracers (only shapes and dtypes are read). Empty when ``mode`` is NONE or there are no sources
    (nothing is hashed then; the tensors are never read).
    """
    mode = constants.RealKvHashMode(int(mode))
    if mode == constants.RealKvHashMode.NONE or not sources:
        return ()
    descs = []
    for s in sources:
        shape = tuple(int(d) for d in s.tensor.shape)
        eff = constants.PARTIAL_READ_BYTES if mode == constants.RealKvHashMode.PARTIAL else s.read_bytes
        descs.append(
            SourceDescriptor(
                page_size=int(s.page_size),
                num_bytes_per_token=int(s.num_bytes_per_token),
                read_bytes=int(s.read_bytes),
                effective_read_bytes=int(eff),
                row_bytes=shape[1] * np.dtype(s.tensor.dtype).itemsize,
                num_rows=shape[0],
            )
        )
    return tuple(descs)


def device_sources(sources: Sequence[RealKvSource]) -> tuple[RealKvSource, ...]:
    """Sources ready to cross ``jit`` without losing a byte.

    numpy tensors become JAX ``uint8`` views of the same bytes: with ``jax_enable_x64`` off, ``jit`` would
    otherwise narrow 8-byte numpy dtypes (int64, float64) to 4 bytes. JAX arrays pass unchanged. Call after
    :func:`check_real_kv_sources` (which checks 2-D and contiguity).
    """
    out = []
    for s in sources:
        if isinstance(s.tensor, np.ndarray):
            u8 = np.ascontiguousarray(s.tensor).view(np.uint8)
            s = prechecked_source(
                jax.device_put(u8),
                page_size=s.page_size,
                num_bytes_per_token=s.num_bytes_per_token,
                read_bytes=s.read_bytes,
            )
        out.append(s)
    return tuple(out)


def source_words(tensor: jax.Array) -> jax.Array:
    """A 2-D source of any dtype as ``uint32[rows, row_bytes // 4]`` (bitcast; row_bytes % 16 == 0)."""
    tensor = jnp.asarray(tensor)
    if tensor.dtype == jnp.bool_:  # bitcast refuses bool; a bool element is one byte holding 0 or 1
        tensor = tensor.astype(jnp.uint8)
    rows = tensor.shape[0]
    itemsize = np.dtype(tensor.dtype).itemsize
    if itemsize == 4:
        return jax.lax.bitcast_convert_type(tensor, jnp.uint32).reshape(rows, -1)
    if itemsize < 4:
        per = 4 // itemsize
        t = tensor.reshape(rows, -1, per)
        return jax.lax.bitcast_convert_type(t, jnp.uint32)
    # itemsize 8 (x64 on): each element becomes two words
    return jax.lax.bitcast_convert_type(tensor, jnp.uint32).reshape(rows, -1)


def real_kv_hash_reference(
    tensors: Sequence[jax.Array], descs: Sequence[SourceDescriptor], slots: jax.Array
) -> pairs.U64:
    """Combined real-KV fingerprint of ``slots`` (int32, any shape), pure jnp (SPEC 2.5).

    Slots whose row lies outside a source read as zero bytes there (canary-jax never reads outside a
    buffer); negative slots likewise. With no descriptors the result is 0.

    Returns:
      U64 of ``slots.shape``.
    """
    if not descs:
        return pairs.const(0, slots.shape)
    per_source = []
    for tensor, d in zip(tensors, descs):
        words = source_words(tensor)  # u32[rows, row_bytes/4]
        row = slots // d.page_size
        col0 = (slots % d.page_size) * (d.num_bytes_per_token // 4)
        nw = d.effective_read_bytes // 4
        ok = (slots >= 0) & (row < d.num_rows)
        row_c = jnp.where(ok, row, 0)
        cols = col0[..., None] + jnp.arange(nw, dtype=jnp.int32)
        gathered = words[row_c[..., None], jnp.where(ok[..., None], cols, 0)]
        gathered = jnp.where(ok[..., None], gathered, jnp.uint32(0))
        per_source.append(hashing.fold_words(gathered, nw // 2))
    return hashing.combine_sources(per_source)
