"""vLLM's batch format and CUDA KV layouts as the arguments of the SGLang launchers (:mod:`interop.sglang`).

A vLLM-style torch engine keeps its per-step tensors and adds, per step::

    src = vllm.k_source(kv_caches[0], layout="block_first")  # once: a view, for the TAIL context's sources
    plan_kw = vllm.plan_inputs(block_table=bt, seq_lens=seq, query_start_loc=qsl, block_size=B,
                               req_to_token_out=r2t, num_reqs=n)
    write_kw = vllm.write_inputs(input_ids=ids, positions=pos, slot_mapping=sm, query_start_loc=qsl, num_reqs=n)
    sglang.launch_canary_plan_kernels(verify_plan_out=vp, write_plan_out=wp, **plan_kw, swa_window_size=0,
        full_to_swa_index_mapping=None, verify_capacity=C, kv_token_id_vs_position_offset=0)
    sglang.launch_canary_write_kernel(context=ctx, plan=wp, **write_kw)

Torch ops only: no host sync, shapes fixed by the inputs' capacities (``num_reqs`` may be a device tensor), so
the calls can sit inside a captured CUDA graph. The batch mapping is :func:`canary_jax.adapters.batches.
from_block_tables`'s (the JAX adapter; the engine test pins the two to the same plans), with one difference:
SGLang's launchers read a dense ``req_to_token``, so the block table is expanded into a caller-owned int32
buffer (slots must fit int32, SGLang's limit; the JAX adapter computes int64 slots in its gather).
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from interop.sglang_types import RealKvSource

__all__ = ["LAYOUTS", "k_source", "plan_inputs", "v_source", "write_inputs"]

Layout = Literal["kv_first", "block_first"]
LAYOUTS = {  # vLLM's ``AttentionBackend.get_kv_cache_shape`` per layer (NHD stride order)
    "kv_first": "[2, num_blocks, block_size, num_kv_heads, head_size]",  # FlashAttention, FlexAttention
    "block_first": "[num_blocks, 2, block_size, num_kv_heads, head_size]",  # FlashInfer, Triton attention
}
_INTS = (torch.int32, torch.int64)


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} dtype {t.dtype} device {t.device}"


def _check(fn: str, name: str, t: Any, dtypes: tuple, shape: tuple, device: torch.device | None = None) -> None:
    """``t`` is a tensor of one of ``dtypes`` whose shape matches ``shape`` (None = any size) on ``device``."""
    dts = "/".join(str(d).removeprefix("torch.") for d in dtypes)
    want = f"a tensor of dtype {dts} and shape {shape}".replace("None", "any")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"kv-canary: {fn}: {name} must be {want}, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"kv-canary: {fn}: {name} must be {want}, got {_describe(t)}")
    if t.dim() != len(shape) or any(w is not None and w != d for w, d in zip(shape, t.shape)):
        raise ValueError(f"kv-canary: {fn}: {name} must be {want}, got {_describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"kv-canary: {fn}: {name} must be on {device} like the other inputs, got {_describe(t)}")


def _live_count(fn: str, num_reqs: Any, rows: int, device: torch.device) -> torch.Tensor:
    """``num_reqs`` as an int64 ``[1]`` tensor on ``device``; a device value is clipped into ``[0, rows]``."""
    if isinstance(num_reqs, torch.Tensor):
        if num_reqs.numel() != 1 or num_reqs.dim() > 1 or num_reqs.dtype not in _INTS or num_reqs.device != device:
            raise ValueError(
                f"kv-canary: {fn}: num_reqs must be an int or an int32/int64 tensor of shape () or "
                f"(1,) on {device}, got {_describe(num_reqs)}"
            )
        return num_reqs.reshape(1).to(torch.int64).clamp(0, rows)
    num_reqs = rows if num_reqs is None else num_reqs
    if isinstance(num_reqs, bool) or not isinstance(num_reqs, int) or not 0 <= num_reqs <= rows:
        raise ValueError(f"kv-canary: {fn}: num_reqs must be an int in [0, {rows}] (the batch rows), got {num_reqs!r}")
    return torch.full((1,), num_reqs, dtype=torch.int64, device=device)


def plan_inputs(
    *,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    req_to_token_out: torch.Tensor,
    num_reqs: int | torch.Tensor | None = None,
    null_block: int | None = 0,
    expected_tokens: torch.Tensor | None = None,
    expected_tokens_valid_lens: torch.Tensor | None = None,
    expected_tokens_out: torch.Tensor | None = None,
) -> dict[str, Any]:
    """SGLang's plan inputs for a vLLM batch (``CommonAttentionMetadata``), ``req_to_token`` filled in place.

    Per batch row ``r < num_reqs``: ``E = query_start_loc[r + 1] - query_start_loc[r]``, ``req_pool_indices = r +
    1``, ``prefix_lens = seq_lens[r] - E``, ``extend_seq_lens = E``, and ``req_to_token_out[r + 1, q] =
    block_table[r, q // block_size] * block_size + q % block_size`` (0 where the block is ``null_block``). Rows
    ``r >= num_reqs`` are padding: index 0 (SGLang's padding row), lengths 0, ``req_to_token_out[r + 1] = 0``.

    Args:
      block_table: ``int32[>= bs, max_blocks]`` physical block ids per batch row (vLLM's ``BlockTable``; block 0
        is its null block). Rows are this step's batch rows; a request may sit in another row next step.
      seq_lens: ``int32/int64[bs]`` tokens in the KV after this step; ``bs`` is the batch capacity.
      query_start_loc: ``int32/int64[bs + 1]`` cumulative new-token offsets; entries past ``num_reqs`` ignored.
      block_size: tokens per block.
      req_to_token_out: ``int32[>= bs + 1, max_blocks * block_size]`` contiguous, caller-owned; rows ``1..bs``
        are overwritten, the others (row 0 = zeros, SGLang's padding row) are left as they are.
      num_reqs: live rows: an int, an int tensor of shape () / (1,) on the batch's device (clipped into
        ``[0, bs]``; what a captured graph passes), or None = every row.
      null_block: the "no block" id, read as slot 0 (verify skips it), like the JAX adapter; None = none.
      expected_tokens: ``int32[>= bs, max_model_len]`` token ids per batch row (vLLM's ``token_ids_cpu`` on the
        device) for the verify-token assert, with ``expected_tokens_valid_lens`` (``int32/int64[bs]``,
        ``num_tokens`` per row) and ``expected_tokens_out`` (``int32[>= bs + 1, max_model_len]`` contiguous,
        rows ``1..bs`` overwritten: SGLang's pool is indexed by ``req_pool_indices``). All three or none.

    Returns:
      ``req_pool_indices``, ``prefix_lens``, ``extend_seq_lens`` (new ``int64[bs]`` tensors), ``req_to_token``
      (``req_to_token_out``), ``req_to_verify_expected_tokens`` (``expected_tokens_out`` or None) and
      ``req_to_verify_expected_tokens_valid_lens`` (``int64[bs]``, 0 on padding rows, or None): keyword
      arguments of :func:`interop.sglang.launch_canary_plan_kernels`.

    Raises:
      TypeError: a field that is not a tensor of the listed dtypes. ValueError: a wrong shape, a device mix,
        a non-contiguous output, ``block_size <= 0``, ``num_reqs`` outside ``[0, bs]``, the expected-token
        arguments given in part. Values (block ids, lengths) are never read on the host (no sync): they are
        the caller's contract (``seq_lens <= max_blocks * block_size``; slots fit int32, or they wrap).
    """
    fn = "plan_inputs"
    _check(fn, "seq_lens", seq_lens, _INTS, (None,))
    bs, dev = int(seq_lens.shape[0]), seq_lens.device
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"kv-canary: {fn}: block_size must be a positive int, got {block_size!r}")
    _check(fn, "query_start_loc", query_start_loc, _INTS, (bs + 1,), dev)
    _check(fn, "block_table", block_table, (torch.int32,), (None, None), dev)
    max_blocks = int(block_table.shape[1])
    _check(fn, "req_to_token_out", req_to_token_out, (torch.int32,), (None, max_blocks * block_size), dev)
    given = [x is not None for x in (expected_tokens, expected_tokens_valid_lens, expected_tokens_out)]
    if any(given) and not all(given):
        raise ValueError(
            f"kv-canary: {fn}: expected_tokens, expected_tokens_valid_lens, expected_tokens_out go together"
        )
    rows = {"block_table": (block_table, bs), "req_to_token_out": (req_to_token_out, bs + 1)}
    if all(given):
        _check(fn, "expected_tokens", expected_tokens, (torch.int32,), (None, None), dev)
        _check(fn, "expected_tokens_valid_lens", expected_tokens_valid_lens, _INTS, (bs,), dev)
        _check(fn, "expected_tokens_out", expected_tokens_out, (torch.int32,), (None, expected_tokens.shape[1]), dev)
        rows.update(expected_tokens=(expected_tokens, bs), expected_tokens_out=(expected_tokens_out, bs + 1))
    for name, (x, need) in rows.items():  # outputs: row 0 is SGLang's padding row, rows 1..bs are written
        if x.shape[0] < need or (name.endswith("_out") and not x.is_contiguous()):
            raise ValueError(
                f"kv-canary: {fn}: {name} must have at least {need} rows (bs = {bs}) and outputs must be "
                f"contiguous, got {_describe(x)} strides {x.stride()}"
            )
    n = _live_count(fn, num_reqs, bs, dev)

    live = torch.arange(bs, device=dev) < n  # bool[bs]
    qsl = query_start_loc.to(torch.int64)
    extend = torch.where(live, qsl[1:] - qsl[:-1], 0)
    prefix = torch.where(live, seq_lens.to(torch.int64) - extend, 0)
    rpi = torch.where(live, torch.arange(1, bs + 1, dtype=torch.int64, device=dev), 0)
    bt = block_table[:bs]
    keep = live[:, None] if null_block is None else live[:, None] & (bt != null_block)
    offsets = torch.arange(block_size, dtype=torch.int32, device=dev)
    slots = bt[:, :, None] * block_size + offsets  # int32[bs, max_blocks, block_size]
    req_to_token_out[1 : bs + 1].view(bs, max_blocks, block_size).copy_(torch.where(keep[:, :, None], slots, 0))
    valid = None
    if all(given):
        expected_tokens_out[1 : bs + 1].copy_(torch.where(live[:, None], expected_tokens[:bs], 0))
        valid = torch.where(live, expected_tokens_valid_lens.to(torch.int64), 0)
    return {
        "req_pool_indices": rpi,
        "prefix_lens": prefix,
        "extend_seq_lens": extend,
        "req_to_token": req_to_token_out,
        "req_to_verify_expected_tokens": expected_tokens_out if all(given) else None,
        "req_to_verify_expected_tokens_valid_lens": valid,
    }


def write_inputs(
    *,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_reqs: int | torch.Tensor | None = None,
) -> dict[str, Any]:
    """SGLang's write-launch token inputs for a vLLM batch: ``out_cache_loc = slot_mapping`` on live tokens.

    Tokens ``t >= query_start_loc[num_reqs]`` belong to no request (the write plan's offsets end there, so
    SGLang never reads them); their ``out_cache_loc`` is -1 (vLLM's ``PAD_SLOT_ID``), as in the JAX adapter.

    Args:
      input_ids: ``int32/int64[T]`` token ids (widened to int64, SGLang's dtype).
      positions: ``int32/int64[T]``.
      slot_mapping: ``int32/int64[T]`` slot each token's KV is written to (-1 = none: not written).
      query_start_loc: ``int32/int64[bs + 1]``, as for :func:`plan_inputs`.
      num_reqs: as for :func:`plan_inputs`.

    Returns:
      ``input_ids``, ``positions``, ``out_cache_loc`` (``int64[T]``) and the write-input assert turned off:
      keyword arguments of :func:`interop.sglang.launch_canary_write_kernel`.

    Raises:
      TypeError / ValueError: as :func:`plan_inputs` (dtype; length other than ``T``; device mix).
    """
    fn = "write_inputs"
    _check(fn, "input_ids", input_ids, _INTS, (None,))
    t, dev = int(input_ids.shape[0]), input_ids.device
    _check(fn, "positions", positions, _INTS, (t,), dev)
    _check(fn, "slot_mapping", slot_mapping, _INTS, (t,), dev)
    _check(fn, "query_start_loc", query_start_loc, _INTS, (None,), dev)
    rows = int(query_start_loc.shape[0]) - 1
    if rows < 0:
        raise ValueError(f"kv-canary: {fn}: query_start_loc must be [bs + 1], got {_describe(query_start_loc)}")
    n = _live_count(fn, num_reqs, rows, dev)
    end = query_start_loc.to(torch.int64).index_select(0, n)
    live = torch.arange(t, device=dev) < end
    return {
        "input_ids": input_ids.to(torch.int64),
        "positions": positions.to(torch.int64),
        "out_cache_loc": torch.where(live, slot_mapping.to(torch.int64), -1),
        "enable_write_input_assert": False,
        "expected_input_tokens": None,
        "expected_input_positions": None,
    }


def _source(fn: str, kv_cache: Any, layout: str, half: int, block_size: int | None, read_bytes: int | None):
    if not isinstance(kv_cache, torch.Tensor):
        raise TypeError(f"kv-canary: {fn}: kv_cache must be a torch tensor, got {type(kv_cache).__name__}")
    if layout not in LAYOUTS:
        raise ValueError(f"kv-canary: {fn}: layout must be one of {sorted(LAYOUTS)}, got {layout!r}")
    what = f"kv-canary: {fn}: kv_cache ({_describe(kv_cache)} strides {kv_cache.stride()}, layout={layout!r})"
    kv_axis = 0 if layout == "kv_first" else 1
    if kv_cache.dim() != 5 or kv_cache.shape[kv_axis] != 2:
        raise ValueError(f"{what} must have the layout's shape {LAYOUTS[layout]}")
    if not kv_cache.is_contiguous():  # vLLM's HND stride order: a slot's bytes are not one run
        raise ValueError(f"{what} must be contiguous in the layout's shape (vLLM's NHD stride order)")
    num_blocks, page, heads, dim = (int(d) for i, d in enumerate(kv_cache.shape) if i != kv_axis)
    if block_size is not None and block_size != page:
        raise ValueError(f"{what} holds {page} tokens per block, not block_size={block_size}")
    nbpt = heads * dim * kv_cache.element_size()
    if nbpt % 16:
        raise ValueError(f"{what} holds {nbpt} bytes per slot and half; SGLang's RealKvSource needs a multiple of 16")
    if kv_axis == 0:
        tensor = kv_cache[half].view(num_blocks, page * heads * dim)
    elif half == 0:  # a block row is K of its block_size slots, then V: K sits at byte 0 of the row
        tensor = kv_cache.view(num_blocks, 2 * page * heads * dim)
    else:
        raise ValueError(
            f"{what}: V starts {page} * {nbpt} bytes into each block row and SGLang's RealKvSource has no row offset "
            "(canary-jax's JAX sources have: canary_jax.adapters.layouts.sources_for_stacked(layer_axis=1, layer=1))"
        )
    rb = nbpt if read_bytes is None else read_bytes
    return RealKvSource(tensor=tensor, page_size=page, num_bytes_per_token=nbpt, read_bytes=rb)


def k_source(
    kv_cache: torch.Tensor, *, layout: Layout, block_size: int | None = None, read_bytes: int | None = None
) -> RealKvSource:
    """An SGLang :class:`~interop.sglang_types.RealKvSource` over the K half of one layer's vLLM KV cache.

    A zero-copy view: slot ``s = block * block_size + i`` hashes the ``num_kv_heads * head_size`` K elements of
    token ``i`` of block ``block``, the bytes SGLang's MHA source hashes for a ``[num_slots, heads, dim]`` K pool.

    Args:
      kv_cache: one layer's cache (``kv_caches[0]`` for SGLang's layer-0 canary), contiguous, any dtype, in
        ``layout``: ``"kv_first"`` ``[2, num_blocks, block_size, num_kv_heads, head_size]`` (vLLM's
        FlashAttention backend, ``flash_attn.py`` ``get_kv_cache_shape``; the source is ``kv_cache[0]`` as
        ``[num_blocks, block_size * heads * dim]``) or ``"block_first"`` ``[num_blocks, 2, block_size,
        num_kv_heads, head_size]`` (FlashInfer, ``flashinfer.py``; the source is the whole cache as
        ``[num_blocks, 2 * block_size * heads * dim]``, whose K half starts each row). The JAX equivalents:
        ``sources_for_token_major(kv_cache[0])``, ``sources_for_stacked(kv_cache, layer_axis=1, layer=0)``.
      block_size: checked against the cache's when given.
      read_bytes: bytes hashed per slot under ALL (a multiple of 16); None = all of the slot's K bytes.

    Returns:
      ``RealKvSource(tensor, page_size=block_size, num_bytes_per_token=heads * dim * itemsize, read_bytes)``.

    Raises:
      TypeError: not a tensor. ValueError (naming the argument, its shape and the layout): an unknown layout, a
        shape that is not the layout's, a non-contiguous cache (vLLM's HND stride order), a slot half that is
        not a multiple of 16 bytes, a ``block_size`` mismatch, and SGLang's ``RealKvSource`` checks.
    """
    return _source("k_source", kv_cache, layout, 0, block_size, read_bytes)


def v_source(
    kv_cache: torch.Tensor, *, layout: Layout, block_size: int | None = None, read_bytes: int | None = None
) -> RealKvSource:
    """As :func:`k_source` for the V half: ``kv_cache[1]`` of ``"kv_first"``.

    Raises:
      ValueError: ``"block_first"`` (V sits at a row offset SGLang's descriptor lacks), and :func:`k_source`'s.
    """
    return _source("v_source", kv_cache, layout, 1, block_size, read_bytes)
