"""Write launch 2, ``canary_write_claim`` (:func:`write_claim_kernel`, launched by :func:`claim_slots`): the slot claim.

Every written entry ``i`` raises its slot's claim word to ``i + 1``: ``claim[slot] = max(claim[slot], i + 1)``. After
the launch, entry ``i`` owns its slot iff the claim word reads ``i + 1``, so the last entry (request-major order)
writing a slot wins, as in the reference. The chain launches zero the claim word of every written entry's slot
first, so only written entries' values are ever compared. The won pass (:mod:`pallas_kernels.write_won`) reads the
claim words in a launch of its own: every claim lands before any entry reads one.

Compiled (Triton), the claim is one masked vector atomic max per block. Interpreted (CPU), it is the retry loop
:func:`settle_claims` that the one-program write (:mod:`pallas_kernels.write_fused`) also runs: Pallas's interpret-mode
atomics refuse masks and lose duplicate updates (``pallas_kernels/README.md``, "Pallas/Triton traps").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import calls, refs
from pallas_kernels.write_flags import CLAIM_WORD, WriteFlag, load_flagged


def settle_claims(words_ref, s: jax.Array, mine: jax.Array, written: jax.Array, *, interpret: bool) -> jax.Array:
    """Raises the claim words of entries ``written`` (slots ``s`` int32[B], values ``mine`` uint32[B]) until none reads
    less than its own value; returns the claim words read last (0 where not ``written``).

    Each round stores ``mine`` where the claim word reads less, then reads back (a barrier between, compiled). Plain
    stores that race leave one of their values, so each round raises every contested word and the loop ends with the
    largest value, in as many rounds as a slot has writers (one read and one check when nothing is behind). Exact
    where one program runs at a time (interpret mode runs programs in order) or within one program (the one-program
    write); concurrent programs of a compiled launch would race between their reads and stores."""

    def read():
        return refs.load_word(words_ref, s, CLAIM_WORD, written)

    def behind(claim):
        return written & (claim < mine)

    def again(claim):
        refs.store_word(words_ref, s, CLAIM_WORD, mine, behind(claim))
        refs.barrier(interpret)
        return read()

    return jax.lax.while_loop(lambda c: jnp.max(behind(c).astype(jnp.int32)) > 0, again, read())


def write_claim_kernel(
    loc_ref,  # u32[T, 2]
    flags_ref,  # u32[T]: WriteFlag.WRITTEN marks the entries that claim
    words_in_ref,  # aliased to words_ref
    words_ref,  # u32[N, S/4] interpreted; compiled the same words as float32 bits (see claim_slots)
    *,
    num_tokens,
    block,
    interpret,
):
    """``claim word[slot] = max(., i + 1)`` for every written entry ``i``, blocks of ``block`` entries over a
    persistent grid. Entries that do not write touch nothing (masked; their slot reads 0, see
    :func:`pallas_kernels.write_flags.load_flagged`)."""
    del words_in_ref

    def block_body(b):
        i = b * block + refs.iota(block)
        _, written, s = load_flagged(flags_ref, loc_ref, i, i < num_tokens, WriteFlag.WRITTEN)
        if interpret:
            settle_claims(words_ref, s, (i + 1).astype(jnp.uint32), written, interpret=True)
        else:
            refs.atomic_max_word(words_ref, s, CLAIM_WORD, i + 1, written)

    refs.for_each_block(refs.cdiv(num_tokens, block), block_body)


def claim_slots(words, loc, flags, *, num_tokens: int, block: int, grid, compiler_params, interpret: bool):
    """The claim launch: ``words`` (u32[N, S/4]) with every written entry's claim word raised to at least its
    ``entry + 1``; ``loc`` u32[T, 2] and ``flags`` u32[T] as :func:`write_claim_kernel`'s.

    Compiled, the kernel takes the words as float32 bits (``bitcast_convert_type`` on either side of the launch, a
    view): the jax releases we run (0.10.2, 0.11.x) lower a vector integer ``atomic_max`` through the float path
    and crash, and that float path (``_expand_atomic_fp_min_max``) is a signed integer ``atomic_rmw max`` on the bits
    for non-negative values. It is exact here: claim words start at 0 and every update ``i + 1`` is a positive int32
    (:func:`pallas_kernels.refs.atomic_max_word`)."""
    compiled = not interpret
    operand = jax.lax.bitcast_convert_type(words, jnp.float32) if compiled else words
    (operand,) = calls.call(
        functools.partial(write_claim_kernel, num_tokens=num_tokens, block=block, interpret=interpret),
        dict(loc=loc, flags=flags, words=operand),
        ("words",),
        grid=grid,
        compiler_params=compiler_params,
        interpret=interpret,
        name="canary_write_claim",
    )
    return jax.lax.bitcast_convert_type(operand, jnp.uint32) if compiled else operand
