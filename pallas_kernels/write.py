"""Pallas write kernel: SGLang's ``canary_write`` with a deterministic ring order and last-writer-wins stores.

Semantics: exactly :func:`canary_jax.reference.write_reference` (SPEC 6), bit for bit, with
``jax_enable_x64`` off and on.

Three ``pallas_call`` s (four when the launch shape admits long requests, see 1b), one XLA scatter-max and
one XLA memset (the flag words); only the chain is serial:

1. ``canary_write_chain`` (``_write_chain_kernel``), one launch with two kinds of program:

   * chain programs (``_chain_role``): each lane runs one request's chain (``write_lanes`` requests per
     program, so a decode batch of thousands of 1-token requests fills the GPU). A lane reads its seed slot
     (before anything is stored; seeds never read field 3), then walks its entries in chunks of
     ``write_prefetch`` steps: the slot / token / position words of the next chunk are loaded (one
     ``[lanes, 2 * write_prefetch]`` load per array) while this chunk runs, so only three splitmix64 per
     token sit on the serial path. Per written entry it records the running prev_hash, a flag word
     (written, chain-position fail, input-assert bits) and, for a chain-position fail, the run position
     before the entry, and zeroes field 3's low word of the slot (the claim word of step 2); these are
     stored once per chunk (one store per output), which keeps Triton's compile time down. Requests of more
     than ``write_long_threshold`` entries are left to step 1b when it runs.
   * entry programs (``_entry_role``, only with real-KV sources), parallel over entries with
     ``write_entry_block`` entries each: the real-KV fingerprint of every entry with a valid slot. They run
     beside the chains, so real-KV hashing never sits on the serial path nor waits for it.

1b. ``canary_write_long`` (``_write_long_kernel``), only when the launch has more tokens than
   ``write_long_threshold`` and at least twice as many tokens as request rows (prefill and mixed batches):
   one long request per program; the whole program runs its chain (three splitmix64 and two selects per
   entry on the serial path, nothing stored per entry) and stores a checkpoint per chunk of
   ``write_long_chunk`` entries, while the entry-parallel work (flags, claim words) runs one entry per
   thread.
2. An XLA scatter-max ``claim word[slot] = max(., entry + 1)`` over written entries, so that the last entry
   (request-major order) writing a slot wins, as in the reference.
3. ``canary_write_won`` (``_write_won_kernel``): each written entry reads its claim word to learn whether it
   won its slot; long-request entries replay the chain from their chunk's checkpoint (prev_hash, run
   position, chain-position fail); per block, the number of violation rows and of written entries. (Winners
   must all be known before any store overwrites a claim word, hence the launch boundary.)
4. ``canary_write_store`` (``_write_commit_kernel``): winners store ``(token, position, prev_hash,
   real_kv_hash)``; blocks with violations scatter their rows at ``write_index + exclusive prefix`` (the order
   does not depend on atomics); program 0 bumps ``write_index`` and the counters.

The canary buffer, ring, write index and counters alias their outputs (``input_output_aliases``); the public
:func:`canary_jax.write` donates them, so a launch costs time in the number of entries, not the pool size.

The flag words start zeroed (an XLA memset), so entries outside every live request, wherever the clamped
offsets put them, are never stored or reported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax import constants
from canary_jax import hashing
from canary_jax import layout
from canary_jax import sources
from canary_jax.plans import VerifyOrWriteContext, WritePlan
from pallas_kernels import _util
from pallas_kernels.config import DEFAULT_CONFIG, PallasConfig, default_interpret
from pallas_kernels.hashing import PairHash

_COUNT_CHUNK = 1024
_F_WRITTEN = 1
_F_CHAIN = 2
_F_INPUT = 8 | 16  # WRITE_TOKEN_MISMATCH | WRITE_POSITION_MISMATCH, stored as is
_F_WINNER = 32
_F_GATE = 64  # long role: the chain-position gate is on; the won pass compares the position
_F_LONG = 128  # long role: prev_at / chain_exp come from a replay from the chunk's checkpoint (won pass)
_LONG_SHIFT = 16  # long role: bits 16.. of the flag word: distance to the checkpoint entry
_CLAIM_WORD = 2 * constants.CANARY_FIELD_REAL_KV_HASH  # low word of field 3


def _chain_role(num_reqs_ref, assert_flag_ref, offsets_ref, seeds_ref, ids_ref, pos_ref, loc_ref, exp_tok_ref,
                exp_pos_ref, words_ref, flags_ref, prev_at_ref, chain_exp_ref, *, pid, programs, n_slots, cw,
                num_tokens, lanes, prefetch, hasher, gather, assert_inputs, long_threshold):
    """Serial chains, one request per lane: flags, running prev_hash and chain-position expectations.

    With ``long_threshold`` (the long role is on), requests of more entries are left to :func:`_write_long_kernel`."""
    nv = jnp.clip(num_reqs_ref[0], 0, cw)
    gate_on = assert_flag_ref[0] != 0
    per_step = 2 * (5 if assert_inputs else 3)

    def block_body(rb):
        r = rb * lanes + _util.iota(lanes)
        live_r = r < nv
        start = _util.clamp_to(_util.load_pair(offsets_ref, r, 0, live_r, gather), num_tokens)
        end = _util.clamp_to(_util.load_pair(offsets_ref, r + 1, 0, live_r, gather), num_tokens)
        count = jnp.where(live_r, jnp.maximum(end - start, 0), 0)
        if long_threshold is not None:
            count = jnp.where(count > long_threshold, 0, count)

        seed = _util.load_pair(seeds_ref, r, 0, live_r, gather)
        seed_neg = _util.is_negative(seed)
        si, s_ok = _util.index_of(seed, n_slots)
        w = _util.load_words(words_ref, si, 0, 6, live_r & ~seed_neg & s_ok, gather)
        seed_tok, seed_pos, seed_prev = hashing.U64(w[0], w[1]), hashing.U64(w[2], w[3]), hashing.U64(w[4], w[5])
        running0 = _util.sel(seed_neg, _util.full_u64(hashing.ANCHOR_HASH, (lanes,)),
                         hasher.mix3(seed_prev, seed_tok, seed_pos))
        gate = (~seed_neg) & gate_on
        run_pos0 = _util.sel(gate, seed_pos, _util.zeros_u64((lanes,)))

        arrays = (loc_ref, ids_ref, pos_ref) + ((exp_tok_ref, exp_pos_ref) if assert_inputs else ())

        def load_chunk(c):
            # One [lanes, 2 * prefetch] load per array: the next `prefetch` entries of every lane's request.
            runs = [_util.load_pair_run(ref, start, c * prefetch, prefetch, count) for ref in arrays]
            out = []
            for k in range(prefetch):
                for run in runs:
                    out += [run[k].lo, run[k].hi]
            return tuple(out)

        def step(j, vals, running, run_pos):
            """One chain step; returns the new state and what the chunk stores for this entry."""
            live = j < count
            loc, tok, pos = hashing.U64(vals[0], vals[1]), hashing.U64(vals[2], vals[3]), hashing.U64(vals[4], vals[5])
            ok = live & (loc.hi == 0) & (loc.lo < _util.u32(n_slots))
            want = _util.add_small(run_pos, 1)
            cfail = ok & gate & _util.ne(pos, want)
            fl = _F_WRITTEN | jnp.where(cfail, _F_CHAIN, 0)
            if assert_inputs:
                etok, epos = hashing.U64(vals[6], vals[7]), hashing.U64(vals[8], vals[9])
                fl = (fl | jnp.where(_util.ne(tok, etok), int(constants.FailReason.WRITE_TOKEN_MISMATCH), 0)
                      | jnp.where(_util.ne(pos, epos), int(constants.FailReason.WRITE_POSITION_MISMATCH), 0))
            out = dict(ok=ok, cfail=cfail, prev=running, run_pos=run_pos, fl=fl.astype(jnp.uint32),
                       slot=jnp.where(ok, loc.lo, _util.u32(0)).astype(jnp.int32))
            running = _util.sel(ok, hasher.mix3(running, tok, pos), running)
            run_pos = _util.sel(ok & gate, pos, run_pos)
            return running, run_pos, out

        def store_chunk(c, outs):
            # One store per output array and chunk (Triton's per-memory-op compile passes grow steeply with
            # the number of memory ops in the loop; per-step stores made this kernel compile for minutes).
            first = start + c * prefetch  # entry of step 0 of this chunk, per lane
            ok = _util.from_columns([o["ok"] for o in outs])  # [lanes, p]
            cfail = _util.from_columns([o["cfail"] for o in outs])
            _util.store_run(flags_ref, first, _util.from_columns([o["fl"] for o in outs]), ok)
            _util.store_pair_run(prev_at_ref, first, [o["prev"] for o in outs], ok)
            _util.store_pair_run(chain_exp_ref, first, [o["run_pos"] for o in outs], cfail)
            slots = _util.from_columns([o["slot"] for o in outs])
            _util.store_word(words_ref, slots, _CLAIM_WORD, jnp.zeros(slots.shape, jnp.uint32), ok)

        def chunk_body(c, carry):
            running, run_pos = hashing.U64(carry[0], carry[1]), hashing.U64(carry[2], carry[3])
            vals = carry[4:]
            nxt = load_chunk(c + 1)
            outs = []
            for k in range(prefetch):
                running, run_pos, out = step(c * prefetch + k, vals[k * per_step:(k + 1) * per_step], running,
                                             run_pos)
                outs.append(out)
            store_chunk(c, outs)
            return (running.lo, running.hi, run_pos.lo, run_pos.hi) + nxt

        num_chunks = _util.cdiv(jnp.max(count), prefetch)
        init = (running0.lo, running0.hi, run_pos0.lo, run_pos0.hi) + load_chunk(jnp.int32(0))
        jax.lax.fori_loop(0, num_chunks, chunk_body, init)

    _util.for_each_block(_util.cdiv(nv, lanes), block_body, pid=pid, programs=programs)


def _write_long_kernel(
    num_reqs_ref,  # i32[1]
    assert_flag_ref,  # i32[1]: enable_chain_position_assert
    offsets_ref,  # u32[Cw + 1, 2]
    seeds_ref,  # u32[Cw, 2]
    ids_ref, pos_ref, loc_ref, exp_tok_ref, exp_pos_ref,  # u32[2 T'] flat pairs, zero-padded to whole chunks
    words_in_ref, flags_in_ref, prev_in_ref, chain_exp_in_ref,  # aliased to the outputs
    words_ref,  # u32[N, S/4]: claim words of written entries zeroed; seeds read (fields 0..2 only)
    flags_ref,  # u32[T]
    prev_at_ref, chain_exp_ref,  # u32[2 T]: prev_hash and run position before each entry
    *, n_slots, cw, num_tokens, rows, chunk, threshold, scan_block, hasher, gather, assert_inputs,
):
    """Serial chains of long requests (more than ``threshold`` entries), one request per program at a time.

    The lane role gives a request one lane and spends every per-entry instruction on the serial path. Here the
    program walks one request in chunks of ``chunk`` entries at aligned entry indices and keeps the serial path
    to the chain itself:

    * entry-parallel, one entry per thread: which entries are written (slot in range, inside the request),
      their flags (written, input-assert bits, ``_F_GATE`` when the chain-position gate is on, ``_F_LONG``
      and, from bit 16 up, the entry's distance to the chunk's first entry of this request) and the zeroed
      claim words;
    * checkpoint: the chain state at that first entry (running prev_hash and run position, exactly that
      entry's own ``prev_at`` / ``chain_exp``) is stored once per chunk;
    * serial, the same chain in every thread: per entry three splitmix64, the written test and two selects,
      nothing stored. The slots, tokens and positions of a chunk come from one aligned load per array (one
      chunk ahead) handed to every thread, so they are register operands of the unrolled steps.

    The won pass (:func:`_write_won_kernel`, parallel over entries) replays the at most ``chunk - 1`` steps
    from the checkpoint to every other entry of the chunk: that is where their ``prev_at`` / ``chain_exp``
    and chain-position failures come from.

    Long requests go to programs by rank (the ``k``-th long request to program ``k mod programs``), so a
    prefill batch runs one chain per program. A launch of its own (``canary_write_long``, after the lane
    chains): Triton's coalescing pass costs about (memory ops) x (IR size) of a kernel, so the two unrolled
    chain bodies compile much faster apart.
    """
    del words_in_ref, flags_in_ref, prev_in_ref, chain_exp_in_ref
    pid = _util.program_id()
    programs = jnp.asarray(pl.num_programs(0)).astype(jnp.int32)  # (int64 under x64 in interpret mode)
    nv = jnp.clip(num_reqs_ref[0], 0, cw)
    gate_on = assert_flag_ref[0] != 0
    big = jnp.int32(2**31 - 1)
    one = _util.iota(rows) * 0  # [rows] zeros: per-request values are carried as identical [rows] vectors
    k_e = _util.iota(chunk)
    w2 = 2 * chunk

    def load_rows(ref, q):
        """Words of entries ``[q * chunk, (q + 1) * chunk)`` of a padded flat pair ref (aligned, in bounds)."""
        return ref[pl.ds(pl.multiple_of(q * w2, w2), w2)]

    def to_rows(v):
        return jnp.broadcast_to(v[None, :], (rows,) + v.shape)

    def run_request(r):
        rv = one + r
        start = _util.clamp_to(_util.load_pair(offsets_ref, rv, 0, rv >= 0, gather), num_tokens)  # [rows], identical
        end = _util.clamp_to(_util.load_pair(offsets_ref, rv + 1, 0, rv >= 0, gather), num_tokens)
        seed = _util.load_pair(seeds_ref, rv, 0, rv >= 0, gather)
        seed_neg = _util.is_negative(seed)
        si, s_ok = _util.index_of(seed, n_slots)
        w = _util.load_words(words_ref, si, 0, 6, ~seed_neg & s_ok, gather)
        seed_tok, seed_pos, seed_prev = hashing.U64(w[0], w[1]), hashing.U64(w[2], w[3]), hashing.U64(w[4], w[5])
        running0 = _util.sel(seed_neg, _util.full_u64(hashing.ANCHOR_HASH, (rows,)), hasher.mix3(seed_prev, seed_tok, seed_pos))
        gate = jnp.max(((~seed_neg) & gate_on).astype(jnp.int32)) != 0  # scalar
        run_pos0 = _util.sel(jnp.broadcast_to(gate, (rows,)), seed_pos, _util.zeros_u64((rows,)))
        start_s, end_s = jnp.max(start), jnp.max(end)  # scalars
        q0 = jax.lax.div(start_s, jnp.int32(chunk))
        q1 = _util.cdiv(end_s, chunk)

        def entry_part(q, first):
            """Flags and claim words of chunk ``q``, one entry per thread (``first``: the chunk's first entry
            of this request, where the checkpoint goes)."""
            i = q * chunk + k_e
            inside = (i >= start_s) & (i < end_s)
            loc = _util.load_pair_flat(loc_ref, i, inside)
            ok = inside & (loc.hi == 0) & (loc.lo < _util.u32(n_slots))
            # (explicit uint32 operands: a select on a scalar predicate between two literals lowers to i1)
            fl = jnp.where(jnp.broadcast_to(gate, (chunk,)), _util.u32(_F_WRITTEN | _F_GATE | _F_LONG),
                           _util.u32(_F_WRITTEN | _F_LONG))
            fl = fl | jax.lax.shift_left(jnp.maximum(i - first, 0).astype(jnp.uint32), _util.u32(_LONG_SHIFT))
            if assert_inputs:
                tok, pos, etok, epos = (_util.load_pair_flat(ref, i, ok) for ref in (ids_ref, pos_ref, exp_tok_ref,
                                                                                  exp_pos_ref))
                fl = (fl | jnp.where(_util.ne(tok, etok), _util.u32(constants.FailReason.WRITE_TOKEN_MISMATCH), _util.u32(0))
                      | jnp.where(_util.ne(pos, epos), _util.u32(constants.FailReason.WRITE_POSITION_MISMATCH), _util.u32(0)))
            _util.store_vec(flags_ref, i, jnp.where(ok, fl, _util.u32(0)), inside)
            _util.store_word(words_ref, jnp.where(ok, loc.lo, _util.u32(0)).astype(jnp.int32), _CLAIM_WORD,
                         jnp.zeros((chunk,), jnp.uint32), ok)

        def chunk_body(q, carry):
            running, run_pos = hashing.U64(carry[0], carry[1]), hashing.U64(carry[2], carry[3])
            loc_c, tok_c, pos_c = (_util.columns(to_rows(v)) for v in carry[4:7])
            first = jnp.maximum(q * chunk, start_s)
            entry_part(q, first)
            firsts = one + first
            every = one == 0  # the checkpoint: every row stores the same words
            for ref, v in ((prev_at_ref, running), (chain_exp_ref, run_pos)):
                _util.store_vec(ref, 2 * firsts, v.lo, every)
                _util.store_vec(ref, 2 * firsts + 1, v.hi, every)
            nxt = tuple(load_rows(ref, q + 1) for ref in (loc_ref, ids_ref, pos_ref))
            for k in range(chunk):
                i = q * chunk + k
                loc = hashing.U64(loc_c[2 * k], loc_c[2 * k + 1])
                tok, pos = hashing.U64(tok_c[2 * k], tok_c[2 * k + 1]), hashing.U64(pos_c[2 * k], pos_c[2 * k + 1])
                ok = (i >= start) & (i < end) & (loc.hi == 0) & (loc.lo < _util.u32(n_slots))
                running = _util.sel(ok, hasher.mix3(running, tok, pos), running)
                run_pos = _util.sel(ok, pos, run_pos)
            return (running.lo, running.hi, run_pos.lo, run_pos.hi) + nxt

        init = (running0.lo, running0.hi, run_pos0.lo, run_pos0.hi) + tuple(
            load_rows(ref, q0) for ref in (loc_ref, ids_ref, pos_ref))
        jax.lax.fori_loop(q0, jnp.maximum(q1, q0), chunk_body, init)

    def scan_body(b, rank_base):
        r = b * scan_block + _util.iota(scan_block)
        live_r = r < nv
        start = _util.clamp_to(_util.load_pair(offsets_ref, r, 0, live_r, gather), num_tokens)
        end = _util.clamp_to(_util.load_pair(offsets_ref, r + 1, 0, live_r, gather), num_tokens)
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

    jax.lax.fori_loop(0, _util.cdiv(nv, scan_block), scan_body, jnp.int32(0))


def _entry_role(loc_ref, src_refs, rkv_ref, *, pid, programs, descs, n_slots, num_tokens, block, hasher, gather,
                source_gather, source_unroll, source_tile_words):
    """Parallel over entries: the real-KV fingerprint of every entry whose slot is in range.

    It runs beside the chains, so it cannot know which entries they write: it hashes every entry with a valid
    slot (a superset; padding entries with a valid slot cost a hash that nobody reads)."""

    def block_body(b):
        i = b * block + _util.iota(block)
        inw = i < num_tokens
        loc = _util.load_pair_flat(loc_ref, i, inw)
        valid = inw & (loc.hi == 0) & (loc.lo < _util.u32(n_slots))
        s = jnp.where(valid, loc.lo, _util.u32(0)).astype(jnp.int32)
        rkv = _util.real_kv_hash(src_refs, descs, s, valid, hasher, source_gather, source_unroll, source_tile_words)
        _util.store_pair(rkv_ref, i, 0, rkv, valid)

    _util.for_each_block(_util.cdiv(num_tokens, block), block_body, pid=pid, programs=programs)


def _write_chain_kernel(
    num_reqs_ref,  # i32[1]
    assert_flag_ref,  # i32[1]: enable_chain_position_assert
    write_index_ref,  # i32[1]: read only here
    offsets_ref,  # u32[Cw + 1, 2]
    seeds_ref,  # u32[Cw, 2]
    ids_ref, pos_ref, loc_ref,  # u32[2 T]: the [T, 2] pairs, flat
    exp_tok_ref, exp_pos_ref,  # u32[2 T] (read only with the input assert)
    *refs,  # sources u32[rows_s, row_words_s]; words_in, flags_in (aliased); outputs: words, flags, prev_at,
            # chain_exp (flat u32[2 T]), base[, rkv]
    descs, chain_programs, entry_programs, n_slots, cw, num_tokens, lanes, prefetch, entry_block, hasher, gather,
    source_gather, source_unroll, source_tile_words, assert_inputs, long_threshold,
):
    src_refs = refs[: len(descs)]
    _, _, words_ref, flags_ref, prev_at_ref, chain_exp_ref, base_ref, *rkv = refs[len(descs):]
    rkv_ref = rkv[0] if rkv else None
    pid = _util.program_id()

    @pl.when(pid == 0)
    def _():
        base_ref[0] = write_index_ref[0]

    @pl.when(pid < chain_programs)
    def _():
        _chain_role(num_reqs_ref, assert_flag_ref, offsets_ref, seeds_ref, ids_ref, pos_ref, loc_ref, exp_tok_ref,
                    exp_pos_ref, words_ref, flags_ref, prev_at_ref, chain_exp_ref, pid=pid,
                    programs=chain_programs, n_slots=n_slots, cw=cw, num_tokens=num_tokens, lanes=lanes,
                    prefetch=prefetch, hasher=hasher, gather=gather, assert_inputs=assert_inputs,
                    long_threshold=long_threshold)

    if descs:
        @pl.when(pid >= chain_programs)
        def _():
            _entry_role(loc_ref, src_refs, rkv_ref, pid=pid - chain_programs, programs=entry_programs,
                        descs=descs, n_slots=n_slots, num_tokens=num_tokens, block=entry_block, hasher=hasher,
                        gather=gather, source_gather=source_gather, source_unroll=source_unroll,
                        source_tile_words=source_tile_words)


def _flagged(flags_ref, loc_ref, i, inw, bit: int):
    """Flag words of entries ``i``, which of them carry ``bit``, and their slots (0 where not)."""
    fl = _util.load_vec(flags_ref, i, inw, 0)
    has = inw & ((fl & bit) != 0)
    return fl, has, jnp.where(has, _util.load_word(loc_ref, i, 0, has), _util.u32(0)).astype(jnp.int32)


def _write_won_kernel(
    loc_ref, ids_ref, pos_ref,  # u32[T, 2]
    words_ref,  # u32[N, S/4]: claim words after the scatter-max, read only here
    flags_in_ref, prev_in_ref, chain_exp_in_ref,  # aliased to flags_ref, prev_at_ref, chain_exp_ref
    flags_ref,  # u32[T]: winners get _F_WINNER; gated long-role entries whose position is not the run
                # position + 1 get _F_CHAIN
    counts_ref,  # i32[NB, 2]: per block, violation rows and written entries
    prev_at_ref, chain_exp_ref,  # u32[T, 2]: long-role entries past their chunk's checkpoint are filled in
    *, num_tokens, block, gather, hasher, has_long,
):
    del flags_in_ref, prev_in_ref, chain_exp_in_ref

    def block_body(b):
        i = b * block + _util.iota(block)
        inw = i < num_tokens
        fl, written, s = _flagged(flags_ref, loc_ref, i, inw, _F_WRITTEN)
        won = written & (_util.load_word(words_ref, s, _CLAIM_WORD, written) == (i + 1).astype(jnp.uint32))
        if has_long:  # (_F_GATE and _F_LONG come from the long role only)
            gated = written & ((fl & _F_GATE) != 0)
            run_pos = _util.load_pair(chain_exp_ref, i, 0, gated, gather)
            # Long-role entries: replay the chain from the chunk's checkpoint (at most chunk - 1 steps).
            off = jnp.where(written & ((fl & _F_LONG) != 0),
                            jax.lax.shift_right_logical(fl, _util.u32(_LONG_SHIFT)).astype(jnp.int32), 0)
            replay = off > 0
            e = i - off
            running = _util.load_pair(prev_at_ref, e, 0, replay, gather)
            rp = _util.load_pair(chain_exp_ref, e, 0, replay, gather)

            def step(j, carry):
                running, rp = hashing.U64(carry[0], carry[1]), hashing.U64(carry[2], carry[3])
                x = e + j
                act = j < off
                w_x = act & ((_util.load_vec(flags_ref, x, act, 0) & _F_WRITTEN) != 0)
                tok = _util.load_pair(ids_ref, x, 0, w_x, gather)
                pos_x = _util.load_pair(pos_ref, x, 0, w_x, gather)
                running = _util.sel(w_x, hasher.mix3(running, tok, pos_x), running)
                rp = _util.sel(w_x, pos_x, rp)
                return running.lo, running.hi, rp.lo, rp.hi

            out = jax.lax.fori_loop(0, jnp.max(off), step, (running.lo, running.hi, rp.lo, rp.hi))
            running, rp = hashing.U64(out[0], out[1]), hashing.U64(out[2], out[3])
            _util.store_pair(prev_at_ref, i, 0, running, replay)
            _util.store_pair(chain_exp_ref, i, 0, rp, replay)
            run_pos = _util.sel(replay, rp, run_pos)
            pos = _util.load_pair(pos_ref, i, 0, gated, gather)
            fl = fl | jnp.where(gated & _util.ne(pos, _util.add_small(run_pos, 1)), _F_CHAIN, 0).astype(jnp.uint32)
        _util.store_vec(flags_ref, i, fl | jnp.where(won, _F_WINNER, 0).astype(jnp.uint32), inw)
        rows = ((fl & _F_INPUT) != 0).astype(jnp.int32) + ((fl & _F_CHAIN) != 0).astype(jnp.int32)
        counts_ref[b, 0] = jnp.sum(rows, dtype=jnp.int32)
        counts_ref[b, 1] = jnp.sum(written.astype(jnp.int32), dtype=jnp.int32)

    _util.for_each_block(_util.cdiv(num_tokens, block), block_body)


def _write_commit_kernel(
    base_ref,  # i32[1]: write_index before this launch
    ids_ref, pos_ref, loc_ref,  # u32[T, 2]
    exp_tok_ref, exp_pos_ref,  # u32[T, 2] (read only with the input assert)
    prev_at_ref, chain_exp_ref,  # u32[T, 2]: prev_hash and run position before each entry
    flags_ref,  # u32[T]: 0 unless written
    counts_ref,  # i32[NB, 2]
    *refs,  # [rkv u32[T, 2]]; words, ring, wi, slot counters, kernel counters (in, aliased), then the same out
    has_rkv, tag, num_tokens, block, ring_capacity, gather, assert_inputs,
):
    rkv_ref = refs[0] if has_rkv else None
    words_ref, ring_ref, wi_ref, slot_counters_ref, kernel_counters_ref = refs[len(refs) - 5:]
    num_blocks = _util.cdiv(num_tokens, block)
    base = base_ref[0]

    @pl.when(_util.program_id() == 0)
    def _():
        rows = _util.sum_counts(counts_ref, 0, num_blocks, chunk=_COUNT_CHUNK, column=0)
        written = _util.sum_counts(counts_ref, 0, num_blocks, chunk=_COUNT_CHUNK, column=1)
        wi_ref[0] = base + rows
        _util.bump_pair_scalar(slot_counters_ref, 2 * tag, written)
        _util.bump_pair_scalar(kernel_counters_ref, 2 * tag, jnp.int32(1))

    def block_body(b):
        i = b * block + _util.iota(block)
        inw = i < num_tokens
        fl, won, s = _flagged(flags_ref, loc_ref, i, inw, _F_WINNER)
        fields = [_util.load_pair(r, i, 0, won, gather) for r in (ids_ref, pos_ref, prev_at_ref)]
        fields.append(_util.load_pair(rkv_ref, i, 0, won, gather) if has_rkv else _util.zeros_u64((block,)))
        for f, v in enumerate(fields):
            _util.store_pair(words_ref, s, 2 * f, v, won)

        @pl.when(counts_ref[b, 0] > 0)
        def _():
            start = base + _util.sum_counts(counts_ref, 0, b, chunk=_COUNT_CHUNK, column=0)
            in_rec = ((fl & _F_INPUT) != 0).astype(jnp.int32)
            ch_rec = ((fl & _F_CHAIN) != 0).astype(jnp.int32)
            n = in_rec + ch_rec
            d_in = start + jnp.cumsum(n, axis=0) - n
            d_ch = d_in + in_rec
            any_rec = n > 0
            loc = _util.load_pair(loc_ref, i, 0, any_rec, gather)
            tok = _util.load_pair(ids_ref, i, 0, any_rec, gather)
            pos = _util.load_pair(pos_ref, i, 0, any_rec, gather)
            prev_at = _util.load_pair(prev_at_ref, i, 0, any_rec, gather)
            chain_exp = _util.add_small(_util.load_pair(chain_exp_ref, i, 0, ch_rec != 0, gather), 1)  # run position + 1
            zero = jnp.zeros((block,), jnp.uint32)
            tag_w = jnp.full((block,), tag, jnp.uint32)
            head = [tag_w, zero, loc.lo, loc.hi, pos.lo, pos.hi, tok.lo, tok.hi]
            if assert_inputs:
                etok = _util.load_pair(exp_tok_ref, i, 0, in_rec != 0, gather)
                epos = _util.load_pair(exp_pos_ref, i, 0, in_rec != 0, gather)
                in_cols = head + [etok.lo, etok.hi, prev_at.lo, prev_at.hi, epos.lo, epos.hi,
                                  fl & _F_INPUT, zero]
                keep_in = (in_rec != 0) & (d_in >= 0) & (d_in < ring_capacity)
                for k, v in enumerate(in_cols):
                    _util.store_word(ring_ref, d_in, k, v, keep_in)
            ch_cols = head + [tok.lo, tok.hi, prev_at.lo, prev_at.hi, chain_exp.lo, chain_exp.hi,
                              jnp.full((block,), int(constants.FailReason.WRITE_POSITION_MISMATCH), jnp.uint32), zero]
            keep_ch = (ch_rec != 0) & (d_ch >= 0) & (d_ch < ring_capacity)
            for k, v in enumerate(ch_cols):
                _util.store_word(ring_ref, d_ch, k, v, keep_ch)

    _util.for_each_block(num_blocks, block_body)


def _write_pallas(context: VerifyOrWriteContext, plan: WritePlan, input_ids, positions, out_cache_loc,
                  expected_input_tokens, expected_input_positions, *, assert_inputs: bool, interpret: bool,
                  config: PallasConfig):
    descs = sources.check_real_kv_sources(context.real_kv_sources, context.real_kv_hash_mode)
    tag = int(context.kernel_kind)
    log = context.log
    num_tokens = int(input_ids.shape[0])
    if num_tokens == 0:  # nothing to store or check: only the launch counter moves
        return context.replace(log=layout.bump_counters(log, tag, jnp.uint32(0)))
    words = layout.canary_words(context.canary_buf)
    n_slots = int(words.shape[0])
    cw = int(plan.write_seed_slot_indices.shape[0])
    hasher = PairHash(config.resolved_multiplier(interpret))
    gather = config.gather
    if not assert_inputs:
        expected_input_tokens, expected_input_positions = input_ids, positions  # never read
    tensors = [s.tensor for s in context.real_kv_sources][: len(descs)]
    srcs = [sources.source_words(t) for t in tensors]
    u32, i32 = jnp.uint32, jnp.int32
    sds = jax.ShapeDtypeStruct
    block = config.write_block
    num_blocks = -(-num_tokens // block)
    grid_entries = (max(1, min(num_blocks, config.write_max_programs)),)
    chain_programs = max(1, min(-(-cw // config.write_lanes), config.write_max_programs))
    # Long requests get their own programs when some request can be long and tokens outnumber requests (a
    # prefill or mixed batch); a decode batch (as many requests as tokens) keeps to the lane role.
    long_threshold = config.write_long_threshold
    long_on = num_tokens > long_threshold and num_tokens >= 2 * cw
    long_programs = max(1, min(cw, num_tokens // (long_threshold + 1), config.write_max_programs)) if long_on else 0
    long_scan_block = min(1024, 1 << max(0, (cw - 1).bit_length()))
    has_rkv = bool(descs)
    entry_programs = max(1, min(-(-num_tokens // config.write_entry_block), config.write_max_programs)) if has_rkv else 0
    params = pltriton.CompilerParams(num_warps=4, num_stages=1)

    # 1. Chains and, in the same launch, the entry-parallel work (claims zeroed, real-KV fingerprints).
    out_shape = [sds(words.shape, u32), sds((num_tokens,), u32), sds((2 * num_tokens,), u32),
                 sds((2 * num_tokens,), u32), sds((1,), i32)]
    if has_rkv:
        out_shape.append(sds((num_tokens, 2), u32))
    words_arg = 10 + len(srcs)
    flat = [a.reshape(-1) for a in (input_ids, positions, out_cache_loc, expected_input_tokens,
                                    expected_input_positions)]
    words, flags, prev_at, chain_exp, base, *rkv = pl.pallas_call(
        functools.partial(
            _write_chain_kernel, descs=descs, chain_programs=chain_programs, entry_programs=entry_programs,
            long_threshold=long_threshold if long_programs else None,
            n_slots=n_slots, cw=cw, num_tokens=num_tokens, lanes=config.write_lanes,
            prefetch=config.write_prefetch, entry_block=config.write_entry_block, hasher=hasher, gather=gather,
            source_gather=config.source_gather, source_unroll=config.source_unroll,
            source_tile_words=config.write_source_tile_words, assert_inputs=assert_inputs),
        out_shape=tuple(out_shape),
        grid=(chain_programs + entry_programs,),
        input_output_aliases={words_arg: 0, words_arg + 1: 1},
        compiler_params=pltriton.CompilerParams(num_warps=config.write_num_warps, num_stages=1),
        interpret=interpret,
        name="canary_write_chain",
    )(plan.write_num_valid_reqs, log.enable_chain_position_assert, log.write_index, plan.write_offsets,
      plan.write_seed_slot_indices, *flat, *srcs, words, jnp.zeros((num_tokens,), u32))

    if long_programs:
        # 1b. Long requests: one chain per program (after the lane chains; seeds read fields 0..2, which no
        # chain kernel writes). Inputs are zero-padded to whole chunks plus one for the look-ahead load.
        k = config.write_long_chunk
        padded = 2 * k * (-(-num_tokens // k) + 1)
        pads = [jnp.pad(a, (0, padded - 2 * num_tokens)) for a in flat[:3 + 2 * assert_inputs]]
        pads += pads[:2] * (not assert_inputs)  # the expected arrays are never read without the input assert
        words, flags, prev_at, chain_exp = pl.pallas_call(
            functools.partial(
                # rows=1: the chain state as [1] vectors (what ran on the H200; Triton still hands the
                # chunk's words to every thread)
                _write_long_kernel, n_slots=n_slots, cw=cw, num_tokens=num_tokens, rows=1,
                chunk=k, threshold=long_threshold, scan_block=long_scan_block, hasher=hasher, gather=gather,
                assert_inputs=assert_inputs),
            out_shape=(sds(words.shape, u32), sds(flags.shape, u32), sds(prev_at.shape, u32),
                       sds(chain_exp.shape, u32)),
            grid=(long_programs,),
            input_output_aliases={9: 0, 10: 1, 11: 2, 12: 3},
            compiler_params=pltriton.CompilerParams(num_warps=config.write_num_warps, num_stages=1),
            interpret=interpret,
            name="canary_write_long",
        )(plan.write_num_valid_reqs, log.enable_chain_position_assert, plan.write_offsets,
          plan.write_seed_slot_indices, *pads, words, flags, prev_at, chain_exp)

    prev_at, chain_exp = prev_at.reshape(num_tokens, 2), chain_exp.reshape(num_tokens, 2)

    # 2. claim[slot] = max(claim, entry + 1) over written entries: the last writer of a slot owns it.
    words = _claim_slots(words, out_cache_loc, flags, num_tokens=num_tokens)

    # 3. Winners and per-block counts.
    flags, counts, prev_at, chain_exp = pl.pallas_call(
        functools.partial(_write_won_kernel, num_tokens=num_tokens, block=block, gather=gather, hasher=hasher,
                          has_long=bool(long_programs)),
        out_shape=(sds(flags.shape, u32), sds((num_blocks, 2), i32), sds(prev_at.shape, u32),
                   sds(chain_exp.shape, u32)),
        grid=grid_entries,
        input_output_aliases={4: 0, 5: 2, 6: 3},
        compiler_params=params,
        interpret=interpret,
        name="canary_write_won",
    )(out_cache_loc, input_ids, positions, words, flags, prev_at, chain_exp)

    # 4. Stores, violation rows, write index and counters.
    r = log.ring.shape[0]
    ring = log.ring.reshape(r, 2 * constants.VIOLATION_FIELDS)
    slot_counters = log.slot_run_counters.reshape(-1)
    kernel_counters = log.kernel_run_counters.reshape(-1)
    first = 10 + len(rkv)
    words, ring, wi, slot_counters, kernel_counters = pl.pallas_call(
        functools.partial(
            _write_commit_kernel, has_rkv=has_rkv, tag=tag, num_tokens=num_tokens, block=block, ring_capacity=r,
            gather=gather, assert_inputs=assert_inputs),
        out_shape=(sds(words.shape, u32), sds(ring.shape, u32), sds(log.write_index.shape, i32),
                   sds(slot_counters.shape, u32), sds(kernel_counters.shape, u32)),
        grid=grid_entries,
        input_output_aliases={first + k: k for k in range(5)},
        compiler_params=params,
        interpret=interpret,
        name="canary_write_store",
    )(base, input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions, prev_at,
      chain_exp, flags, counts, *rkv, words, ring, log.write_index, slot_counters, kernel_counters)

    new_log = _util.updated_log(log, ring=ring, write_index=wi, slot_counters=slot_counters,
                            kernel_counters=kernel_counters)
    return context.replace(canary_buf=layout.canary_bytes(words), log=new_log)


def _claim_slots(words, out_cache_loc, flags, *, num_tokens: int):
    """``claim[slot] = max(claim[slot], entry + 1)`` over written entries: one XLA scatter-max.

    After it, entry ``i`` owns its slot iff the claim word reads ``i + 1``: the last entry (request-major)
    writing a slot wins, as in the reference. XLA's scatter-max is exact with duplicate slots on every
    backend (it uses atomicMax on the GPU); Pallas-Triton's vector atomics do not lower for integer vectors
    in the JAX versions we run (see README).
    """
    n_slots = words.shape[0]
    i = jnp.arange(num_tokens, dtype=jnp.int32)
    dest = jnp.where((flags & _F_WRITTEN) != 0, out_cache_loc[:, 0].astype(jnp.int32), n_slots)
    return words.at[dest, _CLAIM_WORD].max((i + 1).astype(jnp.uint32), mode="drop")


_write_jit = jax.jit(_write_pallas, static_argnames=("assert_inputs", "interpret", "config"))


def write_pallas(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    *,
    enable_write_input_assert: bool = False,
    expected_input_tokens: jax.Array | None = None,
    expected_input_positions: jax.Array | None = None,
    interpret: bool | None = None,
    config: PallasConfig | None = None,
) -> VerifyOrWriteContext:
    """Pallas backend of :func:`canary_jax.write`; same signature and results as
    :func:`canary_jax.reference.write_reference`.

    Calling contract: as the reference (``kernel_run_counters[tag] += 1`` always; ``slot_run_counters[tag]
    += `` entries stored; rows request-major, entry order, input-assert row before chain-position row; the
    last entry writing a slot wins; only the first 32 bytes of written slots change). The canary buffer,
    ring, write index and counters are updated through ``input_output_aliases``: donate them (as
    :func:`canary_jax.write` does) for an in-place update. Sources are read only.

    Args:
      context, plan: the launch context (at most 4 sources, checked before tracing) and write plan.
      input_ids, positions, out_cache_loc: ``uint32[T, 2]`` int64 pairs; ``out_cache_loc < 0`` = skip.
      enable_write_input_assert: static; compare with the expected tensors.
      expected_input_tokens, expected_input_positions: ``uint32[T, 2]`` pairs iff the assert is on.
      interpret: static; ``None`` = compiled on GPU, ``interpret=True`` elsewhere.
      config: static :class:`~pallas_kernels.config.PallasConfig`; ``None`` = the defaults.

    Returns:
      ``context`` with the new canary buffer and log.
    """
    sources.check_real_kv_sources(context.real_kv_sources, context.real_kv_hash_mode)  # > 4 sources: before tracing
    if enable_write_input_assert and (expected_input_tokens is None or expected_input_positions is None):
        raise ValueError("kv-canary: expected input tensors are required when enable_write_input_assert=True")
    if not enable_write_input_assert and (expected_input_tokens is not None or expected_input_positions is not None):
        raise ValueError("kv-canary: expected input tensors must be None when enable_write_input_assert=False")
    interpret = default_interpret() if interpret is None else bool(interpret)
    return _write_jit(context, plan, input_ids, positions, out_cache_loc, expected_input_tokens,
                      expected_input_positions, assert_inputs=bool(enable_write_input_assert),
                      interpret=interpret, config=(config or DEFAULT_CONFIG).for_interpret(interpret))
