"""The write's canary-record traffic on the TPU: seed records in (``canary_write_seeds_tpu``), winners' records out
(``canary_write_store_tpu``, with the real-KV fingerprint of each stored slot).

Both leave the canary buffer (``uint32[N, S/4]`` words) in HBM (``pltpu.ANY``) and move single records with manual
async copies addressed by scalar-prefetched rows (SMEM), as the TPU verify does (:mod:`pallas_kernels.tpu.dma`).

* :func:`seed_states`: per request, its seed slot's record (fields 0..2) is copied into VMEM (double-buffered over
  blocks of requests) and turned into the request's chain start (SPEC 6 steps 3-4): ``running`` = the anchor hash
  for a negative seed, else ``mix3(prev_hash, token, position)`` of the record (an all-zero record for a seed past
  the buffer); ``gate = seed >= 0 and enable_chain_position_assert``; ``run_pos`` = the seed's position where
  gated. It runs before anything is written, so every seed reads the canary as it was before the launch.
* :func:`store`: every winning entry (the last entry, request-major, writing its slot; at most one per slot) copies
  its record ``(token, position, prev_at, real_kv_hash)`` (8 words) from VMEM to its slot's first 32 bytes. The
  real-KV fingerprint is computed here, for winners only (nothing else reads it): the hashed words of each source
  are copied per winning entry into VMEM scratch ``[2, B, nw]`` and block ``b + 1``'s copies are in flight while block
  ``b`` folds and stores. Distinct slots mean distinct destinations, so the stores need no ordering and no atomics.

Launches longer than ``TpuConfig.write_prefetch_entries`` run as several calls (the SMEM bound), in order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from canary_jax.contract import constants, hashing, pairs
from canary_jax.contract.pairs import U64
from pallas_kernels.tpu import dma, real_kv

I32, U32 = jnp.int32, jnp.uint32
RECORD_WORDS = 2 * constants.CANARY_FIELDS_PER_SLOT  # token, position, prev_hash, real_kv_hash
SEED_WORDS = 8  # per request: gate, running lo/hi, run_pos lo/hi, 3 zero words


def _pair(ref, col: int = 0) -> U64:
    """Words ``col``, ``col + 1`` of a ``uint32[B, W]`` ref (or value) as ``U64[B, 1]``."""
    return U64(ref[:, col : col + 1], ref[:, col + 1 : col + 2])


def _block_of(n: int, block: int) -> int:
    return n if n <= block else block


# --- seeds ---------------------------------------------------------------------------------------------------
def _seed_kernel(
    flag_ref,  # i32[1] (SMEM, scalar prefetch): enable_chain_position_assert
    row_ref,  # i32[n] (SMEM): canary row of request r's seed (0 where negative or past the buffer)
    seed_ref,  # u32[B, 2] block of the seed slots
    words_hbm,  # u32[N, S/4] (ANY): the canary buffer, read only
    out_ref,  # u32[B, 8] (output): gate, running, run_pos
    rec_buf,  # u32[2, B, 8] (VMEM scratch): the seed records
    sem,  # DMA semaphores [2]
    *,
    n_slots: int,
    block: int,
    n: int,
):
    copies = [dma.Piece(0, 0, RECORD_WORDS, 0, lambda s, p: (s, jnp.int32(0)))]
    b = jnp.asarray(pl.program_id(0)).astype(I32)
    blocks = -(-n // block)
    slot_b = jax.lax.rem(b, jnp.int32(2))
    count = jnp.int32(n)
    go = functools.partial(dma.start_block, copies, (words_hbm,), (rec_buf,), sem, row_ref, row_ref, block=block)

    @pl.when(b == 0)
    def _():
        go(first=jnp.int32(0), count=count, buf_slot=jnp.int32(0))

    @pl.when(b + 1 < blocks)
    def _():
        go(first=(b + 1) * block, count=count, buf_slot=1 - slot_b)

    dma.wait_block(copies, (words_hbm,), (rec_buf,), sem, first=b * block, count=count, block=block, buf_slot=slot_b)

    shape = (block, 1)
    seed = _pair(seed_ref)
    neg = pairs.is_negative(seed)
    _, ok = pairs.index(seed, n_slots)
    m = ok & ~neg
    rec = rec_buf.at[slot_b]
    tok, pos, prev = (pairs.where(m, _pair(rec, 2 * f), pairs.const(0, shape)) for f in range(3))
    running = pairs.where(neg, pairs.const(hashing.ANCHOR_HASH, shape), hashing.splitmix64_mix3(prev, tok, pos))
    gate = ~neg & (flag_ref[0] != 0)
    run_pos = pairs.where(gate, pos, pairs.const(0, shape))
    cols = (jnp.where(gate, U32(1), U32(0)), running.lo, running.hi, run_pos.lo, run_pos.hi)
    out_ref[...] = jnp.zeros(out_ref.shape, U32)
    for k, v in enumerate(cols):
        out_ref[:, k : k + 1] = v


def seed_states(words, seeds, assert_flag, *, interpret, block: int, prefetch: int) -> jax.Array:
    """``uint32[Cw, 8]`` per request: word 0 the chain-position gate (0 / 1), words 1-2 the starting ``running``,
    3-4 the starting ``run_pos`` (SPEC 6 steps 3-4), from the canary as it is before the launch.

    Args:
      words: ``uint32[N, S/4]`` canary words.
      seeds: ``uint32[Cw, 2]`` the plan's seed slots (int64 pairs; negative = chain start at the anchor).
      assert_flag: ``int32[1]`` ``enable_chain_position_assert``.
    """
    cw, n_slots = int(seeds.shape[0]), int(words.shape[0])
    row, ok = pairs.index(pairs.unpack(seeds), n_slots)
    row = jnp.where(ok, row, 0)
    outs = []
    for lo in range(0, cw, prefetch):
        seg = min(prefetch, cw - lo)
        blk = _block_of(seg, block)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(-(-seg // blk),),
            in_specs=[pl.BlockSpec((blk, 2), lambda i, *_: (i, 0)), pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((blk, SEED_WORDS), lambda i, *_: (i, 0)),
            scratch_shapes=[pltpu.VMEM((2, blk, RECORD_WORDS), U32), pltpu.SemaphoreType.DMA((2,))],
        )
        outs.append(
            pl.pallas_call(
                functools.partial(_seed_kernel, n_slots=n_slots, block=blk, n=seg),
                grid_spec=grid_spec,
                out_shape=jax.ShapeDtypeStruct((seg, SEED_WORDS), U32),
                compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),  # b starts b + 1's copies
                interpret=interpret,
                name="canary_write_seeds_tpu",
            )(assert_flag.astype(I32).reshape(1), row[lo : lo + seg], seeds[lo : lo + seg], words)
        )
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=0)


# --- stores --------------------------------------------------------------------------------------------------
def _store_kernel(
    src_row_ref,  # i32[n] (SMEM, scalar prefetch): canary row of entry i for the source copies (0 unless a winner)
    dest_ref,  # i32[n] (SMEM): canary row entry i stores into, -1 where it does not win
    ids_ref,  # u32[B, 2] block of input_ids
    pos_ref,  # u32[B, 2] block of positions
    chain_ref,  # u32[B, 8] block of the chain's output rows (prev_at in words 0-1)
    meta_ref,  # u32[B, 2] block: the entry's canary row (as src_row), winner (0 / 1)
    *refs,  # src_hbm u32[rows_s, row_words_s] (ANY) per source, words_in (ANY, aliased to words_out),
    # words_out u32[N, S/4] (ANY, output), rec_buf u32[B, 8] (VMEM), src_buf u32[2, B, nw_s] per source,
    # sem DMA[2] (source copies), store_sem DMA[1]
    descs,
    block: int,
    n: int,
):
    k = len(descs)
    src_hbm = refs[:k]
    words_out = refs[k + 1]
    rec_buf = refs[k + 2]
    src_bufs = refs[k + 3 : 2 * k + 3]
    sem, store_sem = refs[-2], refs[-1]
    b = jnp.asarray(pl.program_id(0)).astype(I32)
    blocks = -(-n // block)
    slot_b = jax.lax.rem(b, jnp.int32(2))
    count = jnp.int32(n)

    shape = (block, 1)
    slot = meta_ref[:, 0:1].astype(I32)
    winner = meta_ref[:, 1:2] != 0
    if descs:
        copies = real_kv.pieces(descs, first_src=0, first_buf=0)
        wins = lambda i: dest_ref[i] >= 0  # noqa: E731  (only winners' slots are hashed: nothing else reads them)
        go = functools.partial(
            dma.start_block, copies, src_hbm, src_bufs, sem, src_row_ref, src_row_ref, block=block, when=wins
        )

        @pl.when(b == 0)
        def _():
            go(first=jnp.int32(0), count=count, buf_slot=jnp.int32(0))

        @pl.when(b + 1 < blocks)
        def _():
            go(first=(b + 1) * block, count=count, buf_slot=1 - slot_b)

        dma.wait_block(
            copies, src_hbm, src_bufs, sem, first=b * block, count=count, block=block, buf_slot=slot_b, when=wins
        )
        rkv = real_kv.fingerprint(src_bufs, descs, slot_b, slot, winner)  # rows of non-winners: masked to 0
    else:
        rkv = pairs.const(0, shape)

    fields = (_pair(ids_ref), _pair(pos_ref), _pair(chain_ref), rkv)
    for f, v in enumerate(fields):  # the record's int64 fields, lo then hi word
        rec_buf[:, 2 * f : 2 * f + 1] = v.lo
        rec_buf[:, 2 * f + 1 : 2 * f + 2] = v.hi

    def each_winner(fn):
        def body(j, carry):
            j = jnp.asarray(j).astype(I32)
            i = b * block + j
            row = dest_ref[jnp.minimum(i, n - 1)]

            @pl.when((i < n) & (row >= 0))
            def _():
                fn(j, row)

            return carry

        jax.lax.fori_loop(jnp.int32(0), jnp.int32(block), body, jnp.int32(0))

    def copy(j, row):
        src = rec_buf.at[pl.ds(j, 1), pl.ds(0, RECORD_WORDS)]
        dst = words_out.at[pl.ds(row, 1), pl.ds(0, RECORD_WORDS)]
        return pltpu.make_async_copy(src, dst, store_sem.at[0])

    each_winner(lambda j, row: copy(j, row).start())
    each_winner(lambda j, row: copy(j, row).wait())  # rec_buf is rewritten by the next block


def store(words, dest, ids, pos, chain_rows, srcs, descs, *, interpret, block: int, prefetch: int) -> jax.Array:
    """Stores every winner's record into ``words`` (``uint32[N, S/4]``, aliased: updated in place); returns it.

    Args:
      dest: ``int32[T]`` the canary row entry ``i`` stores into, -1 where it does not (not written, or a later
        entry writes the same slot).
      ids, pos: ``uint32[T, 2]`` int64 pairs.
      chain_rows: ``uint32[T, 8]`` the chain's output rows (:mod:`pallas_kernels.tpu.write_chain`).
      srcs: the real-KV sources' words (``uint32[rows, row_words]`` each, HBM), ``descs`` their descriptors.
    """
    t = int(ids.shape[0])
    win = dest >= 0
    src_row = jnp.where(win, dest, 0).astype(I32)
    meta = jnp.stack([src_row.astype(U32), win.astype(U32)], axis=1)
    nws = [real_kv.hashed_words(d) for d in descs]
    for lo in range(0, t, prefetch):
        seg = min(prefetch, t - lo)
        blk = _block_of(seg, block)
        part = slice(lo, lo + seg)
        row_map = lambda i, *_: (i, 0)  # noqa: E731
        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        grid_spec = pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(-(-seg // blk),),
            in_specs=[
                pl.BlockSpec((blk, 2), row_map),
                pl.BlockSpec((blk, 2), row_map),
                pl.BlockSpec((blk, chain_rows.shape[1]), row_map),
                pl.BlockSpec((blk, 2), row_map),
                *([any_spec] * len(srcs)),
                any_spec,
            ],
            out_specs=any_spec,
            scratch_shapes=[
                pltpu.VMEM((blk, RECORD_WORDS), U32),
                *(pltpu.VMEM((2, blk, nw), U32) for nw in nws),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.SemaphoreType.DMA((1,)),
            ],
        )
        operands = (src_row[part], dest[part], ids[part], pos[part], chain_rows[part], meta[part], *srcs, words)
        words = pl.pallas_call(
            functools.partial(_store_kernel, descs=descs, block=blk, n=seg),
            grid_spec=grid_spec,
            out_shape=jax.ShapeDtypeStruct(words.shape, U32),
            input_output_aliases={len(operands) - 1: 0},  # the canary words, updated in place
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),  # b starts b + 1's copies
            interpret=interpret,
            name="canary_write_store_tpu",
        )(*operands)
    return words
