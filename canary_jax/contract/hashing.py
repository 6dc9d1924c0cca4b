"""splitmix64 and the canary's hashes on :class:`~canary_jax.contract.pairs.U64` words, identical with x64 off and on.

The hash definitions come from SGLang's ``consts.py`` (``splitmix64``, ``splitmix64_mix3``) and
``verify_ref.py`` (``compute_slot_hash``, the real-KV byte fold); SPEC section 2 restates them and section 2.6
gives worked numbers pinned in ``tests/test_hashing.py``. The 64-bit arithmetic is :mod:`canary_jax.contract.pairs`
(32-bit multiplies, logical shifts, xors), so every function here runs in the jnp references and inside Pallas
kernel bodies alike; the kernels pass their own multiplier as ``mul`` (``pallas_kernels.hashing.PairHash``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from canary_jax.contract import constants, pairs
from canary_jax.contract.pairs import U64

MulConst = Callable[[U64, int], U64]
"""``(a, value) -> a * value mod 2**64`` for a static Python-int ``value``."""


def splitmix64(x: U64, *, mul: MulConst = pairs.mul_const) -> U64:
    """The standard splitmix64 finalizer (SPEC 2.1); ``splitmix64(0) == 0``.

    Args:
      x: any shape of uint64 words.
      mul: the ``a * const`` multiplier; every choice computes the same function.
    """
    x = mul(pairs.xor(x, pairs.shr(x, 30)), constants.SPLITMIX64_MUL1)
    x = mul(pairs.xor(x, pairs.shr(x, 27)), constants.SPLITMIX64_MUL2)
    return pairs.xor(x, pairs.shr(x, 31))


def splitmix64_mix3(a: U64, b: U64, c: U64, *, mul: MulConst = pairs.mul_const) -> U64:
    """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)`` (SPEC 2.2); order matters.

    The chain hash of a record is ``splitmix64_mix3(prev_hash, token, position)`` (SPEC 2.3).
    """
    h = splitmix64(a, mul=mul)
    h = splitmix64(pairs.xor(h, b), mul=mul)
    return splitmix64(pairs.xor(h, c), mul=mul)


def fold_step(acc: U64, word: U64, *, mul: MulConst = pairs.mul_const) -> U64:
    """One real-KV fold step (SPEC 2.5), also the combine step over sources: ``splitmix64(acc ^ word)``."""
    return splitmix64(pairs.xor(acc, word), mul=mul)


def fold_words(words: jax.Array, num_words64: int) -> U64:
    """Per-source real-KV fold (SPEC 2.5): ``acc = splitmix64(acc ^ w)`` over 64-bit words in order.

    Args:
      words: ``uint32[..., 2 * num_words64]``, the bytes of one slot read as little-endian uint32 words.
      num_words64: static number of 8-byte words to fold.

    Returns:
      The per-source hash, shape ``words.shape[:-1]``.
    """
    acc = pairs.const(0, words.shape[:-1])
    if num_words64 <= 8:
        for w in range(num_words64):
            acc = fold_step(acc, U64(words[..., 2 * w], words[..., 2 * w + 1]))
        return acc

    def body(w, acc):
        lo = jax.lax.dynamic_index_in_dim(words, 2 * w, axis=words.ndim - 1, keepdims=False)
        hi = jax.lax.dynamic_index_in_dim(words, 2 * w + 1, axis=words.ndim - 1, keepdims=False)
        return fold_step(acc, U64(lo, hi))

    return jax.lax.fori_loop(0, num_words64, body, acc)


def combine_sources(per_source: list[U64]) -> U64:
    """Folds per-source hashes in tuple order: ``acc = splitmix64(acc ^ h_s)``; no sources gives 0."""
    if not per_source:
        raise ValueError("kv-canary: combine_sources needs at least one source hash")
    acc = pairs.const(0, jnp.shape(per_source[0].lo))
    for h in per_source:
        acc = fold_step(acc, h)
    return acc


# --- Python-int versions: documentation and constants, not the test oracle (that lives in tests/) ---------
def splitmix64_python(x: int) -> int:
    """Python-int splitmix64, used to derive constants such as the anchor hash."""
    x &= constants.U64_MASK
    x = ((x ^ (x >> 30)) * constants.SPLITMIX64_MUL1) & constants.U64_MASK
    x = ((x ^ (x >> 27)) * constants.SPLITMIX64_MUL2) & constants.U64_MASK
    return x ^ (x >> 31)


ANCHOR_HASH: int = splitmix64_python(constants.CANARY_CHAIN_ANCHOR)  # 0xDE7FAE23A9A1B716
