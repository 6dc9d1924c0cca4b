"""The step's decode attention as a Pallas kernel of ours, over SGLang's token-major paged pool.

``q [B, Hq, D]`` (pre-scaled) attends to the first ``lengths[b]`` tokens of request ``b``, whose pages are
``block_tables[b]``; ``k_pages`` / ``v_pages`` are ``[P, page_size, Hk, D]`` (token-major, as SGLang's pool keeps
them), read where they lie. The grid is ``(B, Hk, head blocks, KV splits)``: each program takes up to 16 query
heads of one KV head (grouped-query attention), walks its split's pages a few at a time with an online softmax
(f32 running max, sum and output), and writes its partial output, sum and max; the splits are merged by
log-sum-exp outside the kernel. Blocks past a request's length are not read. The same flash-decoding scheme as
JAX's former ``jax.experimental.pallas.ops.gpu.paged_attention`` (removed in jax 0.12.1), written here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_BLOCK_H = 16  # query heads per program (Triton's dot needs >= 16 rows)
_MASK = -1e30


def split_plan(pages_per_seq: int, page_size: int) -> tuple[int, int]:
    """``(kv_splits, pages_per_block)``: the most splits (of 16, 8, 4, 2, 1) dividing ``pages_per_seq`` that leave
    each split at least 64 tokens, and the most pages per step (a power of two, at most 8) dividing a split."""
    fits = (k for k in (16, 8, 4, 2) if pages_per_seq % k == 0 and pages_per_seq // k * page_size >= 64)
    splits = next(fits, 1)
    per_split = pages_per_seq // splits
    per_block = next(p for p in (8, 4, 2, 1) if per_split % p == 0)
    return splits, per_block


def _kernel(q_ref, k_ref, v_ref, bt_ref, len_ref, o_ref, l_ref, m_ref, *, page_size: int, pages_per_block: int):
    from jax.experimental import pallas as pl

    per_split, num_pages, d = bt_ref.shape[0], k_ref.shape[0], k_ref.shape[-1]
    block_tokens = page_size * pages_per_block
    n_tok = jnp.clip(len_ref[0] - pl.program_id(3) * (per_split * page_size), 0, per_split * page_size)
    q = q_ref[...]

    def body(j, carry):
        o, m, l_ = carry
        pages = jnp.clip(bt_ref[pl.ds(j * pages_per_block, pages_per_block)], 0, num_pages - 1)
        k = k_ref[pages].reshape(block_tokens, d)
        v = v_ref[pages].reshape(block_tokens, d)
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        tok = j * block_tokens + jnp.arange(block_tokens, dtype=jnp.int32)
        s = jnp.where((tok < n_tok)[None, :], s, _MASK)
        m_new = jnp.maximum(m, s.max(axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=jnp.float32)
        return o * corr[:, None] + pv, m_new, l_ * corr + p.sum(axis=1)

    h = q.shape[0]
    init = (jnp.zeros((h, d), jnp.float32), jnp.full((h,), _MASK, jnp.float32), jnp.zeros((h,), jnp.float32))
    o, m, l_ = jax.lax.fori_loop(0, (n_tok + block_tokens - 1) // block_tokens, body, init)
    o_ref[...], l_ref[...], m_ref[...] = o, l_, m


def decode_attention_pallas(q, k_pages, v_pages, block_tables, lengths, *, interpret=None):
    """Decode attention of ``q [B, Hq, D]`` (bf16 or f32, pre-scaled) over token-major pages ``[P, ps, Hk, D]``;
    ``block_tables`` int32 ``[B, pages_per_seq]``, ``lengths`` int32 ``[B]``; returns ``[B, Hq, D]`` in ``q``'s dtype.
    Compiled through Triton on a GPU, interpreted elsewhere (``interpret=None``)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu

    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, hq, d = q.shape
    num_pages, ps, hk, _ = k_pages.shape
    pps = block_tables.shape[1]
    g = hq // hk
    splits, per_block = split_plan(pps, ps)
    per_split, g_pad = pps // splits, -(-g // _BLOCK_H) * _BLOCK_H
    qr = jnp.pad(q.reshape(b, hk, g, d), ((0, 0), (0, 0), (0, g_pad - g), (0, 0)))
    page_spec = pl.BlockSpec((num_pages, ps, None, d), lambda bi, h, i, k: (0, 0, h, 0))
    part = (b, splits, hk, g_pad)
    o, l_, m = pl.pallas_call(
        functools.partial(_kernel, page_size=ps, pages_per_block=per_block),
        grid=(b, hk, g_pad // _BLOCK_H, splits),
        in_specs=[
            pl.BlockSpec((None, None, _BLOCK_H, d), lambda bi, h, i, k: (bi, h, i, 0)),
            page_spec,
            page_spec,
            pl.BlockSpec((None, None, per_split), lambda bi, h, i, k: (bi, k, 0)),
            pl.BlockSpec((None, 1), lambda bi, h, i, k: (bi, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, _BLOCK_H, d), lambda bi, h, i, k: (bi, k, h, i, 0)),
            pl.BlockSpec((None, None, None, _BLOCK_H), lambda bi, h, i, k: (bi, k, h, i)),
            pl.BlockSpec((None, None, None, _BLOCK_H), lambda bi, h, i, k: (bi, k, h, i)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*part, d), jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
            jax.ShapeDtypeStruct(part, jnp.float32),
        ],
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        name="paged_decode_attention_token_major",
    )(qr, k_pages, v_pages, block_tables.reshape(b, splits, per_split), lengths.reshape(b, 1).astype(jnp.int32))
    m_all = m.max(axis=1, keepdims=True)
    corr = jnp.exp(m - m_all)
    out = (o * corr[..., None]).sum(axis=1) / ((l_ * corr).sum(axis=1)[..., None] + jnp.finfo(jnp.float32).eps)
    return out[:, :, :g].reshape(b, hq, d).astype(q.dtype)
