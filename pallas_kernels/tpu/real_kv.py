"""The real-KV fingerprint (SPEC 2.5) on the TPU: which bytes each entry copies, and their fold.

The bits are those of :func:`canary_jax.contract.source_hash.real_kv_hash_reference` (the reference verify's
hash); the layouts are the :class:`canary_jax.contract.sources.SourceDescriptor` ones, dense (SGLang's slot run)
and chunked (``SlotChunks``: fused K/V halves, heads-major pools, layers of a stacked pool, quantised data and
their fp8 / fp4 / int4 scales as separate sources).

* :func:`pieces` says what to copy: per source, the ``effective_read_bytes / 4`` words of the slot's sequence
  as one :class:`~pallas_kernels.tpu.dma.Piece` (dense) or one per chunk the hash reaches (chunked); the
  destination is the source's VMEM scratch ``uint32[2, B, effective_read_bytes / 4]`` in sequence order.
* :func:`fingerprint` folds those words: ``acc = splitmix64(acc ^ w)`` over 8-byte words per source, then the
  sources in order (:func:`canary_jax.contract.hashing.fold_step`, ``combine_sources``). Padding words past a
  chunked sequence are zeros (static); an entry whose slot lies outside a source's ``slot_rows`` (or the canary
  buffer) hashes zero bytes there, which folds to 0, so its per-source hash is replaced by 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from canary_jax.contract import hashing, pairs
from canary_jax.contract.pairs import U64
from pallas_kernels.tpu.dma import Piece

I32 = jnp.int32
STATIC_FOLD_WORDS = 32  # sequences up to this many words fold in straight-line code; longer ones in a loop


def hashed_words(d) -> int:
    """Words of a slot's sequence the hash reads (``effective_read_bytes / 4``)."""
    return d.effective_read_bytes // 4


def _address(d, s, row_delta: int, col_delta: int):
    """``(row, word)`` of a piece at ``(row_delta, col_delta)`` from slot ``s``'s ``(row, first word)`` (int32
    scalars) in a source; ``(0, 0)`` (inside every source) when the slot's rows are not all inside it (the
    kernel masks such entries)."""
    if d.page_size == 1:
        row, col0 = s, jnp.int32(0)
    else:
        row = jax.lax.div(s, jnp.int32(d.page_size))
        col0 = jax.lax.rem(s, jnp.int32(d.page_size)) * jnp.int32(d.num_bytes_per_token // 4)
    ok = row < d.slot_rows
    return jnp.where(ok, row + row_delta, 0), jnp.where(ok, col0 + col_delta, 0)


def pieces(descs, *, first_src: int, first_buf: int) -> list[Piece]:
    """The copies of every source for one entry; source ``k`` is HBM operand ``first_src + k`` and scratch
    ``first_buf + k``."""
    out = []
    for k, d in enumerate(descs):
        nw = hashed_words(d)
        if d.dense:
            out.append(Piece(first_src + k, first_buf + k, nw, 0, lambda s, p, d=d: _address(d, s, 0, 0)))
            continue
        cw = d.chunk_bytes // 4
        for c in range(min(d.num_chunks, -(-nw // cw))):  # the chunks the hashed words reach
            dr, dc, _ = d.word_address(c * cw)
            address = lambda s, p, d=d, dr=dr, dc=dc: _address(d, s, dr, dc)  # noqa: E731
            out.append(Piece(first_src + k, first_buf + k, min(cw, nw - c * cw), c * cw, address))
    return out


def _fold(buf, d) -> U64:
    """Per-source fold of ``buf`` (a ``uint32[B, nw]`` ref view) as ``U64[B, 1]``."""
    nw = hashed_words(d)
    seq = nw if d.dense else min(nw, d.num_chunks * (d.chunk_bytes // 4))  # words past seq are zero padding
    b = buf.shape[0]
    acc = pairs.const(0, (b, 1))
    zero = jnp.zeros((b, 1), jnp.uint32)

    if nw <= STATIC_FOLD_WORDS:
        for k in range(0, nw, 2):
            lo = buf[:, k : k + 1] if k < seq else zero
            hi = buf[:, k + 1 : k + 2] if k + 1 < seq else zero
            acc = hashing.fold_step(acc, U64(lo, hi))
        return acc

    def step(k, acc):
        k = jnp.asarray(k).astype(I32)
        x = buf[:, pl.ds(2 * k, 2)]
        lo = jnp.where(2 * k < seq, x[:, 0:1], jnp.uint32(0))
        hi = jnp.where(2 * k + 1 < seq, x[:, 1:2], jnp.uint32(0))
        return hashing.fold_step(acc, U64(lo, hi))

    return jax.lax.fori_loop(jnp.int32(0), jnp.int32(nw // 2), step, acc)


def fingerprint(bufs, descs, buf_slot, slot: jax.Array, ok: jax.Array) -> U64:
    """The combined fingerprint ``U64[B, 1]`` of the entries in buffer ``buf_slot`` of the sources' scratch
    ``bufs`` (one ``uint32[2, B, nw_s]`` ref per source); 0 without sources.

    Args:
      slot: ``int32[B, 1]`` canary slot of each entry (0 where out of range).
      ok: ``bool[B, 1]`` entries whose slot is in the canary buffer and considered; others get 0.
    """
    if not descs:
        return pairs.const(0, slot.shape)
    hs = []
    for buf, d in zip(bufs, descs, strict=True):
        row = slot if d.page_size == 1 else jax.lax.div(slot, jnp.int32(d.page_size))
        inside = ok & (row < d.slot_rows)
        h = _fold(buf.at[buf_slot], d)
        hs.append(pairs.where(inside, h, pairs.const(0, slot.shape)))
    return hashing.combine_sources(hs)
