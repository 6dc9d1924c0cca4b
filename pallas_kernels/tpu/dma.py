"""Row gathers from HBM for the TPU kernels: one manual async copy per entry and piece, double-buffered.

A TPU kernel cannot gather rows at arbitrary slots as a vector load. The pools (the canary buffer as
``uint32[N, S/4]`` words, each real-KV source as ``uint32[rows, row_words]``) therefore stay in HBM
(``memory_space=pltpu.ANY``) and each entry's rows are copied into VMEM scratch with
``pltpu.make_async_copy`` (the pattern of jax's own paged-attention TPU kernel). The copy addresses are scalars
read from SMEM (the scalar-prefetched slot rows). A block's copies all signal the semaphore of its buffer; the
waits rebuild descriptors of the same shapes.

Shapes: ``B`` entries per block; a :class:`Piece` copies ``uint32[1, width]`` words of one row of one HBM
operand into row ``j`` (the entry in its block), words ``[dst_col, dst_col + width)``, of a VMEM scratch
``uint32[2, B, W]`` (2 buffers: the block being hashed and the next one, in flight).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

I32 = jnp.int32


class Piece(NamedTuple):
    """One copy per entry.

    Fields:
      src: index of the HBM operand (in the ``hbm_refs`` list).
      dst: index of the VMEM scratch buffer (in the ``bufs`` list).
      width: words copied (static).
      dst_col: first destination word (static).
      address: ``(slot_row, prev_row) -> (row, col)``: the int32 scalars of the source row and first word, from
        the entry's canary row and predecessor row (0 where out of range or skipped). Must stay inside the
        operand for every input (a masked entry copies a harmless in-range row; the kernel masks its words).
    """

    src: int
    dst: int
    width: int
    dst_col: int
    address: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]


def _copy(piece: Piece, hbm_refs, bufs, sem_ref, buf_slot, j, row, col):
    src = hbm_refs[piece.src].at[pl.ds(row, 1), pl.ds(col, piece.width)]
    dst = bufs[piece.dst].at[buf_slot, pl.ds(j, 1), pl.ds(piece.dst_col, piece.width)]
    return pltpu.make_async_copy(src, dst, sem_ref.at[buf_slot])


def _for_entries(first, count, block: int, body, when=None) -> None:
    """``body(j, i)`` for ``j < block`` with ``i = first + j < count`` (int32 scalars) and, if given, ``when(i)``."""

    def step(j, carry):
        j = jnp.asarray(j).astype(I32)
        i = first + j
        go = i < count
        if when is not None:
            go = go & when(jnp.minimum(i, count - 1))

        @pl.when(go)
        def _():
            body(j, i)

        return carry

    jax.lax.fori_loop(jnp.int32(0), jnp.int32(block), step, jnp.int32(0))


def start_block(
    pieces: Sequence[Piece],
    hbm_refs,
    bufs,
    sem_ref,
    slot_row_ref,
    prev_row_ref,
    *,
    first,
    count,
    block,
    buf_slot,
    when: Callable[[jax.Array], jax.Array] | None = None,
) -> None:
    """Starts every piece's copy for entries ``first + j < count`` (``j < block``) into buffer ``buf_slot``.

    ``slot_row_ref`` / ``prev_row_ref``: ``int32[n]`` in SMEM (scalar prefetch), indexed by entry. ``when(i)``
    (optional, a scalar bool of the entry index, e.g. an SMEM read) skips the entries it is False for; pass the
    same ``when`` to :func:`wait_block`. Rows of skipped entries are left as they were (unspecified).
    """

    def body(j, i):
        s, p = slot_row_ref[i], prev_row_ref[i]
        for piece in pieces:
            row, col = piece.address(s, p)
            _copy(piece, hbm_refs, bufs, sem_ref, buf_slot, j, row, col).start()

    _for_entries(first, count, block, body, when)


def wait_block(pieces: Sequence[Piece], hbm_refs, bufs, sem_ref, *, first, count, block, buf_slot, when=None) -> None:
    """Waits for the copies :func:`start_block` started with the same ``first`` / ``count`` / ``buf_slot`` /
    ``when``."""

    def body(j, i):
        del i
        zero = jnp.int32(0)
        for piece in pieces:
            _copy(piece, hbm_refs, bufs, sem_ref, buf_slot, j, zero, zero).wait()

    _for_entries(first, count, block, body, when)
