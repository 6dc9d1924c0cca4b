"""Pallas verify: SGLang's ``canary_verify`` with the reference's deterministic ring order.

Semantics: exactly :func:`canary_jax.ops.reference.verify_reference` (SPEC 5), bit for bit, with
``jax_enable_x64`` off and on (every int64 is a uint32 pair).

Two ``pallas_call`` s, no atomics:

1. ``canary_verify`` (:func:`_verify_kernel`): a persistent grid walks blocks of ``verify_block`` entries
   (``verify_source_block`` with real-KV sources) up to ``min(num_valid, C)`` (so the cost follows the live
   entries, never the capacity or the pool). Per entry it gathers the slot's record and the predecessor's
   record, recomputes the chain hash and the real-KV fingerprint, and writes one fail-bit byte
   (:class:`~canary_jax.contract.constants.FailReason` bits); per block it writes the number of failing entries.
2. ``canary_verify_rows`` (:func:`_verify_rows_kernel`): blocks with failures compute their ring base from the
   block counts (exclusive prefix), rank their failing entries with an in-block ``cumsum`` and scatter the
   8-field rows at ``write_index + rank`` (fill-once: ranks past the capacity are dropped). Program 0 adds
   the total to ``write_index`` and bumps the counters. Clean blocks cost one scalar load here.

:func:`_verify_pallas` makes both calls; the ring, write index and counters alias their outputs
(``input_output_aliases``), so callers that donate them (``canary_jax.verify`` does) update them in place.
Real-KV sources arrive as a static descriptor tuple (``canary_jax.contract.sources.SourceDescriptor``) plus up to 4
buffers viewed as ``uint32[rows, row_words]``; the more-than-4 check runs before tracing.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import hashing, pairs
from canary_jax.contract.constants import FailReason
from canary_jax.contract.pairs import U64
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan
from pallas_kernels import calls, real_kv, refs
from pallas_kernels.config import PallasConfig, launch_options


def _entry_state(idx, live, slot_ref, prev_ref, words_ref, *, n_slots, hasher, gather, with_rkv_field):
    """Loads one block of entries ``idx[B]`` and recomputes the expected chain hash (shared by both kernels)."""
    slot = refs.load_pair(slot_ref, idx, 0, live, gather)
    considered = live & ~pairs.is_zero(slot)
    s, s_ok = pairs.index(slot, n_slots)
    m = considered & s_ok
    n_words = 8 if with_rkv_field else 6
    w = refs.load_words(words_ref, s, 0, n_words, m, gather)
    tok, pos, prev_h = U64(w[0], w[1]), U64(w[2], w[3]), U64(w[4], w[5])
    rkv = U64(w[6], w[7]) if with_rkv_field else None

    prev = refs.load_pair(prev_ref, idx, 0, considered, gather)
    reachable = ~pairs.is_zero(prev)
    p, p_ok = pairs.index(prev, n_slots)
    pw = refs.load_words(words_ref, p, 0, 6, considered & p_ok & reachable, gather)
    computed = hasher.splitmix64_mix3(U64(pw[4], pw[5]), U64(pw[0], pw[1]), U64(pw[2], pw[3]))
    exp_chain = pairs.where(pairs.is_negative(prev), pairs.const(hashing.ANCHOR_HASH, idx.shape), computed)
    exp_chain = pairs.where(reachable, exp_chain, prev_h)
    return dict(
        slot=slot,
        considered=considered,
        s=s,
        m=m,
        tok=tok,
        pos=pos,
        prev_h=prev_h,
        rkv=rkv,
        reachable=reachable,
        exp_chain=exp_chain,
    )


def _active(num_valid_ref, enable_ref, cap):
    return jnp.where(enable_ref[0] != 0, jnp.clip(num_valid_ref[0], 0, cap), 0)


def verify_block(
    b,
    active,
    slot_ref,
    exp_tok_ref,
    exp_pos_ref,
    prev_ref,
    words_ref,
    src_refs,
    bits_ref,
    counts_ref,
    *,
    descs,
    check,
    n_slots,
    cap,
    block,
    hasher,
    gather,
    source_gather,
    source_unroll,
    source_tile_words,
):
    """Block ``b`` of ``block`` entries (of ``active``): one fail-bit byte per entry into ``bits_ref`` u8[C] and the
    block's number of failing entries into ``counts_ref[b]`` (the verify pass of :func:`_verify_kernel` and of
    :mod:`pallas_kernels.phase`)."""
    idx = b * block + refs.iota(block)
    live = idx < active
    e = _entry_state(
        idx, live, slot_ref, prev_ref, words_ref, n_slots=n_slots, hasher=hasher, gather=gather, with_rkv_field=True
    )
    considered = e["considered"]
    exp_pos = refs.load_pair(exp_pos_ref, idx, 0, considered, gather)
    exp_rkv = real_kv.real_kv_hash(
        src_refs, descs, e["s"], e["m"], hasher, source_gather, source_unroll, source_tile_words
    )
    bits = (
        jnp.where(e["reachable"] & pairs.ne(e["prev_h"], e["exp_chain"]), int(FailReason.VERIFY_CHAIN_HASH_MISMATCH), 0)
        | jnp.where(pairs.ne(e["pos"], exp_pos), int(FailReason.VERIFY_POSITION_MISMATCH), 0)
        | jnp.where(pairs.ne(e["rkv"], exp_rkv), int(FailReason.VERIFY_REAL_KV_HASH_MISMATCH), 0)
    ).astype(jnp.int32)
    if check:
        exp_tok = refs.load_pair(exp_tok_ref, idx, 0, considered, gather)
        tok_fail = ~pairs.is_minus_one(exp_tok) & pairs.ne(e["tok"], exp_tok)
        bits = bits | jnp.where(tok_fail, int(FailReason.VERIFY_TOKEN_MISMATCH), 0).astype(jnp.int32)
    bits = jnp.where(considered, bits, 0)
    refs.store_vec(bits_ref, idx, bits.astype(jnp.uint8), idx < cap)
    counts_ref[b] = jnp.sum((bits != 0).astype(jnp.int32), dtype=jnp.int32)


def store_rows(
    b,
    start,
    active,
    slot_ref,
    exp_tok_ref,
    prev_ref,
    words_ref,
    bits_ref,
    ring_ref,
    *,
    tag,
    check,
    n_slots,
    block,
    ring_capacity,
    hasher,
    gather,
):
    """The violation rows of block ``b``'s failing entries, ranked in entry order from ring row ``start``
    (fill-once: rows past ``ring_capacity`` are dropped). The rows pass of :func:`_verify_rows_kernel` and of
    :mod:`pallas_kernels.phase`."""
    idx = b * block + refs.iota(block)
    live = idx < active
    bits = refs.load_vec(bits_ref, idx, live, 0).astype(jnp.int32)
    flag = (bits != 0).astype(jnp.int32)
    dest = start + jnp.cumsum(flag, axis=0) - flag
    keep = (flag != 0) & (dest >= 0) & (dest < ring_capacity)
    e = _entry_state(
        idx, keep, slot_ref, prev_ref, words_ref, n_slots=n_slots, hasher=hasher, gather=gather, with_rkv_field=False
    )
    exp_tok = refs.load_pair(exp_tok_ref, idx, 0, keep, gather) if check else pairs.const(-1, idx.shape)
    zero = jnp.zeros(idx.shape, jnp.uint32)
    cols = [  # the 8 int64 fields of a violation row (constants.VIOLATION_FIELD_*), as lo, hi words
        jnp.full(idx.shape, tag, jnp.uint32),
        zero,
        e["slot"].lo,
        e["slot"].hi,
        e["pos"].lo,
        e["pos"].hi,
        e["tok"].lo,
        e["tok"].hi,
        exp_tok.lo,
        exp_tok.hi,
        e["prev_h"].lo,
        e["prev_h"].hi,
        e["exp_chain"].lo,
        e["exp_chain"].hi,
        bits.astype(jnp.uint32),
        zero,
    ]
    for k, v in enumerate(cols):
        refs.store_word(ring_ref, dest, k, v, keep)


def _verify_kernel(
    num_valid_ref,  # i32[1]
    enable_ref,  # i32[1]
    write_index_ref,  # i32[1], read only here
    slot_ref,  # u32[C, 2]
    exp_tok_ref,  # u32[C, 2], read only when check
    exp_pos_ref,  # u32[C, 2]
    prev_ref,  # u32[C, 2]
    words_ref,  # u32[N, S/4]
    *more_refs,  # u32[rows_s, row_words_s] per source; outputs bits_ref u8[C], counts_ref i32[NB], base_ref i32[1]
    descs,
    block,
    **statics,
):
    src_refs = more_refs[: len(descs)]
    bits_ref, counts_ref, base_ref = more_refs[len(descs) :]
    active = _active(num_valid_ref, enable_ref, statics["cap"])

    @pl.when(refs.program_id() == 0)
    def _():
        base_ref[0] = write_index_ref[0]

    def block_body(b):
        verify_block(
            b,
            active,
            slot_ref,
            exp_tok_ref,
            exp_pos_ref,
            prev_ref,
            words_ref,
            src_refs,
            bits_ref,
            counts_ref,
            descs=descs,
            block=block,
            **statics,
        )

    refs.for_each_block(refs.cdiv(active, block), block_body)


def _verify_rows_kernel(
    num_valid_ref,  # i32[1]
    enable_ref,  # i32[1]
    slot_ref,  # u32[C, 2]
    exp_tok_ref,  # u32[C, 2], read only when check
    prev_ref,  # u32[C, 2]
    words_ref,  # u32[N, S/4]
    bits_ref,  # u8[C]
    counts_ref,  # i32[NB]
    base_ref,  # i32[1]: write_index before this launch
    ring_in_ref,
    wi_in_ref,
    src_in_ref,
    krc_in_ref,  # aliased to the outputs below; unused
    ring_ref,  # u32[R, 16]
    wi_ref,  # i32[1]
    slot_counters_ref,  # u32[2 * tags]
    kernel_counters_ref,  # u32[2 * tags]
    *,
    tag,
    counter_row,
    check,
    n_slots,
    cap,
    block,
    ring_capacity,
    hasher,
    gather,
):
    del ring_in_ref, wi_in_ref, src_in_ref, krc_in_ref
    active = _active(num_valid_ref, enable_ref, cap)
    num_blocks = refs.cdiv(active, block)
    base = base_ref[0]

    @pl.when(refs.program_id() == 0)
    def _():
        total = refs.sum_counts(counts_ref, 0, num_blocks)
        wi_ref[0] = base + total
        refs.bump_pair_scalar(slot_counters_ref, 2 * counter_row, active)
        refs.bump_pair_scalar(kernel_counters_ref, 2 * counter_row, jnp.int32(1))

    def block_body(b):
        @pl.when(counts_ref[b] > 0)
        def _():
            start = base + refs.sum_counts(counts_ref, 0, b)
            store_rows(
                b,
                start,
                active,
                slot_ref,
                exp_tok_ref,
                prev_ref,
                words_ref,
                bits_ref,
                ring_ref,
                tag=tag,
                check=check,
                n_slots=n_slots,
                block=block,
                ring_capacity=ring_capacity,
                hasher=hasher,
                gather=gather,
            )

    refs.for_each_block(num_blocks, block_body)


def verify_grid(cap: int, has_sources: bool, config: PallasConfig) -> tuple[int, int, int]:
    """``(block, blocks, programs)`` of a verify over a plan of capacity ``cap``: entries per block (the config's
    source block with real-KV sources), blocks covering the capacity, and the persistent grid's programs."""
    block = config.verify_source_block if has_sources else config.verify_block
    num_blocks = -(-cap // block)
    return block, num_blocks, max(1, min(num_blocks, config.verify_max_programs))


def _verify_pallas(
    context: VerifyOrWriteContext, plan: VerifyPlan, *, check: bool, interpret: bool, config: PallasConfig
):
    """Both ``pallas_call`` s of a verify launch (traced under ``jax.jit``, statics bound)."""
    pro = calls.prologue(context, config, interpret)
    cap = int(plan.verify_slot_indices.shape[0])
    block, num_blocks, programs = verify_grid(cap, bool(pro.descs), config)
    grid = (programs,)
    params = pltriton.CompilerParams(num_warps=config.verify_num_warps, num_stages=1)
    sds = jax.ShapeDtypeStruct
    statics = dict(check=check, n_slots=pro.n_slots, cap=cap, block=block, hasher=pro.hasher, gather=config.gather)

    args = dict(
        num_valid=plan.verify_num_valid,
        enable=plan.enable,
        write_index=pro.log.write_index,
        slot=plan.verify_slot_indices,
        exp_tok=plan.verify_expected_tokens,
        exp_pos=plan.verify_expected_positions,
        prev=plan.verify_prev_slot_indices,
        words=pro.words,
        **{f"source{k}": s for k, s in enumerate(pro.srcs)},
    )
    out_shape = dict(bits=sds((cap,), jnp.uint8), counts=sds((num_blocks,), jnp.int32), base=sds((1,), jnp.int32))
    kernel = functools.partial(
        _verify_kernel,
        descs=pro.descs,
        source_gather=config.source_gather,
        source_unroll=config.source_unroll,
        source_tile_words=config.source_tile_words,
        **statics,
    )
    bits, counts, base = calls.call(
        kernel, args, out_shape, grid=grid, compiler_params=params, interpret=interpret, name="canary_verify"
    )

    args = dict(
        num_valid=plan.verify_num_valid,
        enable=plan.enable,
        slot=plan.verify_slot_indices,
        exp_tok=plan.verify_expected_tokens,
        prev=plan.verify_prev_slot_indices,
        words=pro.words,
        bits=bits,
        counts=counts,
        base=base,
    )
    _, new_log = calls.call_with_log(
        functools.partial(_verify_rows_kernel, tag=pro.tag, counter_row=pro.counter_row, **statics),
        args,
        pro.log,
        grid=grid,
        compiler_params=params,
        interpret=interpret,
        name="canary_verify_rows",
    )
    return context.replace(log=new_log)


_verify_jit = jax.jit(_verify_pallas, static_argnames=("check", "interpret", "config"))


def verify_pallas(
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    *,
    check_verify_expected_token: bool = False,
    interpret: bool | None = None,
    config: PallasConfig | None = None,
) -> VerifyOrWriteContext:
    """Pallas backend of :func:`canary_jax.verify`; same signature and results as
    :func:`canary_jax.ops.reference.verify_reference`.

    Calling contract: as the reference (``kernel_run_counters[tag] += 1`` always; with ``enable[0] == 0``
    nothing else changes; ``slot_run_counters[tag] += min(num_valid, C)``; failing entries append rows in
    ascending entry order to the fill-once ring). The ring, write index and counters are updated through
    ``input_output_aliases``: donate ``context.log`` (as :func:`canary_jax.verify` does) for an in-place
    update. The canary buffer and the sources are read only.

    Args:
      context: the launch context; at most 4 real-KV sources (checked before tracing).
      plan: the verify plan.
      check_verify_expected_token: static; compare stored tokens with ``verify_expected_tokens``.
      interpret: static; ``None`` = compiled where the canary buffer lives on a GPU, interpreted elsewhere
        (see :func:`pallas_kernels.config.launch_options`).
      config: static :class:`~pallas_kernels.config.PallasConfig`; ``None`` = the defaults.

    Returns:
      ``context`` with the new log.

    The launch's static checks are the caller's (:func:`canary_jax.verify` runs them once, before tracing);
    this entry point re-checks only the source count, for direct callers.

    Raises:
      ValueError: more than 4 real-KV sources.
      NotImplementedError: ``config.multiplier == "asm"`` with ``interpret=True``.
    """
    interpret, config = launch_options(context, interpret, config)
    return _verify_jit(context, plan, check=bool(check_verify_expected_token), interpret=interpret, config=config)
