"""Write in one launch, ``canary_write_fused`` (:func:`write_fused_kernel`): for small launches (a decode step),
every pass of :mod:`pallas_kernels.write` in a single program, with block barriers where the passes were launches.

The default for launches of at most ``PallasConfig.write_fused_max_tokens`` (128) tokens without real-KV sources and
``write_fused_max_hashed`` (128) with them, a decode step's writes. Bit-identical. With a source, the torch
launchers' captured decode step took 59.7 us of device time against 90.4 us on an H100
(``benchmarks/results/2026-12-05_h100_glue.md``). Without sources, inside the H200 serving step, it took 7.9 / 10.5
us of kernels against 14.3 / 15.3 us for the multi-launch write at batch 1 / 128
(``benchmarks/results/2026-12-05_h200_plan_kernel.md``). Alone and large it loses: one program serialises about ten
dependent global-memory round trips and every entry's scattered loads and stores go through one SM, 70 us against
13.5 us at 4096 one-token requests (``benchmarks/results/2026-12-04_h200_write_fused.md``). The serving-step compile
crash once seen with it on was most likely a one-request launch's one-element Triton tensors
(blocks are now at least :data:`MIN_BLOCK` wide; ``benchmarks/plan_lanes_probe.py``).

The multi-launch write needs launch boundaries for two global orders: every chain must read its seed before any
record is stored, and every winner of a slot must be known before a store overwrites the slot's claim word. One
program (one CTA) gets both orders from ``__syncthreads`` (:func:`barrier`), so a launch of at most
``PallasConfig.write_fused_max_tokens`` entries runs as one kernel with nothing before or after it (no flag
memset, no claim launch):

1. the flag words are zeroed (entries outside every live request then carry none);
2. the serial chains, one request per lane (:func:`pallas_kernels.write_chain._chain_role` with one program and
   up to 4096 lanes), and, with real-KV sources, the fingerprints (``_entry_role``);
3. the claim (:func:`_claim_pass`): every written entry stores ``entry + 1`` in its slot's claim word; after a
   barrier each reads it back, and entries that read a smaller value store again, until none does
   (:func:`pallas_kernels.write_claim.settle_claims`, also the interpreted multi-launch claim's loop). Plain stores
   that race leave one of their values, so each round raises every contested claim word and the loop ends
   with the largest writer, the reference's last-writer-wins, in as many rounds as a slot has writers (one
   round and one check without duplicates). The pass also counts violation rows and written entries per block;
4. the commit (:func:`pallas_kernels.write_commit.write_commit_kernel`, one program over every block).

Launches of at most ``PallasConfig.write_small_max_tokens`` (32 by default, at most 128) tokens over at most 128
request rows (a small decode step's) skip all of the above: :mod:`pallas_kernels.write_small` keeps the whole write
in registers (one-hot selects instead of flag words and claim words) and waits on memory three times instead of
about ten; the same bytes.

In interpret mode the program runs its statements in order over whole vectors, so the barriers are no-ops
there (Pallas's interpreter has no rule for them) and the claim's scatter keeps one of the racing values, which
the loop accepts. Bit-identical to :func:`canary_jax.ops.reference.write_reference`, as the multi-launch path.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import calls, refs, write_small
from pallas_kernels.write_chain import _chain_role, _entry_role
from pallas_kernels.write_claim import settle_claims
from pallas_kernels.write_commit import write_commit_kernel
from pallas_kernels.write_flags import CLAIM_WORD, INPUT_MISMATCH, WriteFlag, load_flagged

MAX_LANES = 4096
"""Most chain lanes (requests in flight at once) of the one program; more requests loop over lane blocks."""

MIN_BLOCK = 32
"""Fewest chain lanes and claim / commit entries per block (the multi-launch write's smallest blocks): a
one-request or one-token launch keeps Triton's tensors at least this wide."""

MAX_PREFETCH = 2
"""Most chain steps per prefetched chunk. The one program holds every pass, so its Triton compile grows with the
chunk's unrolled memory ops: offline compiles for sm_90 (triton 3.6) took 1.6 s at prefetch 1, 2.6 s at 2, 4.7 s
at 4 and 12.4 s at 8 (a decode request has one step)."""


def _claim_pass(loc_ref, words_ref, flags_ref, counts_ref, *, num_tokens, block, interpret):
    """Winners of every slot (``WriteFlag.WINNER`` added to their flags) and per-block counts.

    Refs: ``loc_ref`` u32[2 T] flat, ``words_ref`` u32[N, S/4] (claim words), ``flags_ref`` u32[T] (read and
    updated), ``counts_ref`` i32[NB, 2] (violation rows, written entries per block of ``block`` entries)."""
    size = -(-num_tokens // block) * block
    i = refs.iota(size)
    inw = i < num_tokens
    fl, written, s = load_flagged(flags_ref, loc_ref, i, inw, WriteFlag.WRITTEN)
    mine = (i + 1).astype(jnp.uint32)
    refs.store_word(words_ref, s, CLAIM_WORD, mine, written)
    refs.barrier(interpret)
    claim = settle_claims(words_ref, s, mine, written, interpret=interpret)
    refs.barrier(interpret)  # every claim word is read before the commit stores a winner's record over it
    won = written & (claim == mine)
    refs.store_vec(flags_ref, i, fl | jnp.where(won, WriteFlag.WINNER, 0).astype(jnp.uint32), inw)
    rows = ((fl & INPUT_MISMATCH) != 0).astype(jnp.int32) + ((fl & WriteFlag.CHAIN_POSITION) != 0).astype(jnp.int32)
    nb = size // block
    b = refs.iota(nb)
    counts_ref[b, 0] = jnp.sum(rows.reshape(nb, block), axis=1, dtype=jnp.int32)
    counts_ref[b, 1] = jnp.sum(written.astype(jnp.int32).reshape(nb, block), axis=1, dtype=jnp.int32)


def write_fused_kernel(
    num_reqs_ref,  # i32[1]
    assert_flag_ref,  # i32[1]: enable_chain_position_assert
    offsets_ref,  # u32[Cw + 1, 2]
    seeds_ref,  # u32[Cw, 2]
    ids_ref,
    pos_ref,
    loc_ref,  # u32[2 T]: the [T, 2] pairs, flat
    exp_tok_ref,
    exp_pos_ref,  # u32[2 T] (read only with the input assert)
    *more_refs,  # sources u32[rows_s, row_words_s]; words_in, ring_in, wi_in, slot_c_in, kernel_c_in (aliased);
    # outputs: words, flags u32[T], prev_at / chain_exp u32[2 T], counts i32[NB, 2] [, rkv u32[T, 2]], ring,
    # write index, slot counters, kernel counters
    descs,
    **statics,
):
    """The whole write of :func:`pallas_kernels.write._write_pallas` in one program (see the module docstring)."""
    inputs = (
        num_reqs_ref,
        assert_flag_ref,
        offsets_ref,
        seeds_ref,
        ids_ref,
        pos_ref,
        loc_ref,
        exp_tok_ref,
        exp_pos_ref,
    )
    src_refs = more_refs[: len(descs)]
    wi_in_ref = more_refs[len(descs) + 2]
    scratch = more_refs[len(descs) + 5 :]
    write_body(inputs, src_refs, wi_in_ref, scratch, descs=descs, **statics)


def write_body(
    inputs,
    src_refs,
    base_ref,
    scratch,
    *,
    descs,
    n_slots,
    cw,
    num_tokens,
    lanes,
    prefetch,
    entry_block,
    block,
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
    small=False,
):
    """Every pass of the write, run by one program: :func:`write_fused_kernel`'s, and the last verify program's in
    :mod:`pallas_kernels.phase`.

    Refs: ``inputs`` the 9 write operands of :func:`write_fused_kernel` in its order, ``src_refs`` the sources,
    ``base_ref`` the write index rows are appended at (i32[1]: the input, or the output a verify pass before this
    one has moved), ``scratch`` the outputs: words, flags, prev_at, chain_exp, counts [, rkv], ring, write index,
    slot counters, kernel counters; with ``small`` (:func:`pallas_kernels.write_small.small_write_body` runs
    instead, in registers) only words, chain (u32[4 T]) and the log's four."""
    if small:
        write_small.small_write_body(
            inputs,
            src_refs,
            base_ref,
            scratch[0],
            scratch[1],
            scratch[len(scratch) - 4 :],
            descs=descs,
            n_slots=n_slots,
            cw=cw,
            num_tokens=num_tokens,
            tokens_block=block,
            reqs_block=lanes,
            tag=tag,
            counter_row=counter_row,
            hasher=hasher,
            gather=gather,
            source_gather=source_gather,
            source_unroll=source_unroll,
            source_tile_words=source_tile_words,
            assert_inputs=assert_inputs,
            ring_capacity=ring_capacity,
            interpret=interpret,
        )
        return
    words_ref, flags_ref, prev_at_ref, chain_exp_ref, counts_ref, *rest = scratch
    rkv_ref = rest[0] if descs else None
    log_refs = rest[len(rest) - 4 :]
    zero = jnp.int32(0)

    i = refs.iota(-(-num_tokens // block) * block)
    refs.store_vec(flags_ref, i, jnp.zeros(i.shape, jnp.uint32), i < num_tokens)
    refs.barrier(interpret)
    _chain_role(
        inputs,
        (words_ref, flags_ref, prev_at_ref, chain_exp_ref),
        pid=zero,
        programs=1,
        n_slots=n_slots,
        cw=cw,
        num_tokens=num_tokens,
        lanes=lanes,
        prefetch=prefetch,
        hasher=hasher,
        gather=gather,
        assert_inputs=assert_inputs,
        long_threshold=None,
    )
    loc_ref = inputs[6]
    if descs:
        _entry_role(
            loc_ref,
            src_refs,
            rkv_ref,
            pid=zero,
            programs=1,
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
    refs.barrier(interpret)
    _claim_pass(loc_ref, words_ref, flags_ref, counts_ref, num_tokens=num_tokens, block=block, interpret=interpret)
    refs.barrier(interpret)
    commit_refs = (base_ref, *inputs[4:], prev_at_ref, chain_exp_ref, flags_ref, counts_ref)
    write_commit_kernel(
        *commit_refs,
        *([rkv_ref] if descs else []),
        words_ref,
        *log_refs,
        has_rkv=bool(descs),
        tag=tag,
        counter_row=counter_row,
        num_tokens=num_tokens,
        block=block,
        ring_capacity=ring_capacity,
        gather=gather,
        assert_inputs=assert_inputs,
        pid=zero,
    )


def fused_shape(cw: int, prefetch: int) -> tuple[int, int]:
    """``(lanes, prefetch)`` of the fused chain: one lane per request up to :data:`MAX_LANES` (a power of 2), and
    the config's prefetch cut to :data:`MAX_PREFETCH` and so that a chunk load stays at most ``MAX_LANES``
    entries per array."""
    lanes = min(MAX_LANES, max(MIN_BLOCK, 1 << max(0, (cw - 1).bit_length())))
    return lanes, max(1, min(prefetch, MAX_PREFETCH, MAX_LANES // lanes))


def fused_operands(pro, plan, flat: dict, *, assert_inputs: bool, interpret: bool, config) -> tuple[dict, dict, dict]:
    """``(args, scratch, statics)`` of the one-program write: its operands by name (the canary words last), its
    scratch outputs and the statics of :func:`write_body` (``ring_capacity`` aside). Arguments as
    :func:`write_fused`; shared with :mod:`pallas_kernels.phase`."""
    num_tokens = refs.entries(flat["ids"])
    cw = int(plan.write_seed_slot_indices.shape[0])
    lanes, prefetch = fused_shape(cw, config.write_prefetch)
    pow2_tokens = 1 << max(0, (num_tokens - 1).bit_length())
    block = min(MAX_LANES, max(MIN_BLOCK, pow2_tokens))
    u32, sds = jnp.uint32, jax.ShapeDtypeStruct
    args = dict(
        num_reqs=plan.write_num_valid_reqs,
        assert_flag=pro.log.enable_chain_position_assert,
        offsets=plan.write_offsets,
        seeds=plan.write_seed_slot_indices,
        **flat,
        **{f"source{k}": s for k, s in enumerate(pro.srcs)},
        words=pro.words,
    )
    small = write_small.takes_small(num_tokens, cw, config.write_small_max_tokens)
    if small:  # everything in registers but its serial chains' (prev_hash, run position) per entry
        scratch = dict(chain=sds((4 * num_tokens,), u32))
    else:
        scratch = dict(
            flags=sds((num_tokens,), u32),
            prev_at=sds((2 * num_tokens,), u32),
            chain_exp=sds((2 * num_tokens,), u32),
            counts=sds((-(-num_tokens // block), 2), jnp.int32),
        )
        if pro.descs:
            scratch["rkv"] = sds((num_tokens, 2), u32)
    statics = dict(
        descs=pro.descs,
        n_slots=pro.n_slots,
        cw=cw,
        num_tokens=num_tokens,
        lanes=lanes,
        prefetch=prefetch,
        entry_block=min(128, max(MIN_BLOCK, pow2_tokens)),
        block=block,
        tag=pro.tag,
        counter_row=pro.counter_row,
        hasher=pro.hasher,
        gather=config.gather,
        source_gather=config.source_gather,
        source_unroll=config.source_unroll,
        source_tile_words=config.write_source_tile_words,
        assert_inputs=assert_inputs,
        interpret=interpret,
        small=small,
    )
    return args, scratch, statics


def write_fused(pro, plan, flat: dict, *, assert_inputs: bool, interpret: bool, config) -> tuple:
    """The one launch: ``(words, log)`` after the write. ``pro`` is the launch's
    :class:`~pallas_kernels.calls.Prologue`, ``flat`` the flat ``uint32[2 T]`` operands ``ids``, ``pos``,
    ``loc``, ``exp_tok``, ``exp_pos`` (the expected ones standing in for themselves without the assert), and
    ``plan`` the :class:`~canary_jax.planning.plans.WritePlan`; traced under the write's ``jax.jit``."""
    args, scratch, statics = fused_operands(
        pro, plan, flat, assert_inputs=assert_inputs, interpret=interpret, config=config
    )
    (words, *_), log = calls.call_with_log(
        functools.partial(write_fused_kernel, **statics),
        args,
        pro.log,
        outs=("words",),
        scratch=scratch,
        grid=(1,),
        compiler_params=pltriton.CompilerParams(num_warps=config.write_fused_num_warps, num_stages=1),
        interpret=interpret,
        name="canary_write_fused",
    )
    return words, log
