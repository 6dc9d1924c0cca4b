"""The real-KV hash of sources, pure jnp (SPEC 2.5): a source's bytes as uint32 words, and the fold of each
slot's hashed bytes across every source. The reference the kernels' in-kernel hash
(``pallas_kernels.real_kv``) must match bit for bit, and the element widths both read.

The source descriptors it reads are :class:`canary_jax.contract.sources.SourceDescriptor`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax.contract import hashing, pairs


def element_bits(dtype: Any) -> int:
    """Bits per element of ``dtype``: 4 for ``int4`` / ``float4_e2m1fn``, 8 for bool, ``8 * itemsize`` else."""
    dt = np.dtype(dtype)
    if dt.kind in "iuf":
        return 8 * dt.itemsize
    for info in (jnp.iinfo, jnp.finfo):
        try:
            return int(info(dt).bits)
        except (TypeError, ValueError):
            continue
    return 8 * dt.itemsize


def source_words(tensor: jax.Array) -> jax.Array:
    """A source of any dtype and rank >= 2 as ``uint32[shape[0], row_bytes // 4]`` (a reshape and a bitcast,
    no copy inside ``jit``; ``row_bytes % 4 == 0``). Packed sub-byte dtypes bitcast ``32 / bits`` elements
    per word (XLA's packing: element ``k`` of a word in bits ``k * bits ..``)."""
    tensor = jnp.asarray(tensor)
    if tensor.dtype == jnp.bool_:  # bitcast refuses bool; a bool element is one byte holding 0 or 1
        tensor = tensor.astype(jnp.uint8)
    rows = tensor.shape[0]
    bits = element_bits(tensor.dtype)
    if bits == 32:
        return jax.lax.bitcast_convert_type(tensor, jnp.uint32).reshape(rows, -1)
    if bits < 32:
        return jax.lax.bitcast_convert_type(tensor.reshape(rows, -1, 32 // bits), jnp.uint32)
    # 64 bits (x64 on): each element becomes two words
    return jax.lax.bitcast_convert_type(tensor, jnp.uint32).reshape(rows, -1)


def real_kv_hash_reference(tensors: Sequence[jax.Array], descs: Sequence[Any], slots: jax.Array) -> pairs.U64:
    """Combined real-KV fingerprint of ``slots`` (int32, any shape), pure jnp (SPEC 2.5).

    Per source: the first ``effective_read_bytes`` bytes of each slot's sequence (dense: the slot's own run;
    chunked: its chunks in order, zero-padded), folded as little-endian 8-byte words. Slots whose rows lie
    outside a source (``row >= slot_rows``) read as zero bytes there (canary-jax never reads outside a
    buffer); negative slots likewise. With no descriptors the result is 0.

    Returns:
      U64 of ``slots.shape``.
    """
    if not descs:
        return pairs.const(0, slots.shape)
    per_source = []
    for tensor, d in zip(tensors, descs):
        words = source_words(tensor)  # u32[rows, row_bytes/4]
        nw = d.effective_read_bytes // 4
        addr = [d.word_address(k) for k in range(nw)]
        row_off = np.asarray([a[0] for a in addr], np.int32)
        col_off = np.asarray([a[1] for a in addr], np.int32)
        in_seq = np.asarray([a[2] for a in addr], bool)
        row = slots // d.page_size
        col0 = (slots % d.page_size) * (d.num_bytes_per_token // 4)
        ok = (slots >= 0) & (row < d.slot_rows)
        rows = jnp.where(ok, row, 0)[..., None] + row_off
        cols = jnp.where(ok, col0, 0)[..., None] + col_off
        take = ok[..., None] & in_seq
        gathered = words[jnp.where(take, rows, 0), jnp.where(take, cols, 0)]
        gathered = jnp.where(take, gathered, jnp.uint32(0))
        per_source.append(hashing.fold_words(gathered, nw // 2))
    return hashing.combine_sources(per_source)
