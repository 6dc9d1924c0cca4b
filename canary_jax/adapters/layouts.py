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
* :func:`sources_for_fused_kv` ``[num_slots, 2 * heads (+ padding), head_dim]`` (unpaged),
  ``[num_pages, page_size, 2 * heads (+ padding), head_dim]`` or its RPA-v3 split
  ``[num_pages, page_size, 2 * heads // packing, packing, head_dim]``, K and V interleaved per head
  (K0 V0 K1 V1 ...). Who allocates which: sglang-jax 0.0.2 ``MHATokenToKVPool._create_buffers``
  (``sgl_jax/srt/mem_cache/memory_pool.py``) allocates the 3-D form, one array per layer in ``kv_buffer``,
  ``[size + page_size, 2 * head_num, head_dim]`` (``merge_kv`` puts K head h in row 2h, V head h in row 2h + 1;
  checked by running it, ``tests/stacks/``). The 4- and 5-D paged forms are the RPA-v3 page shapes of vLLM TPU
  (tpu-inference ``kv_cache.py`` ``create_kv_caches``) and EasyDeL eSurge (``RaggedPagesCacheView.kv_pages``)
  as their sources describe them; no stack version was run here to confirm which of them allocates the 4-D
  form (packing folded into the heads) rather than the 5-D one, so treat those two as read from their code, not
  tested against a release. ``half="k"`` hashes the K heads in head order (exactly the bytes of a separate K pool
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
major pools, padded small rows, layer offsets) are canary-jax's extension (``canary_jax.contract.sources``). The
argument checks, the fused-token piece arithmetic and the one chunked-source builder the helpers share are
:mod:`canary_jax.adapters.slot_pieces`.
"""

from __future__ import annotations

import math
from typing import Any, Literal

from canary_jax.adapters.slot_pieces import (
    _check_array,
    _check_int,
    _check_scale_bytes,
    _describe,
    _fused_pieces,
    _heads_major_source,
    _nbytes,
    _source,
    _token_bytes,
)
from canary_jax.contract.sources import RealKvSource

Half = Literal["k", "v", "kv"]
KvLayout = Literal["interleaved", "k_then_v"]


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
    paged: bool | None = None,
    read_bytes: int | None = None,
) -> tuple[RealKvSource]:
    """One source hashing the K heads, the V heads or both of a fused K/V pool (one layer).

    Args:
      pool: ``[num_slots, combined_heads, head_dim]`` (unpaged: sglang-jax 0.0.2's ``kv_buffer[layer]``,
        ``[size + page_size, 2 * head_num, head_dim]``, passed as allocated), ``[num_pages, page_size,
        combined_heads, head_dim]`` or ``[num_pages, page_size, combined_heads // packing, packing, head_dim]``
        (``kv_layout="interleaved"``: combined head ``2h`` is K head ``h``, ``2h + 1`` V head ``h``, heads past
        ``2 * num_kv_heads`` are padding and never hashed), or ``[num_pages, page_size, 2, heads, head_dim]``
        (``"k_then_v"``; ``[num_slots, 2, heads, head_dim]`` with ``paged=False``). ``head_dim`` is the stored
        (possibly 128-aligned) width; a head must be a multiple of 4 bytes. Which stack version allocates which
        shape: see this module's docstring.
      paged: whether dim 1 is the page size; None = a 3-D pool is unpaged (one slot per row), any other rank
        paged. The canary's slot index is the row (unpaged) or ``page * page_size + offset`` (paged), the
        stack's own slot numbering either way.
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
    _check_array(fn, "pool", pool, min_rank=3)
    if paged is None:
        paged = len(pool.shape) != 3
    elif not isinstance(paged, bool):
        raise TypeError(f"kv-canary: {fn}: paged must be a bool or None, got {paged!r}")
    if len(pool.shape) < (4 if paged else 3):
        raise ValueError(
            f"kv-canary: {fn}: a paged pool must be [num_pages, page_size, heads, head_dim] or longer, got "
            f"{_describe(pool)} (pass paged=False for one slot per row)"
        )
    token_dims = tuple(int(d) for d in pool.shape[2 if paged else 1 :])
    tb = _token_bytes(fn, "pool", pool, token_dims)
    cb, nc, stride, off = _fused_pieces(fn, pool, token_dims, num_kv_heads=num_kv_heads, half=half, kv_layout=kv_layout)
    return (
        _source(
            fn,
            "pool",
            pool,
            page_size=int(pool.shape[1]) if paged else 1,
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
