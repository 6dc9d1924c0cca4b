"""The decoder: random bf16 weights, the paged bf16 KV pool (SGLang's layout, one K and one V array per
layer), RMSNorm, RoPE and one forward that writes its tokens' K / V into the pool and samples greedily."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from benchmarks.serving_step.attention import (
    Attention,
    decode_attention_pallas,
    decode_attention_xla,
    prefill_attention,
)
from benchmarks.serving_step.shapes import ModelShape


def init_params(m: ModelShape, seed: int) -> dict:
    """Random bf16 weights (normal / sqrt(fan_in)); norms near 1."""
    key = jax.random.PRNGKey(seed)

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def dense(k, shape, fan_in):
        return (jax.random.normal(k, shape, jnp.float32) / math.sqrt(fan_in)).astype(jnp.bfloat16)

    @functools.partial(jax.jit, static_argnums=(1,))
    def norm(k, n):
        return (1.0 + 0.1 * jax.random.normal(k, (n,), jnp.float32)).astype(jnp.bfloat16)

    h, q, kv, f = m.hidden, m.q_dim, m.kv_dim, m.mlp
    layers = []
    for i in range(m.layers):
        ks = jax.random.split(jax.random.fold_in(key, i), 11)
        layers.append(
            dict(
                ln1=norm(ks[0], h),
                wq=dense(ks[1], (h, q), h),
                wk=dense(ks[2], (h, kv), h),
                wv=dense(ks[3], (h, kv), h),
                q_norm=norm(ks[4], m.head_dim),
                k_norm=norm(ks[5], m.head_dim),
                wo=dense(ks[6], (q, h), q),
                ln2=norm(ks[7], h),
                w_gate=dense(ks[8], (h, f), h),
                w_up=dense(ks[9], (h, f), h),
                w_down=dense(ks[10], (f, h), f),
            )
        )
    ke = jax.random.split(jax.random.fold_in(key, 10_000), 2)
    return dict(embed=dense(ke[0], (m.vocab, h), 1), layers=tuple(layers), ln_f=norm(ke[1], h))


def allocate_pool(m: ModelShape, num_pages: int, page_size: int, seed: int) -> tuple[tuple, tuple]:
    """Random bf16 K and V pools, one ``[num_pages, page_size * kv_dim]`` array per layer (never zeros)."""

    @functools.partial(jax.jit, static_argnums=(1,))
    def layer(k, shape):
        return jax.random.normal(k, shape, jnp.bfloat16)

    key = jax.random.PRNGKey(seed + 1)
    shape = (num_pages, page_size * m.kv_dim)
    ks = tuple(layer(jax.random.fold_in(key, 2 * i), shape) for i in range(m.layers))
    vs = tuple(layer(jax.random.fold_in(key, 2 * i + 1), shape) for i in range(m.layers))
    return ks, vs


def rms_norm(x, w, eps):
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y * w.astype(jnp.float32)).astype(jnp.bfloat16)


def rope(x, positions, theta):
    """Rotate-half RoPE of ``x [T, H, D]`` at ``positions [T]``."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions.astype(jnp.float32)[:, None] * inv[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def forward(params, kv, ids, positions, loc, b, *, m: ModelShape, kind: str, attn: Attention, page_size: int):
    """One forward: writes K / V of the ``T`` tokens at ``loc``, attends, samples (greedy) the last token of each
    request. Returns ``(kv, next_tokens int32[B])``."""
    ks, vs = list(kv[0]), list(kv[1])
    t = ids.shape[0]
    x = params["embed"][ids]
    scale = 1.0 / math.sqrt(m.head_dim)
    for li, lp in enumerate(params["layers"]):
        h = rms_norm(x, lp["ln1"], m.eps)
        q = (h @ lp["wq"]).reshape(t, m.q_heads, m.head_dim)
        k = (h @ lp["wk"]).reshape(t, m.kv_heads, m.head_dim)
        v = (h @ lp["wv"]).reshape(t, m.kv_heads, m.head_dim)
        q = rope(rms_norm(q, lp["q_norm"], m.eps), positions, m.rope_theta)
        k = rope(rms_norm(k, lp["k_norm"], m.eps), positions, m.rope_theta)
        pages = ks[li].shape[0]
        shape4 = (pages, page_size, m.kv_heads, m.head_dim)
        kf = ks[li].reshape(pages * page_size, m.kv_heads, m.head_dim).at[loc].set(k, unique_indices=True)
        vf = vs[li].reshape(pages * page_size, m.kv_heads, m.head_dim).at[loc].set(v, unique_indices=True)
        ks[li], vs[li] = kf.reshape(ks[li].shape), vf.reshape(vs[li].shape)
        if kind == "decode":
            fn = decode_attention_pallas if attn.decode == "pallas" else decode_attention_xla
            qs = (q.astype(jnp.float32) * scale).astype(q.dtype)
            o = fn(qs, kf.reshape(shape4), vf.reshape(shape4), b["bt"], b["lengths"])
        else:
            o = prefill_attention(q, kf[b["pslots"]], vf[b["pslots"]], k, v, impl=attn.prefill)
        x = x + o.reshape(t, m.q_dim) @ lp["wo"]
        h = rms_norm(x, lp["ln2"], m.eps)
        x = x + (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]
    xs = rms_norm(x[b["sample"]], params["ln_f"], m.eps)
    logits = xs @ params["embed"].T  # bf16 out (f32 accumulation): no f32 copy of the embedding
    return (tuple(ks), tuple(vs)), jnp.argmax(logits, axis=-1).astype(jnp.int32)
