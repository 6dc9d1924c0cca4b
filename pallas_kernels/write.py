"""Pallas write: SGLang's ``canary_write`` with a deterministic ring order and last-writer-wins stores.

Semantics: exactly :func:`canary_jax.ops.reference.write_reference` (SPEC 6), bit for bit, with
``jax_enable_x64`` off and on. :func:`write_pallas` is the public entry point, :func:`_write_pallas` makes the
launches below; each kernel body lives in a module of its own. Four ``pallas_call`` s (five when the launch shape
admits long requests, see 1b) and one XLA memset (the flag words); between them only views of the operands
(reshapes, bitcasts). Only the chain is serial:

1. ``canary_write_chain`` (:mod:`pallas_kernels.write_chain`): the serial chains, one request per lane, and,
   in the same launch, the real-KV fingerprint of every entry (entry programs, only with real-KV sources).
1b. ``canary_write_long`` (:mod:`pallas_kernels.write_long`), only when the launch has more tokens than
   ``write_long_threshold`` and at least twice as many tokens as request rows (prefill and mixed batches):
   one long request per program, the whole program on its chain, a checkpoint per chunk.
2. ``canary_write_claim`` (:mod:`pallas_kernels.write_claim`): ``claim word[slot] = max(., entry + 1)`` over
   written entries (a vector atomic max compiled, a retry loop interpreted), so that the last entry
   (request-major order) writing a slot wins, as in the reference.
3. ``canary_write_won`` (:mod:`pallas_kernels.write_won`): each written entry learns whether it won its slot;
   long-request entries replay the chain from their chunk's checkpoint; per block, the number of violation
   rows and of written entries.
4. ``canary_write_store`` (:mod:`pallas_kernels.write_commit`): winners store their records, violation rows go
   to ``write_index + exclusive prefix``, program 0 bumps ``write_index`` and the counters.

Entries talk across launches through a flag word each (:mod:`pallas_kernels.write_flags`). The canary buffer,
ring, write index and counters alias their outputs (``input_output_aliases``); the public
:func:`canary_jax.write` donates them, so a launch costs time in the number of entries, not the pool size.
The flag words start zeroed (the memset), so entries outside every live request, wherever the clamped offsets
put them, are never stored or reported.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import layout, validation
from canary_jax.ops import chain_hints
from canary_jax.ops.chain_hints import ChainHint
from canary_jax.planning.plans import VerifyOrWriteContext, WritePlan
from pallas_kernels import calls
from pallas_kernels.config import PallasConfig, launch_options
from pallas_kernels.write_chain import write_chain_kernel
from pallas_kernels.write_claim import claim_slots
from pallas_kernels.write_commit import write_commit_kernel
from pallas_kernels.write_fused import write_fused
from pallas_kernels.write_long import write_long_kernel
from pallas_kernels.write_won import write_won_kernel


def flat_operands(ids, pos, loc, exp_tok, exp_pos, *, assert_inputs: bool) -> dict:
    """The write's token operands as flat ``uint32[2 T]`` words by kernel name; without the input assert the
    actual tokens and positions stand in for the expected ones (never read)."""
    if not assert_inputs:
        exp_tok, exp_pos = ids, pos
    named = dict(ids=ids, pos=pos, loc=loc, exp_tok=exp_tok, exp_pos=exp_pos)
    return {k: v.reshape(-1) for k, v in named.items()}


def takes_fused(num_tokens: int, cw: int, has_rkv: bool, config: PallasConfig) -> bool:
    """Whether a write of ``num_tokens`` tokens over a plan of ``cw`` request rows (with real-KV sources iff
    ``has_rkv``) runs as the one program of :mod:`pallas_kernels.write_fused`: at least one and at most
    ``write_fused_max_tokens`` (``write_fused_max_hashed``) tokens, and no long-request role (see
    :func:`_write_pallas`)."""
    long_on = num_tokens > config.write_long_threshold and num_tokens >= 2 * cw
    bound = config.write_fused_max_hashed if has_rkv else config.write_fused_max_tokens
    return 0 < num_tokens <= bound and not long_on


def _write_pallas(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids,
    positions,
    out_cache_loc,
    expected_input_tokens,
    expected_input_positions,
    chain_hint: ChainHint | None = None,
    *,
    assert_inputs: bool,
    interpret: bool,
    config: PallasConfig,
    emit_chain: bool = False,
):
    """Every launch of a write (traced under ``jax.jit``, statics bound); arguments as :func:`write_pallas`, and
    a step's chain reuse (:mod:`canary_jax.ops.chain_hints`): ``chain_hint`` (one that fits this launch) to
    reuse, ``emit_chain`` to make one. Returns ``(context, the hint made or None)``."""
    num_tokens = int(input_ids.shape[0])
    if num_tokens == 0:  # nothing to store or check: only the launch counter moves
        log = layout.bump_counters(context.log, calls.counter_row(context), jnp.uint32(0))
        return context.replace(log=log), None
    pro = calls.prologue(context, config, interpret)
    descs, log, words, n_slots, hasher = pro.descs, pro.log, pro.words, pro.n_slots, pro.hasher
    cw = int(plan.write_seed_slot_indices.shape[0])
    gather = config.gather
    if not assert_inputs:
        expected_input_tokens, expected_input_positions = input_ids, positions  # never read
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
    entry_programs = (
        max(1, min(-(-num_tokens // config.write_entry_block), config.write_max_programs)) if has_rkv else 0
    )
    flat = flat_operands(
        input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions, assert_inputs=True
    )
    if takes_fused(num_tokens, cw, has_rkv, config):
        # A small launch (a decode step): every pass in one program, one kernel (pallas_kernels.write_fused).
        words, new_log = write_fused(pro, plan, flat, assert_inputs=assert_inputs, interpret=interpret, config=config)
        return context.replace(canary_buf=layout.canary_bytes(words), log=new_log), None
    # A step's chain reuse (canary_jax.ops.chain_hints) pays only for long requests' chains: only a launch with the
    # long role makes or takes a hint (a decode launch's one-step chains cost less than carrying one).
    reuse = "none"
    if long_programs:
        reuse = "consume" if chain_hint is not None else "emit" if emit_chain else "none"
    chain_params = pltriton.CompilerParams(num_warps=config.write_num_warps, num_stages=1)
    # the launches over entry blocks (claim, won, store)
    per_block = dict(grid=grid_entries, compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=1))
    # statics of both chain kernels (lanes and long requests)
    chains = dict(
        n_slots=n_slots, cw=cw, num_tokens=num_tokens, hasher=hasher, gather=gather, assert_inputs=assert_inputs
    )

    # 1. Chains and, in the same launch, the entry-parallel work (claims zeroed, real-KV fingerprints).
    args = dict(
        num_reqs=plan.write_num_valid_reqs,
        assert_flag=log.enable_chain_position_assert,
        write_index=log.write_index,
        offsets=plan.write_offsets,
        seeds=plan.write_seed_slot_indices,
        **flat,
        **{f"source{k}": s for k, s in enumerate(pro.srcs)},
        words=words,
        flags=jnp.zeros((num_tokens,), u32) if reuse != "consume" else chain_hint.flags,
    )
    if reuse == "consume":  # the outputs start from the hint's chains (long requests that match keep them)
        args.update(prev_at=chain_hint.prev_at, chain_exp=chain_hint.chain_exp)
    out_shape = dict(
        words=sds(words.shape, u32),
        flags=sds((num_tokens,), u32),
        prev_at=sds((2 * num_tokens,), u32),
        chain_exp=sds((2 * num_tokens,), u32),
        base=sds((1,), i32),
    )
    if has_rkv:
        out_shape["rkv"] = sds((num_tokens, 2), u32)
    if reuse == "emit":
        out_shape["req_state"] = sds((cw, 5), u32)
    words, flags, prev_at, chain_exp, base, *extra = calls.call(
        functools.partial(
            write_chain_kernel,
            descs=descs,
            chain_programs=chain_programs,
            entry_programs=entry_programs,
            long_threshold=long_threshold if long_programs else None,
            lanes=config.write_lanes,
            prefetch=config.write_prefetch,
            entry_block=config.write_entry_block,
            source_gather=config.source_gather,
            source_unroll=config.source_unroll,
            source_tile_words=config.write_source_tile_words,
            reuse=reuse,
            **chains,
        ),
        args,
        out_shape,
        grid=(chain_programs + entry_programs,),
        compiler_params=chain_params,
        interpret=interpret,
        name="canary_write_chain",
    )

    if long_programs:
        # 1b. Long requests: one chain per program (after the lane chains; seeds read fields 0..2, which no
        # chain kernel writes). The flat operands as they are: the look-ahead loads read 0 past their end.
        k = config.write_long_chunk
        args = dict(
            num_reqs=plan.write_num_valid_reqs,
            assert_flag=log.enable_chain_position_assert,
            offsets=plan.write_offsets,
            seeds=plan.write_seed_slot_indices,
            **flat,
            words=words,
            flags=flags,
            prev_at=prev_at,
            chain_exp=chain_exp,
        )
        if reuse == "consume":
            args["hint_state"] = chain_hint.req_state
        words, flags, prev_at, chain_exp = calls.call(
            functools.partial(
                # rows=1: the chain state as [1] vectors (what ran on the H200; Triton still hands the
                # chunk's words to every thread)
                write_long_kernel,
                rows=1,
                chunk=k,
                threshold=long_threshold,
                scan_block=long_scan_block,
                consume=reuse == "consume",
                interpret=interpret,
                **chains,
            ),
            args,
            ("words", "flags", "prev_at", "chain_exp"),
            grid=(long_programs,),
            compiler_params=chain_params,
            interpret=interpret,
            name="canary_write_long",
        )

    hint = None
    if reuse == "emit":
        hint = ChainHint(flags, prev_at, chain_exp, extra[-1], n_slots=n_slots, assert_inputs=assert_inputs)
    prev_at, chain_exp = prev_at.reshape(num_tokens, 2), chain_exp.reshape(num_tokens, 2)

    # 2. claim[slot] = max(claim, entry + 1) over written entries: the last writer of a slot owns it.
    words = claim_slots(
        words, out_cache_loc, flags, num_tokens=num_tokens, block=block, interpret=interpret, **per_block
    )

    # 3. Winners and per-block counts.
    args = dict(
        loc=out_cache_loc, ids=input_ids, pos=positions, words=words, flags=flags, prev_at=prev_at, chain_exp=chain_exp
    )
    out_shape = dict(
        flags=sds(flags.shape, u32),
        counts=sds((num_blocks, 2), i32),
        prev_at=sds(prev_at.shape, u32),
        chain_exp=sds(chain_exp.shape, u32),
    )
    flags, counts, prev_at, chain_exp = calls.call(
        functools.partial(
            write_won_kernel,
            num_tokens=num_tokens,
            block=block,
            gather=gather,
            hasher=hasher,
            has_long=bool(long_programs),
        ),
        args,
        out_shape,
        **per_block,
        interpret=interpret,
        name="canary_write_won",
    )

    # 4. Stores, violation rows, write index and counters.
    args = dict(
        base=base,
        ids=input_ids,
        pos=positions,
        loc=out_cache_loc,
        exp_tok=expected_input_tokens,
        exp_pos=expected_input_positions,
        prev_at=prev_at,
        chain_exp=chain_exp,
        flags=flags,
        counts=counts,
    )
    if has_rkv:
        args["rkv"] = extra[0]
    args["words"] = words
    (words,), new_log = calls.call_with_log(
        functools.partial(
            write_commit_kernel,
            has_rkv=has_rkv,
            tag=pro.tag,
            counter_row=pro.counter_row,
            num_tokens=num_tokens,
            block=block,
            gather=gather,
            assert_inputs=assert_inputs,
        ),
        args,
        log,
        outs=("words",),
        **per_block,
        interpret=interpret,
        name="canary_write_store",
    )
    return context.replace(canary_buf=layout.canary_bytes(words), log=new_log), hint


_write_jit = jax.jit(_write_pallas, static_argnames=("assert_inputs", "interpret", "config", "emit_chain"))


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
    :func:`canary_jax.ops.reference.write_reference`.

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
      interpret: static; ``None`` = compiled where the canary buffer lives on a GPU, interpreted elsewhere
        (see :func:`pallas_kernels.config.launch_options`).
      config: static :class:`~pallas_kernels.config.PallasConfig`; ``None`` = the defaults.

    Returns:
      ``context`` with the new canary buffer and log.

    The launch's static checks are the caller's (:func:`canary_jax.write` runs them once, before tracing);
    this entry point re-checks only the source count and the expected-input rule, for direct callers.

    Raises:
      ValueError: more than 4 real-KV sources, or expected tensors present without the assert or missing with it.
      NotImplementedError: ``config.multiplier == "asm"`` with ``interpret=True``.
    """
    interpret, config = launch_options(context, interpret, config)
    # The expected-input rule, for direct callers (canary_jax.write checked the whole launch).
    validation.check_expected_inputs(
        enable_write_input_assert,
        has_tokens=expected_input_tokens is not None,
        has_positions=expected_input_positions is not None,
    )
    # A step's chain reuse (canary_jax.ops.chain_hints): take the scope's hint if it fits, else leave ours.
    scope = chain_hints.current()
    hint = None if scope is None else scope.hint
    assert_inputs = bool(enable_write_input_assert)
    if hint is not None and not hint.fits(
        num_tokens=int(input_ids.shape[0]),
        cw=int(plan.write_seed_slot_indices.shape[0]),
        n_slots=int(context.canary_buf.shape[0]),
        assert_inputs=assert_inputs,
    ):
        hint = None
    out, made = _write_jit(
        context,
        plan,
        input_ids,
        positions,
        out_cache_loc,
        expected_input_tokens,
        expected_input_positions,
        hint,
        assert_inputs=assert_inputs,
        interpret=interpret,
        config=config,
        emit_chain=scope is not None and scope.hint is None,
    )
    if made is not None:
        scope.hint = made
    return out
