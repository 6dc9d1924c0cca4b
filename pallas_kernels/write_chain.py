"""Write launch 1, ``canary_write_chain``: the serial chains (lane role) and, beside them, the real-KV fingerprints
(entry role), as two kinds of program in one ``pallas_call`` (:func:`write_chain_kernel`).

* Chain programs (:func:`_chain_role`): each lane runs one request's chain (``write_lanes`` requests per
  program, so a decode batch of thousands of 1-token requests fills the GPU). A lane reads its seed slot
  (before anything is stored; seeds never read field 3), then walks its entries in chunks of ``write_prefetch``
  steps: the slot / token / position words of the next chunk are loaded (one ``[lanes, 2 * write_prefetch]``
  load per array) while this chunk runs, so only three splitmix64 per token sit on the serial path. Per written
  entry it records the running prev_hash, a flag word (:class:`~pallas_kernels.write_flags.WriteFlag`) and, for
  a chain-position fail, the run position before the entry, and zeroes the slot's claim word; these are stored
  once per chunk (one store per output), which keeps Triton's compile time down. Requests of more than
  ``write_long_threshold`` entries are left to :mod:`pallas_kernels.write_long` when it runs.
* Entry programs (:func:`_entry_role`, only with real-KV sources), parallel over entries with
  ``write_entry_block`` entries each: the real-KV fingerprint of every entry with a valid slot. They run beside
  the chains, so real-KV hashing never sits on the serial path nor waits for it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from canary_jax.contract import hashing, pairs
from canary_jax.contract.pairs import U64
from pallas_kernels import real_kv, refs
from pallas_kernels.write_flags import CLAIM_WORD, WriteFlag


def _chain_role(
    in_refs,
    out_refs,
    *,
    pid,
    programs,
    n_slots,
    cw,
    num_tokens,
    lanes,
    prefetch,
    hasher,
    gather,
    assert_inputs,
    long_threshold,
    state_ref=None,
):
    """Serial chains, one request per lane: flags, running prev_hash and chain-position expectations.

    Refs as in :func:`write_chain_kernel`: ``in_refs`` its inputs but ``write_index`` (num_reqs, assert_flag,
    offsets, seeds, ids, pos, loc, exp_tok, exp_pos), ``out_refs`` words, flags, prev_at and chain_exp. With
    ``long_threshold`` (the long role is on), requests of more entries are left to
    :func:`pallas_kernels.write_long.write_long_kernel`. ``state_ref`` (``u32[Cw, 5]``, a hint being made, see
    :mod:`canary_jax.ops.chain_hints`) gets every live request's chain start."""
    num_reqs_ref, assert_flag_ref, offsets_ref, seeds_ref, ids_ref, pos_ref, loc_ref, exp_tok_ref, exp_pos_ref = in_refs
    words_ref, flags_ref, prev_at_ref, chain_exp_ref = out_refs
    nv = jnp.clip(num_reqs_ref[0], 0, cw)
    gate_on = assert_flag_ref[0] != 0
    per_step = 2 * (5 if assert_inputs else 3)

    def block_body(rb):
        r = rb * lanes + refs.iota(lanes)
        live_r = r < nv
        start = pairs.clamp(refs.load_pair(offsets_ref, r, 0, live_r, gather), num_tokens)
        end = pairs.clamp(refs.load_pair(offsets_ref, r + 1, 0, live_r, gather), num_tokens)
        count = jnp.where(live_r, jnp.maximum(end - start, 0), 0)
        if long_threshold is not None:
            count = jnp.where(count > long_threshold, 0, count)

        seed = refs.load_pair(seeds_ref, r, 0, live_r, gather)
        seed_neg = pairs.is_negative(seed)
        si, s_ok = pairs.index(seed, n_slots)
        w = refs.load_words(words_ref, si, 0, 6, live_r & ~seed_neg & s_ok, gather)
        seed_tok, seed_pos, seed_prev = U64(w[0], w[1]), U64(w[2], w[3]), U64(w[4], w[5])
        running0 = pairs.where(
            seed_neg, pairs.const(hashing.ANCHOR_HASH, (lanes,)), hasher.splitmix64_mix3(seed_prev, seed_tok, seed_pos)
        )
        gate = (~seed_neg) & gate_on
        run_pos0 = pairs.where(gate, seed_pos, pairs.const(0, (lanes,)))
        chain_start(state_ref, None, r, live_r, running0, run_pos0, gate, count)

        arrays = (loc_ref, ids_ref, pos_ref) + ((exp_tok_ref, exp_pos_ref) if assert_inputs else ())

        def load_chunk(c):
            # One [lanes, 2 * prefetch] load per array: the next `prefetch` entries of every lane's request.
            runs = [refs.load_pair_run(ref, start, c * prefetch, prefetch, count) for ref in arrays]
            out = []
            for k in range(prefetch):
                for run in runs:
                    out += [run[k].lo, run[k].hi]
            return tuple(out)

        def step(j, vals, running, run_pos):
            """One chain step; returns the new state and what the chunk stores for this entry."""
            live = j < count
            loc, tok, pos = U64(vals[0], vals[1]), U64(vals[2], vals[3]), U64(vals[4], vals[5])
            ok = live & pairs.in_range(loc, n_slots)
            want = pairs.add(run_pos, 1)
            cfail = ok & gate & pairs.ne(pos, want)
            fl = WriteFlag.WRITTEN | jnp.where(cfail, WriteFlag.CHAIN_POSITION, 0)
            if assert_inputs:
                etok, epos = U64(vals[6], vals[7]), U64(vals[8], vals[9])
                fl = (
                    fl
                    | jnp.where(pairs.ne(tok, etok), WriteFlag.TOKEN_MISMATCH, 0)
                    | jnp.where(pairs.ne(pos, epos), WriteFlag.POSITION_MISMATCH, 0)
                )
            out = dict(
                ok=ok,
                cfail=cfail,
                prev=running,
                run_pos=run_pos,
                fl=fl.astype(jnp.uint32),
                slot=jnp.where(ok, loc.lo, pairs.u32(0)).astype(jnp.int32),
            )
            running = pairs.where(ok, hasher.splitmix64_mix3(running, tok, pos), running)
            run_pos = pairs.where(ok & gate, pos, run_pos)
            return running, run_pos, out

        def store_chunk(c, outs):
            # One store per output array and chunk (Triton's per-memory-op compile passes grow steeply with
            # the number of memory ops in the loop; per-step stores made this kernel compile for minutes).
            first = start + c * prefetch  # entry of step 0 of this chunk, per lane
            ok = refs.from_columns([o["ok"] for o in outs])  # [lanes, p]
            cfail = refs.from_columns([o["cfail"] for o in outs])
            refs.store_run(flags_ref, first, refs.from_columns([o["fl"] for o in outs]), ok)
            refs.store_pair_run(prev_at_ref, first, [o["prev"] for o in outs], ok)
            refs.store_pair_run(chain_exp_ref, first, [o["run_pos"] for o in outs], cfail)
            slots = refs.from_columns([o["slot"] for o in outs])
            refs.store_word(words_ref, slots, CLAIM_WORD, jnp.zeros(slots.shape, jnp.uint32), ok)

        def chunk_body(c, carry):
            running, run_pos = U64(carry[0], carry[1]), U64(carry[2], carry[3])
            vals = carry[4:]
            nxt = load_chunk(c + 1)
            outs = []
            for k in range(prefetch):
                running, run_pos, out = step(
                    c * prefetch + k, vals[k * per_step : (k + 1) * per_step], running, run_pos
                )
                outs.append(out)
            store_chunk(c, outs)
            return (running.lo, running.hi, run_pos.lo, run_pos.hi) + nxt

        num_chunks = refs.cdiv(jnp.max(count), prefetch)
        init = (running0.lo, running0.hi, run_pos0.lo, run_pos0.hi) + load_chunk(jnp.int32(0))
        jax.lax.fori_loop(0, num_chunks, chunk_body, init)

    refs.for_each_block(refs.cdiv(nv, lanes), block_body, pid=pid, programs=programs)


def chain_start(state_ref, hint_ref, r, live, running0: U64, run_pos0: U64, gate, count):
    """Records the chain start of requests ``r`` in ``state_ref`` (when making a hint) and, with a hint, zeroes
    ``count`` where the hint's chain start is the same (their chains are then the hint's); returns ``count``."""
    words = (running0.lo, running0.hi, run_pos0.lo, run_pos0.hi, gate.astype(jnp.uint32))
    if state_ref is not None:
        for k, v in enumerate(words):
            refs.store_word(state_ref, r, k, v, live)
    if hint_ref is None:
        return count
    same = live
    for k, v in enumerate(words):
        same = same & (refs.load_word(hint_ref, r, k, live) == v)
    return jnp.where(same, 0, count)


def _entry_role(
    loc_ref,
    src_refs,
    rkv_ref,
    *,
    pid,
    programs,
    descs,
    n_slots,
    num_tokens,
    block,
    hasher,
    gather,
    source_gather,
    source_unroll,
    source_tile_words,
):
    """Parallel over entries: the real-KV fingerprint of every entry whose slot is in range.

    It runs beside the chains, so it cannot know which entries they write: it hashes every entry with a valid
    slot (a superset; padding entries with a valid slot cost a hash that nobody reads)."""

    def block_body(b):
        i = b * block + refs.iota(block)
        inw = i < num_tokens
        loc = refs.load_pair_flat(loc_ref, i, inw)
        valid = inw & pairs.in_range(loc, n_slots)
        s = jnp.where(valid, loc.lo, pairs.u32(0)).astype(jnp.int32)
        rkv = real_kv.real_kv_hash(src_refs, descs, s, valid, hasher, source_gather, source_unroll, source_tile_words)
        refs.store_pair(rkv_ref, i, 0, rkv, valid)

    refs.for_each_block(refs.cdiv(num_tokens, block), block_body, pid=pid, programs=programs)


def write_chain_kernel(
    num_reqs_ref,  # i32[1]
    assert_flag_ref,  # i32[1]: enable_chain_position_assert
    write_index_ref,  # i32[1]: read only here
    offsets_ref,  # u32[Cw + 1, 2]
    seeds_ref,  # u32[Cw, 2]
    ids_ref,
    pos_ref,
    loc_ref,  # u32[2 T]: the [T, 2] pairs, flat
    exp_tok_ref,
    exp_pos_ref,  # u32[2 T] (read only with the input assert)
    *more_refs,  # sources u32[rows_s, row_words_s]; words_in u32[N, S/4], flags_in u32[T] (aliased); outputs:
    # words_ref, flags_ref u32[T], prev_at_ref / chain_exp_ref u32[2 T], base_ref i32[1]
    # [, rkv_ref u32[T, 2]]
    descs,
    chain_programs,
    entry_programs,
    n_slots,
    cw,
    num_tokens,
    lanes,
    prefetch,
    entry_block,
    hasher,
    gather,
    source_gather,
    source_unroll,
    source_tile_words,
    assert_inputs,
    long_threshold,
    reuse="none",
):
    """Programs ``[0, chain_programs)`` run :func:`_chain_role`, the next ``entry_programs`` :func:`_entry_role`;
    program 0 also copies ``write_index`` to ``base_ref`` (the ring base of the commit pass).

    ``reuse``: ``none``; ``emit`` (a ``u32[Cw, 5]`` chain-start output comes last); ``consume`` (inputs
    ``prev_at`` / ``chain_exp``, aliased to the outputs, follow ``flags_in``: the hint's, which the long
    requests that match keep; the lane chains are recomputed, they are short)."""
    src_refs = more_refs[: len(descs)]
    rest = more_refs[len(descs) :]
    n_in = 4 if reuse == "consume" else 2
    words_ref, flags_ref, prev_at_ref, chain_exp_ref, base_ref, *extra = rest[n_in:]
    rkv_ref = extra[0] if descs else None
    state_ref = extra[-1] if reuse == "emit" else None
    inputs = (ids_ref, pos_ref, loc_ref, exp_tok_ref, exp_pos_ref)
    pid = refs.program_id()

    @pl.when(pid == 0)
    def _():
        base_ref[0] = write_index_ref[0]

    @pl.when(pid < chain_programs)
    def _():
        _chain_role(
            (num_reqs_ref, assert_flag_ref, offsets_ref, seeds_ref, *inputs),
            (words_ref, flags_ref, prev_at_ref, chain_exp_ref),
            pid=pid,
            programs=chain_programs,
            n_slots=n_slots,
            cw=cw,
            num_tokens=num_tokens,
            lanes=lanes,
            prefetch=prefetch,
            hasher=hasher,
            gather=gather,
            assert_inputs=assert_inputs,
            long_threshold=long_threshold,
            state_ref=state_ref,
        )

    if descs:

        @pl.when(pid >= chain_programs)
        def _():
            _entry_role(
                loc_ref,
                src_refs,
                rkv_ref,
                pid=pid - chain_programs,
                programs=entry_programs,
                descs=descs,
                n_slots=n_slots,
                num_tokens=num_tokens,
                block=entry_block,
                hasher=hasher,
                gather=gather,
                source_gather=source_gather,
                source_unroll=source_unroll,
                source_tile_words=source_tile_words,
            )
