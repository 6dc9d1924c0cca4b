"""A HEAD / TAIL phase in one launch, ``canary_phase``: the verify, then the write, as one kernel.

A phase is a verify of the slots the forward reads, then a write of the tokens it stores
(:meth:`canary_jax.runtime.launch_endpoint.CanaryEndpoint.launch_per_forward`, SPEC 8.2). Apart, the Pallas
backend makes it three launches at decode size: ``canary_verify``, ``canary_verify_rows`` and
``canary_write_fused``. The rows and the write each need every verify block done first, which a launch boundary
gave. Here a ticket gives it instead:

1. every program verifies its blocks (:func:`pallas_kernels.verify.verify_block`: fail bits and per-block counts,
   the persistent grid of the verify launch);
2. it takes a ticket: ``__syncthreads`` (its stores are done), then an ``atomic_add`` on the log's
   ``launch_ticket`` (acquire-release at GPU scope: what the programs before it stored is visible to it);
3. the program that draws the last ticket finishes alone: it ranks the failing blocks from the counts, a chunk
   of 1024 block counts per vector load, so a clean launch reads them in a few loads (:func:`_rows_pass`), writes
   their rows from ``write_index`` and bumps the verify's counters, then runs every pass of the write
   (:func:`pallas_kernels.write_fused.write_body`), and zeroes the ticket for the next launch.

The verify reads the canary records before the write changes any: the write runs only after every program has
drawn its ticket. Byte for byte the verify launch followed by the write launch (the references, SPEC 5 and 6).
The ticket lives in the log (:attr:`canary_jax.contract.layout.ViolationLog.launch_ticket`, zero between
launches); a log without one, a write too large for the one program, a launch without tokens or
``PallasConfig.phase_one_launch=False`` run the two launches instead. In interpret mode the programs run one
after another, so the last one finishes, and the barriers are no-ops.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import ints, layout, sources, validation
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan
from pallas_kernels import calls, refs, verify, write, write_fused
from pallas_kernels.config import PallasConfig, launch_options

ROWS_CHUNK = 1024
"""Block counts per vector load of the last program's rows pass."""


def _rows_pass(r: dict, active, *, statics: dict, block: int, counter_row: int, ring_capacity: int) -> None:
    """The verify's rows and counters, by one program: failing blocks in order, each block's rows from
    ``write_index`` plus the failing entries of the blocks before it; then ``write_index`` moves past them and
    the verify's counters are bumped (``slot += active``, ``kernel += 1``)."""
    nb = refs.cdiv(active, block)
    wi_ref = r["out_write_index"]
    base = wi_ref[0]
    lane = refs.iota(ROWS_CHUNK)

    def chunk_body(c, run):
        cnt = refs.load_vec(r["out_counts"], c * ROWS_CHUNK + lane, c * ROWS_CHUNK + lane < nb, 0)
        before = jnp.cumsum(cnt, axis=0, dtype=jnp.int32) - cnt

        def next_failing(k):
            return jnp.min(jnp.where((cnt > 0) & (lane >= k), lane, ROWS_CHUNK)).astype(jnp.int32)

        def one_block(k):
            start = base + run + jnp.sum(jnp.where(lane == k, before, 0), dtype=jnp.int32)
            verify.store_rows(
                c * ROWS_CHUNK + k,
                start,
                active,
                r["in_v_slot"],
                r["in_v_exp_tok"],
                r["in_v_prev"],
                r["in_words"],
                r["out_bits"],
                r["out_ring"],
                block=block,
                ring_capacity=ring_capacity,
                **statics,
            )
            return next_failing(k + 1)

        total = jnp.sum(cnt, dtype=jnp.int32)

        @pl.when(total > 0)
        def _():
            jax.lax.while_loop(lambda k: k < ROWS_CHUNK, one_block, next_failing(0))

        return run + total

    total = jax.lax.fori_loop(0, refs.cdiv(nb, ROWS_CHUNK), chunk_body, jnp.int32(0))
    wi_ref[0] = base + total
    refs.bump_pair_scalar(r["out_slot_counters"], 2 * counter_row, active)
    refs.bump_pair_scalar(r["out_kernel_counters"], 2 * counter_row, jnp.int32(1))


def _phase_kernel(
    *all_refs, names, programs, block, cap, verify_statics, rows_statics, write_statics, write_scratch, ring_capacity
):
    """The whole phase (see the module docstring); ``names`` the refs' names in order (``in_*`` operands,
    ``out_*`` outputs), ``write_scratch`` the names of the write's scratch outputs (one for the small body)."""
    r = dict(zip(names, all_refs, strict=True))
    descs = write_statics["descs"]
    srcs = [r[f"in_source{k}"] for k in range(len(descs))]
    interpret = write_statics["interpret"]
    active = verify._active(r["in_v_num_valid"], r["in_v_enable"], cap)

    def block_body(b):
        verify.verify_block(
            b,
            active,
            r["in_v_slot"],
            r["in_v_exp_tok"],
            r["in_v_exp_pos"],
            r["in_v_prev"],
            r["in_words"],
            srcs,
            r["out_bits"],
            r["out_counts"],
            descs=descs,
            cap=cap,
            block=block,
            **verify_statics,
        )

    refs.for_each_block(refs.cdiv(active, block), block_body)
    refs.barrier(interpret)
    ticket = pltriton.atomic_add(r["out_ticket"], (jnp.int32(0),), jnp.int32(1))

    @pl.when(ticket == programs - 1)
    def _():
        refs.barrier(interpret)
        _rows_pass(
            r,
            active,
            statics=rows_statics,
            block=block,
            counter_row=write_statics["counter_row"],
            ring_capacity=ring_capacity,
        )
        refs.barrier(interpret)
        write_inputs = ("num_reqs", "assert_flag", "offsets", "seeds", "ids", "pos", "loc", "exp_tok", "exp_pos")
        inputs = tuple(r[f"in_{k}"] for k in write_inputs)
        scratch = [r[f"out_{k}"] for k in ("words", *write_scratch, *calls.LOG_OUTPUTS)]
        write_fused.write_body(
            inputs, srcs, r["out_write_index"], scratch, ring_capacity=ring_capacity, **write_statics
        )
        r["out_ticket"][0] = jnp.int32(0)


def _phase(context, vplan, wplan, ids, pos, loc, et, ep, *, check, assert_inputs, interpret, config):
    """The one launch (traced under ``jax.jit``, statics bound): the context after verify and write."""
    pro = calls.prologue(context, config, interpret)
    flat = write.flat_operands(ids, pos, loc, et, ep, assert_inputs=assert_inputs)
    w_args, w_scratch, write_statics = write_fused.fused_operands(
        pro, wplan, flat, assert_inputs=assert_inputs, interpret=interpret, config=config
    )
    cap = int(vplan.verify_slot_indices.shape[0])
    block, num_blocks, programs = verify.verify_grid(cap, bool(pro.descs), config)
    sds = jax.ShapeDtypeStruct
    words = w_args.pop("words")
    args = dict(
        v_num_valid=vplan.verify_num_valid,
        v_enable=vplan.enable,
        v_slot=vplan.verify_slot_indices,
        v_exp_tok=vplan.verify_expected_tokens,
        v_exp_pos=vplan.verify_expected_positions,
        v_prev=vplan.verify_prev_slot_indices,
        **w_args,
        words=words,
        ticket=pro.log.launch_ticket,
    )
    w_scratch = {("w_counts" if k == "counts" else k): v for k, v in w_scratch.items()}
    scratch = dict(bits=sds((cap,), jnp.uint8), counts=sds((num_blocks,), jnp.int32), **w_scratch)
    shared = dict(n_slots=pro.n_slots, hasher=pro.hasher, gather=config.gather, check=check)
    verify_statics = dict(
        shared,
        source_gather=config.source_gather,
        source_unroll=config.source_unroll,
        source_tile_words=config.source_tile_words,
    )
    outs = ("words", "ticket")
    log_names = calls.LOG_OUTPUTS
    names = tuple(f"in_{k}" for k in (*args, *log_names)) + tuple(f"out_{k}" for k in (*outs, *scratch, *log_names))
    kernel = functools.partial(
        _phase_kernel,
        names=names,
        programs=programs,
        block=block,
        cap=cap,
        verify_statics=verify_statics,
        rows_statics=dict(shared, tag=pro.tag),
        write_statics=write_statics,
        write_scratch=tuple(w_scratch),
    )
    (words, ticket, *_), log = calls.call_with_log(
        kernel,
        args,
        pro.log,
        outs=outs,
        scratch=scratch,
        grid=(programs,),
        compiler_params=pltriton.CompilerParams(num_warps=config.phase_num_warps, num_stages=1),
        interpret=interpret,
        name="canary_phase",
    )
    log = dataclasses.replace(log, launch_ticket=ticket)
    return context.replace(canary_buf=layout.canary_bytes(words), log=log)


_phase_jit = jax.jit(_phase, static_argnames=("check", "assert_inputs", "interpret", "config"))


def takes_one_launch(context: VerifyOrWriteContext, wplan: WritePlan, num_tokens: int, config: PallasConfig) -> bool:
    """Whether :func:`phase_pallas` runs the phase as one ``canary_phase`` launch: ``config.phase_one_launch``,
    a log with a launch ticket, and a write that takes the one program
    (:func:`pallas_kernels.write.takes_fused`)."""
    has_rkv = bool(sources.source_descriptors(context.real_kv_sources, context.real_kv_hash_mode))
    return (
        config.phase_one_launch
        and context.log.launch_ticket is not None
        and write.takes_fused(num_tokens, int(wplan.write_seed_slot_indices.shape[0]), has_rkv, config)
    )


def phase_pallas(
    context: VerifyOrWriteContext,
    verify_plan: VerifyPlan,
    write_plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    *,
    check_verify_expected_token: bool = False,
    enable_write_input_assert: bool = False,
    expected_input_tokens: jax.Array | None = None,
    expected_input_positions: jax.Array | None = None,
    interpret: bool | None = None,
    config: PallasConfig | None = None,
) -> VerifyOrWriteContext:
    """Pallas backend of :func:`canary_jax.verify_then_write`: :func:`pallas_kernels.verify.verify_pallas`, then
    :func:`pallas_kernels.write.write_pallas` on its result, in one launch where :func:`takes_one_launch` says so
    (see the module docstring), else as those two calls. Same bytes either way.

    Args:
      context: the launch context; at most 4 real-KV sources (checked before tracing).
      verify_plan, write_plan: the phase's plans.
      input_ids, positions, out_cache_loc: ``uint32[T, 2]`` int64 pairs, or narrow ``int32[T]`` (each entry
        sign-extended: :func:`canary_jax.contract.ints.as_int64_field`, read as it is by the one launch); so may
        be the expected ones. ``out_cache_loc < 0`` = skip.
      check_verify_expected_token: static; the verify's token check.
      enable_write_input_assert: static; the write's input assert, with the expected tensors iff on.
      interpret, config: static, as for :func:`pallas_kernels.verify.verify_pallas`.

    Returns:
      ``context`` with the new canary buffer and log (the ticket zero again).

    Raises:
      ValueError: more than 4 real-KV sources, or expected tensors present without the assert or missing with it.
      NotImplementedError: ``config.multiplier == "asm"`` with ``interpret=True``.
    """
    interpret, config = launch_options(context, interpret, config)
    validation.check_expected_inputs(
        enable_write_input_assert,
        has_tokens=expected_input_tokens is not None,
        has_positions=expected_input_positions is not None,
    )
    check, assert_inputs = bool(check_verify_expected_token), bool(enable_write_input_assert)
    if not takes_one_launch(context, write_plan, int(input_ids.shape[0]), config):
        input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions = (
            ints.widen(a)
            for a in (input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions)
        )
        ctx = verify.verify_pallas(
            context, verify_plan, check_verify_expected_token=check, interpret=interpret, config=config
        )
        return write.write_pallas(
            ctx,
            write_plan,
            input_ids,
            positions,
            out_cache_loc,
            enable_write_input_assert=assert_inputs,
            expected_input_tokens=expected_input_tokens,
            expected_input_positions=expected_input_positions,
            interpret=interpret,
            config=config,
        )
    return _phase_jit(
        context,
        verify_plan,
        write_plan,
        input_ids,
        positions,
        out_cache_loc,
        expected_input_tokens,
        expected_input_positions,
        check=check,
        assert_inputs=assert_inputs,
        interpret=interpret,
        config=config,
    )
