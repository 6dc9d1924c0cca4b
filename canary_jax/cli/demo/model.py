"""A small decoder-only transformer over a paged, bf16 KV pool (the demo's "model").

Random weights from a seed; grouped-query attention (``num_q_heads`` query heads share ``num_kv_heads`` K/V
heads); RoPE; bytewise vocabulary (256 byte tokens plus a few specials). The KV pools are what a serving
engine owns and what the canary protects:

* ``k_pool``, ``v_pool``: ``bf16[num_layers, num_pages, page_size * kv_dim]`` with
  ``kv_dim = num_kv_heads * head_dim``. KV slot ``s`` of layer ``l`` is
  ``pool[l, s // page_size, (s % page_size) * kv_dim : + kv_dim]``, i.e. SGLang's paged layout, so
  ``k_pool[0]`` is directly a :class:`~canary_jax.contract.sources.RealKvSource` with ``page_size`` slots per row and
  ``num_bytes_per_token = 2 * kv_dim``.
* Slot 0 (page 0) is the dummy slot: padded tokens write their KV there and nothing ever reads it.

One :func:`forward_impl` call runs a whole serving batch: a flat token array (chunked prefills and decodes of
several requests, padded to a fixed capacity so the step is compiled once). Every token first scatters its
K/V into the pool at ``out_cache_loc``, then attends over its request's context through the
``req_to_token`` table (positions ``0..position``), so a chunk sees itself and every earlier chunk.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

BYTE_VOCAB = 256
BOS_TOKEN = 256
EOS_TOKEN = 257
PAD_TOKEN = 258
VOCAB_SIZE = 259
# Sampling is restricted to printable ASCII so generated continuations stay readable bytes.
SAMPLE_LO, SAMPLE_HI = 32, 127


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class ModelConfig:
    """Shape of the demo transformer.

    Fields:
      num_layers: transformer blocks.
      d_model: residual width.
      num_q_heads: query heads; a multiple of ``num_kv_heads``.
      num_kv_heads: K/V heads (grouped-query attention).
      head_dim: per-head width, even (RoPE).
      d_ff: MLP hidden width.
      seed: weight seed.
    """

    num_layers: int = 2
    d_model: int = 64
    num_q_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    d_ff: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "d_model", "num_q_heads", "num_kv_heads", "head_dim", "d_ff"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE), got {self.head_dim}")
        if (self.kv_dim * 2) % 16:
            raise ValueError(
                f"num_kv_heads * head_dim * 2 bytes must be a multiple of 16 (canary real-KV rows), "
                f"got {self.kv_dim * 2}"
            )

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one slot owns in one layer's K pool (bf16)."""
        return 2 * self.kv_dim


def init_params(cfg: ModelConfig) -> dict:
    """Random weights (bf16 matmuls are overkill here: f32 params, bf16 KV)."""
    key = jax.random.PRNGKey(cfg.seed)
    keys = iter(jax.random.split(key, 4 + 8 * cfg.num_layers))

    def dense(shape, fan_in):
        return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(fan_in)

    d, q, kv, f = cfg.d_model, cfg.num_q_heads * cfg.head_dim, cfg.kv_dim, cfg.d_ff
    layers = []
    for _ in range(cfg.num_layers):
        layers.append(
            dict(
                ln1=jnp.ones((d,), jnp.float32),
                wq=dense((d, q), d),
                wk=dense((d, kv), d),
                wv=dense((d, kv), d),
                wo=dense((q, d), q),
                ln2=jnp.ones((d,), jnp.float32),
                w1=dense((d, f), d),
                w2=dense((f, d), f),
            )
        )
    return dict(
        embed=jax.random.normal(next(keys), (VOCAB_SIZE, d), jnp.float32),
        layers=layers,
        ln_f=jnp.ones((d,), jnp.float32),
        unembed=dense((d, VOCAB_SIZE), d),
    )


def allocate_pools(cfg: ModelConfig, *, num_pages: int, page_size: int) -> tuple[jax.Array, jax.Array]:
    """Zeroed ``bf16[num_layers, num_pages, page_size * kv_dim]`` K and V pools."""
    shape = (cfg.num_layers, num_pages, page_size * cfg.kv_dim)
    return jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)


def _rms_norm(x, w):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * w


def _rope(x, positions):
    """x: [T, H, D], positions: int32[T]."""
    half = x.shape[-1] // 2
    freq = 1.0 / (10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half))
    ang = positions.astype(jnp.float32)[:, None] * freq[None, :]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def forward_impl(
    params: dict,
    k_pool: jax.Array,
    v_pool: jax.Array,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    token_rows: jax.Array,
    req_to_token: jax.Array,
    sample_index: jax.Array,
    key: jax.Array,
    *,
    cfg: ModelConfig,
):
    """Runs one serving batch, writing its K/V into the pools and sampling one token per request (traced inside
    the caller's ``jit``; :func:`forward` is the standalone jitted program).

    Args:
      params: :func:`init_params` output.
      k_pool, v_pool: ``bf16[num_layers, num_pages, page_size * kv_dim]`` (donated by the jitted callers), or the
        same bytes as ``bf16[num_layers, num_pages, page_size, num_kv_heads, head_dim]`` (heads an axis, so a
        caller's ``jit`` can shard the pool over heads: ``canary-jax demo --devices N``); returned in their shape.
      input_ids: ``int32[T]`` tokens (padding: any token).
      positions: ``int32[T]`` position of each token in its request.
      out_cache_loc: ``int32[T]`` KV slot each token writes (padding: 0, the dummy slot).
      token_rows: ``int32[T]`` req_to_token row of each token's request (0 = padding: attends to nothing).
      req_to_token: ``int32[R, L]`` slot of every position of every request row.
      sample_index: ``int32[B]`` token index whose logits are sampled for batch row b (any value for padding).
      key: PRNG key for sampling.
      cfg: static model config.

    Returns:
      ``(k_pool, v_pool, next_tokens int32[B])``.
    """
    layer_shape = k_pool.shape[1:]  # [num_pages, page_size * kv_dim] or [num_pages, page_size, heads, head_dim]
    num_slots = int(np.prod(layer_shape)) // cfg.kv_dim
    t = input_ids.shape[0]
    h, g, dh = cfg.num_kv_heads, cfg.num_q_heads // cfg.num_kv_heads, cfg.head_dim

    ctx_slots = req_to_token[token_rows]  # [T, L]
    ctx_len = req_to_token.shape[1]
    visible = (jnp.arange(ctx_len)[None, :] <= positions[:, None]) & (token_rows[:, None] > 0)

    x = params["embed"][input_ids]
    kps, vps = [], []
    for li, lp in enumerate(params["layers"]):
        hdn = _rms_norm(x, lp["ln1"])
        q = _rope((hdn @ lp["wq"]).reshape(t, h * g, dh), positions)
        k = _rope((hdn @ lp["wk"]).reshape(t, h, dh), positions)
        v = (hdn @ lp["wv"]).reshape(t, h, dh)
        kp = k_pool[li].reshape(num_slots, cfg.kv_dim).at[out_cache_loc].set(k.reshape(t, -1).astype(jnp.bfloat16))
        vp = v_pool[li].reshape(num_slots, cfg.kv_dim).at[out_cache_loc].set(v.reshape(t, -1).astype(jnp.bfloat16))
        kps.append(kp.reshape(layer_shape))
        vps.append(vp.reshape(layer_shape))
        kc = kp[ctx_slots].reshape(t, ctx_len, h, dh).astype(jnp.float32)
        vc = vp[ctx_slots].reshape(t, ctx_len, h, dh).astype(jnp.float32)
        qg = q.reshape(t, h, g, dh)
        s = jnp.einsum("thgd,tlhd->thgl", qg, kc) / np.sqrt(dh)
        s = jnp.where(visible[:, None, None, :], s, -1e30)
        p = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("thgl,tlhd->thgd", p, vc).reshape(t, h * g * dh)
        x = x + o @ lp["wo"]
        hdn = _rms_norm(x, lp["ln2"])
        x = x + jax.nn.gelu(hdn @ lp["w1"]) @ lp["w2"]
    x = _rms_norm(x[sample_index], params["ln_f"])
    logits = x @ params["unembed"]
    allowed = (jnp.arange(VOCAB_SIZE) >= SAMPLE_LO) & (jnp.arange(VOCAB_SIZE) < SAMPLE_HI)
    logits = jnp.where(allowed[None, :], logits, -1e30)
    next_tokens = jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
    return jnp.stack(kps), jnp.stack(vps), next_tokens


# forward_impl as its own jitted program (donates the pools). The demo engine instead traces forward_impl inside its one
# jitted serving step (canary_jax.cli.demo.canary_ops.served_step).
forward = functools.partial(jax.jit, static_argnames=("cfg",), donate_argnames=("k_pool", "v_pool"))(forward_impl)


def tokenize(text: str) -> list[int]:
    """Bytewise tokenizer: ``[BOS] + utf-8 bytes``."""
    return [BOS_TOKEN] + list(text.encode("utf-8"))


def detokenize(tokens) -> str:
    return bytes(int(t) for t in tokens if 0 <= int(t) < BYTE_VOCAB).decode("utf-8", errors="replace")
