"""In-kernel real-KV fingerprint (SPEC 2.5): the bytes of each entry's slot in every source, folded and combined.

:func:`real_kv_hash` is the kernel counterpart of :func:`canary_jax.contract.sources.real_kv_hash_reference` (same
bits); the verify kernel and the write kernel's entry programs call it. One loop covers every source at once and keeps
the next iteration's loads in flight; ``source_gather`` (see :class:`~pallas_kernels.config.PallasConfig`)
picks how the bytes are loaded: 2-D row tiles (``tile``, ``tile_contiguous``) or per-lane pieces of 4, 8 or 16
bytes (``word``, ``pair``, ``quad``). ``pallas_kernels/README.md`` explains the choice;
``benchmarks/results/2026-11-30_h200_pallas.md`` has the figures.

Chunked sources (``canary_jax.contract.sources.SlotChunks``, canary-jax's extension): word ``k`` of a slot's sequence
lives in chunk ``c = k // chunk_words`` at ``(row + offset_rows + c * stride_rows, first word + (offset_cols +
c * stride_cols) / 4 + k % chunk_words)``; words past ``num_chunks`` chunks are zero padding. A dense (SGLang)
descriptor takes exactly the code it always took; a chunked one computes each word's address with int32
division by the static ``chunk_words`` and loads it with the same masked gathers (explicit ``other``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import pairs
from canary_jax.contract.pairs import U64
from pallas_kernels import refs
from pallas_kernels.hashing import PairHash

I32 = jnp.int32


def real_kv_hash(
    src_refs,
    descs,
    slot: jax.Array,
    mask: jax.Array,
    hasher: PairHash,
    mode: str,
    unroll: int = 2,
    tile_words: int = 16,
) -> U64:
    """Combined real-KV fingerprint of int32 ``slot[B]`` (SPEC 2.5); 0 with no descriptors.

    Args:
      src_refs: one ``uint32[rows_s, row_words_s]`` ref per source.
      descs: static ``canary_jax.contract.sources.SourceDescriptor`` per source (page size, bytes per token, bytes
      read). slot, mask: int32 ``[B]`` slots and which lanes to hash (masked lanes read no memory and fold zeros).
      hasher: the splitmix64 multiplier.
      mode: ``tile`` / ``tile_contiguous`` (2-D row tiles, see :func:`_hash_tiles`) or ``word`` / ``pair`` /
        ``quad`` (16-byte chunks per lane, gathered as 4, 2 or 1 loads).
      unroll: ``>= 1``: one loop over chunks (tiles) serves every source at once: iteration ``k`` folds pieces
        ``k * unroll ..`` of each source (independent chains, so their hashing overlaps) while the loads of the
        next iteration are already in flight (carried in the loop state). ``0``: fully unrolled straight-line
        code, whose compile time grows steeply with the bytes hashed.
      tile_words: uint32 words per tile row in the tile modes.

    Returns:
      ``U64[B]``. Rows outside a source read as zero bytes (as the reference).
    """
    shape = slot.shape
    if not descs:
        return pairs.const(0, shape)
    geo = []
    for ref, d in zip(src_refs, descs, strict=True):
        if d.page_size == 1:
            row, col0 = slot, jnp.zeros(shape, I32)
        else:
            row = jax.lax.div(slot, jnp.asarray(d.page_size, I32))
            col0 = jax.lax.rem(slot, jnp.asarray(d.page_size, I32)) * (d.num_bytes_per_token // 4)
        geo.append((ref, row, col0, mask & (row < d.slot_rows), d.effective_read_bytes // 16))
    if mode in ("tile", "tile_contiguous"):
        return _hash_tiles(geo, descs, shape, hasher, unroll, tile_words, mode == "tile_contiguous")

    def load_chunk(si, c):  # 16-byte piece c of source si: 4 words
        ref, row, col0, ok, n = geo[si]
        d = descs[si]
        if d.dense:
            return tuple(refs.load_words(ref, row, col0 + 4 * c, 4, ok & (c < n), mode))
        if (d.chunk_bytes // 4) % 4 == 0:  # the piece lies inside one chunk: one 4-word run
            dr, dc, in_seq = word_address(d, 4 * c)
            return tuple(refs.load_words(ref, row + dr, col0 + dc, 4, ok & (c < n) & in_seq, mode))
        out = []
        for u in range(4):  # pieces may straddle chunks: word by word
            dr, dc, in_seq = word_address(d, 4 * c + u)
            out.append(refs.load_word(ref, row + dr, col0 + dc, ok & (c < n) & in_seq))
        return tuple(out)

    def fold_chunk(h, si, w, c, full):
        folded = hasher.fold_step(hasher.fold_step(h, U64(w[0], w[1])), U64(w[2], w[3]))
        return folded if full else pairs.where(c < geo[si][4], folded, h)

    return _pipelined_fold(shape, [g[4] for g in geo], load_chunk, fold_chunk, hasher, unroll)


def word_address(d, k):
    """``(row_delta, col_word_delta, in_sequence)`` of word ``k`` of a chunked source's slot sequence
    (``k``: static int, int32 scalar or int32 vector); see the module docstring. Static ``k`` gives Python
    ints (``canary_jax.contract.sources.SourceDescriptor.word_address``)."""
    if isinstance(k, int):
        return d.word_address(k)
    k = jnp.asarray(k).astype(I32)  # a loop index is int64 with x64 on
    cw = d.chunk_bytes // 4
    c = jax.lax.div(k, jnp.asarray(cw, I32)) if cw > 1 else k
    w = k - c * cw
    in_seq = c < d.num_chunks
    row_delta = d.offset_rows + c * d.chunk_stride_rows
    col_delta = d.offset_cols // 4 + c * (d.chunk_stride_cols // 4) + w
    return jnp.where(in_seq, row_delta, 0), jnp.where(in_seq, col_delta, 0), in_seq


def _pipelined_fold(shape, pieces, load_piece, fold_piece, hasher: PairHash, unroll: int) -> U64:
    """``acc = fold over sources s of splitmix64(acc ^ h_s)`` where ``h_s`` folds the ``pieces[s]`` pieces of
    source ``s`` in order: ``h = fold_piece(h, s, load_piece(s, p), p, full)``.

    ``unroll == 0``: straight-line code (static ``p``; ``full`` is True). ``unroll >= 1``: one loop serves
    every source at once: iteration ``k`` folds pieces ``k * unroll ..`` of each source (independent chains,
    so their hashing overlaps) while the next iteration's pieces are already loading (carried in the loop
    state); ``full`` says whether every iteration's pieces of that source exist (else ``fold_piece`` masks
    with the dynamic ``p``)."""
    if unroll == 0:
        hs = []
        for si, n in enumerate(pieces):
            xs = [load_piece(si, p) for p in range(n)]
            h = pairs.const(0, shape)
            for p, x in enumerate(xs):
                h = fold_piece(h, si, x, p, True)
            hs.append(h)
    else:
        total = max(pieces)
        unroll = max(1, min(unroll, total))
        steps = -(-total // unroll)

        def load(k):
            return tuple(tuple(load_piece(si, k * unroll + u) for u in range(unroll)) for si in range(len(pieces)))

        def body(k, carry):
            hs, cur = carry
            nxt = load(k + 1)  # issued before this iteration's folds, so they overlap
            new = []
            for si, n in enumerate(pieces):
                h = hs[si]
                for u in range(unroll):
                    h = fold_piece(h, si, cur[si][u], k * unroll + u, n == steps * unroll)
                new.append(h)
            return tuple(new), nxt

        init = (tuple(pairs.const(0, shape) for _ in pieces), load(jnp.int32(0)))
        hs, _ = jax.lax.fori_loop(0, steps, body, init)
    acc = pairs.const(0, shape)
    for h in hs:
        acc = hasher.fold_step(acc, h)
    return acc


def _hash_tiles(geo, descs, shape, hasher: PairHash, unroll: int, tile_words: int, contiguous: bool = False) -> U64:
    """Real-KV fingerprint from 2-D tile loads: ``[B, tile]`` words of every entry's row per load, then the
    fold walks the columns in order. A source's tile is ``tile_words`` wide, or narrower when it hashes fewer
    words (PARTIAL: 4). On Triton (offline PTX, sm_90) each thread holds its own row and loads it 4 bytes at a
    time, so an iteration has ``tile`` independent loads in flight per entry and source.

    ``unroll == 0``: straight-line code over all tiles of all sources; ``unroll >= 1``: a loop whose iteration
    folds ``unroll`` tiles of every source while the next iteration's tiles are already loading.

    ``contiguous``: leave the column indices unmasked so Triton can prove them contiguous. Offline (triton
    3.6, sm_90) that turns the 4-byte loads into 16-byte loads plus a shared-memory layout hand-over
    (``source_gather="tile_contiguous"``; dense sources only: a chunked source's words are addressed one by
    one, see :func:`word_address`)."""
    srcs = []
    for (ref, row, col0, ok, n), d in zip(geo, descs, strict=True):
        n_words = 4 * n  # words to hash
        tw = min(tile_words, 1 << (n_words - 1).bit_length())
        srcs.append((ref, row, col0, ok, n_words, tw, -(-n_words // tw), d))

    def load_tile(src, t):
        ref, row, col0, ok, n_words, tw, _, d = src
        c = t * tw + refs.iota(tw)
        m = ok[:, None] & (c < n_words)[None, :]
        if not d.dense:  # per-word chunk addresses; padding words past the chunks load nothing (other 0)
            dr, dc, in_seq = word_address(d, c)
            m = m & in_seq[None, :]
            rows = jnp.where(m, row[:, None] + dr[None, :], 0)
            cols = jnp.where(m, col0[:, None] + dc[None, :], 0)
            return pltriton.load(ref.at[rows, cols], mask=m, other=0)
        if contiguous:  # indices Triton can prove contiguous along a row: 16-byte loads, then a shared-memory
            rows = jnp.where(ok, row, 0)[:, None]  # hand-over (masked lanes load nothing on Triton and clamp
            cols = col0[:, None] + c[None, :]  # in interpret mode)
        else:
            rows = jnp.where(m, row[:, None], 0)
            cols = jnp.where(m, col0[:, None] + c[None, :], 0)
        return pltriton.load(ref.at[rows, cols], mask=m, other=0)

    def fold(h, si, x, t, full):
        _, _, _, _, n_words, tw, n_tiles, _ = srcs[si]
        exact = full and n_words == n_tiles * tw  # else the last tile is partly past the hashed words
        cols = refs.columns(x)
        for c in range(0, tw, 2):
            if isinstance(t, int) and t * tw + c >= n_words:
                break
            folded = hasher.fold_step(h, U64(cols[c], cols[c + 1]))
            h = folded if exact else pairs.where(t * tw + c < n_words, folded, h)
        return h

    return _pipelined_fold(shape, [src[6] for src in srcs], lambda si, t: load_tile(srcs[si], t), fold, hasher, unroll)
