"""Ref plumbing shared by the verify and write kernels: masked loads and stores, block loops, program ids.

Every helper traces to plain ``jax.lax`` ops plus ``pltriton.load`` / ``pltriton.store``, so the same kernel
body lowers through Triton on the GPU and runs under ``interpret=True`` on the CPU. Every masked load carries an
explicit ``other`` and an index clamped into the buffer (interpret mode clamps out-of-range windows where Triton
skips lanes); every masked store sends its masked-out lanes one past the end (see :func:`store_word`).
PITFALLS and ``pallas_kernels/README.md`` say why.

Shapes: ``B`` is a block of lanes (entries or requests); 64-bit values are :class:`~canary_jax.contract.pairs.U64`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from canary_jax.contract import constants, layout, pairs
from canary_jax.contract.pairs import U64

I32 = jnp.int32
U32 = jnp.uint32


if hasattr(jax.lax, "unstack"):
    unstack = jax.lax.unstack
else:  # older jax (0.8.3, which sglang-jax 0.0.2 pins, has none): the same static slices

    def unstack(x: jax.Array, axis: int = 0) -> tuple[jax.Array, ...]:
        """``jax.lax.unstack``: the slices of ``x`` along ``axis``, that axis dropped."""
        return tuple(jax.lax.index_in_dim(x, i, axis, keepdims=False) for i in range(x.shape[axis]))


def iota(n: int) -> jax.Array:
    """``int32[n]``: ``0, 1, ..., n - 1``."""
    return jax.lax.iota(I32, n)


def cdiv(a, b: int):
    """``ceil(a / b)`` as int32 for a non-negative (traced) ``a`` and a static ``b > 0``."""
    return jax.lax.div(jnp.asarray(a).astype(I32) + (b - 1), jnp.asarray(b, I32))


# --- loads ---------------------------------------------------------------------------------------------------
def load_vec(ref, idx: jax.Array, mask: jax.Array, other=0) -> jax.Array:
    """``ref[idx]`` of a 1-D ref, masked (``other`` where masked), index clamped."""
    idx = jnp.where(mask, idx, 0)
    return pltriton.load(ref.at[idx], mask=mask, other=other)


def load_window(ref, start: jax.Array, n: int, *, interpret: bool) -> jax.Array:
    """``ref[start : start + n]`` of a 1-D ref, words at or past its end read 0 (a masked load, ``other`` 0).

    ``start`` should carry ``pl.multiple_of``: compiled, the pointers are ``start + iota(n)`` (contiguous, so Triton
    can vectorise the load; it skips the masked lanes). Interpreted, masked indices are clamped to 0 first, so no lane
    reads out of bounds."""
    idx = start + iota(n)
    mask = idx < ref.shape[0]
    if interpret:
        idx = jnp.where(mask, idx, 0)
    return pltriton.load(ref.at[idx], mask=mask, other=0)


def load_word(ref, row: jax.Array, col, mask: jax.Array) -> jax.Array:
    """``ref[row, col]`` of a 2-D uint32 ref (``col`` static int or int32 vector), masked, other 0."""
    row = jnp.where(mask, row, 0)
    if not isinstance(col, int):
        col = jnp.where(mask, jnp.broadcast_to(col, row.shape), 0)
    return pltriton.load(ref.at[row, col], mask=mask, other=0)


def load_words(ref, row: jax.Array, col, n: int, mask: jax.Array, mode: str) -> list[jax.Array]:
    """Words ``ref[row, col + k]`` for ``k < n`` (n in 1, 2, 4, ...) as a list of ``[B]`` vectors (0 where masked).

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
            out.extend(unstack(x, axis=1))
        else:
            even, odd = unstack(x.reshape(b, 2, 2), axis=2)  # even = [w0, w2], odd = [w1, w3]
            w0, w2 = unstack(even, axis=1)
            w1, w3 = unstack(odd, axis=1)
            out.extend([w0, w1, w2, w3])
    return out


def load_pair(ref, row: jax.Array, col: int, mask: jax.Array, mode: str) -> U64:
    """The int64 at words ``(col, col + 1)`` of row ``row`` of a 2-D uint32 ref (0 where masked)."""
    lo, hi = load_words(ref, row, col, 2, mask, "word" if mode == "word" else "pair")
    return U64(lo, hi)


def narrow(ref) -> bool:
    """Whether a per-entry int64 operand is held narrow: ``int32[T]``, one word an entry, sign-extended on load
    (a traced int32 field the caller's ``jit`` passes as it is, :func:`canary_jax.contract.ints.as_int64_field`),
    rather than as ``uint32`` pairs."""
    return jnp.dtype(ref.dtype) == jnp.dtype(I32)


def entries(x) -> int:
    """The entries of a flat per-entry operand: ``T`` of ``int32[T]`` (narrow) or of ``uint32[2 T]``."""
    return int(x.shape[0]) if narrow(x) else int(x.shape[0]) // 2


def load_pair_flat(ref, i: jax.Array, mask: jax.Array) -> U64:
    """The int64 of entry ``i`` of a flat ``uint32[2 T]`` ref (a ``[T, 2]`` pair array reshaped), or of a
    :func:`narrow` ``int32[T]`` one."""
    if narrow(ref):
        return pairs.from_int32(load_vec(ref, i, mask, 0))
    idx = 2 * jnp.where(mask, i, 0)[:, None] + iota(2)[None, :]
    m2 = jnp.broadcast_to(mask[:, None], idx.shape)
    lo, hi = unstack(pltriton.load(ref.at[idx], mask=m2, other=0), axis=1)
    return U64(lo, hi)


def load_entry(ref, i: jax.Array, mask: jax.Array, mode: str) -> U64:
    """The int64 of entry ``i`` of a per-entry pair ref: ``uint32[T, 2]`` (:func:`load_pair`) or its flat
    ``uint32[2 T]`` form, or a :func:`narrow` ``int32[T]`` one (:func:`load_pair_flat`); 0 where masked."""
    return load_pair_flat(ref, i, mask) if len(ref.shape) == 1 else load_pair(ref, i, 0, mask, mode)


def load_pair_run(ref, start: jax.Array, first: jax.Array, n: int, count: jax.Array) -> list[U64]:
    """Entries ``start + first + k`` (``k < n``, a power of 2) of a flat ``uint32[2 T]`` pair ref for each
    lane, as ``n`` U64 (0 where ``first + k >= count``): one ``[B, 2 n]`` load of contiguous words per lane
    (a single memory op, so Triton's per-op compile passes see ``1`` op instead of ``n``). A :func:`narrow` ref
    gives one ``[B, n]`` load of its words, sign-extended."""
    if narrow(ref):
        k = iota(n)
        m = (first + k)[None, :] < count[:, None]
        idx = jnp.where(m, start[:, None] + (first + k)[None, :], 0)
        return [pairs.from_int32(c) for c in columns(pltriton.load(ref.at[idx], mask=m, other=0))]
    k = iota(2 * n)
    step = first + jax.lax.div(k, jnp.int32(2))
    m = step[None, :] < count[:, None]
    idx = jnp.where(m, 2 * start[:, None] + (2 * first + k)[None, :], 0)
    cols = columns(pltriton.load(ref.at[idx], mask=m, other=0))
    return [U64(cols[2 * j], cols[2 * j + 1]) for j in range(n)]


# --- columns of a [B, W] block ----------------------------------------------------------------------------------
def columns(x: jax.Array) -> list[jax.Array]:
    """The columns of a ``[B, W]`` array (``W`` a power of 2) as ``W`` vectors ``[B]``, in order.

    A tree of reshape + ``unstack`` along a trailing axis of 2 (``tt.split`` on Triton). The splits are
    register renames once each thread holds whole rows; Triton loads the default tiles that way directly."""
    b, w = x.shape
    if w == 1:
        return [x.reshape(b)]
    even, odd = unstack(x.reshape(b, w // 2, 2), axis=2)
    out = []
    for e, o in zip(columns(even), columns(odd), strict=True):
        out += [e, o]
    return out


def from_columns(cols: list[jax.Array]) -> jax.Array:
    """``[B, W]`` from ``W`` (a power of 2) vectors ``[B]``: the inverse of :func:`columns` (a tree of
    two-way stacks, ``tt.join`` on Triton)."""
    if len(cols) == 1:
        return cols[0][:, None]
    even, odd = from_columns(cols[0::2]), from_columns(cols[1::2])
    return jnp.stack([even, odd], axis=-1).reshape(even.shape[0], 2 * even.shape[1])


# --- stores ------------------------------------------------------------------------------------------------------
def store_word(ref, row: jax.Array, col: int, value: jax.Array, mask: jax.Array) -> None:
    """Masked ``ref[row, col] = value``. Masked-out lanes point one past the end: Triton skips them, and the
    interpreter's scatter drops them instead of writing back a stale value over a live lane's store."""
    row = jnp.where(mask, row, ref.shape[0])
    pltriton.store(ref.at[row, col], value, mask=mask)


def store_pair(ref, row: jax.Array, col: int, value: U64, mask: jax.Array) -> None:
    """Masked ``ref[row, col:col + 2] = (value.lo, value.hi)`` of a 2-D uint32 ref."""
    store_word(ref, row, col, value.lo, mask)
    store_word(ref, row, col + 1, value.hi, mask)


def store_vec(ref, idx: jax.Array, value: jax.Array, mask: jax.Array) -> None:
    """Masked ``ref[idx] = value`` of a 1-D ref (masked-out lanes point one past the end, see :func:`store_word`)."""
    idx = jnp.where(mask, idx, ref.shape[0])
    pltriton.store(ref.at[idx], value, mask=mask)


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


def atomic_max_word(ref, row: jax.Array, col: int, value: jax.Array, mask: jax.Array) -> None:
    """Atomic ``ref[row, col] = max(ref[row, col], value)`` where ``mask`` (compiled only), for a 2-D float32 ref
    that holds int32 bits (the caller bitcasts outside the kernel) and non-negative int32 ``value`` s and words.

    Pallas lowers a float ``atomic_max`` as a signed integer ``atomic_rmw max`` on the bits for non-negative values
    (and an ``umin`` for negative ones, masked off here), which is the integer max for such words; the integer
    vector form crashes the Triton lowering of jax 0.10.2 and 0.11.x (README, "Pallas/Triton traps"). Masked-out
    lanes do nothing (Triton skips them; their row is clamped to 0). Interpret-mode atomics refuse masks and lose
    duplicate updates: interpreted kernels take another path."""
    row = jnp.where(mask, row, 0)
    pltriton.atomic_max(ref, (row, col), jax.lax.bitcast_convert_type(value.astype(I32), jnp.float32), mask=mask)


# --- counters (int64 pairs flattened to u32[2 * tags]) -------------------------------------------------------------
def bump_pair_scalar(ref, word: int, delta: jax.Array) -> None:
    """``ref[word:word + 2]`` (one int64 as lo, hi) += ``delta`` (a non-negative scalar, taken as uint32)."""
    total = pairs.add(pairs.U64(ref[word], ref[word + 1]), pairs.U64(delta.astype(U32), pairs.u32(0)))
    ref[word] = total.lo
    ref[word + 1] = total.hi


def barrier(interpret: bool) -> None:
    """``__syncthreads``: every global store of the program before it is visible to every thread after it, and every
    load before it has read its value before any store after it lands. A no-op interpreted (statements run in order
    over whole vectors)."""
    if not interpret:
        pltriton.debug_barrier()


# --- grid loops ----------------------------------------------------------------------------------------------------
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


def sum_counts(counts_ref, lo, hi, *, column: int | None = None, chunk: int = 1024) -> jax.Array:
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


# --- the violation log as flat kernel operands ----------------------------------------------------------------------
def log_operands(log: layout.ViolationLog) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(ring u32[R, 16], slot_counters u32[2 * tags], kernel_counters u32[2 * tags])``: the log's arrays
    reshaped (outside any ``pallas_call``) to the 2-D / 1-D refs the kernels index."""
    ring = log.ring.reshape(log.ring.shape[0], 2 * constants.VIOLATION_FIELDS)
    return ring, log.slot_run_counters.reshape(-1), log.kernel_run_counters.reshape(-1)


def aliases(args: dict, outs: Sequence[str]) -> dict[int, int]:
    """``input_output_aliases`` of a ``pallas_call`` from names: output ``k`` aliases the input of the same name
    (``args`` in call order); an output whose name no input has is a fresh buffer."""
    names = list(args)
    return {names.index(name): k for k, name in enumerate(outs) if name in args}


def updated_log(log: layout.ViolationLog, *, ring, write_index, slot_counters, kernel_counters) -> layout.ViolationLog:
    """The log after a launch: the aliased kernel outputs reshaped back to the log's shapes (the assert flag and
    the launch ticket as they were)."""
    return dataclasses.replace(
        log,
        ring=ring.reshape(log.ring.shape),
        write_index=write_index,
        slot_run_counters=slot_counters.reshape(log.slot_run_counters.shape),
        kernel_run_counters=kernel_counters.reshape(log.kernel_run_counters.shape),
    )
