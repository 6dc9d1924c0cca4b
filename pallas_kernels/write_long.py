"""Write launch 1b, ``canary_write_long``: the serial chains of long requests, one request per program at a time
(:func:`write_long_kernel`).

It runs only when the launch has more tokens than ``write_long_threshold`` and at least twice as many tokens as
request rows (prefill and mixed batches; decode batches never pay for it), after the lane chains of
:mod:`pallas_kernels.write_chain`, which leave these requests alone. Like the reference, it relies on the plan
contract (write offsets non-decreasing over the live requests): with overlapping request ranges two programs
would write the same entries' flags and checkpoints.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from canary_jax.contract import hashing, pairs
from canary_jax.contract.pairs import U64
from pallas_kernels import refs
from pallas_kernels.write_chain import chain_start
from pallas_kernels.write_flags import CLAIM_WORD, LONG_SHIFT, WriteFlag

ZERO_BLOCK = 1024
"""Entries per step of the claim-word zeroing of a request whose chain came from a hint."""


def write_long_kernel(
    num_reqs_ref,  # i32[1]
    assert_flag_ref,  # i32[1]: enable_chain_position_assert
    offsets_ref,  # u32[Cw + 1, 2]
    seeds_ref,  # u32[Cw, 2]
    ids_ref,
    pos_ref,
    loc_ref,
    exp_tok_ref,
    exp_pos_ref,  # u32[2 T] flat pairs
    *more_refs,  # words_in, flags_in, prev_in, chain_exp_in (aliased to the outputs) [, hint u32[Cw, 5]];
    # outputs: words u32[N, S/4] (claim words of written entries zeroed; seeds read, fields 0..2 only),
    # flags u32[T], prev_at / chain_exp u32[2 T] (prev_hash and run position before each entry)
    consume=False,
    n_slots,
    cw,
    num_tokens,
    rows,
    chunk,
    threshold,
    scan_block,
    hasher,
    gather,
    assert_inputs,
    interpret,
):
    """Serial chains of long requests (more than ``threshold`` entries), one request per program at a time.

    The lane role gives a request one lane and spends every per-entry instruction on the serial path. Here the
    program walks one request in chunks of ``chunk`` entries at aligned entry indices and keeps the serial path
    to the chain itself:

    * entry-parallel, one entry per thread: which entries are written (slot in range, inside the request),
      their flags (written, input-assert bits, ``WriteFlag.GATE`` when the chain-position gate is on,
      ``WriteFlag.LONG`` and, from bit ``LONG_SHIFT`` up, the entry's distance to the chunk's first entry of this
      request) and the zeroed claim words;
    * checkpoint: the chain state at that first entry (running prev_hash and run position, exactly that
      entry's own ``prev_at`` / ``chain_exp``) is stored once per chunk;
    * serial, the same chain in every thread: per entry three splitmix64, the written test and two selects,
      nothing stored. The slots, tokens and positions of a chunk come from one aligned load per array (one
      chunk ahead; masked, so words past the operand's end read 0 and the operands need no padding) handed to
      every thread, so they are register operands of the unrolled steps.

    The won pass (:func:`pallas_kernels.write_won.write_won_kernel`, parallel over entries) replays the at most
    ``chunk - 1`` steps from the checkpoint to every other entry of the chunk: that is where their ``prev_at`` /
    ``chain_exp`` and chain-position failures come from.

    Long requests go to programs by rank (the ``k``-th long request to program ``k mod programs``), so a
    prefill batch runs one chain per program. A launch of its own (``canary_write_long``, after the lane
    chains): Triton's coalescing pass costs about (memory ops) x (IR size) of a kernel, so the two unrolled
    chain bodies compile much faster apart.

    With ``consume`` (a chain hint, :mod:`canary_jax.ops.chain_hints`) a request whose chain start equals the
    hint's runs no chunk: its entries keep the hint's flags and checkpoints, which the outputs start from, and
    only its claim words are zeroed, ``ZERO_BLOCK`` entries per step.
    """
    hint_ref = more_refs[4] if consume else None
    words_ref, flags_ref, prev_at_ref, chain_exp_ref = more_refs[len(more_refs) - 4 :]
    pid = refs.program_id()
    programs = jnp.asarray(pl.num_programs(0)).astype(jnp.int32)  # (int64 under x64 in interpret mode)
    nv = jnp.clip(num_reqs_ref[0], 0, cw)
    gate_on = assert_flag_ref[0] != 0
    big = jnp.int32(2**31 - 1)
    one = refs.iota(rows) * 0  # [rows] zeros: per-request values are carried as identical [rows] vectors
    k_e = refs.iota(chunk)
    w2 = 2 * chunk

    def load_rows(ref, q):
        """Words of entries ``[q * chunk, (q + 1) * chunk)`` of a flat pair ref (aligned; 0 past its end)."""
        return refs.load_window(ref, pl.multiple_of(q * w2, w2), w2, interpret=interpret)

    def to_rows(v):
        return jnp.broadcast_to(v[None, :], (rows,) + v.shape)

    def run_request(r):
        rv = one + r
        start = pairs.clamp(refs.load_pair(offsets_ref, rv, 0, rv >= 0, gather), num_tokens)  # [rows], identical
        end = pairs.clamp(refs.load_pair(offsets_ref, rv + 1, 0, rv >= 0, gather), num_tokens)
        seed = refs.load_pair(seeds_ref, rv, 0, rv >= 0, gather)
        seed_neg = pairs.is_negative(seed)
        si, s_ok = pairs.index(seed, n_slots)
        w = refs.load_words(words_ref, si, 0, 6, ~seed_neg & s_ok, gather)
        seed_tok, seed_pos, seed_prev = U64(w[0], w[1]), U64(w[2], w[3]), U64(w[4], w[5])
        running0 = pairs.where(
            seed_neg, pairs.const(hashing.ANCHOR_HASH, (rows,)), hasher.splitmix64_mix3(seed_prev, seed_tok, seed_pos)
        )
        gate = jnp.max(((~seed_neg) & gate_on).astype(jnp.int32)) != 0  # scalar
        run_pos0 = pairs.where(jnp.broadcast_to(gate, (rows,)), seed_pos, pairs.const(0, (rows,)))
        start_s, end_s = jnp.max(start), jnp.max(end)  # scalars
        q0 = jax.lax.div(start_s, jnp.int32(chunk))
        q1 = refs.cdiv(end_s, chunk)
        if hint_ref is not None:  # the hint's chain start: this request's chain is the hint's
            gates = jnp.broadcast_to(gate, (rows,))
            same = jnp.max(chain_start(None, hint_ref, rv, rv >= 0, running0, run_pos0, gates, one + 1)) == 0
            q1 = jnp.where(same, q0, q1)

            def zero_claims(b, carry):
                """Only the claim words of the request's written entries, ``ZERO_BLOCK`` entries at a time."""
                i = start_s + b * ZERO_BLOCK + refs.iota(ZERO_BLOCK)
                inside = i < end_s
                loc = refs.load_pair_flat(loc_ref, i, inside)
                ok = inside & pairs.in_range(loc, n_slots)
                slot = jnp.where(ok, loc.lo, pairs.u32(0)).astype(jnp.int32)
                refs.store_word(words_ref, slot, CLAIM_WORD, jnp.zeros((ZERO_BLOCK,), jnp.uint32), ok)
                return carry

            trips = jnp.where(same, refs.cdiv(jnp.maximum(end_s - start_s, 0), ZERO_BLOCK), 0)
            jax.lax.fori_loop(0, trips, zero_claims, jnp.int32(0))

        def entry_part(q, first):
            """Flags and claim words of chunk ``q``, one entry per thread (``first``: the chunk's first entry
            of this request, where the checkpoint goes)."""
            i = q * chunk + k_e
            inside = (i >= start_s) & (i < end_s)
            loc = refs.load_pair_flat(loc_ref, i, inside)
            ok = inside & pairs.in_range(loc, n_slots)
            # (explicit uint32 operands: a select on a scalar predicate between two literals lowers to i1)
            fl = jnp.where(
                jnp.broadcast_to(gate, (chunk,)),
                pairs.u32(WriteFlag.WRITTEN | WriteFlag.GATE | WriteFlag.LONG),
                pairs.u32(WriteFlag.WRITTEN | WriteFlag.LONG),
            )
            fl = fl | pairs.shl32(jnp.maximum(i - first, 0).astype(jnp.uint32), LONG_SHIFT)
            if assert_inputs:
                tok, pos, etok, epos = (
                    refs.load_pair_flat(ref, i, ok) for ref in (ids_ref, pos_ref, exp_tok_ref, exp_pos_ref)
                )
                fl = (
                    fl
                    | jnp.where(pairs.ne(tok, etok), pairs.u32(WriteFlag.TOKEN_MISMATCH), pairs.u32(0))
                    | jnp.where(pairs.ne(pos, epos), pairs.u32(WriteFlag.POSITION_MISMATCH), pairs.u32(0))
                )
            refs.store_vec(flags_ref, i, jnp.where(ok, fl, pairs.u32(0)), inside)
            refs.store_word(
                words_ref,
                jnp.where(ok, loc.lo, pairs.u32(0)).astype(jnp.int32),
                CLAIM_WORD,
                jnp.zeros((chunk,), jnp.uint32),
                ok,
            )

        def chunk_body(q, carry):
            running, run_pos = U64(carry[0], carry[1]), U64(carry[2], carry[3])
            loc_c, tok_c, pos_c = (refs.columns(to_rows(v)) for v in carry[4:7])
            first = jnp.maximum(q * chunk, start_s)
            entry_part(q, first)
            firsts = one + first
            every = one == 0  # the checkpoint: every row stores the same words
            for ref, v in ((prev_at_ref, running), (chain_exp_ref, run_pos)):
                refs.store_vec(ref, 2 * firsts, v.lo, every)
                refs.store_vec(ref, 2 * firsts + 1, v.hi, every)
            nxt = tuple(load_rows(ref, q + 1) for ref in (loc_ref, ids_ref, pos_ref))
            for k in range(chunk):
                i = q * chunk + k
                loc = U64(loc_c[2 * k], loc_c[2 * k + 1])
                tok, pos = U64(tok_c[2 * k], tok_c[2 * k + 1]), U64(pos_c[2 * k], pos_c[2 * k + 1])
                ok = (i >= start) & (i < end) & pairs.in_range(loc, n_slots)
                running = pairs.where(ok, hasher.splitmix64_mix3(running, tok, pos), running)
                run_pos = pairs.where(ok, pos, run_pos)
            return (running.lo, running.hi, run_pos.lo, run_pos.hi) + nxt

        init = (running0.lo, running0.hi, run_pos0.lo, run_pos0.hi) + tuple(
            load_rows(ref, q0) for ref in (loc_ref, ids_ref, pos_ref)
        )
        jax.lax.fori_loop(q0, jnp.maximum(q1, q0), chunk_body, init)

    def scan_body(b, rank_base):
        r = b * scan_block + refs.iota(scan_block)
        live_r = r < nv
        start = pairs.clamp(refs.load_pair(offsets_ref, r, 0, live_r, gather), num_tokens)
        end = pairs.clamp(refs.load_pair(offsets_ref, r + 1, 0, live_r, gather), num_tokens)
        is_long = live_r & (end - start > threshold)
        n_long = is_long.astype(jnp.int32)
        rank = rank_base + jnp.cumsum(n_long, dtype=jnp.int32) - n_long
        mine0 = is_long & (jax.lax.rem(rank, programs) == pid)

        def next_mine(mine):
            return jnp.min(jnp.where(mine, r, big))

        def body(r_sel):
            run_request(r_sel)
            return next_mine(mine0 & (r > r_sel))

        jax.lax.while_loop(lambda r_sel: r_sel < big, body, next_mine(mine0))
        return rank_base + jnp.sum(n_long, dtype=jnp.int32)  # (a plain sum is int64 under x64)

    jax.lax.fori_loop(0, refs.cdiv(nv, scan_block), scan_body, jnp.int32(0))
