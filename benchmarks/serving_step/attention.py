"""The step's attention: decode over SGLang's token-major paged pool (our Pallas kernel,
:mod:`benchmarks.serving_step.decode_kernel`, or an XLA gather + einsum), chunked prefill
(``dot_product_attention`` over the prefix and the causal chunk, merged by log-sum-exp), an f32 reference, and
the self-check that picks one."""

from __future__ import annotations

import dataclasses
import functools
import math
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.serving_step.decode_kernel import decode_attention_pallas
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
            "Pallas paged decode attention over the token-major pool (benchmarks/serving_step/decode_kernel.py)"
            if attn.decode == "pallas"
            else "XLA (page gather + einsum)"
        )
    return (
        "cuDNN flash attention (jax.nn.dot_product_attention implementation='cudnn'), prefix + causal chunk, LSE merge"
        if attn.prefill == "cudnn"
        else "XLA jax.nn.dot_product_attention, prefix + causal chunk, LSE merge"
    )
