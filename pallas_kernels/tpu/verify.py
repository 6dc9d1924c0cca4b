"""TPU verify: SGLang's ``canary_verify`` (SPEC 5) as a Pallas Mosaic kernel, with the reference's ring order.

Semantics: exactly :func:`canary_jax.ops.reference.verify_reference`, bit for bit, with ``jax_enable_x64`` off
and on (every int64 is a :mod:`canary_jax.contract.pairs` word pair; no 64-bit type appears in the kernel).

Structure (each piece reused from the reference where it exists):

* The live prefix: as the reference, one ``lax.switch`` branch per prefix size of
  :func:`canary_jax.ops.reference.prefix_buckets`, picked on device from ``active = min(num_valid, C)`` (0 when
  disabled), so a launch's work follows its live entries (at most ``max(64, 4 active)``), never ``C`` or the pool.
* ``canary_verify_tpu`` (:func:`_verify_kernel`, one ``pallas_call`` per branch of ``n`` entries): a sequential
  grid over blocks of ``B`` entries (``TpuConfig.verify_block``, or ``n`` when shorter). Scalar prefetch puts
  ``active`` and each entry's canary row and predecessor row (``int32[n]``, 0 where out of range) in SMEM
  (prefixes longer than ``TpuConfig.verify_prefetch_entries`` run as several calls, so SMEM stays bounded); the
  ``index_map`` s clamp every block index to the last live block, so blocks past ``active`` move no data. The
  plan's pair arrays arrive as ``uint32[B, 2]`` VMEM blocks (entries on sublanes, a multiple of 8). The canary
  buffer (``uint32[N, S/4]``) and the real-KV sources stay in HBM (``pltpu.ANY``); each entry's record, its
  predecessor's record and its hashed source words are copied into VMEM scratch (:mod:`pallas_kernels.tpu.dma`),
  double-buffered: while block ``b`` is hashed, block ``b + 1``'s copies are in flight. The kernel writes each
  entry's full violation row (``uint32[B, 16]``: 8 int64 fields as lo, hi words; fail bits 0 where it passes).
* The ring: :func:`canary_jax.contract.layout.append_violation_rows` appends the rows whose bits are nonzero,
  in ascending entry order, to the fill-once ring; :func:`canary_jax.contract.layout.bump_counters` bumps the
  counters. No atomics, the same order as every backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from canary_jax.contract import constants, hashing, layout, pairs, sources, validation
from canary_jax.contract.constants import FailReason
from canary_jax.contract.pairs import U64
from canary_jax.ops import reference
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan
from pallas_kernels.tpu import dma, real_kv
from pallas_kernels.tpu.config import DEFAULT_CONFIG, TpuConfig, interpret_params

I32, U32 = jnp.int32, jnp.uint32
RECORD_WORDS = 2 * constants.CANARY_FIELDS_PER_SLOT  # 8 words: token, position, prev_hash, real_kv_hash
ROW_WORDS = 2 * constants.VIOLATION_FIELDS  # 16 words per violation row


def _pair(ref) -> U64:
    """A ``uint32[B, 2]`` block as ``U64[B, 1]``."""
    return U64(ref[:, 0:1], ref[:, 1:2])


def _verify_kernel(
    active_ref,  # i32[1] (SMEM, scalar prefetch): min(num_valid, C), >= 1 here
    slot_row_ref,  # i32[n] (SMEM): canary row of entry i to copy (0 where out of range or skipped)
    prev_row_ref,  # i32[n] (SMEM): canary row of entry i's predecessor (0 where out of range or none)
    slot_ref,  # u32[B, 2] block of the plan's slot indices
    prev_ref,  # u32[B, 2] block of the predecessor slots
    exp_pos_ref,  # u32[B, 2] block of the expected positions
    *refs,  # [exp_tok_ref u32[B, 2] if check], words_hbm u32[N, S/4] (ANY), src_hbm u32[rows_s, row_words_s]
    # (ANY) per source, rows_ref u32[B, 16] (output), scratch: rec u32[2, B, 8], prev_rec u32[2, B, 8],
    # src_buf u32[2, B, nw_s] per source, sem DMA[2]
    descs,
    check: bool,
    n_slots: int,
    tag: int,
    block: int,
    n: int,
):
    k = 0
    exp_tok_ref = None
    if check:
        exp_tok_ref, k = refs[0], 1
    words_hbm = refs[k]
    src_hbm = refs[k + 1 : k + 1 + len(descs)]
    rows_ref = refs[k + 1 + len(descs)]
    rec_buf, prev_buf = refs[k + 2 + len(descs) : k + 4 + len(descs)]
    src_bufs = refs[k + 4 + len(descs) : k + 4 + 2 * len(descs)]
    sem = refs[-1]

    hbm_refs = (words_hbm, *src_hbm)
    bufs = (rec_buf, prev_buf, *src_bufs)
    zero = jnp.int32(0)
    copies = [
        dma.Piece(0, 0, RECORD_WORDS, 0, lambda s, p: (s, zero)),
        dma.Piece(0, 1, RECORD_WORDS, 0, lambda s, p: (p, zero)),
        *real_kv.pieces(descs, first_src=1, first_buf=2),
    ]

    b = jnp.asarray(pl.program_id(0)).astype(I32)  # int64 in interpret mode with x64 on
    active = jnp.minimum(active_ref[0], n)
    live_blocks = jax.lax.div(active + (block - 1), jnp.int32(block))
    slot_b = jax.lax.rem(b, jnp.int32(2))
    go = functools.partial(dma.start_block, copies, hbm_refs, bufs, sem, slot_row_ref, prev_row_ref, block=block)

    @pl.when(b == 0)
    def _():
        go(first=zero, count=active, buf_slot=zero)

    @pl.when(b < live_blocks)
    def _():
        @pl.when(b + 1 < live_blocks)
        def _():
            go(first=(b + 1) * block, count=active, buf_slot=1 - slot_b)

        dma.wait_block(copies, hbm_refs, bufs, sem, first=b * block, count=active, block=block, buf_slot=slot_b)
        _verify_block(
            b, active, slot_b, slot_ref, prev_ref, exp_pos_ref, exp_tok_ref, rec_buf, prev_buf, src_bufs, rows_ref,
            descs=descs, n_slots=n_slots, tag=tag, block=block,
        )  # fmt: skip


def _verify_block(
    b, active, slot_b, slot_ref, prev_ref, exp_pos_ref, exp_tok_ref, rec_buf, prev_buf, src_bufs, rows_ref, *,
    descs, n_slots, tag, block,
):  # fmt: skip
    """The fail bits and violation rows of block ``b`` once its copies have landed (SPEC 5 step 4)."""
    shape = (block, 1)
    idx = b * block + jax.lax.broadcasted_iota(I32, shape, 0)
    live = idx < active
    slot = _pair(slot_ref)
    considered = live & ~pairs.is_zero(slot)
    s, s_ok = pairs.index(slot, n_slots)
    m = considered & s_ok
    rec = rec_buf.at[slot_b]
    tok, pos, prev_h, rkv = (
        pairs.where(m, U64(rec[:, 2 * f : 2 * f + 1], rec[:, 2 * f + 1 : 2 * f + 2]), pairs.const(0, shape))
        for f in range(constants.CANARY_FIELDS_PER_SLOT)
    )

    prev = _pair(prev_ref)
    reachable = ~pairs.is_zero(prev)
    _, p_ok = pairs.index(prev, n_slots)
    pm = considered & p_ok & reachable
    prec = prev_buf.at[slot_b]
    p_tok, p_pos, p_prev = (
        pairs.where(pm, U64(prec[:, 2 * f : 2 * f + 1], prec[:, 2 * f + 1 : 2 * f + 2]), pairs.const(0, shape))
        for f in range(3)
    )
    computed = hashing.splitmix64_mix3(p_prev, p_tok, p_pos)
    exp_chain = pairs.where(pairs.is_negative(prev), pairs.const(hashing.ANCHOR_HASH, shape), computed)
    exp_chain = pairs.where(reachable, exp_chain, prev_h)
    exp_rkv = real_kv.fingerprint(src_bufs, descs, slot_b, s, m)

    bits = (
        jnp.where(reachable & pairs.ne(prev_h, exp_chain), U32(FailReason.VERIFY_CHAIN_HASH_MISMATCH), U32(0))
        | jnp.where(pairs.ne(pos, _pair(exp_pos_ref)), U32(FailReason.VERIFY_POSITION_MISMATCH), U32(0))
        | jnp.where(pairs.ne(rkv, exp_rkv), U32(FailReason.VERIFY_REAL_KV_HASH_MISMATCH), U32(0))
    )
    if exp_tok_ref is not None:
        exp_tok = _pair(exp_tok_ref)
        tok_fail = ~pairs.is_minus_one(exp_tok) & pairs.ne(tok, exp_tok)
        bits = bits | jnp.where(tok_fail, U32(FailReason.VERIFY_TOKEN_MISMATCH), U32(0))
    else:
        exp_tok = pairs.const(-1, shape)
    bits = jnp.where(considered, bits, U32(0))
    cols = [pairs.const(tag, shape), slot, pos, tok, exp_tok, prev_h, exp_chain, U64(bits, jnp.zeros(shape, U32))]
    for f, v in enumerate(cols):  # constants.VIOLATION_FIELD_* order, lo then hi word
        rows_ref[:, 2 * f : 2 * f + 1] = v.lo
        rows_ref[:, 2 * f + 1 : 2 * f + 2] = v.hi


def _rows_pallas(context, plan, active, *, lo, n, check, interpret, config):
    """The ``canary_verify_tpu`` call over the entries ``[lo, lo + n)``, of which the first ``active`` (int32
    scalar in ``[0, n]``) are live: ``uint32[n, 16]`` rows (rows past ``active`` unspecified)."""
    descs = sources.source_descriptors(context.real_kv_sources, context.real_kv_hash_mode)
    words = layout.canary_words(context.canary_buf)
    n_slots = int(words.shape[0])
    block = n if n <= config.verify_block else config.verify_block
    grid = (-(-n // block),)

    def rows_of(a):
        r, ok = pairs.index(pairs.unpack(a), n_slots)
        return jnp.where(ok, r, 0)

    part = slice(lo, lo + n)
    slot_p, prev_p = plan.verify_slot_indices[part], plan.verify_prev_slot_indices[part]
    pair_args = [slot_p, prev_p, plan.verify_expected_positions[part]]
    if check:
        pair_args.append(plan.verify_expected_tokens[part])
    srcs = [sources.source_words(s.tensor) for s in context.real_kv_sources][: len(descs)]

    def block_map(i, active_ref, *_):
        last = jnp.maximum(jax.lax.div(active_ref[0] + (block - 1), jnp.int32(block)) - 1, 0)
        return jnp.minimum(jnp.asarray(i).astype(I32), last), 0

    pair_spec = pl.BlockSpec((block, 2), block_map)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    nws = [real_kv.hashed_words(d) for d in descs]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=3,
        grid=grid,
        in_specs=[pair_spec] * len(pair_args) + [any_spec] * (1 + len(srcs)),
        out_specs=pl.BlockSpec((block, ROW_WORDS), block_map),
        scratch_shapes=[
            pltpu.VMEM((2, block, RECORD_WORDS), U32),
            pltpu.VMEM((2, block, RECORD_WORDS), U32),
            *(pltpu.VMEM((2, block, nw), U32) for nw in nws),
            pltpu.SemaphoreType.DMA((2,)),
        ],
    )
    kernel = functools.partial(
        _verify_kernel, descs=descs, check=check, n_slots=n_slots, tag=int(context.kernel_kind), block=block, n=n
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((n, ROW_WORDS), U32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),  # block b + 1's copies start in b
        interpret=interpret,
        name="canary_verify_tpu",
    )(active.reshape(1), rows_of(slot_p), rows_of(prev_p), *pair_args, words, *srcs)


def _verify_prefix(context, plan, active, *, n, check, interpret, config) -> layout.ViolationLog:
    """One ``lax.switch`` branch: entries ``[0, n)`` (``active <= n``); the log with their rows appended.

    The prefix runs in segments of ``config.verify_prefetch_entries`` entries, one ``pallas_call`` each, so the
    scalar-prefetched rows (``2 * 4`` bytes per entry of SMEM) stay bounded; a segment past ``active`` is skipped
    (``lax.cond``). Segments append in entry order, so the ring order is the reference's."""
    log = context.log
    for lo in range(0, n, config.verify_prefetch_entries):
        seg = min(config.verify_prefetch_entries, n - lo)
        seg_active = jnp.clip(active - lo, 0, seg).astype(I32)

        def run(log, lo=lo, seg=seg, seg_active=seg_active):
            rows = _rows_pallas(
                context, plan, seg_active, lo=lo, n=seg, check=check, interpret=interpret, config=config
            )
            rows = rows.reshape(seg, constants.VIOLATION_FIELDS, 2)
            record = (jnp.arange(seg, dtype=I32) < seg_active) & (rows[:, constants.VIOLATION_FIELDS - 1, 0] != 0)
            return layout.append_violation_rows(log, rows, record)

        log = jax.lax.cond(seg_active > 0, run, lambda log: log, log)
    return log


@functools.partial(jax.jit, static_argnames=("check", "interpret", "config"))
def _verify_jit(context: VerifyOrWriteContext, plan: VerifyPlan, *, check, interpret, config):
    cap = int(plan.verify_slot_indices.shape[0])
    active = jnp.where(plan.enable[0] != 0, jnp.clip(plan.verify_num_valid[0], 0, cap), 0).astype(I32)
    sizes = reference.prefix_buckets(cap)
    branches = [functools.partial(_verify_prefix, n=n, check=check, interpret=interpret, config=config) for n in sizes]
    log = jax.lax.switch(reference.bucket_index(active, sizes), branches, context, plan, active)
    log = layout.bump_counters(log, int(context.kernel_kind), active.astype(U32))
    return context.replace(log=log)


def verify_tpu(
    context: VerifyOrWriteContext,
    plan: VerifyPlan,
    *,
    check_verify_expected_token: bool = False,
    interpret=None,
    config: TpuConfig | None = None,
) -> VerifyOrWriteContext:
    """TPU backend of :func:`canary_jax.verify`; same signature and results as
    :func:`canary_jax.ops.reference.verify_reference` (and :func:`pallas_kernels.verify.verify_pallas`).

    Calling contract: as the reference (``kernel_run_counters[tag] += 1`` always; with ``enable[0] == 0``
    nothing else changes; ``slot_run_counters[tag] += min(num_valid, C)``; failing entries append rows in
    ascending entry order to the fill-once ring; out-of-range slots read as all-zero records with a zero
    fingerprint). The canary buffer and the sources are read only.

    Args:
      context: the launch context; at most 4 real-KV sources (checked before tracing).
      plan: the verify plan.
      check_verify_expected_token: static; compare stored tokens with ``verify_expected_tokens``.
      interpret: static; ``None`` = compiled where the canary buffer lives on a TPU, TPU interpret mode
        elsewhere; a bool; or a ``pltpu.InterpretParams`` (see :func:`pallas_kernels.tpu.config.interpret_params`).
      config: static :class:`~pallas_kernels.tpu.config.TpuConfig`; ``None`` = the defaults.

    Returns:
      ``context`` with the new log.

    The launch's static checks are the caller's (:func:`canary_jax.verify` runs them once, before tracing);
    this entry point re-checks only the source count, for direct callers.

    Raises:
      ValueError: more than 4 real-KV sources.
    """
    validation.check_source_count(len(context.real_kv_sources))
    config = config or DEFAULT_CONFIG
    params = interpret_params(interpret, context, config)
    return _verify_jit(context, plan, check=bool(check_verify_expected_token), interpret=params, config=config)
