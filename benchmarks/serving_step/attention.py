"""The step's attention: decode over SGLang's token-major paged pool (JAX's Pallas paged-attention kernel body
under a token-major wrapper, or an XLA gather + einsum), chunked prefill (``dot_product_attention`` over the
prefix and the causal chunk, merged by log-sum-exp), an f32 reference, and the self-check that picks one."""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.serving_step.timing import log


def decode_attention_xla(q, k_pages, v_pages, block_tables, lengths):
    """``q [B, Hq, D]`` (pre-scaled) over token-major pages ``[P, ps, Hk, D]``: gather + einsum (XLA)."""
    b, hq, d = q.shape
    _, ps, hk, _ = k_pages.shape
    n = block_tables.shape[1] * ps
    kc = k_pages[block_tables].reshape(b, n, hk, d)
    vc = v_pages[block_tables].reshape(b, n, hk, d)
    s = jnp.einsum("bhgd,bshd->bhgs", q.reshape(b, hk, hq // hk, d), kc, preferred_element_type=jnp.float32)
    s = jnp.where((jnp.arange(n)[None, :] < lengths[:, None])[:, None, None, :], s, -1e30)
    p = jax.nn.softmax(s, axis=-1).astype(vc.dtype)
    o = jnp.einsum("bhgs,bshd->bhgd", p, vc, preferred_element_type=jnp.float32)
    return o.reshape(b, hq, d).astype(q.dtype)


def _kv_splits(pages_per_seq: int) -> tuple[int, int]:
    k_splits = next(k for k in (16, 8, 4, 2, 1) if pages_per_seq % k == 0)
    return k_splits, max(1, min(8, pages_per_seq // k_splits))


def decode_attention_pallas(q, k_pages, v_pages, block_tables, lengths, *, interpret=None):
    """JAX's Pallas GPU paged-attention kernel body over SGLang's token-major pool.

    ``jax.experimental.pallas.ops.gpu.paged_attention.paged_attention`` wants ``[Hk, pages, page_size, D]``;
    this wrapper is its ``paged_attention_unbatched`` with the K / V block specs reading head ``h`` of
    ``[pages, page_size, Hk, D]`` instead (the kernel body is JAX's, unchanged). ``q`` is pre-scaled.
    """
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import triton as plgpu
    from jax.experimental.pallas.ops.gpu import paged_attention as pa

    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    b, hq, d = q.shape
    num_pages, ps, hk, _ = k_pages.shape
    pps = block_tables.shape[1]
    k_splits, ppcb = _kv_splits(pps)
    ppp = pps // k_splits
    g = hq // hk
    block_h = 16
    head_splits = -(-g // block_h)
    kernel = functools.partial(
        pa.paged_attention_kernel,
        num_heads=g,
        pages_per_compute_block=ppcb,
        mask_value=pa.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=None,
    )

    def one(q1, bt, ln):  # q1 [Hq, D], bt [pps], ln [1]
        qr = q1.reshape(hk, g, d)
        if g % block_h:
            qr = jnp.pad(qr, ((0, 0), (0, -g % block_h), (0, 0)))
        o, l_, m_ = pl.pallas_call(
            kernel,
            grid=(hk, head_splits, k_splits),
            in_specs=[
                pl.BlockSpec((None, block_h, d), lambda h, i, k: (h, i, 0)),
                pl.BlockSpec((num_pages, ps, None, d), lambda h, i, k: (0, 0, h, 0)),
                None,
                pl.BlockSpec((num_pages, ps, None, d), lambda h, i, k: (0, 0, h, 0)),
                None,
                pl.BlockSpec((None, ppp), lambda h, i, k: (k, 0)),
                pl.BlockSpec((1,), lambda h, i, k: (0,)),
            ],
            out_specs=[
                pl.BlockSpec((None, None, block_h, d), lambda h, i, k: (k, h, i, 0)),
                pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
                pl.BlockSpec((None, None, block_h), lambda h, i, k: (k, h, i)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((k_splits, *qr.shape), q.dtype),
                jax.ShapeDtypeStruct((k_splits, *qr.shape[:-1]), jnp.float32),
                jax.ShapeDtypeStruct((k_splits, *qr.shape[:-1]), jnp.float32),
            ],
            interpret=interpret,
            compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
            name="paged_attention_token_major",
        )(qr, k_pages, None, v_pages, None, bt.reshape(k_splits, ppp), ln)
        o, l_, m_ = o[..., :g, :], l_[..., :g], m_[..., :g]
        m_next = m_.max(axis=0)
        corr = jnp.exp(m_ - m_next[None])
        o = o.astype(jnp.float32) * corr[..., None]
        l_next = (l_ * corr).sum(axis=0)
        o = o.sum(axis=0) / (l_next[..., None] + jnp.finfo(jnp.float32).eps)
        return o.reshape(hq, d).astype(q.dtype)

    return jax.vmap(one)(q, block_tables, lengths[:, None].astype(jnp.int32))


def prefill_attention(q, k_prefix, v_prefix, k_new, v_new, *, impl):
    """A chunk after its prefix: ``dot_product_attention`` over the prefix (no mask) and over the chunk
    (causal, square), merged by the two log-sum-exps. ``q [T, Hq, D]``, keys ``[S, Hk, D]``."""
    dpa = functools.partial(jax.nn.dot_product_attention, implementation=impl, return_residual=True)
    o1, l1 = dpa(q[None], k_prefix[None], v_prefix[None], is_causal=False)
    o2, l2 = dpa(q[None], k_new[None], v_new[None], is_causal=True)
    l1, l2 = l1.astype(jnp.float32), l2.astype(jnp.float32)
    mx = jnp.maximum(l1, l2)
    w1, w2 = jnp.exp(l1 - mx)[..., None], jnp.exp(l2 - mx)[..., None]
    o = (o1.astype(jnp.float32) * w1 + o2.astype(jnp.float32) * w2) / (w1 + w2)
    return o[0].astype(q.dtype)


def attention_reference(q, k, v, q_pos, k_len):
    """f32 reference: query ``t`` at position ``q_pos[t]`` sees keys ``[0, min(q_pos[t] + 1, k_len))``."""
    hq, hk = q.shape[1], k.shape[1]
    kk = jnp.repeat(k.astype(jnp.float32), hq // hk, axis=1)
    vv = jnp.repeat(v.astype(jnp.float32), hq // hk, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kk) / math.sqrt(q.shape[-1])
    keys = jnp.arange(k.shape[0])
    ok = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] < k_len)
    s = jnp.where(ok[None], s, -1e30)
    return jnp.einsum("hts,shd->thd", jax.nn.softmax(s, axis=-1), vv)


@dataclasses.dataclass(frozen=True)
class Attention:
    decode: str  # pallas | xla
    prefill: str  # cudnn | xla


# --- attention self-checks -------------------------------------------------------------------------------------
def _self_check(info: dict, name: str, tol: float, against: str, rel_err) -> bool:
    """Runs ``rel_err()`` (a relative error, float), records it as ``info[name + "_check_rel_err"]`` and says
    whether it is below ``tol``; an error or a miss is recorded as ``info[name + "_fallback"]`` (and printed)."""
    try:
        err = rel_err()
        info[f"{name}_check_rel_err"] = err
        if not err < tol:
            raise ValueError(f"relative error {err:.3g} against {against}")
        return True
    except Exception as e:  # noqa: BLE001
        info[f"{name}_fallback"] = f"{type(e).__name__}: {str(e)[:300]}"
        traceback.print_exc()
        return False


def choose_attention(args, on_gpu: bool, t0: float) -> tuple[Attention, dict]:
    """Picks the decode / prefill attention: the requested one, or on the GPU the fastest one that compiles and
    matches an f32 reference on small inputs (XLA otherwise)."""
    info = {}
    dec = args.attn_decode if args.attn_decode != "auto" else ("pallas" if on_gpu else "xla")
    pre = args.attn_prefill if args.attn_prefill != "auto" else ("cudnn" if on_gpu else "xla")
    rng = np.random.default_rng(7)

    def decode_err():
        ps, hk, hq, d, pages, b = 16, 2, 4, 128, 40, 2
        kp = jnp.asarray(rng.standard_normal((pages, ps, hk, d)), jnp.bfloat16)
        vp = jnp.asarray(rng.standard_normal((pages, ps, hk, d)), jnp.bfloat16)
        q = jnp.asarray(rng.standard_normal((b, hq, d)) / math.sqrt(d), jnp.bfloat16)
        bt = jnp.asarray(rng.permutation(np.arange(1, pages))[: b * 16].reshape(b, 16), jnp.int32)
        lengths = jnp.asarray([256, 200], jnp.int32)
        got = jax.jit(functools.partial(decode_attention_pallas, interpret=not on_gpu))(q, kp, vp, bt, lengths)
        want = jax.jit(decode_attention_xla)(q, kp, vp, bt, lengths)
        return float(jnp.linalg.norm((got - want).astype(jnp.float32)) / jnp.linalg.norm(want.astype(jnp.float32)))

    def prefill_err():
        s, t, hq, hk, d = 256, 128, 4, 2, 128
        q = jnp.asarray(rng.standard_normal((t, hq, d)), jnp.bfloat16)
        kk = jnp.asarray(rng.standard_normal((s + t, hk, d)), jnp.bfloat16)
        vv = jnp.asarray(rng.standard_normal((s + t, hk, d)), jnp.bfloat16)
        fn = jax.jit(functools.partial(prefill_attention, impl="cudnn"))
        got = fn(q, kk[:s], vv[:s], kk[s:], vv[s:])
        want = attention_reference(q, kk, vv, jnp.arange(s, s + t), s + t)
        return float(jnp.linalg.norm(got.astype(jnp.float32) - want) / jnp.linalg.norm(want))

    if dec == "pallas" and not _self_check(info, "decode", 2e-2, "XLA", decode_err):
        dec = "xla"
    if pre == "cudnn" and not _self_check(info, "prefill", 3e-2, "the f32 reference", prefill_err):
        pre = "xla"
    log(f"attention: decode={dec} prefill={pre} {info}", t0)
    return Attention(decode=dec, prefill=pre), info


def attention_label(attn: Attention, kind: str) -> str:
    if kind == "decode":
        return (
            "Pallas paged_attention_kernel (jax.experimental.pallas.ops.gpu.paged_attention), token-major wrapper"
            if attn.decode == "pallas"
            else "XLA (page gather + einsum)"
        )
    return (
        "cuDNN flash attention (jax.nn.dot_product_attention implementation='cudnn'), prefix + causal chunk, LSE merge"
        if attn.prefill == "cudnn"
        else "XLA jax.nn.dot_product_attention, prefix + causal chunk, LSE merge"
    )
