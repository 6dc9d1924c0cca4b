"""Faults in the bytes of a buffer: a KV slot's bytes (:func:`flip_kv_bits`) and a canary record
(:func:`flip_canary_bits`), as pure functions (numpy in, numpy out; JAX in, JAX out, jit-able).

A KV flip models SGLang's ``real_kv_used`` / ``real_kv_unused_cache`` / ``real_kv_post_forward`` perturbations
(caught by the real-KV fingerprint of the verify that next reads the slot); a canary-record flip a corrupted
canary buffer (caught by the chain or position check). Re-exported by :mod:`canary_jax.tools.faults`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants, ints, sources
from canary_jax.runtime import shapes
from canary_jax.tools.faults.array_checks import _check_index, _is_jax

__all__ = ["flip_canary_bits", "flip_kv_bits"]


def _rows_bytes(tensor: Any) -> tuple[int, int]:
    rows = int(tensor.shape[0])
    return rows, int(np.prod(tensor.shape[1:], dtype=np.int64)) * sources.element_bits(tensor.dtype) // 8


def _to_bytes(t: jax.Array) -> jax.Array:
    """``t`` (JAX, >= 2-D) as ``uint8[rows, row_bytes]`` (bit casts, no arithmetic)."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1)
    u8 = jax.lax.bitcast_convert_type(flat, jnp.uint8)
    return u8.reshape(rows, -1)


def _from_bytes(u8: jax.Array, like: jax.Array) -> jax.Array:
    rows = like.shape[0]
    itemsize = np.dtype(like.dtype).itemsize
    t = u8.reshape(rows, -1, itemsize) if itemsize > 1 else u8.reshape(rows, -1)
    return jax.lax.bitcast_convert_type(t, like.dtype).reshape(like.shape)


def flip_kv_bits(
    tensor: Any,
    slot: Any,
    *,
    page_size: int | None = None,
    num_bytes_per_token: int | None = None,
    byte: Any = 0,
    xor: int = 0xFF,
) -> Any:
    """XORs ``xor`` into byte ``byte`` of ``slot``'s KV bytes: ``u8[slot // page_size, (slot % page_size) *
    num_bytes_per_token + byte] ^= xor``, where ``u8`` is the tensor viewed as ``uint8[rows, row_bytes]`` (the
    addressing of a :class:`~canary_jax.contract.sources.RealKvSource`, SPEC 3; SGLang's ``flip_first_byte_in_source``
    with ``byte=0, xor=0xFF``). For a chunked source (``RealKvSource.chunks``, canary-jax's extension) ``byte``
    indexes the slot's hashed sequence: chunk ``byte // chunk_bytes``, which starts ``offset_bytes + c *
    chunk_stride_bytes`` bytes after the slot's first byte in the tensor's flat bytes.

    Args:
      tensor: the KV buffer (numpy or JAX, any dtype of 1 byte or more per element, >= 2-D; dim 0 = pages), or
        a RealKvSource (its tensor, page size, bytes per token and chunks are used).
      slot: the KV slot (int, or a traced int32 inside ``jit``: then an out-of-range slot changes nothing).
      page_size: slots per row (default 1, or the source's).
      num_bytes_per_token: bytes each slot owns in its row (default ``row_bytes // page_size``, or the
        source's).
      byte: the byte within the slot, in ``[0, num_bytes_per_token)`` (chunked: ``[0, num_chunks *
        chunk_bytes)``, and a Python int); may be traced for a dense layout. Bytes ``>= 16`` are seen only by
        ALL hashing (and only below the source's ``read_bytes``).
      xor: the bit mask, in ``[1, 255]`` (``1 << b`` flips bit b).

    Returns:
      A new array of the tensor's dtype and shape (numpy in, numpy out; JAX in, JAX out).

    Raises:
      TypeError: a tensor that is not an array or RealKvSource, or non-int indices.
      ValueError: a tensor below 2-D, bad page_size / num_bytes_per_token / xor, or a concrete slot or byte
        out of range; naming the argument.
      NotImplementedError: a packed sub-byte dtype (``int4``), or a traced ``byte`` of a chunked source.
    """
    chunks = None
    if isinstance(tensor, sources.RealKvSource):
        page_size = tensor.page_size if page_size is None else page_size
        num_bytes_per_token = tensor.num_bytes_per_token if num_bytes_per_token is None else num_bytes_per_token
        chunks = getattr(tensor, "chunks", None)
        tensor = tensor.tensor
    if not (_is_jax(tensor) or isinstance(tensor, np.ndarray)):
        raise TypeError(
            f"kv-canary: tensor must be a numpy or JAX array or a RealKvSource, got {type(tensor).__name__}"
        )
    if tensor.ndim < 2:
        raise ValueError(f"kv-canary: tensor must be at least 2-D, got shape {tuple(tensor.shape)}")
    if sources.element_bits(tensor.dtype) < 8:
        raise NotImplementedError(f"kv-canary: flip_kv_bits does not address packed sub-byte dtypes ({tensor.dtype})")
    rows, row_bytes = _rows_bytes(tensor)
    ps = 1 if page_size is None else ints.check_int(page_size, name="page_size")
    if ps < 1:
        raise ValueError(f"kv-canary: page_size must be >= 1, got {ps}")
    nbpt = (
        row_bytes // ps
        if num_bytes_per_token is None
        else ints.check_int(num_bytes_per_token, name="num_bytes_per_token")
    )
    if nbpt < 1 or (chunks is None and ps * nbpt > row_bytes):
        raise ValueError(
            f"kv-canary: num_bytes_per_token must be in [1, row_bytes / page_size = {row_bytes // ps}], got {nbpt}"
        )
    x = ints.check_int(xor, name="xor")
    if not 1 <= x <= 255:
        raise ValueError(f"kv-canary: xor must be in [1, 255], got {x}")
    _check_index(slot, "slot", rows * ps)
    # The byte's place past the slot's first byte, split into whole rows and a remainder (no int32 overflow).
    if chunks is None:
        _check_index(byte, "byte", nbpt)
        extra_rows, extra = 0, byte
    else:
        if shapes.is_traced(byte):
            raise NotImplementedError("kv-canary: flip_kv_bits needs a concrete byte for a chunked source")
        _check_index(byte, "byte", chunks.num_chunks * chunks.chunk_bytes)
        c, w = divmod(int(np.asarray(byte)), chunks.chunk_bytes)
        extra_rows, extra = divmod(chunks.offset_bytes + c * chunks.chunk_stride_bytes + w, row_bytes)
    if _is_jax(tensor):
        s = jnp.asarray(slot, jnp.int32)
        at = (s % ps) * nbpt + jnp.asarray(extra, jnp.int32)
        row, col = s // ps + extra_rows + at // row_bytes, at % row_bytes
        u8 = _to_bytes(tensor)
        u8 = u8.at[row, col].set(u8[row, col] ^ jnp.uint8(x), mode="drop")
        return _from_bytes(u8, tensor)
    s = int(np.asarray(slot))
    at = (s % ps) * nbpt + int(np.asarray(extra))
    row, col = s // ps + extra_rows + at // row_bytes, at % row_bytes
    if row >= rows:
        raise ValueError(f"kv-canary: byte {int(np.asarray(byte))} of slot {s} lies past the tensor's {rows} rows")
    out = np.array(tensor, copy=True)
    out.view(np.uint8).reshape(rows, -1)[row, col] ^= np.uint8(x)
    return out


def flip_canary_bits(canary_buf: Any, slot: Any, *, field: int, bit: Any) -> Any:
    """Flips bit ``bit`` of field ``field`` of ``slot``'s canary record (a corrupted canary buffer):
    ``canary_buf[slot, 8 * field + bit // 8] ^= 1 << (bit % 8)`` (fields are little-endian int64, SPEC 1.1).

    Args:
      canary_buf: ``uint8[num_slots, stride >= 32]`` (numpy or JAX).
      slot: the slot (may be traced).
      field: 0 token, 1 position, 2 prev_hash, 3 real_kv_hash (``canary_jax.contract.constants.CANARY_FIELD_*``).
      bit: the bit of the int64 field, in ``[0, 64)`` (may be traced).

    Returns:
      A new buffer.

    Raises:
      TypeError / ValueError: a buffer that is not ``uint8[N, >= 32]``, or a field, slot or bit out of range.
    """
    if not (_is_jax(canary_buf) or isinstance(canary_buf, np.ndarray)):
        raise TypeError(f"kv-canary: canary_buf must be a numpy or JAX array, got {type(canary_buf).__name__}")
    if canary_buf.ndim != 2 or np.dtype(canary_buf.dtype) != np.uint8 or canary_buf.shape[1] < 32:
        raise ValueError(
            f"kv-canary: canary_buf must be uint8[num_slots, >= 32], got {canary_buf.dtype} {tuple(canary_buf.shape)}"
        )
    f = ints.check_int(field, name="field")
    if not 0 <= f < constants.CANARY_FIELDS_PER_SLOT:
        raise ValueError(f"kv-canary: field must be in [0, {constants.CANARY_FIELDS_PER_SLOT}), got {f}")
    _check_index(slot, "slot", int(canary_buf.shape[0]))
    _check_index(bit, "bit", 64)
    if _is_jax(canary_buf):
        b = jnp.asarray(bit, jnp.int32)
        col = 8 * f + b // 8
        mask = jnp.left_shift(jnp.uint8(1), (b % 8).astype(jnp.uint8))
        s = jnp.asarray(slot, jnp.int32)
        return canary_buf.at[s, col].set(canary_buf[s, col] ^ mask, mode="drop")
    out = np.array(canary_buf, copy=True)
    out[int(slot), 8 * f + int(bit) // 8] ^= np.uint8(1 << (int(bit) % 8))
    return out
