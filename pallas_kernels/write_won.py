"""Write launch 3, ``canary_write_won`` (:func:`write_won_kernel`): each written entry reads its slot's claim word to
learn whether it won the slot.

The claim launch before it (:mod:`pallas_kernels.write_claim`, ``canary_write_claim``) leaves ``entry + 1`` of the
last entry (request-major order) writing a slot in the slot's claim word, as in the reference. Long-role entries also
replay their chain from their chunk's checkpoint here (prev_hash, run position, chain-position failure). Every winner
must be known before any store overwrites a claim word, which is why the won pass is a launch of its own.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from canary_jax.contract import pairs
from canary_jax.contract.pairs import U64
from pallas_kernels import refs
from pallas_kernels.write_flags import CLAIM_WORD, INPUT_MISMATCH, LONG_SHIFT, WriteFlag, load_flagged


def write_won_kernel(
    loc_ref,
    ids_ref,
    pos_ref,  # u32[T, 2]
    words_ref,  # u32[N, S/4]: claim words after the claim launch, read only here
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
