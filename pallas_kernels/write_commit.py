"""Write launch 4, ``canary_write_store`` (:func:`write_commit_kernel`): the winners store ``(token, position,
prev_hash, real_kv_hash)``; blocks with violations scatter their rows at ``write_index + exclusive prefix`` (the
reference's order, request-major, entry order, input-assert row before chain-position row, without atomics);
program 0 bumps ``write_index`` and the counters.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl

from canary_jax.contract import pairs
from canary_jax.contract.constants import FailReason
from pallas_kernels import refs
from pallas_kernels.write_flags import INPUT_MISMATCH, WriteFlag, load_flagged


def write_commit_kernel(
    base_ref,  # i32[1]: write_index before this launch
    ids_ref,
    pos_ref,
    loc_ref,  # u32[T, 2]
    exp_tok_ref,
    exp_pos_ref,  # u32[T, 2] (read only with the input assert)
    prev_at_ref,
    chain_exp_ref,  # u32[T, 2]: prev_hash and run position before each entry
    flags_ref,  # u32[T]: 0 unless written
    counts_ref,  # i32[NB, 2]
    *more_refs,  # [rkv u32[T, 2]]; words u32[N, S/4], ring u32[R, 16], write index i32[1], slot and kernel
    # counters u32[2 * tags] (in, aliased), then the same as outputs
    has_rkv,
    tag,
    counter_row,
    num_tokens,
    block,
    ring_capacity,
    gather,
    assert_inputs,
    pid=None,
):
    """Winners store their records; blocks with violations scatter their rows; program 0 moves the write index
    and bumps the counters. ``pid``: this program's id in the pass (None: the grid's), for a kernel that runs the
    pass in one of its programs (:mod:`pallas_kernels.phase`)."""
    rkv_ref = more_refs[0] if has_rkv else None
    words_ref, ring_ref, wi_ref, slot_counters_ref, kernel_counters_ref = more_refs[len(more_refs) - 5 :]
    num_blocks = refs.cdiv(num_tokens, block)
    base = base_ref[0]

    @pl.when((refs.program_id() if pid is None else pid) == 0)
    def _():
        rows = refs.sum_counts(counts_ref, 0, num_blocks, column=0)
        written = refs.sum_counts(counts_ref, 0, num_blocks, column=1)
        wi_ref[0] = base + rows
        refs.bump_pair_scalar(slot_counters_ref, 2 * counter_row, written)
        refs.bump_pair_scalar(kernel_counters_ref, 2 * counter_row, jnp.int32(1))

    def block_body(b):
        i = b * block + refs.iota(block)
        inw = i < num_tokens
        fl, won, s = load_flagged(flags_ref, loc_ref, i, inw, WriteFlag.WINNER)
        fields = [refs.load_entry(r, i, won, gather) for r in (ids_ref, pos_ref, prev_at_ref)]
        fields.append(refs.load_entry(rkv_ref, i, won, gather) if has_rkv else pairs.const(0, (block,)))
        for f, v in enumerate(fields):
            refs.store_pair(words_ref, s, 2 * f, v, won)

        @pl.when(counts_ref[b, 0] > 0)
        def _():
            start = base + refs.sum_counts(counts_ref, 0, b, column=0)
            in_rec = ((fl & INPUT_MISMATCH) != 0).astype(jnp.int32)
            ch_rec = ((fl & WriteFlag.CHAIN_POSITION) != 0).astype(jnp.int32)
            n = in_rec + ch_rec
            d_in = start + jnp.cumsum(n, axis=0) - n
            d_ch = d_in + in_rec
            any_rec = n > 0
            loc = refs.load_entry(loc_ref, i, any_rec, gather)
            tok = refs.load_entry(ids_ref, i, any_rec, gather)
            pos = refs.load_entry(pos_ref, i, any_rec, gather)
            prev_at = refs.load_entry(prev_at_ref, i, any_rec, gather)
            chain_exp = pairs.add(refs.load_entry(chain_exp_ref, i, ch_rec != 0, gather), 1)  # run position + 1
            zero = jnp.zeros((block,), jnp.uint32)
            tag_w = jnp.full((block,), tag, jnp.uint32)
            head = [tag_w, zero, loc.lo, loc.hi, pos.lo, pos.hi, tok.lo, tok.hi]
            if assert_inputs:
                etok = refs.load_entry(exp_tok_ref, i, in_rec != 0, gather)
                epos = refs.load_entry(exp_pos_ref, i, in_rec != 0, gather)
                in_cols = head + [etok.lo, etok.hi, prev_at.lo, prev_at.hi, epos.lo, epos.hi, fl & INPUT_MISMATCH, zero]
                keep_in = (in_rec != 0) & (d_in >= 0) & (d_in < ring_capacity)
                for k, v in enumerate(in_cols):
                    refs.store_word(ring_ref, d_in, k, v, keep_in)
            ch_cols = head + [
                tok.lo,
                tok.hi,
                prev_at.lo,
                prev_at.hi,
                chain_exp.lo,
                chain_exp.hi,
                jnp.full((block,), int(FailReason.WRITE_POSITION_MISMATCH), jnp.uint32),
                zero,
            ]
            keep_ch = (ch_rec != 0) & (d_ch >= 0) & (d_ch < ring_capacity)
            for k, v in enumerate(ch_cols):
                refs.store_word(ring_ref, d_ch, k, v, keep_ch)

    refs.for_each_block(num_blocks, block_body, pid=pid, programs=None if pid is None else 1)
