"""The stand-in model the stack drivers share: what it writes as K/V and which token it samples.

Both drivers (``sgl_serving``, ``esurge_serving``) replace only the model: the stack's own code schedules,
allocates and writes the KV; these give the values, deterministic in (layer, token, position), so a test can
recompute any slot's K/V and any request's greedy output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

VOCAB = 1000


def fake_kv(layer: int, tokens: jax.Array, positions: jax.Array, heads: int, head_dim: int):
    """K, V ``bf16[T, heads, head_dim]``: small integers of (layer, token, position), exact in bf16."""
    t = tokens.astype(jnp.int32)[:, None, None]
    p = positions.astype(jnp.int32)[:, None, None]
    h = jnp.arange(heads, dtype=jnp.int32)[None, :, None]
    d = jnp.arange(head_dim, dtype=jnp.int32)[None, None, :]
    k = (t * 7 + p * 13 + layer * 29 + h * 31 + d) % 251 - 125
    v = (t * 11 + p * 3 + layer * 17 + h * 19 + d * 5) % 241 - 120
    return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)


def next_token(tok: int, pos: int) -> int:
    """The greedy token after ``tok`` at ``pos`` (never 0)."""
    return (tok * 1103 + pos * 12345 + 7) % (VOCAB - 1) + 1
