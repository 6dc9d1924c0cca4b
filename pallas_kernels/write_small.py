"""The write of a small launch held in registers (:func:`small_write_body`): what
:func:`pallas_kernels.write_fused.write_body` runs, in the one-program write and in the phase kernel, when the
launch has at most :data:`SMALL_MAX_TOKENS` tokens (and ``PallasConfig.write_small_max_tokens``) over a plan of at
most :data:`SMALL_MAX_REQS` request rows, both static.

The general body spends a decode step in about ten dependent global-memory round trips (flag memset, chain,
claim words read back in a loop, commit). Here every vector of the launch fits in the program's registers, so a
decode step (no request of more than one token) waits on memory three times:

1. every input at once, each load under a static mask: the request count, the chain-position flag, the write
   index, the launch's counters, the offsets and seeds (``[R]``, ``R`` request lanes), the tokens, positions and
   slots and, with the input assert, the expected ones (``[B]``, ``B`` entry lanes);
2. what depends only on those: each written entry's seed record (its request's), and the real-KV words of every
   winner (:func:`pallas_kernels.real_kv.real_kv_hash`);
3. the stores: the winners' records, the violation rows at ``write_index + rank``, the write index and counters.

Between them everything is register work, with one-hot selects and reductions where data moves between lanes
(Triton has no register gather), in ``[CHUNK, B]`` tiles a chunk per loop step (fewer registers than ``[R, B]`` or
``[B, B]`` at once):

* each entry's request: the entry against every live request's ``[start, start + count)`` (clamped offsets; the
  plan contract makes live requests' ranges ordered and disjoint), summing the one request row it lies in (start,
  end and seed flags packed in one int32) and that row's seed slot;
* the last writer of each slot (the reference's last-writer-wins; request-major is entry order): the slots of
  written entries against those of every later entry;
* the ring rows' ranks: an exclusive cumsum of each entry's row count (input-assert row, then chain-position row);
* a written entry's ``prev_hash`` is its request's chain start (``mix3`` of its seed record, or the anchor hash), and
  its run position the seed's position, when it is its request's only written entry.

A launch with a request of several tokens (a prefill or mixed batch) first runs the serial chains, one request per
lane as the general body, each step's token, position and slot loaded one step ahead (cache hits: step 0 loaded
them), the running ``prev_hash`` and run position of every written entry stored to a scratch output ``u32[4 T]``
that the entry lanes read back after a barrier: one more round trip, and one chain step per token of the longest
request.

Bit for bit :func:`canary_jax.ops.reference.write_reference` (for plans within the contract, as every Pallas write).
A barrier sits between the seed loads and the stores (a request may seed from a slot another request writes). In
interpret mode barriers are no-ops and statements run in order.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import constants, hashing, pairs
from canary_jax.contract.pairs import U64
from pallas_kernels import real_kv, refs

SMALL_MAX_TOKENS = 128
"""Most tokens of a launch this body takes (``B``: entries meet every other entry and every request row)."""

SMALL_MAX_REQS = 128
"""Most request rows (``write_req_capacity``) of a launch this body takes."""

CHUNK = 32
"""Lanes of the other side per ``[CHUNK, B]`` one-hot tile (a loop step). Offline for sm_90, whole ``[128, 128]``
tiles took ptxas to 255 registers and spills in the phase kernel; chunks keep it at the phase's 2 programs per SM."""

I32, U32 = jnp.int32, jnp.uint32

# A request row packed in one int32 (what the [CHUNK, B] selects move): its first entry and its end (8 bits each:
# both are at most 128), then its seed's flags. A row an entry lies in has end > 0, so its word is never 0.
_STOP_SHIFT = 8
_FIRST = 0xFF
_SEED_NEG = 1 << 16
_SEED_OK = 1 << 17
assert SMALL_MAX_TOKENS <= _FIRST


def takes_small(num_tokens: int, cw: int, max_tokens: int) -> bool:
    """Whether a one-program write of ``num_tokens`` tokens over ``cw`` request rows runs this body:
    ``0 < num_tokens <= min(max_tokens, SMALL_MAX_TOKENS)`` and ``cw <= SMALL_MAX_REQS`` (``max_tokens``:
    ``PallasConfig.write_small_max_tokens``, 0 = never)."""
    return 0 < num_tokens <= min(max_tokens, SMALL_MAX_TOKENS) and cw <= SMALL_MAX_REQS


class _Requests(NamedTuple):
    """Request rows ``r`` of a plan, as read by :func:`_requests` (``[L]`` lanes)."""

    start: jax.Array  # int32: the first entry (clamped offset)
    count: jax.Array  # int32: entries (0 past the live requests)
    seed_neg: jax.Array  # bool: the chain starts at the anchor
    seed_slot: jax.Array  # int32: the seed slot (0 where outside the buffer)
    seed_ok: jax.Array  # bool: the seed slot is inside the buffer


def _requests(offsets_ref, seeds_ref, num_reqs, r, *, cw, num_tokens, n_slots, gather) -> _Requests:
    """Request rows ``r`` (int32 ``[L]``): loads under the static mask ``r < cw`` only, so they wait for nothing."""
    in_cw = r < cw
    if not cw:  # no request rows (a plan of zero capacity): nothing is written
        zero = jnp.zeros(r.shape, I32)
        return _Requests(zero, zero, in_cw, zero, in_cw)
    start = pairs.clamp(refs.load_pair(offsets_ref, r, 0, in_cw, gather), num_tokens)
    stop = pairs.clamp(refs.load_pair(offsets_ref, r + 1, 0, in_cw, gather), num_tokens)
    seed = refs.load_pair(seeds_ref, r, 0, in_cw, gather)
    count = jnp.where(in_cw & (r < jnp.clip(num_reqs, 0, cw)), jnp.maximum(stop - start, 0), 0)
    seed_slot, seed_ok = pairs.index(seed, n_slots)
    return _Requests(start, count, pairs.is_negative(seed), seed_slot, seed_ok)


def _sum_where(mask: jax.Array, values: jax.Array) -> jax.Array:
    """``sum(where(mask, values, 0), axis=0)`` in ``values``' dtype (a one-hot ``mask`` column selects one value)."""
    return jnp.sum(jnp.where(mask, values, jnp.zeros((), values.dtype)), axis=0, dtype=values.dtype)


def _any(mask: jax.Array) -> jax.Array:
    return jnp.max(mask.astype(I32)) > 0


def small_write_body(
    inputs,
    src_refs,
    base_ref,
    words_ref,
    chain_ref,
    log_refs,
    *,
    descs,
    n_slots,
    cw,
    num_tokens,
    tokens_block,
    reqs_block,
    tag,
    counter_row,
    hasher,
    gather,
    source_gather,
    source_unroll,
    source_tile_words,
    assert_inputs,
    ring_capacity,
    interpret,
):
    """The whole write of a small launch (see the module docstring).

    Refs: ``inputs`` the 9 write operands of :func:`pallas_kernels.write_fused.write_fused_kernel` in its order
    (num_reqs i32[1], assert flag i32[1], offsets u32[Cw + 1, 2], seeds u32[Cw, 2], then ids, pos, loc, exp_tok,
    exp_pos: flat u32[2 T] or narrow i32[T]), ``src_refs`` the sources u32[rows_s, row_words_s], ``base_ref`` the
    write index the rows are appended at (i32[1]), ``words_ref`` the canary words u32[N, S/4], ``chain_ref``
    u32[4 T] scratch (words ``4 e .. 4 e + 3``: entry ``e``'s prev_hash and run position, from the serial chains of a
    launch with a request of several tokens), ``log_refs`` the ring
    u32[R, 16], write index i32[1], slot and kernel counters u32[2 * tags] (outputs).
    Statics: ``tokens_block`` (``B``) and ``reqs_block`` (``R``) powers of 2, at least ``num_tokens`` / ``cw`` and
    at least :data:`CHUNK` (Triton tensors); the others as :func:`~pallas_kernels.write_fused.write_body`."""
    num_reqs_ref, assert_flag_ref, offsets_ref, seeds_ref, ids_ref, pos_ref, loc_ref, exp_tok_ref, exp_pos_ref = inputs
    ring_ref, wi_ref, slot_counters_ref, kernel_counters_ref = log_refs
    b, t = tokens_block, num_tokens

    # --- 1. every input at once: static masks only, so no load waits for another ---------------------------------
    num_reqs = num_reqs_ref[0]
    gate_on = assert_flag_ref[0] != 0
    base = base_ref[0]
    w = 2 * counter_row
    slot_count = U64(slot_counters_ref[w], slot_counters_ref[w + 1])
    kernel_count = U64(kernel_counters_ref[w], kernel_counters_ref[w + 1])
    req_args = (offsets_ref, seeds_ref, num_reqs)
    req_statics = dict(cw=cw, num_tokens=t, n_slots=n_slots, gather=gather)
    r = refs.iota(reqs_block)
    reqs = _requests(*req_args, r, **req_statics)
    i = refs.iota(b)
    inw = i < t
    tok, pos, loc = (refs.load_pair_flat(ref, i, inw) for ref in (ids_ref, pos_ref, loc_ref))
    if assert_inputs:
        etok, epos = (refs.load_pair_flat(ref, i, inw) for ref in (exp_tok_ref, exp_pos_ref))

    # --- requests of several entries (not a decode step): their serial chains, one request per lane, before
    # anything else (little is live yet); each written entry's prev_hash and run position go through chain_ref ---------
    multi = _any(reqs.count > 1)

    @pl.when(multi)
    def _():
        q = reqs
        rec = refs.load_words(words_ref, q.seed_slot, 0, 6, (q.count > 0) & ~q.seed_neg & q.seed_ok, gather)
        running = pairs.where(
            q.seed_neg,
            pairs.const(hashing.ANCHOR_HASH, r.shape),
            hasher.splitmix64_mix3(U64(rec[4], rec[5]), U64(rec[0], rec[1]), U64(rec[2], rec[3])),
        )
        q_gate = ~q.seed_neg & gate_on
        run_pos = pairs.where(q_gate, U64(rec[2], rec[3]), pairs.const(0, r.shape))

        def step_inputs(j):
            e, live = q.start + j, j < q.count
            return tuple(refs.load_pair_flat(ref, e, live) for ref in (loc_ref, ids_ref, pos_ref))

        def step(j, carry):
            running, run_pos = U64(*carry[0]), U64(*carry[1])
            e_loc, e_tok, e_pos = (U64(*v) for v in carry[2])
            nxt = step_inputs(j + 1)  # in flight while this step hashes
            ok = (j < q.count) & pairs.in_range(e_loc, n_slots)
            refs.store_pair_run(chain_ref, 2 * (q.start + j), [running, run_pos], jnp.stack([ok, ok], axis=1))
            running = pairs.where(ok, hasher.splitmix64_mix3(running, e_tok, e_pos), running)
            run_pos = pairs.where(ok & q_gate, e_pos, run_pos)
            return tuple(running), tuple(run_pos), tuple(tuple(v) for v in nxt)

        init = (tuple(running), tuple(run_pos), tuple(tuple(v) for v in step_inputs(jnp.int32(0))))
        jax.lax.fori_loop(0, jnp.max(q.count), step, init)
        refs.barrier(interpret)

    # --- each entry's request: [CHUNK, B] compares against every live request's range, a chunk of rows per step ----
    row = (
        reqs.start
        | ((reqs.start + reqs.count) << _STOP_SHIFT)
        | jnp.where(reqs.seed_neg, _SEED_NEG, 0)
        | jnp.where(reqs.seed_ok, _SEED_OK, 0)
    ).astype(I32)

    def member_chunk(c, acc):
        k = (c * CHUNK + refs.iota(CHUNK))[:, None]
        # the chunk's rows (one-hot maxima: a vector's chunk costs Triton fewer registers this way than loaded)
        row_k = jnp.max(jnp.where(k == r[None, :], row[None, :], -1), axis=1)[:, None]
        seed_k = jnp.max(jnp.where(k == r[None, :], reqs.seed_slot[None, :], -1), axis=1)[:, None]
        first, stop = row_k & _FIRST, (row_k >> _STOP_SHIFT) & _FIRST
        member = (first <= i[None, :]) & (i[None, :] < stop)  # one-hot columns
        return acc[0] + _sum_where(member, row_k), acc[1] + _sum_where(member, seed_k)

    zero = jnp.zeros((b,), I32)
    mine, my_seed = jax.lax.fori_loop(0, reqs_block // CHUNK, member_chunk, (zero, zero)) if cw else (zero, zero)
    seed_neg, seed_ok = (mine & _SEED_NEG) != 0, (mine & _SEED_OK) != 0
    written = (mine != 0) & pairs.in_range(loc, n_slots)
    slot = jnp.where(written, loc.lo, pairs.u32(0)).astype(I32)

    # --- last writers: [CHUNK, B] compares of the slots of written entries, a chunk of other entries per step --------
    key = jnp.where(written, slot, -1)  # the slot of a written entry, else -1

    def overwritten_by(c, acc):
        k = (c * CHUNK + refs.iota(CHUNK))[:, None]
        key_k = jnp.max(jnp.where(k == i[None, :], key[None, :], -1), axis=1)[:, None]  # key[k] (a one-hot max)
        later = (key_k >= 0) & (k > i[None, :]) & (key_k == key[None, :])
        return jnp.maximum(acc, jnp.max(later.astype(I32), axis=0))

    winner = written & (jax.lax.fori_loop(0, b // CHUNK, overwritten_by, jnp.zeros((b,), I32)) == 0)

    # --- 2. loads that depend only on (1): seed records, winners' real-KV words ---------------------------------
    seed_words = refs.load_words(words_ref, my_seed, 0, 6, written & ~multi & ~seed_neg & seed_ok, gather)
    rkv = real_kv.real_kv_hash(src_refs, descs, slot, winner, hasher, source_gather, source_unroll, source_tile_words)
    seed_tok, seed_pos, seed_prev = (U64(seed_words[k], seed_words[k + 1]) for k in (0, 2, 4))
    anchor = pairs.const(hashing.ANCHOR_HASH, (b,))
    chain0 = pairs.where(seed_neg, anchor, hasher.splitmix64_mix3(seed_prev, seed_tok, seed_pos))
    gate = ~seed_neg & gate_on
    zeros = pairs.const(0, (b,))

    # after serial chains, every written entry's prev_hash and run position are in chain_ref (the loads are masked
    # off in a decode step)
    from_chains = multi & written
    prev_hash = pairs.where(multi, refs.load_pair_flat(chain_ref, 2 * i, from_chains), chain0)
    run_pos = pairs.where(
        multi, refs.load_pair_flat(chain_ref, 2 * i + 1, from_chains), pairs.where(gate, seed_pos, zeros)
    )

    # --- checks and ring ranks -------------------------------------------------------------------------------
    want = pairs.add(run_pos, 1)
    chain_row = written & gate & pairs.ne(pos, want)
    if assert_inputs:
        in_bits = (
            jnp.where(pairs.ne(tok, etok), int(constants.FailReason.WRITE_TOKEN_MISMATCH), 0)
            | jnp.where(pairs.ne(pos, epos), int(constants.FailReason.WRITE_POSITION_MISMATCH), 0)
        ).astype(U32)
        in_row = written & (in_bits != 0)
    else:
        in_row = jnp.zeros((b,), bool)
    n_rows = in_row.astype(I32) + chain_row.astype(I32)
    at_in = base + jnp.cumsum(n_rows, axis=0, dtype=I32) - n_rows
    at_chain = at_in + in_row.astype(I32)
    total_rows = jnp.sum(n_rows, dtype=I32)
    total_written = jnp.sum(written.astype(I32), dtype=I32)

    # --- 3. stores ---------------------------------------------------------------------------------------------
    refs.barrier(interpret)  # every seed record is read before a record lands
    record = [tok, pos, prev_hash, rkv]
    _store_rows(words_ref, slot, winner, [v for f in record for v in f])
    head = [jnp.full((b,), tag, U32), jnp.zeros((b,), U32), loc.lo, loc.hi, pos.lo, pos.hi, tok.lo, tok.hi]
    if assert_inputs:
        cols = head + [etok.lo, etok.hi, prev_hash.lo, prev_hash.hi, epos.lo, epos.hi, in_bits, jnp.zeros((b,), U32)]
        _store_rows(ring_ref, at_in, in_row & (at_in >= 0) & (at_in < ring_capacity), cols)
    bits = jnp.full((b,), int(constants.FailReason.WRITE_POSITION_MISMATCH), U32)
    cols = head + [tok.lo, tok.hi, prev_hash.lo, prev_hash.hi, want.lo, want.hi, bits, jnp.zeros((b,), U32)]
    _store_rows(ring_ref, at_chain, chain_row & (at_chain >= 0) & (at_chain < ring_capacity), cols)
    wi_ref[0] = base + total_rows
    _store_count(slot_counters_ref, w, pairs.add(slot_count, U64(total_written.astype(U32), pairs.u32(0))))
    _store_count(kernel_counters_ref, w, pairs.add(kernel_count, 1))


def _store_rows(ref, row: jax.Array, mask: jax.Array, cols: list[jax.Array]) -> None:
    """``ref[row[b], :len(cols)] = cols[:][b]`` where ``mask[b]``: one ``[B, 2]`` store per pair of words
    (masked-out lanes point one past the end, :func:`pallas_kernels.refs.store_word`)."""
    row = jnp.where(mask, row, ref.shape[0])
    m2 = jnp.broadcast_to(mask[:, None], (row.shape[0], 2))
    for k in range(0, len(cols), 2):
        values = refs.from_columns(cols[k : k + 2])
        idx = jnp.broadcast_to(row[:, None], values.shape), jnp.broadcast_to(k + refs.iota(2)[None, :], values.shape)
        pltriton.store(ref.at[idx], values, mask=m2)


def _store_count(ref, word: int, value: U64) -> None:
    ref[word] = value.lo
    ref[word + 1] = value.hi
