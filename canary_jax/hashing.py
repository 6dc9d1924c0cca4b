"""splitmix64 and friends on little-endian uint32 pairs, identical with ``jax_enable_x64`` off and on.

A 64-bit value is held as ``U64 = (lo, hi)``: two ``uint32`` arrays of one shape, ``value = lo + hi * 2**32``.
Only 32-bit multiplies, logical shifts and xors are used, so the same code traces with x64 off (JAX's
default, where no 64-bit dtype exists) and on, and lowers inside Pallas kernels (Triton cannot lower uint64
constants above 2**63 - 1, see PITFALLS). The hash definitions come from SGLang's ``consts.py``
(``splitmix64``, ``splitmix64_mix3``) and ``verify_ref.py`` (``compute_slot_hash``, the real-KV byte fold);
SPEC section 2 restates them and section 2.6 gives worked numbers pinned in ``tests/test_hashing.py``.

Every function here is a plain function of ``jax.lax`` / ``jax.numpy`` ops on ``uint32`` arrays, usable in
jnp references and inside Pallas kernel bodies alike.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import constants


class U64(NamedTuple):
    """A 64-bit unsigned value as two ``uint32`` arrays of the same shape (little-endian words)."""

    lo: jax.Array
    hi: jax.Array


def _u32(value: int) -> jax.Array:
    return jnp.asarray(np.uint32(value & 0xFFFFFFFF))


def u64_const(value: int) -> U64:
    """A Python int (taken modulo 2**64) as a scalar U64."""
    value &= constants.U64_MASK
    return U64(_u32(value), _u32(value >> 32))


def u64_zeros_like(x: jax.Array) -> U64:
    z = jnp.zeros_like(x, dtype=jnp.uint32)
    return U64(z, z)


def u64_xor(a: U64, b: U64) -> U64:
    return U64(a.lo ^ b.lo, a.hi ^ b.hi)


def u64_eq(a: U64, b: U64) -> jax.Array:
    return (a.lo == b.lo) & (a.hi == b.hi)


def u64_ne(a: U64, b: U64) -> jax.Array:
    return (a.lo != b.lo) | (a.hi != b.hi)


def u64_where(pred: jax.Array, a: U64, b: U64) -> U64:
    return U64(jnp.where(pred, a.lo, b.lo), jnp.where(pred, a.hi, b.hi))


def _shr32(x: jax.Array, k: int) -> jax.Array:
    return jax.lax.shift_right_logical(x, jnp.asarray(k, x.dtype))


def _shl32(x: jax.Array, k: int) -> jax.Array:
    return jax.lax.shift_left(x, jnp.asarray(k, x.dtype))


def u64_shr(a: U64, k: int) -> U64:
    """Logical right shift by a static ``0 < k < 32``."""
    assert 0 < k < 32, k
    return U64(_shr32(a.lo, k) | _shl32(a.hi, 32 - k), _shr32(a.hi, k))


def mulhi_u32(a: jax.Array, b: jax.Array) -> jax.Array:
    """High 32 bits of the 64-bit product of two uint32 arrays, from 16-bit limbs."""
    m16 = jnp.uint32(0xFFFF)
    a0, a1 = a & m16, _shr32(a, 16)
    b0, b1 = b & m16, _shr32(b, 16)
    p00 = a0 * b0
    p01 = a0 * b1
    p10 = a1 * b0
    p11 = a1 * b1
    mid = _shr32(p00, 16) + (p01 & m16) + (p10 & m16)  # < 3 * 2**16, no overflow
    return p11 + _shr32(p01, 16) + _shr32(p10, 16) + _shr32(mid, 16)


def u64_mul_const(a: U64, value: int) -> U64:
    """``a * value mod 2**64`` for a static Python-int multiplier."""
    b_lo, b_hi = _u32(value), _u32(value >> 32)
    lo = a.lo * b_lo
    hi = mulhi_u32(a.lo, b_lo) + a.lo * b_hi + a.hi * b_lo
    return U64(lo, hi)


def splitmix64(x: U64) -> U64:
    """The standard splitmix64 finalizer (SPEC 2.1); ``splitmix64(0) == 0``."""
    x = u64_mul_const(u64_xor(x, u64_shr(x, 30)), constants.SPLITMIX64_MUL1)
    x = u64_mul_const(u64_xor(x, u64_shr(x, 27)), constants.SPLITMIX64_MUL2)
    return u64_xor(x, u64_shr(x, 31))


def splitmix64_mix3(a: U64, b: U64, c: U64) -> U64:
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)`` (SPEC 2.2); order matters."""
    h = splitmix64(a)
    h = splitmix64(u64_xor(h, b))
    return splitmix64(u64_xor(h, c))


def anchor_hash_like(x: jax.Array) -> U64:
    """``splitmix64(CANARY_CHAIN_ANCHOR)`` broadcast to the shape of ``x`` (the chain-head prev_hash)."""
    h = splitmix64_python(constants.CANARY_CHAIN_ANCHOR)
    shape = jnp.shape(x)
    return U64(jnp.full(shape, h & 0xFFFFFFFF, jnp.uint32), jnp.full(shape, h >> 32, jnp.uint32))


def fold_words(words: jax.Array, num_words64: int) -> U64:
    """Per-source real-KV fold (SPEC 2.5): ``acc = splitmix64(acc ^ w)`` over 64-bit words in order.

    Args:
      words: ``uint32[..., 2 * num_words64]``, the bytes of one slot read as little-endian uint32 words.
      num_words64: static number of 8-byte words to fold.

    Returns:
      The per-source hash, shape ``words.shape[:-1]``.
    """
    acc = U64(jnp.zeros(words.shape[:-1], jnp.uint32), jnp.zeros(words.shape[:-1], jnp.uint32))
    if num_words64 <= 8:
        for w in range(num_words64):
            acc = splitmix64(u64_xor(acc, U64(words[..., 2 * w], words[..., 2 * w + 1])))
        return acc

    def body(w, acc):
        lo = jax.lax.dynamic_index_in_dim(words, 2 * w, axis=words.ndim - 1, keepdims=False)
        hi = jax.lax.dynamic_index_in_dim(words, 2 * w + 1, axis=words.ndim - 1, keepdims=False)
        return splitmix64(u64_xor(acc, U64(lo, hi)))

    return jax.lax.fori_loop(0, num_words64, body, acc)


def combine_sources(per_source: list[U64]) -> U64:
    """Folds per-source hashes in tuple order: ``acc = splitmix64(acc ^ h_s)``; no sources gives 0."""
    if not per_source:
        raise ValueError("kv-canary: combine_sources needs at least one source hash")
    acc = u64_zeros_like(per_source[0].lo)
    for h in per_source:
        acc = splitmix64(u64_xor(acc, h))
    return acc


# --- Python-int versions: documentation and constants, not the test oracle (that lives in tests/) ---------
def splitmix64_python(x: int) -> int:
    """Python-int splitmix64, used to derive constants such as the anchor hash."""
    x &= constants.U64_MASK
    x = ((x ^ (x >> 30)) * constants.SPLITMIX64_MUL1) & constants.U64_MASK
    x = ((x ^ (x >> 27)) * constants.SPLITMIX64_MUL2) & constants.U64_MASK
    return x ^ (x >> 31)


ANCHOR_HASH: int = splitmix64_python(constants.CANARY_CHAIN_ANCHOR)  # 0xDE7FAE23A9A1B716
