"""Real-KV sources for the KV pool layouts of JAX serving stacks: views of one layer's bytes, never copies.

Each helper takes a pool array as its stack allocates it and returns a tuple of
:class:`~canary_jax.contract.sources.RealKvSource` for ``real_kv_sources=`` (at most 4 per launch, so concatenate at
most that many). No helper reshapes, slices or bitcasts the pool: every source holds the pool array itself plus a
static slot layout (:class:`~canary_jax.contract.sources.SlotChunks`), and the launch views it as
``uint32[shape[0], row_words]`` inside its own traced program (a bitcast XLA keeps free). So the helpers copy
nothing eagerly either, and work the same on tracers inside your ``jit``. They check shapes and dtypes when
called (statically) and raise ``ValueError`` / ``TypeError`` naming the argument, its shape and dtype.

What a slot hashes, per helper (``read_bytes=None`` hashes all of it under ALL; PARTIAL hashes its first 16
bytes; bytes are little-endian element bytes, packed sub-byte dtypes as XLA packs them):

* :func:`sources_for_token_major` ``[num_pages, page_size, *token]`` (or ``[num_slots, *token]``): the token's
  bytes. SGLang's own MHA pool (``[num_slots, heads, dim]`` per layer) is this with ``paged=False``.
* :func:`sources_for_fused_kv` ``[num_pages, page_size, 2 * heads (+ padding), head_dim]`` or its RPA-v3 split
  ``[num_pages, page_size, 2 * heads // packing, packing, head_dim]`` with K and V interleaved per head
  (K0 V0 K1 V1 ...): sglang-jax ``MHATokenToKVPool`` (``memory_pool.py``, one fused buffer per layer), vLLM TPU
  (tpu-inference ``kv_cache.py`` ``create_kv_caches``) and EasyDeL eSurge (``RaggedPagesCacheView.kv_pages``,
  v2 and v3). ``half="k"`` hashes the K heads in head order (exactly the bytes of a separate K pool
  ``[pages, page_size, heads, head_dim]``), ``"v"`` the V heads, ``"kv"`` both (the token's leading
  ``2 * heads`` heads). ``kv_layout="k_then_v"`` reads ``[num_pages, page_size, 2, heads, head_dim]`` instead.
* :func:`sources_for_stacked`: all layers in one array, ``[layers, pages, page_size, *token]``
  (``layer_axis=0``) or vLLM TPU's unified block-major ``[pages, layers, page_size, *token]``
  (``create_unified_kv_cache``, ``layer_axis=1``); any ``layer`` (SGLang hashes layer 0), token-major or fused.
* :func:`sources_for_heads_major` ``[heads, pages, page_size, head_dim]`` (JAX's Pallas paged attention,
  ``jax.experimental.pallas.ops.tpu.paged_attention``): the heads of a slot in head order, i.e. the same bytes
  in the same order as the token-major pool holding the same values.
* :func:`sources_for_quantised`: fp8 / int8 / packed int4 / fp4 data plus its per-token or per-token-head scale
  array as a second source, so both are protected; scales whose per-slot bytes are not a multiple of 4 are
  refused (see the function).

Only the dense token-major source is SGLang's contract; the chunked sources (K or V half of a fused pool, heads-
major pools, padded small rows, layer offsets) are canary-jax's extension (``canary_jax.contract.sources``).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np

from canary_jax.contract.sources import RealKvSource, SlotChunks, element_bits

Half = Literal["k", "v", "kv"]
KvLayout = Literal["interleaved", "k_then_v"]


# --- shared checks ----------------------------------------------------------------------------------------------
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


# --- layouts ------------------------------------------------------------------------------------------------------
def sources_for_token_major(pool: Any, *, paged: bool = True, read_bytes: int | None = None) -> tuple[RealKvSource]:
    """One source hashing each slot's token bytes of a token-major pool.

    Args:
      pool: ``[num_pages, page_size, *token]`` (``paged``) or ``[num_slots, *token]``, any dtype; a token is
        ``prod(token)`` elements (e.g. ``[heads, head_dim]``), whole bytes, a multiple of 4 bytes.
      paged: whether dim 1 is the page size.
      read_bytes: bytes hashed under ALL, a multiple of 16 up to the token rounded up to 16; None = all.

    Returns:
      ``(source,)``. A token of a multiple of 16 bytes is SGLang's dense source (same bytes, same program).

    Raises:
      ValueError / TypeError naming ``pool`` with its shape and dtype.
    """
    fn = "sources_for_token_major"
    _check_array(fn, "pool", pool, min_rank=3 if paged else 2)
    page_size = int(pool.shape[1]) if paged else 1
    tb = _token_bytes(fn, "pool", pool, tuple(int(d) for d in pool.shape[2 if paged else 1 :]))
    return (_source(fn, "pool", pool, page_size=page_size, slot_pitch=tb, chunk_bytes=tb, read_bytes=read_bytes),)


def sources_for_fused_kv(
    pool: Any,
    *,
    num_kv_heads: int | None = None,
    half: Half = "k",
    kv_layout: KvLayout = "interleaved",
    read_bytes: int | None = None,
) -> tuple[RealKvSource]:
    """One source hashing the K heads, the V heads or both of a fused K/V pool (one layer).

    Args:
      pool: ``[num_pages, page_size, combined_heads, head_dim]`` or ``[num_pages, page_size, combined_heads //
        packing, packing, head_dim]`` (``kv_layout="interleaved"``: combined head ``2h`` is K head ``h``,
        ``2h + 1`` V head ``h``, heads past ``2 * num_kv_heads`` are padding and never hashed), or
        ``[num_pages, page_size, 2, heads, head_dim]`` (``"k_then_v"``). ``head_dim`` is the stored (possibly
        128-aligned) width; a head must be a multiple of 4 bytes.
      num_kv_heads: real KV heads; None = ``combined_heads // 2`` (interleaved) or ``heads`` (k_then_v).
      half: ``"k"`` (a slot's K heads in head order), ``"v"``, or ``"kv"`` (K and V, in storage order).
      kv_layout: ``"interleaved"`` or ``"k_then_v"``.
      read_bytes: bytes hashed under ALL (multiple of 16, at most the half rounded up to 16); None = all.

    Returns:
      ``(source,)``: a chunked source (``half="k"`` with heads > 1 reads ``heads`` chunks of a head each,
      two heads apart).

    Raises:
      ValueError / TypeError naming the argument (``pool`` with shape and dtype, ``half``, ``num_kv_heads``).
    """
    fn = "sources_for_fused_kv"
    _check_array(fn, "pool", pool, min_rank=4)
    token_dims = tuple(int(d) for d in pool.shape[2:])
    tb = _token_bytes(fn, "pool", pool, token_dims)
    cb, nc, stride, off = _fused_pieces(fn, pool, token_dims, num_kv_heads=num_kv_heads, half=half, kv_layout=kv_layout)
    return (
        _source(
            fn,
            "pool",
            pool,
            page_size=int(pool.shape[1]),
            slot_pitch=tb,
            chunk_bytes=cb,
            num_chunks=nc,
            chunk_stride=stride,
            offset=off,
            read_bytes=read_bytes,
        ),
    )


def sources_for_stacked(
    pool: Any,
    *,
    layer: int = 0,
    layer_axis: int = 0,
    half: Half | None = None,
    num_kv_heads: int | None = None,
    kv_layout: KvLayout = "interleaved",
    read_bytes: int | None = None,
) -> tuple[RealKvSource]:
    """One source hashing layer ``layer`` of a pool that stacks every layer in one array.

    Args:
      pool: ``[layers, num_pages, page_size, *token]`` (``layer_axis=0``) or ``[num_pages, layers, page_size,
        *token]`` (``layer_axis=1``: vLLM TPU's unified block-major cache, ``create_unified_kv_cache``).
      layer: the layer to hash (SGLang hashes layer 0).
      layer_axis: 0 or 1, as above.
      half: None for a token-major token (all its bytes, as :func:`sources_for_token_major`), or ``"k"`` /
        ``"v"`` / ``"kv"`` for a fused token (as :func:`sources_for_fused_kv`, with ``num_kv_heads`` and
        ``kv_layout``).
      read_bytes: bytes hashed under ALL; None = all.

    Returns:
      ``(source,)``. With ``layer_axis=0`` a row of the source is one whole layer (``page_size`` is the layer's
      slot count) and the source covers exactly that layer's slots (``SlotChunks.slot_rows=1``): a launch
      that hashes a slot past them is refused (and, inside ``jit``, a canary buffer with more slots;
      :mod:`canary_jax.contract.coverage`).

    Raises:
      ValueError / TypeError naming the argument.
    """
    fn = "sources_for_stacked"
    _check_array(fn, "pool", pool, min_rank=4)
    if layer_axis not in (0, 1) or isinstance(layer_axis, bool):
        raise ValueError(f"kv-canary: {fn}: layer_axis must be 0 or 1, got {layer_axis!r}")
    num_layers = int(pool.shape[layer_axis])
    layer = _check_int(fn, "layer", layer, low=0)
    if layer >= num_layers:
        raise ValueError(
            f"kv-canary: {fn}: layer={layer} is outside the pool's {num_layers} layers ({_describe(pool)})"
        )
    token_dims = tuple(int(d) for d in pool.shape[3:])
    if not token_dims:
        raise ValueError(f"kv-canary: {fn}: pool must have token dims after page_size, got {_describe(pool)}")
    tb = _token_bytes(fn, "pool", pool, token_dims)
    page = int(pool.shape[2])
    if half is None:
        cb, nc, stride, off = tb, 1, 0, 0
    else:
        cb, nc, stride, off = _fused_pieces(
            fn, pool, token_dims, num_kv_heads=num_kv_heads, half=half, kv_layout=kv_layout
        )
    if layer_axis == 0:  # rows = layers; a row holds the layer's num_pages * page_size slots
        page_size = int(pool.shape[1]) * page
        layer_bytes, slot_rows = page_size * tb, 1
    else:  # rows = pages; a row holds every layer's page_size slots, layer after layer
        page_size = page
        layer_bytes, slot_rows = page * tb, None
    return (
        _source(
            fn,
            "pool",
            pool,
            page_size=page_size,
            slot_pitch=tb,
            chunk_bytes=cb,
            num_chunks=nc,
            chunk_stride=stride,
            offset=off + layer * layer_bytes,
            slot_rows=slot_rows,
            read_bytes=read_bytes,
        ),
    )


def sources_for_heads_major(pool: Any, *, read_bytes: int | None = None) -> tuple[RealKvSource]:
    """One source hashing each slot's heads, in head order, of a heads-major pool.

    Args:
      pool: ``[num_kv_heads, num_pages, page_size, head_dim]`` (one of K or V, as JAX's Pallas paged attention
        takes ``k_pages`` / ``v_pages``); a head must be a multiple of 4 bytes.
      read_bytes: bytes hashed under ALL; None = all ``num_kv_heads * head_dim`` elements' bytes.

    Returns:
      ``(source,)``: ``num_kv_heads`` chunks of one head each, one head plane apart. It hashes the same bytes,
      in the same order, as :func:`sources_for_token_major` of the ``[num_pages, page_size, num_kv_heads,
      head_dim]`` pool holding the same values.

    Raises:
      ValueError / TypeError naming ``pool`` with its shape and dtype.
    """
    fn = "sources_for_heads_major"
    _check_array(fn, "pool", pool, min_rank=4)
    if len(pool.shape) != 4:
        raise ValueError(
            f"kv-canary: {fn}: pool must be [num_kv_heads, num_pages, page_size, head_dim], got {_describe(pool)}"
        )
    heads, pages, page, dim = (int(d) for d in pool.shape)
    hb = _token_bytes(fn, "pool", pool, (dim,))
    return (
        _heads_major_source(fn, "pool", pool, heads=heads, slots=pages * page, head_bytes=hb, read_bytes=read_bytes),
    )


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


def sources_for_quantised(
    data: Any,
    scales: Any | None,
    *,
    layout: Literal["token_major", "heads_major"] = "token_major",
    read_bytes: int | None = None,
    scale_read_bytes: int | None = None,
) -> tuple[RealKvSource, ...]:
    """Two sources for a quantised pool: its data and its scales, so both are protected.

    Args:
      data: fp8 / int8 / packed int4 / fp4 (any dtype) pool, ``[num_pages, page_size, *token]``
        (``layout="token_major"``) or ``[num_kv_heads, num_pages, page_size, head_dim]`` (``"heads_major"``).
        Packed sub-byte tokens are hashed as their packed bytes (XLA: element ``2i`` in the low nibble of byte
        ``i``); a token (heads-major: a head) must be a multiple of 4 bytes.
      scales: the scale array of the same slots: ``[num_pages, page_size, *per_slot]`` (per token:
        ``[pages, page_size]`` or ``[..., 1]``; per token and head: ``[..., num_kv_heads]``), or for
        ``heads_major`` ``[num_kv_heads, num_pages, page_size, *per_head]``. A slot's scale bytes (heads-major:
        per head) must be a multiple of 4; smaller rows are padded with zeros to 16 bytes in the hash, so rows
        under 16 bytes are protected whole. None: protect the data alone (the scales are then NOT protected;
        say so where you choose it).
      layout: ``"token_major"`` or ``"heads_major"``, for both arrays.
      read_bytes, scale_read_bytes: bytes hashed under ALL per source; None = all.

    Returns:
      ``(data_source, scale_source)``, or ``(data_source,)`` with ``scales=None``.

    Raises:
      ValueError: arrays whose slots differ; a scale row whose bytes per slot (or per head) are not a
        multiple of 4: the canary hashes 4-byte words and cannot isolate 2 bytes of one slot from its
        neighbour's, so such scales would NOT be protected; store them with at least 4 bytes per slot (e.g.
        float32 or an even number of 16-bit heads), or pass ``scales=None`` and accept that they are not.
      TypeError: an argument that is not an array.
    """
    fn = "sources_for_quantised"
    if layout == "token_major":
        out = sources_for_token_major(data, read_bytes=read_bytes)
        if scales is None:
            return out
        _check_array(fn, "scales", scales, min_rank=2)
        if tuple(scales.shape[:2]) != tuple(data.shape[:2]):
            raise ValueError(
                f"kv-canary: {fn}: scales ({_describe(scales)}) must have the data's [num_pages, page_size] = "
                f"{tuple(int(d) for d in data.shape[:2])} leading dims"
            )
        per_slot = math.prod(int(d) for d in scales.shape[2:])
        sb = _nbytes(scales, per_slot)
        _check_scale_bytes(fn, scales, sb, "slot")
        src = _source(
            fn,
            "scales",
            scales,
            page_size=int(scales.shape[1]),
            slot_pitch=sb,
            chunk_bytes=sb,
            read_bytes=scale_read_bytes,
        )
        return out + (src,)
    if layout == "heads_major":
        out = sources_for_heads_major(data, read_bytes=read_bytes)
        if scales is None:
            return out
        _check_array(fn, "scales", scales, min_rank=3)
        if tuple(scales.shape[:3]) != tuple(data.shape[:3]):
            raise ValueError(
                f"kv-canary: {fn}: scales ({_describe(scales)}) must have the data's [num_kv_heads, num_pages, "
                f"page_size] = {tuple(int(d) for d in data.shape[:3])} leading dims"
            )
        heads, pages, page = (int(d) for d in scales.shape[:3])
        sb = _nbytes(scales, math.prod(int(d) for d in scales.shape[3:]))
        _check_scale_bytes(fn, scales, sb, "slot and head")
        src = _heads_major_source(
            fn, "scales", scales, heads=heads, slots=pages * page, head_bytes=sb, read_bytes=scale_read_bytes
        )
        return out + (src,)
    raise ValueError(f"kv-canary: {fn}: layout must be 'token_major' or 'heads_major', got {layout!r}")


def _check_scale_bytes(fn: str, scales: Any, nbytes: int, per: str) -> None:
    if nbytes <= 0 or nbytes % 4:
        raise ValueError(
            f"kv-canary: {fn}: scales ({_describe(scales)}) hold {nbytes if nbytes > 0 else 'a fraction of a'} "
            f"byte(s) per {per}; the canary hashes 4-byte words and cannot isolate them from the neighbouring "
            "slot's, so these scales would NOT be protected. Store at least 4 bytes per "
            f"{per} (e.g. float32), or pass scales=None to protect the data alone"
        )
