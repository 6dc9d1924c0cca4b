"""The kernels' choice of 64-bit multiplier for splitmix64 (:class:`PairHash`).

The hashes themselves are :mod:`canary_jax.contract.hashing` on :mod:`canary_jax.contract.pairs` words, so one kernel
body serves ``jax_enable_x64`` off and on. Only the ``a * const`` multiply differs, with two interchangeable choices:

* ``portable``: :func:`canary_jax.contract.pairs.mul_const`, the high word from 16-bit limbs; runs everywhere, including
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

from canary_jax.contract import hashing, pairs
from canary_jax.contract.pairs import U64

MULTIPLIERS = ("portable", "asm")


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
    """splitmix64 family on :class:`~canary_jax.contract.pairs.U64` words with a chosen ``multiplier``.

    Raises:
      ValueError: ``multiplier`` not in ``portable`` | ``asm``.
    """

    multiplier: str = "portable"

    def __post_init__(self):
        if self.multiplier not in MULTIPLIERS:
            raise ValueError(f"kv-canary: multiplier must be one of {MULTIPLIERS}, got {self.multiplier!r}")

    def mul_const(self, a: U64, value: int) -> U64:
        """``a * value mod 2**64`` for a static Python-int multiplier."""
        return pairs.mul_const(a, value, mulhi=None if self.multiplier == "portable" else _mulhi_asm)

    def splitmix64(self, x: U64) -> U64:
        """:func:`canary_jax.contract.hashing.splitmix64` with this multiplier."""
        return hashing.splitmix64(x, mul=self.mul_const)

    def splitmix64_mix3(self, a: U64, b: U64, c: U64) -> U64:
        """:func:`canary_jax.contract.hashing.splitmix64_mix3` with this multiplier (the chain hash, SPEC 2.3)."""
        return hashing.splitmix64_mix3(a, b, c, mul=self.mul_const)

    def fold_step(self, acc: U64, word: U64) -> U64:
        """:func:`canary_jax.contract.hashing.fold_step` with this multiplier: ``splitmix64(acc ^ word)`` (SPEC 2.5)."""
        return hashing.fold_step(acc, word, mul=self.mul_const)
