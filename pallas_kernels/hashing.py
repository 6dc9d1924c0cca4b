"""In-kernel splitmix64 on uint32 pairs, shared by the verify and write Pallas kernels.

A 64-bit value is a :class:`canary_jax.hashing.U64` ``(lo, hi)`` of ``uint32`` arrays, so one kernel body
serves ``jax_enable_x64`` off and on (Pallas cannot hold int64 with x64 off, and Triton cannot lower uint64
constants above 2**63 - 1, see PITFALLS). Two interchangeable multipliers:

* ``portable``: :func:`canary_jax.hashing.mulhi_u32` from 16-bit limbs; runs everywhere, including
  ``interpret=True`` on CPU (what CI runs).
* ``asm``: the high word of the 32x32 product as one PTX ``mul.hi.u32`` through
  ``pltriton.elementwise_inline_asm``; ptxas then folds ``lo * c_lo``, ``mulhi`` and the two cross products
  into the same IMAD sequence a native 64-bit multiply compiles to. GPU (Triton) only.

Both compute the same function bit for bit; ``tests/test_pallas_units.py`` pins the portable one against
SPEC 2.6 and ``tests/test_gpu_pallas.py`` compares the two on the GPU.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import constants
from canary_jax import hashing
from canary_jax.hashing import U64

MULTIPLIERS = ("portable", "asm")


def u32(value: int) -> jax.Array:
    """A ``uint32`` scalar constant (value taken mod 2**32)."""
    return jnp.asarray(np.uint32(int(value) & 0xFFFFFFFF))


def shr(x: jax.Array, k: int) -> jax.Array:
    return jax.lax.shift_right_logical(x, jnp.asarray(k, x.dtype))


def shl(x: jax.Array, k: int) -> jax.Array:
    return jax.lax.shift_left(x, jnp.asarray(k, x.dtype))


def _mulhi_asm(a: jax.Array, const: int) -> jax.Array:
    from jax.experimental.pallas import triton as pltriton  # GPU-only path

    [out] = pltriton.elementwise_inline_asm(
        f"mul.hi.u32 $0, $1, {int(const) & 0xFFFFFFFF:#010x};",
        args=[a],
        constraints="=r,r",
        pack=1,
        # int32, not uint32: Pallas-Triton values are signless, and a ui32 result type would not match them.
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.int32)],
    )
    return out.astype(jnp.uint32)


@dataclasses.dataclass(frozen=True)
class PairHash:
    """splitmix64 family on U64 pairs with a chosen ``multiplier`` (``portable`` | ``asm``)."""

    multiplier: str = "portable"

    def __post_init__(self):
        if self.multiplier not in MULTIPLIERS:
            raise ValueError(f"kv-canary: multiplier must be one of {MULTIPLIERS}, got {self.multiplier!r}")

    def mul_const(self, a: U64, value: int) -> U64:
        """``a * value mod 2**64`` for a static Python-int multiplier."""
        if self.multiplier == "portable":
            return hashing.u64_mul_const(a, value)
        c_lo, c_hi = value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF
        lo = a.lo * u32(c_lo)
        hi = _mulhi_asm(a.lo, c_lo) + a.lo * u32(c_hi) + a.hi * u32(c_lo)
        return U64(lo, hi)

    def splitmix64(self, x: U64) -> U64:
        x = self.mul_const(hashing.u64_xor(x, hashing.u64_shr(x, 30)), constants.SPLITMIX64_MUL1)
        x = self.mul_const(hashing.u64_xor(x, hashing.u64_shr(x, 27)), constants.SPLITMIX64_MUL2)
        return hashing.u64_xor(x, hashing.u64_shr(x, 31))

    def mix3(self, a: U64, b: U64, c: U64) -> U64:
        """``splitmix64(splitmix64(splitmix64(a) ^ b) ^ c)`` (SPEC 2.2)."""
        h = self.splitmix64(a)
        h = self.splitmix64(hashing.u64_xor(h, b))
        return self.splitmix64(hashing.u64_xor(h, c))

    def fold_step(self, acc: U64, word: U64) -> U64:
        """One real-KV fold step: ``splitmix64(acc ^ word)`` (SPEC 2.5)."""
        return self.splitmix64(hashing.u64_xor(acc, word))


def const_pair(value: int, like: jax.Array) -> U64:
    """A Python int (mod 2**64) broadcast to the shape of ``like`` as a U64."""
    value &= constants.U64_MASK
    shape = jnp.shape(like)
    return U64(jnp.full(shape, u32(value), jnp.uint32), jnp.full(shape, u32(value >> 32), jnp.uint32))
