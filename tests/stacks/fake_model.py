"""The stand-in model the stack drivers share: what it writes as K/V and which token it samples.

Both drivers (``sgl_serving``, ``esurge_serving``) replace only the model: the stack's own code schedules,
allocates and writes the KV; these give the values, deterministic in (layer, token, position), so a test can
recompute any slot's K/V and any request's greedy output. ``workload`` is the requests both drivers serve.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


def workload(seed: int, *, prefix_tokens: tuple[int, int]) -> list[tuple[int, str, list[int], int]]:
    """``(arrival_step, rid, prompt, max_tokens)``: prompts on two shared system prefixes of ``prefix_tokens``
    tokens, long prompts (30 + tokens, chunked by the stack's budget), and an exact repeat of r00 (a full-prefix
    hit) arriving at step 30; six waves of three."""
    rng = np.random.default_rng(seed)
    sys_a, sys_b = (rng.integers(1, VOCAB, n).tolist() for n in prefix_tokens)
    out = []
    for w, at in enumerate((0, 6, 14, 25, 38, 52)):
        for j in range(3):
            kind = (w + j) % 3
            if kind == 0:
                prompt = sys_a + rng.integers(1, VOCAB, 3 + j).tolist()
            elif kind == 1:
                prompt = sys_b + rng.integers(1, VOCAB, 5 + 2 * j).tolist()
            else:
                prompt = rng.integers(1, VOCAB, 30 + 4 * j).tolist()
            out.append((at, f"r{len(out):02d}", prompt, 6 + (len(out) * 5) % 17))
    out.append((30, f"r{len(out):02d}", out[0][2], 10))
    return out
