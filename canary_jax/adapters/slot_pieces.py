"""The byte geometry of a pool slot, shared by :mod:`canary_jax.adapters.layouts`' helpers: argument checks,
the pieces of a fused K/V token, and the one builder of a chunked
:class:`~canary_jax.contract.sources.RealKvSource` over a pool array.

Every function takes ``fn`` (the public helper's name) and ``name`` (the argument's) and raises ``ValueError`` /
``TypeError`` as ``kv-canary: {fn}: {name} (shape ... dtype ...): ...``. Sizes are bytes of the pool's dtype,
packed for sub-byte dtypes (:func:`canary_jax.contract.sources.element_bits`); the canary reads 4-byte words, so
every piece, pitch and offset must be a multiple of 4. Nothing here reshapes, slices or copies an array: a source
holds the array itself plus a static :class:`~canary_jax.contract.sources.SlotChunks`.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from canary_jax.contract.sources import RealKvSource, SlotChunks, element_bits


def _describe(x: Any) -> str:
    return f"shape {tuple(int(d) for d in x.shape)} dtype {np.dtype(x.dtype)}"


def _check_array(fn: str, name: str, x: Any, *, min_rank: int) -> None:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"kv-canary: {fn}: {name} must be a JAX or numpy array, got {type(x).__name__}")
    if len(x.shape) < min_rank:
        raise ValueError(f"kv-canary: {fn}: {name} must be at least {min_rank}-D, got {_describe(x)}")
    if any(int(d) == 0 for d in x.shape):
        raise ValueError(f"kv-canary: {fn}: {name} is empty, got {_describe(x)}")


def _nbytes(x: Any, elements: int) -> int:
    """Bytes of ``elements`` elements of ``x``'s dtype (packed for sub-byte dtypes), or -1 if not whole."""
    bits = elements * element_bits(x.dtype)
    return bits // 8 if bits % 8 == 0 else -1


def _check_int(fn: str, name: str, value: Any, *, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"kv-canary: {fn}: {name} must be an int >= {low}, got {value!r}")
    return int(value)


def _check_pos_int(fn: str, name: str, value: Any) -> int:
    """A pool object's size attribute (or an argument sized like one): a Python int > 0, bools refused; the pool
    adapters (:mod:`canary_jax.adapters.sglang_jax_pools`, :mod:`canary_jax.adapters.esurge_cache`) read theirs
    through it."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"kv-canary: {fn}: {name} must be a positive int, got {value!r}")
    return int(value)


def _source(
    fn: str,
    name: str,
    x: Any,
    *,
    page_size: int,
    slot_pitch: int,
    chunk_bytes: int,
    num_chunks: int = 1,
    chunk_stride: int = 0,
    offset: int = 0,
    slot_rows: int | None = None,
    read_bytes: int | None,
) -> RealKvSource:
    """A chunked source over ``x`` (rows = dim 0), errors re-raised naming the helper and the argument."""
    if min(chunk_bytes, slot_pitch) <= 0 or chunk_bytes % 4 or slot_pitch % 4 or offset % 4 or chunk_stride % 4:
        raise ValueError(
            f"kv-canary: {fn}: {name} ({_describe(x)}) puts {chunk_bytes}-byte pieces {slot_pitch} bytes apart; the "
            "canary reads whole 4-byte words, so each hashed piece and each slot must be a multiple of 4 bytes"
        )
    padded = -(-num_chunks * chunk_bytes // 16) * 16
    rb = padded if read_bytes is None else read_bytes
    try:
        return RealKvSource(
            tensor=x,
            page_size=page_size,
            num_bytes_per_token=slot_pitch,
            read_bytes=rb,
            chunks=SlotChunks(
                chunk_bytes=chunk_bytes,
                num_chunks=num_chunks,
                chunk_stride_bytes=chunk_stride,
                offset_bytes=offset,
                slot_rows=slot_rows,
            ),
        )
    except (TypeError, ValueError) as e:
        raise type(e)(f"kv-canary: {fn}: {name} ({_describe(x)}): {e}") from None


def _token_bytes(fn: str, name: str, x: Any, token_dims: tuple[int, ...]) -> int:
    tb = _nbytes(x, math.prod(token_dims))
    if tb <= 0:
        raise ValueError(
            f"kv-canary: {fn}: {name} ({_describe(x)}) has a token of {token_dims} that is not whole bytes"
        )
    return tb


def _fused_pieces(
    fn: str, x: Any, token_dims: tuple[int, ...], *, num_kv_heads: int | None, half: str, kv_layout: str
) -> tuple[int, int, int, int]:
    """``(chunk_bytes, num_chunks, chunk_stride, offset)`` of one half of a fused token (relative to the token)."""
    if half not in ("k", "v", "kv"):
        raise ValueError(f"kv-canary: {fn}: half must be 'k', 'v' or 'kv', got {half!r}")
    head_bytes = _nbytes(x, token_dims[-1])
    if head_bytes <= 0:
        raise ValueError(f"kv-canary: {fn}: pool ({_describe(x)}) has a head_dim that is not whole bytes")
    if kv_layout == "interleaved":
        combined = math.prod(token_dims[:-1])
        heads = combined // 2 if num_kv_heads is None else _check_int(fn, "num_kv_heads", num_kv_heads, low=1)
        if heads < 1 or 2 * heads > combined:
            raise ValueError(
                f"kv-canary: {fn}: pool ({_describe(x)}) holds {combined} combined K/V heads per token, "
                f"fewer than 2 x num_kv_heads={heads}"
            )
        if half == "kv":
            return 2 * heads * head_bytes, 1, 0, 0
        return head_bytes, heads, 2 * head_bytes, (head_bytes if half == "v" else 0)
    if kv_layout == "k_then_v":
        if len(token_dims) != 3 or token_dims[0] != 2:
            raise ValueError(
                f"kv-canary: {fn}: kv_layout='k_then_v' needs a pool [..., 2, heads, head_dim] per token, "
                f"got {_describe(x)}"
            )
        stored = token_dims[1]
        heads = stored if num_kv_heads is None else _check_int(fn, "num_kv_heads", num_kv_heads, low=1)
        if heads > stored:
            raise ValueError(
                f"kv-canary: {fn}: pool ({_describe(x)}) holds {stored} heads per half, fewer than num_kv_heads={heads}"
            )
        half_bytes, plane = heads * head_bytes, stored * head_bytes
        if half == "kv":
            return (2 * half_bytes, 1, 0, 0) if heads == stored else (half_bytes, 2, plane, 0)
        return half_bytes, 1, 0, (plane if half == "v" else 0)
    raise ValueError(f"kv-canary: {fn}: kv_layout must be 'interleaved' or 'k_then_v', got {kv_layout!r}")


def _heads_major_source(fn, name, x, *, heads, slots, head_bytes, read_bytes) -> RealKvSource:
    # rows = heads; a row is one head's plane of `slots` slots; chunk c = head c, one plane (row) apart
    return _source(
        fn,
        name,
        x,
        page_size=slots,
        slot_pitch=head_bytes,
        chunk_bytes=head_bytes,
        num_chunks=heads,
        chunk_stride=slots * head_bytes,
        read_bytes=read_bytes,
    )


def _check_scale_bytes(fn: str, scales: Any, nbytes: int, per: str) -> None:
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(
            f"kv-canary: {fn}: scales ({_describe(scales)}) hold {nbytes if nbytes > 0 else 'a fraction of a'} "
            f"byte(s) per {per}; the canary hashes 4-byte words and cannot isolate them from the neighbouring "
            "slot's, so these scales would NOT be protected. Store at least 4 bytes per "
            f"{per} (e.g. float32), or pass scales=None to protect the data alone"
        )
