"""TPU write: SGLang's ``canary_write`` (SPEC 6) as Pallas Mosaic kernels, with the reference's ring order.

Semantics: exactly :func:`canary_jax.ops.reference.write_reference`, bit for bit, with ``jax_enable_x64`` off and
on (every int64 is a :mod:`canary_jax.contract.pairs` word pair; no 64-bit type appears in a kernel), for short and
long requests alike (one kernel walks every chain). Three ``pallas_call`` s, in this order:

1. ``canary_write_seeds_tpu`` (:func:`pallas_kernels.tpu.write_records.seed_states`): each request's chain start
   from its seed record, copied from HBM before anything is written (seeds read the canary as it was).
2. ``canary_write_chain_tpu`` (:mod:`pallas_kernels.tpu.write_chain`): the serial chain over the entries in
   request-major order (restarting at each request's first entry), with the chain-position check and the input
   assert; its token blocks stream in while the chain hashes.
3. ``canary_write_store_tpu`` (:func:`pallas_kernels.tpu.write_records.store`): the winners (the last entry,
   request-major, writing each slot) fingerprint their slot's real KV and copy their records into the canary
   buffer, which is aliased in place.

XLA glue between them, all ``O(T + Cw)`` and free of atomics: the clamped offsets, each entry's owning request (a
scatter-max of request starts and a ``cummax``; the plan contract makes the owner of an entry the last request
starting at or before it), the control rows the chain reads, the winners
(:func:`canary_jax.ops.reference.last_writer_mask`, a sort), the violation rows appended in entry order (input
assert row before chain-position row) by :func:`canary_jax.contract.layout.append_violation_rows`, and the
counters (:func:`canary_jax.contract.layout.bump_counters`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from canary_jax.contract import constants, layout, pairs, sources, validation
from canary_jax.ops import reference
from canary_jax.planning.plans import VerifyOrWriteContext, WritePlan
from pallas_kernels.tpu import write_chain, write_records
from pallas_kernels.tpu.config import DEFAULT_CONFIG, TpuConfig, interpret_params
from pallas_kernels.tpu.write_chain import ChainFlag, CtlBit

I32, U32 = jnp.int32, jnp.uint32


def _control_rows(plan: WritePlan, seed_out, entry_ok, num_tokens: int):
    """``(ctl uint32[T, 8], written bool[T])``: each entry's :class:`CtlBit` word and its request's seed state."""
    cw = int(plan.write_seed_slot_indices.shape[0])
    active = jnp.clip(plan.write_num_valid_reqs[0], 0, cw)
    off = pairs.clamp(pairs.unpack(plan.write_offsets), num_tokens)
    start, end = off[:-1], off[1:]
    req = jnp.arange(cw, dtype=I32)
    has = (req < active) & (end > start)
    # owner[i] = 1 + the last request with entries that starts at or before entry i (0: none)
    owner = jnp.zeros((num_tokens,), I32).at[jnp.where(has, start, num_tokens)].max(req + 1, mode="drop")
    owner = jax.lax.cummax(owner)
    r = jnp.maximum(owner - 1, 0)
    i = jnp.arange(num_tokens, dtype=I32)
    live = (owner > 0) & (i < end[r])
    first = live & (i == start[r])
    written = live & entry_ok
    seed = seed_out[r]
    bits = (
        jnp.where(first, U32(CtlBit.FIRST), U32(0))
        | jnp.where(written, U32(CtlBit.WRITTEN), U32(0))
        | jnp.where(seed[:, 0] != 0, U32(CtlBit.GATE), U32(0))
    )
    ctl = jnp.concatenate([bits[:, None], seed[:, 1:5], jnp.zeros((num_tokens, 3), U32)], axis=1)
    return ctl, written


def _violation_rows(tag: int, out_cache_loc, input_ids, positions, exp_tok, exp_pos, chain_rows, *, assert_inputs):
    """The reference's candidate rows ``uint32[2T, 8, 2]`` (per entry: input-assert row, chain-position row) and
    which are recorded."""
    t = int(input_ids.shape[0])
    flags = chain_rows[:, 4]
    prev_at, chain_exp = chain_rows[:, 0:2], chain_rows[:, 2:4]
    zero = jnp.zeros((t,), U32)

    def rows(cols):
        tag_col = pairs.pack(pairs.const(tag, (t,)))
        return jnp.stack([tag_col, *cols], axis=1)

    in_bits = flags & U32(write_chain.INPUT_MISMATCH)
    if assert_inputs:
        in_rows = rows([out_cache_loc, positions, input_ids, exp_tok, prev_at, exp_pos, jnp.stack([in_bits, zero], -1)])
    else:
        in_rows = jnp.zeros((t, constants.VIOLATION_FIELDS, 2), U32)
    ch_bits = pairs.pack(pairs.const(int(constants.FailReason.WRITE_POSITION_MISMATCH), (t,)))
    ch_rows = rows([out_cache_loc, positions, input_ids, input_ids, prev_at, chain_exp, ch_bits])
    all_rows = jnp.stack([in_rows, ch_rows], axis=1).reshape(2 * t, constants.VIOLATION_FIELDS, 2)
    record = jnp.stack([in_bits != 0, (flags & U32(ChainFlag.CHAIN_POSITION)) != 0], axis=1).reshape(2 * t)
    return all_rows, record


@functools.partial(jax.jit, static_argnames=("assert_inputs", "interpret", "config"))
def _write_jit(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids,
    positions,
    out_cache_loc,
    exp_tok,
    exp_pos,
    *,
    assert_inputs: bool,
    interpret,
    config: TpuConfig,
) -> VerifyOrWriteContext:
    tag = int(context.kernel_kind)
    num_tokens = int(input_ids.shape[0])
    if num_tokens == 0:  # nothing to store or check: only the launch counter moves (as every backend)
        return context.replace(log=layout.bump_counters(context.log, tag, jnp.uint32(0)))
    descs = sources.source_descriptors(context.real_kv_sources, context.real_kv_hash_mode)
    srcs = [sources.source_words(s.tensor) for s in context.real_kv_sources][: len(descs)]
    words = layout.canary_words(context.canary_buf)
    n_slots = int(words.shape[0])
    if not assert_inputs:
        exp_tok, exp_pos = input_ids, positions  # never read

    # 1. Seeds, before anything is written.
    seed_out = write_records.seed_states(
        words,
        plan.write_seed_slot_indices,
        context.log.enable_chain_position_assert,
        interpret=interpret,
        block=config.write_req_block,
        prefetch=config.write_prefetch_entries,
    )
    # 2. The chain, every request in one walk.
    loc = pairs.unpack(out_cache_loc)
    entry_ok = ~pairs.is_negative(loc) & pairs.in_range(loc, n_slots)
    ctl, written = _control_rows(plan, seed_out, entry_ok, num_tokens)
    chain_rows = write_chain.chain(
        input_ids, positions, ctl, exp_tok, exp_pos, assert_inputs=assert_inputs, interpret=interpret,
        block=config.write_block,
    )  # fmt: skip

    # Rows and counters (entry order), then the winners' stores.
    rows, record = _violation_rows(
        tag, out_cache_loc, input_ids, positions, exp_tok, exp_pos, chain_rows, assert_inputs=assert_inputs
    )
    log = layout.append_violation_rows(context.log, rows, record)
    log = layout.bump_counters(log, tag, jnp.sum(written).astype(U32))
    slot, _ = pairs.index(loc, n_slots)
    dest = jnp.where(reference.last_writer_mask(slot, written, n_slots), slot, -1).astype(I32)
    # 3. The winners' records, in place.
    words = write_records.store(
        words, dest, input_ids, positions, chain_rows, srcs, descs, interpret=interpret, block=config.write_block,
        prefetch=config.write_prefetch_entries,
    )  # fmt: skip
    return context.replace(canary_buf=layout.canary_bytes(words), log=log)


def write_tpu(
    context: VerifyOrWriteContext,
    plan: WritePlan,
    input_ids: jax.Array,
    positions: jax.Array,
    out_cache_loc: jax.Array,
    *,
    enable_write_input_assert: bool = False,
    expected_input_tokens: jax.Array | None = None,
    expected_input_positions: jax.Array | None = None,
    interpret=None,
    config: TpuConfig | None = None,
) -> VerifyOrWriteContext:
    """TPU backend of :func:`canary_jax.write`; same signature and results as
    :func:`canary_jax.ops.reference.write_reference` (and :func:`pallas_kernels.write.write_pallas`).

    Calling contract: as the reference (``kernel_run_counters[tag] += 1`` always, ``slot_run_counters[tag] +=``
    entries written; rows request-major in entry order, an entry's input-assert row before its chain-position row;
    seeds read before any store; the last entry writing a slot wins; only the first 32 bytes of written slots
    change; the sources are read only). Relies on the plan contract (write offsets non-decreasing over the live
    requests), as the reference does.

    Args:
      context: the launch context; at most 4 real-KV sources (checked before tracing).
      plan: the write plan.
      input_ids, positions, out_cache_loc: ``uint32[T, 2]`` int64 pairs (negative ``out_cache_loc`` = skip).
      enable_write_input_assert: static; compare against the expected tensors.
      expected_input_tokens, expected_input_positions: ``uint32[T, 2]`` pairs iff the assert is on.
      interpret: static; ``None`` = compiled where the canary buffer lives on a TPU, TPU interpret mode
        elsewhere; a bool; or a ``pltpu.InterpretParams`` (see :func:`pallas_kernels.tpu.config.interpret_params`).
      config: static :class:`~pallas_kernels.tpu.config.TpuConfig`; ``None`` = the defaults.

    Returns:
      ``context`` with the new canary buffer and log.

    The launch's static checks are the caller's (:func:`canary_jax.write` runs them once, before tracing);
    this entry point re-checks only the source count, for direct callers.

    Raises:
      ValueError: more than 4 real-KV sources.
    """
    validation.check_source_count(len(context.real_kv_sources))
    config = config or DEFAULT_CONFIG
    params = interpret_params(interpret, context, config)
    assert_inputs = bool(enable_write_input_assert)
    return _write_jit(
        context,
        plan,
        input_ids,
        positions,
        out_cache_loc,
        expected_input_tokens if assert_inputs else None,
        expected_input_positions if assert_inputs else None,
        assert_inputs=assert_inputs,
        interpret=params,
        config=config,
    )
