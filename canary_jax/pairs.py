"""In-jit arithmetic on int64 values held as ``uint32[..., 2]`` little-endian pairs (see :mod:`canary_jax.ints`).

Shared by the jnp references and the plan builder. Every function is plain ``jax.numpy`` on uint32 words, so it
traces identically with ``jax_enable_x64`` off and on. Values are two's-complement int64 unless a function says
it works on uint64.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from canary_jax import constants
from canary_jax import hashing


def as_u64(p: jax.Array) -> hashing.U64:
    """``uint32[..., 2]`` -> :class:`~canary_jax.hashing.U64` (no copy)."""
    return hashing.U64(p[..., 0], p[..., 1])


def from_u64(u: hashing.U64) -> jax.Array:
    """:class:`~canary_jax.hashing.U64` -> ``uint32[..., 2]``."""
    return jnp.stack([u.lo, u.hi], axis=-1)


def from_int32(x: jax.Array) -> jax.Array:
    """int32 array -> int64 pairs (sign-extended, exact)."""
    lo = x.astype(jnp.uint32)
    hi = jnp.where(x < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0))
    return jnp.stack([lo, hi], axis=-1)


def const(value: int, shape) -> jax.Array:
    """A Python int (taken mod 2**64) broadcast to pairs of ``shape``."""
    value &= constants.U64_MASK
    return jnp.stack(
        [jnp.full(shape, value & 0xFFFFFFFF, jnp.uint32), jnp.full(shape, value >> 32, jnp.uint32)], axis=-1
    )


def add(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a + b`` mod 2**64."""
    lo = a[..., 0] + b[..., 0]
    carry = (lo < a[..., 0]).astype(jnp.uint32)
    return jnp.stack([lo, a[..., 1] + b[..., 1] + carry], axis=-1)


def sub(a: jax.Array, b: jax.Array) -> jax.Array:
    """``a - b`` mod 2**64."""
    lo = a[..., 0] - b[..., 0]
    borrow = (a[..., 0] < b[..., 0]).astype(jnp.uint32)
    return jnp.stack([lo, a[..., 1] - b[..., 1] - borrow], axis=-1)


def is_negative(p: jax.Array) -> jax.Array:
    return p[..., 1] >= jnp.uint32(0x80000000)


def is_zero(p: jax.Array) -> jax.Array:
    return (p[..., 0] == 0) & (p[..., 1] == 0)


def is_positive(p: jax.Array) -> jax.Array:
    return ~is_negative(p) & ~is_zero(p)


def ne(a: jax.Array, b: jax.Array) -> jax.Array:
    return (a[..., 0] != b[..., 0]) | (a[..., 1] != b[..., 1])


def lt(a: jax.Array, b: jax.Array) -> jax.Array:
    """Signed ``a < b``."""
    ah = jax.lax.bitcast_convert_type(a[..., 1], jnp.int32)
    bh = jax.lax.bitcast_convert_type(b[..., 1], jnp.int32)
    return (ah < bh) | ((ah == bh) & (a[..., 0] < b[..., 0]))


def in_range(p: jax.Array, n: int) -> jax.Array:
    """``0 <= p < n`` for a static ``0 <= n < 2**32``."""
    return (p[..., 1] == 0) & (p[..., 0] < jnp.uint32(n))


def index(p: jax.Array, n: int) -> tuple[jax.Array, jax.Array]:
    """``(int32 index, in-range mask)``: the index is 0 where ``p`` is outside ``[0, n)``."""
    ok = in_range(p, n)
    return jnp.where(ok, p[..., 0], 0).astype(jnp.int32), ok


def clamp_to_int32(p: jax.Array, lo: int, hi: int) -> jax.Array:
    """``clip(p, lo, hi)`` as int32, for static ``0 <= lo <= hi < 2**31``."""
    neg = is_negative(p)
    big = (~neg) & ((p[..., 1] != 0) | (p[..., 0] > jnp.uint32(hi)))
    v = jnp.where(neg, jnp.uint32(lo), jnp.where(big, jnp.uint32(hi), p[..., 0])).astype(jnp.int32)
    return jnp.clip(v, lo, hi)


def cumsum(p: jax.Array) -> jax.Array:
    """Inclusive cumsum (mod 2**64) along axis 0."""
    if p.shape[0] == 0:
        return p
    lo, hi = jax.lax.associative_scan(
        lambda a, b: (a[0] + b[0], a[1] + b[1] + (a[0] + b[0] < a[0]).astype(jnp.uint32)),
        (p[..., 0], p[..., 1]),
    )
    return jnp.stack([lo, hi], axis=-1)
