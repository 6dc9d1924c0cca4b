"""Write step 2 and launch 3: the slot claim (:func:`claim_slots`, an XLA scatter-max) and ``canary_write_won``
(:func:`write_won_kernel`).

The claim makes the last entry (request-major order) that writes a slot its owner, as in the reference; the won
pass lets each written entry read its claim word to learn whether it won. Long-role entries also replay their
chain from their chunk's checkpoint here (prev_hash, run position, chain-position failure). Every winner must be
known before any store overwrites a claim word, which is why the won pass is a launch of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from canary_jax.contract import pairs
from canary_jax.contract.pairs import U64
from pallas_kernels import refs
from pallas_kernels.write_flags import CLAIM_WORD, INPUT_MISMATCH, LONG_SHIFT, WriteFlag, load_flagged


def claim_slots(words, out_cache_loc, flags, *, num_tokens: int):
    """``claim[slot] = max(claim[slot], entry + 1)`` over written entries: one XLA scatter-max.

    After it, entry ``i`` owns its slot iff the claim word reads ``i + 1``: the last entry (request-major)
    writing a slot wins, as in the reference. XLA's scatter-max is exact with duplicate slots on every
    backend (it uses atomicMax on the GPU); Pallas-Triton's vector atomics do not lower for integer vectors
    in the JAX versions we run (see README).

    The update of an entry that does not write is 0, which leaves any claim word as it is, so its slot needs no
    masking: the index is the slot's low word as it stands (an index outside the buffer, a negative int32
    included, is dropped). Two elementwise ops, the index column and the scatter: the torch path runs each as
    one kernel.
    """
    assert WriteFlag.WRITTEN == 1  # the update is the WRITTEN bit times entry + 1
    i1 = jnp.arange(1, num_tokens + 1, dtype=jnp.uint32)
    update = (flags & jnp.uint32(WriteFlag.WRITTEN)) * i1
    lo = jax.lax.bitcast_convert_type(out_cache_loc[:, 0], jnp.int32)[:, None]
    index = jnp.concatenate([lo, jnp.full((num_tokens, 1), CLAIM_WORD, jnp.int32)], axis=1)
    dnums = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(), inserted_window_dims=(0, 1), scatter_dims_to_operand_dims=(0, 1)
    )
    return jax.lax.scatter_max(words, index, update, dnums, mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def write_won_kernel(
    loc_ref,
    ids_ref,
    pos_ref,  # u32[T, 2]
    words_ref,  # u32[N, S/4]: claim words after the scatter-max, read only here
    flags_in_ref,
    prev_in_ref,
    chain_exp_in_ref,  # aliased to flags_ref, prev_at_ref, chain_exp_ref
    flags_ref,  # u32[T]: winners get WriteFlag.WINNER; gated long-role entries whose position is not the run
    # position + 1 get WriteFlag.CHAIN_POSITION
    counts_ref,  # i32[NB, 2]: per block, violation rows and written entries
    prev_at_ref,
    chain_exp_ref,  # u32[T, 2]: long-role entries past their chunk's checkpoint are filled in
    *,
    num_tokens,
    block,
    gather,
    hasher,
    has_long,
):
    del flags_in_ref, prev_in_ref, chain_exp_in_ref

    def block_body(b):
        i = b * block + refs.iota(block)
        inw = i < num_tokens
        fl, written, s = load_flagged(flags_ref, loc_ref, i, inw, WriteFlag.WRITTEN)
        won = written & (refs.load_word(words_ref, s, CLAIM_WORD, written) == (i + 1).astype(jnp.uint32))
        if has_long:  # (WriteFlag.GATE and WriteFlag.LONG come from the long role only)
            gated = written & ((fl & WriteFlag.GATE) != 0)
            run_pos = refs.load_pair(chain_exp_ref, i, 0, gated, gather)
            # Long-role entries: replay the chain from the chunk's checkpoint (at most chunk - 1 steps).
            off = jnp.where(written & ((fl & WriteFlag.LONG) != 0), pairs.shr32(fl, LONG_SHIFT).astype(jnp.int32), 0)
            replay = off > 0
            e = i - off
            running = refs.load_pair(prev_at_ref, e, 0, replay, gather)
            rp = refs.load_pair(chain_exp_ref, e, 0, replay, gather)

            def step(j, carry):
                running, rp = U64(carry[0], carry[1]), U64(carry[2], carry[3])
                x = e + j
                act = j < off
                w_x = act & ((refs.load_vec(flags_ref, x, act, 0) & WriteFlag.WRITTEN) != 0)
                tok = refs.load_pair(ids_ref, x, 0, w_x, gather)
                pos_x = refs.load_pair(pos_ref, x, 0, w_x, gather)
                running = pairs.where(w_x, hasher.splitmix64_mix3(running, tok, pos_x), running)
                rp = pairs.where(w_x, pos_x, rp)
                return running.lo, running.hi, rp.lo, rp.hi

            out = jax.lax.fori_loop(0, jnp.max(off), step, (running.lo, running.hi, rp.lo, rp.hi))
            running, rp = U64(out[0], out[1]), U64(out[2], out[3])
            refs.store_pair(prev_at_ref, i, 0, running, replay)
            refs.store_pair(chain_exp_ref, i, 0, rp, replay)
            run_pos = pairs.where(replay, rp, run_pos)
            pos = refs.load_pair(pos_ref, i, 0, gated, gather)
            chain_fail = gated & pairs.ne(pos, pairs.add(run_pos, 1))
            fl = fl | jnp.where(chain_fail, WriteFlag.CHAIN_POSITION, 0).astype(jnp.uint32)
        refs.store_vec(flags_ref, i, fl | jnp.where(won, WriteFlag.WINNER, 0).astype(jnp.uint32), inw)
        rows = ((fl & INPUT_MISMATCH) != 0).astype(jnp.int32) + ((fl & WriteFlag.CHAIN_POSITION) != 0).astype(jnp.int32)
        counts_ref[b, 0] = jnp.sum(rows, dtype=jnp.int32)
        counts_ref[b, 1] = jnp.sum(written.astype(jnp.int32), dtype=jnp.int32)

    refs.for_each_block(refs.cdiv(num_tokens, block), block_body)
