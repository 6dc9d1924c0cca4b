"""64-bit integer arithmetic on uint32 words: the one home of :class:`U64` and its operations.

With ``jax_enable_x64`` off no JAX array can be 64-bit, so every SGLang int64 (and every uint64 hash) is held
as two ``uint32`` words, little-endian: ``value = lo + hi * 2**32`` (see ``docs/DESIGN.md``). Two forms:

* :class:`U64` ``(lo, hi)``: two ``uint32`` arrays of one shape. Every operation here takes and returns this
  form. It is what hashing and the Pallas kernel bodies compute on (one vector per word).
* packed ``uint32[..., 2]``: the storage form of plans, logs and token arrays (the same bytes as SGLang's int64
  tensor). :func:`unpack` / :func:`pack` convert explicitly; :mod:`canary_jax.contract.ints` converts host int64 arrays
  at the API boundary.

Every function is plain ``jax.lax`` / ``jax.numpy`` on ``uint32`` words with logical shifts and 32-bit
multiplies only, so it traces the same with x64 off and on, runs in the jnp references, the plan builder and
:mod:`canary_jax.contract.hashing`, and lowers inside Pallas kernel bodies (Triton cannot lower uint64 constants above
2**63 - 1, see PITFALLS). Values are two's-complement int64 unless a function says it works on uint64.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import constants


class U64(NamedTuple):
    """A 64-bit value as two ``uint32`` arrays of the same shape: ``lo + hi * 2**32``."""

    lo: jax.Array
    hi: jax.Array


# --- 32-bit words ------------------------------------------------------------------------------------------
def u32(value: int) -> jax.Array:
    """A ``uint32`` scalar constant (``value`` taken mod 2**32)."""
    return jnp.asarray(np.uint32(int(value) & 0xFFFFFFFF))


def shr32(x: jax.Array, k) -> jax.Array:
    """Logical right shift of a ``uint32`` array by ``k`` bits (``>>`` is arithmetic on signed ints)."""
    return jax.lax.shift_right_logical(x, jnp.asarray(k, x.dtype))


def shl32(x: jax.Array, k) -> jax.Array:
    """Left shift of a ``uint32`` array by ``k`` bits."""
    return jax.lax.shift_left(x, jnp.asarray(k, x.dtype))


def mulhi_u32(a: jax.Array, b: jax.Array) -> jax.Array:
    """High 32 bits of the 64-bit product of two ``uint32`` arrays, from 16-bit limbs."""
    m16 = jnp.uint32(0xFFFF)
    a0, a1 = a & m16, shr32(a, 16)
    b0, b1 = b & m16, shr32(b, 16)
    p00 = a0 * b0
    p01 = a0 * b1
    p10 = a1 * b0
    p11 = a1 * b1
    mid = shr32(p00, 16) + (p01 & m16) + (p10 & m16)  # < 3 * 2**16, no overflow
    return p11 + shr32(p01, 16) + shr32(p10, 16) + shr32(mid, 16)


# --- forms and constants -------------------------------------------------------------------------------------
def unpack(p: jax.Array) -> U64:
    """Packed ``uint32[..., 2]`` -> :class:`U64` of shape ``p.shape[:-1]`` (no copy)."""
    return U64(p[..., 0], p[..., 1])


def pack(a: U64) -> jax.Array:
    """:class:`U64` -> packed ``uint32[..., 2]``."""
    return jnp.stack([a.lo, a.hi], axis=-1)


def const(value: int, shape=()) -> U64:
    """A Python int (taken mod 2**64, so -1 is all ones) broadcast to ``shape``."""
    value &= constants.U64_MASK
    lo = jnp.full(shape, u32(value), jnp.uint32)
    return U64(lo, lo if value >> 32 == value & 0xFFFFFFFF else jnp.full(shape, u32(value >> 32), jnp.uint32))


def from_int32(x: jax.Array) -> U64:
    """Integer array of at most 32 bits -> int64, exact: sign-extended for signed dtypes (int32, int16, int8),
    zero-extended for unsigned ones (uint32, uint16, uint8)."""
    return U64(x.astype(jnp.uint32), jnp.where(x < 0, jnp.uint32(0xFFFFFFFF), jnp.uint32(0)))


# --- arithmetic (mod 2**64) ------------------------------------------------------------------------------------
def add(a: U64, b: U64 | int) -> U64:
    """``a + b`` mod 2**64; ``b`` a U64 or a static Python int (taken mod 2**64)."""
    if isinstance(b, int):
        b &= constants.U64_MASK
        lo = a.lo + u32(b)
        hi = a.hi + (lo < a.lo).astype(jnp.uint32)
        return U64(lo, hi + u32(b >> 32) if b >> 32 else hi)
    lo = a.lo + b.lo
    return U64(lo, a.hi + b.hi + (lo < a.lo).astype(jnp.uint32))


def sub(a: U64, b: U64) -> U64:
    """``a - b`` mod 2**64."""
    borrow = (a.lo < b.lo).astype(jnp.uint32)
    return U64(a.lo - b.lo, a.hi - b.hi - borrow)


def mul_const(a: U64, value: int, *, mulhi: Callable[[jax.Array, int], jax.Array] | None = None) -> U64:
    """``a * value`` mod 2**64 for a static Python-int multiplier.

    ``mulhi(x, c)`` gives the high word of ``x * c`` for uint32 ``x`` and the static low word ``c`` of the
    multiplier; None uses the portable :func:`mulhi_u32` (the Pallas kernels can pass a one-instruction one).
    """
    value &= constants.U64_MASK
    b_lo, b_hi = u32(value), u32(value >> 32)
    high = mulhi_u32(a.lo, b_lo) if mulhi is None else mulhi(a.lo, value & 0xFFFFFFFF)
    return U64(a.lo * b_lo, high + a.lo * b_hi + a.hi * b_lo)


def xor(a: U64, b: U64) -> U64:
    return U64(a.lo ^ b.lo, a.hi ^ b.hi)


def shr(a: U64, k: int) -> U64:
    """Logical (uint64) right shift by a static ``0 < k < 32``."""
    assert 0 < k < 32, k
    return U64(shr32(a.lo, k) | shl32(a.hi, 32 - k), shr32(a.hi, k))


def where(pred: jax.Array, a: U64, b: U64) -> U64:
    """``a`` where ``pred``, else ``b`` (``pred`` broadcasts against both words)."""
    return U64(jnp.where(pred, a.lo, b.lo), jnp.where(pred, a.hi, b.hi))


def cumsum(a: U64) -> U64:
    """Inclusive cumsum (mod 2**64) along axis 0."""
    if a.lo.shape[0] == 0:
        return a
    lo, hi = jax.lax.associative_scan(
        lambda x, y: (x[0] + y[0], x[1] + y[1] + (x[0] + y[0] < x[0]).astype(jnp.uint32)), (a.lo, a.hi)
    )
    return U64(lo, hi)


# --- comparisons -----------------------------------------------------------------------------------------------
def ne(a: U64, b: U64) -> jax.Array:
    return (a.lo != b.lo) | (a.hi != b.hi)


def lt(a: U64, b: U64) -> jax.Array:
    """Signed ``a < b``."""
    ah = jax.lax.bitcast_convert_type(a.hi, jnp.int32)
    bh = jax.lax.bitcast_convert_type(b.hi, jnp.int32)
    return (ah < bh) | ((ah == bh) & (a.lo < b.lo))


def is_zero(a: U64) -> jax.Array:
    return (a.lo | a.hi) == 0


def is_negative(a: U64) -> jax.Array:
    return shr32(a.hi, 31) != 0


def is_positive(a: U64) -> jax.Array:
    return ~is_negative(a) & ~is_zero(a)


def is_minus_one(a: U64) -> jax.Array:
    return ((~a.lo) | (~a.hi)) == 0


# --- int64 -> int32 indices --------------------------------------------------------------------------------------
def in_range(a: U64, n: int) -> jax.Array:
    """``0 <= a < n`` for a static ``0 <= n < 2**32``."""
    return (a.hi == 0) & (a.lo < u32(n))


def index(a: U64, n: int) -> tuple[jax.Array, jax.Array]:
    """``(int32 index, 0 <= a < n)``: the index is 0 where ``a`` is outside ``[0, n)`` (static ``n < 2**31``)."""
    ok = in_range(a, n)
    return jnp.where(ok, a.lo, u32(0)).astype(jnp.int32), ok


def clamp(a: U64, n: int) -> jax.Array:
    """``clip(a, 0, n)`` as int32, for a static ``0 <= n < 2**31``."""
    neg = is_negative(a)
    big = (~neg) & ((a.hi != 0) | (a.lo > u32(n)))
    return jnp.where(neg, u32(0), jnp.where(big, u32(n), a.lo)).astype(jnp.int32)
