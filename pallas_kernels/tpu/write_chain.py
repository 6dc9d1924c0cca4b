"""The write's serial chain on the TPU (``canary_write_chain_tpu``): one pass over the entries in request-major order.

Every live request owns a contiguous run of entries (the plan contract: write offsets non-decreasing over the live
requests), so the chain of every request, short or long, is one walk over the launch's entries in flat order that
restarts at each request's first entry from that request's seed state (``running``, ``run_pos``; computed by
:func:`pallas_kernels.tpu.write_records.seed_states` before anything is written). Per entry, as SGLang's loop
(SPEC 6 step 5): the running prev_hash before the entry, the chain-position check (``pos != run_pos + 1`` where the
request's gate is on), then ``running = mix3(running, tok, pos)`` and ``run_pos = pos`` for written entries only.

TPU layout: a sequential grid (``dimension_semantics=("arbitrary",)``) over blocks of ``B`` entries. The token,
position and control words arrive as ``uint32[B, 2]`` / ``uint32[B, 8]`` VMEM blocks through ``BlockSpec`` s, so
Pallas's pipeline copies block ``b + 1`` in while block ``b`` hashes: the copies overlap the chain. The chain
state crosses grid steps in a VMEM scratch ``uint32[8, 128]`` (row 0, lanes 0..3). Inside a block the chain is a
``fori_loop`` over the block's rows with ``[1, 1]`` pair values (dynamic row loads and stores); the input assert,
which does not depend on the chain, is one vector compare over the block. No 64-bit type appears.

Outputs (``uint32[T, 8]`` per entry): words 0-1 the prev_hash the entry stores (``prev_at``), 2-3 the run position
+ 1 it was checked against (``chain_exp``), 4 the flag word (:class:`ChainFlag`, with the input-assert fail bits
8 / 16 as they go into the ring), 5-7 zero. Entries outside every live request, or not written, carry flag 0.
"""

from __future__ import annotations

import enum
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from canary_jax.contract import hashing, pairs
from canary_jax.contract.constants import FailReason
from canary_jax.contract.pairs import U64

I32, U32 = jnp.int32, jnp.uint32
CTL_WORDS = 8  # control row per entry: bits, init running lo/hi, init run_pos lo/hi, 3 zero words
OUT_WORDS = 8  # output row per entry: prev_at lo/hi, chain_exp lo/hi, flags, 3 zero words


class CtlBit(enum.IntFlag):
    """Word 0 of an entry's control row (built in XLA from the plan)."""

    FIRST = 1 << 0  # first entry of a live request: the chain restarts from words 1-4 (the seed state)
    WRITTEN = 1 << 1  # in a live request and its slot in [0, num_slots): it stores, counts and advances the chain
    GATE = 1 << 2  # its request's chain-position gate (seed >= 0 and the device flag on)


class ChainFlag(enum.IntFlag):
    """Word 4 of an entry's output row."""

    WRITTEN = 1 << 0  # as CtlBit.WRITTEN
    CHAIN_POSITION = 1 << 1  # chain-position check failed: a WRITE_POSITION_MISMATCH row
    TOKEN_MISMATCH = int(FailReason.WRITE_TOKEN_MISMATCH)  # input assert (written entries only), ring bit as is
    POSITION_MISMATCH = int(FailReason.WRITE_POSITION_MISMATCH)  # likewise


INPUT_MISMATCH = ChainFlag.TOKEN_MISMATCH | ChainFlag.POSITION_MISMATCH
assert not INPUT_MISMATCH & (ChainFlag.WRITTEN | ChainFlag.CHAIN_POSITION)


def _row_pair(ref, j, col: int = 0) -> U64:
    """Row ``j`` (int32 scalar) of a ``uint32[B, W]`` ref, words ``col``, ``col + 1``, as ``U64[1, 1]``."""
    x = ref[pl.ds(j, 1), :]
    return U64(x[:, col : col + 1], x[:, col + 1 : col + 2])


def _chain_kernel(
    ids_ref,  # u32[B, 2] block of input_ids
    pos_ref,  # u32[B, 2] block of positions
    ctl_ref,  # u32[B, 8] block of control rows (CtlBit word, seed state)
    *refs,  # [exp_tok_ref u32[B, 2], exp_pos_ref u32[B, 2] if assert_inputs], out_ref u32[B, 8] (output),
    # carry_ref u32[8, 128] (VMEM scratch: running lo/hi, run_pos lo/hi in row 0, lanes 0..3)
    n: int,
    block: int,
    assert_inputs: bool,
):
    if assert_inputs:
        exp_tok_ref, exp_pos_ref, out_ref, carry_ref = refs
    else:
        out_ref, carry_ref = refs
    b = jnp.asarray(pl.program_id(0)).astype(I32)  # int64 in interpret mode with x64 on

    @pl.when(b == 0)
    def _():
        carry_ref[...] = jnp.zeros(carry_ref.shape, U32)

    out_ref[...] = jnp.zeros(out_ref.shape, U32)
    c = carry_ref[0:1, 0:4]
    state = (U64(c[:, 0:1], c[:, 1:2]), U64(c[:, 2:3], c[:, 3:4]))

    def step(j, state):
        j = jnp.asarray(j).astype(I32)
        running, run_pos = state
        in_launch = b * block + j < n  # rows of a partial last block past the launch are never entries
        ctl = ctl_ref[pl.ds(j, 1), :]
        bits = ctl[:, 0:1]
        first = in_launch & ((bits & U32(CtlBit.FIRST)) != 0)
        written = in_launch & ((bits & U32(CtlBit.WRITTEN)) != 0)
        gate = (bits & U32(CtlBit.GATE)) != 0
        running = pairs.where(first, U64(ctl[:, 1:2], ctl[:, 2:3]), running)
        run_pos = pairs.where(first, U64(ctl[:, 3:4], ctl[:, 4:5]), run_pos)
        tok, pos = _row_pair(ids_ref, j), _row_pair(pos_ref, j)
        want = pairs.add(run_pos, 1)
        chain_fail = written & gate & pairs.ne(pos, want)
        flags = jnp.where(written, U32(ChainFlag.WRITTEN), U32(0)) | jnp.where(
            chain_fail, U32(ChainFlag.CHAIN_POSITION), U32(0)
        )
        row = pl.ds(j, 1)
        out_ref[row, 0:1] = running.lo
        out_ref[row, 1:2] = running.hi
        out_ref[row, 2:3] = want.lo
        out_ref[row, 3:4] = want.hi
        out_ref[row, 4:5] = flags
        nxt = hashing.splitmix64_mix3(running, tok, pos)
        running = pairs.where(written, nxt, running)
        run_pos = pairs.where(written & gate, pos, run_pos)
        return running, run_pos

    running, run_pos = jax.lax.fori_loop(jnp.int32(0), jnp.int32(block), step, state)
    carry_ref[0:1, 0:1] = running.lo
    carry_ref[0:1, 1:2] = running.hi
    carry_ref[0:1, 2:3] = run_pos.lo
    carry_ref[0:1, 3:4] = run_pos.hi

    if assert_inputs:  # independent of the chain: one compare over the block, written entries only
        tok = U64(ids_ref[:, 0:1], ids_ref[:, 1:2])
        pos = U64(pos_ref[:, 0:1], pos_ref[:, 1:2])
        tok_fail = pairs.ne(tok, U64(exp_tok_ref[:, 0:1], exp_tok_ref[:, 1:2]))
        pos_fail = pairs.ne(pos, U64(exp_pos_ref[:, 0:1], exp_pos_ref[:, 1:2]))
        flags = out_ref[:, 4:5]
        bits = jnp.where(tok_fail, U32(ChainFlag.TOKEN_MISMATCH), U32(0)) | jnp.where(
            pos_fail, U32(ChainFlag.POSITION_MISMATCH), U32(0)
        )
        out_ref[:, 4:5] = flags | jnp.where((flags & U32(ChainFlag.WRITTEN)) != 0, bits, U32(0))


def chain(ids, pos, ctl, exp_tok, exp_pos, *, assert_inputs: bool, interpret, block: int) -> jax.Array:
    """The ``canary_write_chain_tpu`` call over all ``T`` entries: ``uint32[T, 8]`` output rows (see the module).

    Args:
      ids, pos: ``uint32[T, 2]`` int64 pairs (input_ids, positions).
      ctl: ``uint32[T, 8]`` control rows (:class:`CtlBit` word, then the entry's request's seed state).
      exp_tok, exp_pos: ``uint32[T, 2]`` expected inputs, read only when ``assert_inputs``.
      block: entries per grid step (a multiple of 8; ``T`` when shorter).
    """
    n = int(ids.shape[0])
    block = n if n <= block else block
    pair_spec = pl.BlockSpec((block, 2), lambda i: (i, 0))
    row_spec = pl.BlockSpec((block, CTL_WORDS), lambda i: (i, 0))
    args = [ids, pos, ctl] + ([exp_tok, exp_pos] if assert_inputs else [])
    specs = [pair_spec, pair_spec, row_spec] + ([pair_spec, pair_spec] if assert_inputs else [])
    return pl.pallas_call(
        functools.partial(_chain_kernel, n=n, block=block, assert_inputs=assert_inputs),
        grid=(-(-n // block),),
        in_specs=specs,
        out_specs=pl.BlockSpec((block, OUT_WORDS), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((n, OUT_WORDS), U32),
        scratch_shapes=[pltpu.VMEM((8, 128), U32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),  # the chain crosses blocks
        interpret=interpret,
        name="canary_write_chain_tpu",
    )(*args)
