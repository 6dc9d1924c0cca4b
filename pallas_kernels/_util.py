"""Small in-kernel helpers shared by the verify and write kernels (uint32 pairs, gathers, block loops).

Every helper traces to plain ``jax.lax`` ops plus ``pltriton.load`` / ``pltriton.store``, so the same
kernel body lowers through Triton on the GPU and runs under ``interpret=True`` on the CPU. Every masked load
carries an explicit ``other`` and an index clamped into the buffer (interpret mode clamps out-of-range
windows where Triton skips lanes; PITFALLS).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax import hashing
from canary_jax import layout
from canary_jax.hashing import U64
from pallas_kernels.hashing import PairHash, shr, u32

I32 = jnp.int32
U32 = jnp.uint32


def iota(n: int) -> jax.Array:
    return jax.lax.iota(I32, n)


def cdiv(a, b: int):
    return jax.lax.div(jnp.asarray(a).astype(I32) + (b - 1), jnp.asarray(b, I32))


def sel(pred: jax.Array, a: U64, b: U64) -> U64:
    return U64(jnp.where(pred, a.lo, b.lo), jnp.where(pred, a.hi, b.hi))


def ne(a: U64, b: U64) -> jax.Array:
    return (a.lo != b.lo) | (a.hi != b.hi)


def is_zero(a: U64) -> jax.Array:
    return (a.lo | a.hi) == 0


def is_negative(a: U64) -> jax.Array:
    return shr(a.hi, 31) != 0


def is_minus_one(a: U64) -> jax.Array:
    return ((~a.lo) | (~a.hi)) == 0


def add_small(a: U64, k: int) -> U64:
    lo = a.lo + u32(k)
    return U64(lo, a.hi + (lo < a.lo).astype(U32))


def index_of(a: U64, n: int) -> tuple[jax.Array, jax.Array]:
    """``(int32 index, 0 <= a < n)``; the index is 0 where out of range (``n < 2**31``)."""
    ok = (a.hi == 0) & (a.lo < u32(n))
    return jnp.where(ok, a.lo, u32(0)).astype(I32), ok


def clamp_to(a: U64, n: int) -> jax.Array:
    """int64 pair clamped into ``[0, n]`` as int32 (``n < 2**31``)."""
    neg = is_negative(a)
    big = (~neg) & ((a.hi != 0) | (a.lo > u32(n)))
    return jnp.where(neg, u32(0), jnp.where(big, u32(n), a.lo)).astype(I32)


def zeros_u64(shape) -> U64:
    z = jnp.zeros(shape, U32)
    return U64(z, z)


def full_u64(value: int, shape) -> U64:
    value &= (1 << 64) - 1
    return U64(jnp.full(shape, u32(value), U32), jnp.full(shape, u32(value >> 32), U32))


# --- loads and stores ----------------------------------------------------------------------------------------
def load_vec(ref, idx: jax.Array, mask: jax.Array, other=0) -> jax.Array:
    """``ref[idx]`` for a 1-D ref, masked, index clamped."""
    idx = jnp.where(mask, idx, 0)
    return pltriton.load(ref.at[idx], mask=mask, other=other)


def load_word(ref, row: jax.Array, col, mask: jax.Array) -> jax.Array:
    """``ref[row, col]`` of a 2-D uint32 ref (``col`` static int or int32 vector), masked, other 0."""
    row = jnp.where(mask, row, 0)
    if not isinstance(col, int):
        col = jnp.where(mask, jnp.broadcast_to(col, row.shape), 0)
    return pltriton.load(ref.at[row, col], mask=mask, other=0)


def load_words(ref, row: jax.Array, col, n: int, mask: jax.Array, mode: str) -> list[jax.Array]:
    """Words ``ref[row, col + k]`` for ``k < n`` (n in 1, 2, 4) as a list of ``[B]`` vectors.

    ``mode``: ``word`` = one gather per word; ``pair`` = ``[B, 2]`` vector gathers; ``quad`` = ``[B, 4]``
    vector gathers (needs ``n % 4 == 0``, falls back to pairs otherwise). The vector forms let Triton emit
    8 / 16-byte loads when the column is provably aligned.
    """
    if mode == "word" or n == 1:
        return [load_word(ref, row, col + k, mask) for k in range(n)]
    width = 4 if (mode == "quad" and n % 4 == 0) else 2
    out = []
    row_m = jnp.where(mask, row, 0)
    if not isinstance(col, int):
        col = jnp.broadcast_to(col, row.shape)
    col_m = col if isinstance(col, int) else jnp.where(mask, col, 0)
    b = row.shape[0]
    for base in range(0, n, width):
        if isinstance(col_m, int):
            cols = jnp.broadcast_to((iota(width) + (col_m + base))[None, :], (b, width))
        else:
            cols = (col_m + base)[:, None] + iota(width)[None, :]
        rows = jnp.broadcast_to(row_m[:, None], (b, width))
        m2 = jnp.broadcast_to(mask[:, None], (b, width))
        x = pltriton.load(ref.at[rows, cols], mask=m2, other=0)  # u32[B, width]
        if width == 2:
            out.extend(jax.lax.unstack(x, axis=1))
        else:
            even, odd = jax.lax.unstack(x.reshape(b, 2, 2), axis=2)  # even = [w0, w2], odd = [w1, w3]
            w0, w2 = jax.lax.unstack(even, axis=1)
            w1, w3 = jax.lax.unstack(odd, axis=1)
            out.extend([w0, w1, w2, w3])
    return out


def load_pair(ref, row: jax.Array, col: int, mask: jax.Array, mode: str) -> U64:
    """The int64 at words ``(col, col + 1)`` of row ``row`` of a 2-D uint32 ref, as a U64 (0 where masked)."""
    lo, hi = load_words(ref, row, col, 2, mask, "word" if mode == "word" else "pair")
    return U64(lo, hi)


def load_pair_flat(ref, i: jax.Array, mask: jax.Array) -> U64:
    """The int64 of entry ``i`` of a flat ``uint32[2 T]`` ref (a ``[T, 2]`` pair array reshaped), as a U64."""
    idx = 2 * jnp.where(mask, i, 0)[:, None] + iota(2)[None, :]
    m2 = jnp.broadcast_to(mask[:, None], idx.shape)
    lo, hi = jax.lax.unstack(pltriton.load(ref.at[idx], mask=m2, other=0), axis=1)
    return U64(lo, hi)


def load_pair_run(ref, start: jax.Array, first: jax.Array, n: int, count: jax.Array) -> list[U64]:
    """Entries ``start + first + k`` (``k < n``, a power of 2) of a flat ``uint32[2 T]`` pair ref for each
    lane, as ``n`` U64 (0 where ``first + k >= count``): one ``[B, 2 n]`` load of contiguous words per lane
    (a single memory op, so Triton's per-op compile passes see ``1`` op instead of ``n``)."""
    k = iota(2 * n)
    step = first + jax.lax.div(k, jnp.int32(2))
    m = step[None, :] < count[:, None]
    idx = jnp.where(m, 2 * start[:, None] + (2 * first + k)[None, :], 0)
    cols = columns(pltriton.load(ref.at[idx], mask=m, other=0))
    return [U64(cols[2 * j], cols[2 * j + 1]) for j in range(n)]


def from_columns(cols: list[jax.Array]) -> jax.Array:
    """``[B, W]`` from ``W`` (a power of 2) vectors ``[B]``: the inverse of :func:`columns` (a tree of
    two-way stacks, ``tt.join`` on Triton)."""
    if len(cols) == 1:
        return cols[0][:, None]
    even, odd = from_columns(cols[0::2]), from_columns(cols[1::2])
    return jnp.stack([even, odd], axis=-1).reshape(even.shape[0], 2 * even.shape[1])


def store_run(ref, first: jax.Array, values: jax.Array, mask: jax.Array) -> None:
    """``ref[first + k] = values[:, k]`` where ``mask[:, k]``, for a 1-D ref: one masked store per call
    (masked-out elements point one past the end, see :func:`store_word`)."""
    idx = first[:, None] + iota(values.shape[1])[None, :]
    pltriton.store(ref.at[jnp.where(mask, idx, ref.shape[0])], values, mask=mask)


def store_pair_run(ref, first: jax.Array, values: list[U64], mask: jax.Array) -> None:
    """Entries ``first + k`` of a flat ``uint32[2 T]`` pair ref get ``values[k]`` where ``mask[:, k]``: one
    ``[B, 2 n]`` store."""
    words = []
    for v in values:
        words += [v.lo, v.hi]
    m2 = jnp.broadcast_to(mask[:, :, None], mask.shape + (2,)).reshape(mask.shape[0], 2 * mask.shape[1])
    store_run(ref, 2 * first, from_columns(words), m2)


def store_word(ref, row: jax.Array, col: int, value: jax.Array, mask: jax.Array) -> None:
    """Masked ``ref[row, col] = value``. Masked-out lanes point one past the end: Triton skips them, and the
    interpreter's scatter drops them instead of writing back a stale value over a live lane's store."""
    row = jnp.where(mask, row, ref.shape[0])
    pltriton.store(ref.at[row, col], value, mask=mask)


def store_pair(ref, row: jax.Array, col: int, value: U64, mask: jax.Array) -> None:
    store_word(ref, row, col, value.lo, mask)
    store_word(ref, row, col + 1, value.hi, mask)


def store_vec(ref, idx: jax.Array, value: jax.Array, mask: jax.Array) -> None:
    """Masked ``ref[idx] = value`` (masked-out lanes point one past the end, see :func:`store_word`)."""
    idx = jnp.where(mask, idx, ref.shape[0])
    pltriton.store(ref.at[idx], value, mask=mask)


# --- counters (uint32 pairs flattened to u32[2 * tags]) --------------------------------------------------------
def bump_pair_scalar(ref, word: int, delta: jax.Array) -> None:
    """``ref[word:word+2]`` (one int64 as lo, hi) += ``delta`` (non-negative uint32 scalar)."""
    lo = ref[word]
    hi = ref[word + 1]
    nlo = lo + delta.astype(U32)
    ref[word] = nlo
    ref[word + 1] = hi + (nlo < lo).astype(U32)


# --- grid loops ------------------------------------------------------------------------------------------------
def program_id() -> jax.Array:
    """``pl.program_id(0)`` as int32 (it is int64 in interpret mode with x64 on)."""
    return jnp.asarray(pl.program_id(0)).astype(I32)


def for_each_block(num_blocks: jax.Array, body, *, pid: jax.Array | None = None, programs=None) -> None:
    """Calls ``body(b)`` for blocks ``b = pid, pid + G, ... < num_blocks`` (persistent grid).

    ``pid`` / ``programs`` default to this program's id and the grid size; a kernel whose programs play
    several roles passes its role-local id and role size.
    """
    pid = program_id() if pid is None else pid
    g = jnp.asarray(pl.num_programs(0) if programs is None else programs).astype(I32)
    trips = jax.lax.div(jnp.maximum(jnp.asarray(num_blocks).astype(I32) - pid, 0) + g - 1, g)

    def step(k, carry):
        body(pid + k * g)
        return carry

    jax.lax.fori_loop(0, trips, step, jnp.int32(0))


def sum_counts(counts_ref, lo, hi, *, chunk: int, column: int | None = None) -> jax.Array:
    """``sum(counts_ref[lo:hi])`` (int32; ``counts_ref`` 1-D, or 2-D with ``column``) in chunks of ``chunk``."""
    n = jnp.maximum(hi - lo, 0)
    trips = cdiv(n, chunk)

    def step(k, acc):
        idx = lo + k * chunk + iota(chunk)
        m = idx < hi
        if column is None:
            v = load_vec(counts_ref, idx, m, 0)
        else:
            v = load_word(counts_ref, idx, column, m)
        return acc + jnp.sum(v.astype(I32), dtype=I32)

    return jax.lax.fori_loop(0, trips, step, jnp.int32(0))


# --- real-KV fingerprint ---------------------------------------------------------------------------------------
def real_kv_hash(src_refs, descs, slot: jax.Array, mask: jax.Array, hasher: PairHash, mode: str,
                 unroll: int = 2, tile_words: int = 16) -> U64:
    """Combined real-KV fingerprint of int32 ``slot`` (SPEC 2.5); 0 with no descriptors.

    ``mode == "tile"`` / ``"tile_contiguous"``: see :func:`_real_kv_hash_tiles` (2-D row tiles).

    ``unroll >= 1``: one loop over 16-byte chunks serves every source at once: iteration ``k`` folds chunks
    ``k * unroll ..`` of each source (independent chains, so their hashing overlaps) while the loads of the
    next ``unroll`` chunks of every source are already in flight (carried in the loop state). ``unroll == 0``:
    fully unrolled straight-line code (faster on the H200 in our one measurement, but its compile time grows
    steeply: 52 s for 4 sources x 256 bytes). Rows outside a source read as zero bytes (as
    :func:`canary_jax.sources.real_kv_hash_reference`).
    """
    shape = slot.shape
    if not descs:
        return zeros_u64(shape)
    geo = []
    for ref, d in zip(src_refs, descs):
        if d.page_size == 1:
            row, col0 = slot, jnp.zeros(shape, I32)
        else:
            row = jax.lax.div(slot, jnp.asarray(d.page_size, I32))
            col0 = jax.lax.rem(slot, jnp.asarray(d.page_size, I32)) * (d.num_bytes_per_token // 4)
        geo.append((ref, row, col0, mask & (row < d.num_rows), d.effective_read_bytes // 16))
    if mode in ("tile", "tile_contiguous"):
        return _real_kv_hash_tiles(geo, shape, hasher, unroll, tile_words, mode == "tile_contiguous")

    def load_chunk(si, c):  # 16-byte chunk c of source si: 4 words
        ref, row, col0, ok, n = geo[si]
        return tuple(load_words(ref, row, col0 + 4 * c, 4, ok & (c < n), mode))

    def fold_chunk(h, si, w, c, full):
        folded = hasher.fold_step(hasher.fold_step(h, U64(w[0], w[1])), U64(w[2], w[3]))
        return folded if full else sel(c < geo[si][4], folded, h)

    return _pipelined_fold(shape, [g[4] for g in geo], load_chunk, fold_chunk, hasher, unroll)


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
            h = zeros_u64(shape)
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

        hs, _ = jax.lax.fori_loop(0, steps, body, (tuple(zeros_u64(shape) for _ in pieces), load(jnp.int32(0))))
    acc = zeros_u64(shape)
    for h in hs:
        acc = hasher.fold_step(acc, h)
    return acc


def columns(x: jax.Array) -> list[jax.Array]:
    """The columns of a ``[B, W]`` array (``W`` a power of 2) as ``W`` vectors ``[B]``, in order.

    A tree of reshape + ``unstack`` along a trailing axis of 2 (``tt.split`` on Triton). The splits are
    register renames once each thread holds whole rows; Triton loads the default tiles that way directly."""
    b, w = x.shape
    if w == 1:
        return [x.reshape(b)]
    even, odd = jax.lax.unstack(x.reshape(b, w // 2, 2), axis=2)
    out = []
    for e, o in zip(columns(even), columns(odd)):
        out += [e, o]
    return out


def _real_kv_hash_tiles(geo, shape, hasher: PairHash, unroll: int, tile_words: int,
                        contiguous: bool = False) -> U64:
    """Real-KV fingerprint from 2-D tile loads: ``[B, tile]`` words of every entry's row per load, then the
    fold walks the columns in order. A source's tile is ``tile_words`` wide, or narrower when it hashes fewer
    words (PARTIAL: 4). On Triton (offline PTX, sm_90) each thread holds its own row and loads it 4 bytes at a
    time, so an iteration has ``tile`` independent loads in flight per entry and source.

    ``unroll == 0``: straight-line code over all tiles of all sources; ``unroll >= 1``: a loop whose iteration
    folds ``unroll`` tiles of every source while the next iteration's tiles are already loading.

    ``contiguous``: leave the column indices unmasked so Triton can prove them contiguous. Offline (triton
    3.6, sm_90) that turns the 4-byte loads into 16-byte loads plus a shared-memory layout hand-over; not yet
    timed on the GPU, hence not the default (``source_gather="tile_contiguous"``)."""
    srcs = []
    for ref, row, col0, ok, n in geo:
        n_words = 4 * n  # words to hash
        tw = min(tile_words, 1 << (n_words - 1).bit_length())
        srcs.append((ref, row, col0, ok, n_words, tw, -(-n_words // tw)))

    def load_tile(src, t):
        ref, row, col0, ok, n_words, tw, _ = src
        c = t * tw + iota(tw)
        m = ok[:, None] & (c < n_words)[None, :]
        if contiguous:  # indices Triton can prove contiguous along a row: 16-byte loads, then a shared-memory
            rows = jnp.where(ok, row, 0)[:, None]  # hand-over (masked lanes load nothing on Triton and clamp
            cols = col0[:, None] + c[None, :]  # in interpret mode)
        else:
            rows = jnp.where(m, row[:, None], 0)
            cols = jnp.where(m, col0[:, None] + c[None, :], 0)
        return pltriton.load(ref.at[rows, cols], mask=m, other=0)

    def fold(h, si, x, t, full):
        _, _, _, _, n_words, tw, n_tiles = srcs[si]
        exact = full and n_words == n_tiles * tw  # else the last tile is partly past the hashed words
        cols = columns(x)
        for c in range(0, tw, 2):
            if isinstance(t, int) and t * tw + c >= n_words:
                break
            folded = hasher.fold_step(h, U64(cols[c], cols[c + 1]))
            h = folded if exact else sel(t * tw + c < n_words, folded, h)
        return h

    return _pipelined_fold(shape, [src[6] for src in srcs], lambda si, t: load_tile(srcs[si], t), fold, hasher,
                           unroll)


def chain_hash(hasher: PairHash, prev: U64, tok: U64, pos: U64) -> U64:
    """``mix3(prev_hash, token, position)`` (SPEC 2.3)."""
    return hasher.mix3(prev, tok, pos)


__all__ = [name for name in dir() if not name.startswith("_")] + ["H"]


def updated_log(log: layout.ViolationLog, *, ring, write_index, slot_counters, kernel_counters) -> layout.ViolationLog:
    """The log after a launch: the aliased kernel outputs reshaped back to the log's shapes."""
    return layout.ViolationLog(
        ring=ring.reshape(log.ring.shape),
        write_index=write_index,
        slot_run_counters=slot_counters.reshape(log.slot_run_counters.shape),
        kernel_run_counters=kernel_counters.reshape(log.kernel_run_counters.shape),
        enable_chain_position_assert=log.enable_chain_position_assert,
    )
