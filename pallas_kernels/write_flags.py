"""The write kernels' per-entry flag word (``u32[T]``) and claim word, shared by every write launch.

The chain launches set the flags, the won pass adds ``WINNER`` (and, for long-role entries, ``CHAIN_POSITION``),
and the commit pass stores winners and turns ``INPUT_MISMATCH`` / ``CHAIN_POSITION`` into ring rows. Flags start
zeroed, so an entry outside every live request carries none.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp

from canary_jax.contract import constants, pairs
from canary_jax.contract.constants import FailReason
from pallas_kernels import refs


class WriteFlag(enum.IntFlag):
    """Bits 0..7 of an entry's flag word; bits ``LONG_SHIFT`` and up carry a distance (see ``LONG``)."""

    WRITTEN = 1 << 0  # live entry with its slot in range: it stores (if it wins) and counts
    CHAIN_POSITION = 1 << 1  # chain-position check failed: a WRITE_POSITION_MISMATCH row with the run position
    TOKEN_MISMATCH = int(FailReason.WRITE_TOKEN_MISMATCH)  # input assert; the same bit as the ring's, stored as is
    POSITION_MISMATCH = int(FailReason.WRITE_POSITION_MISMATCH)  # input assert; likewise
    WINNER = 1 << 5  # the last entry (request-major) writing its slot: it stores the record
    GATE = 1 << 6  # long role: the chain-position gate is on; the won pass compares the position
    LONG = 1 << 7  # long role: prev_at / chain_exp come from a replay from the chunk's checkpoint (won pass)


INPUT_MISMATCH = WriteFlag.TOKEN_MISMATCH | WriteFlag.POSITION_MISMATCH  # the input-assert row's fail bits
LONG_SHIFT = 16  # long role: bits 16.. of the flag word hold the entry's distance to its chunk's checkpoint
CLAIM_WORD = 2 * constants.CANARY_FIELD_REAL_KV_HASH  # low word of field 3: the slot claim (canary_write_claim)

assert not INPUT_MISMATCH & (
    WriteFlag.WRITTEN | WriteFlag.CHAIN_POSITION | WriteFlag.WINNER | WriteFlag.GATE | WriteFlag.LONG
)
assert max(WriteFlag) < 1 << LONG_SHIFT


def load_flagged(flags_ref, loc_ref, i: jax.Array, inw: jax.Array, bit: WriteFlag):
    """Flag words of entries ``i[B]`` (``flags_ref`` u32[T], ``loc_ref`` u32[T, 2], its flat u32[2 T] or a narrow
    i32[T], :func:`pallas_kernels.refs.narrow`), which of them carry ``bit``, and their slots (int32, 0 where not)."""
    fl = refs.load_vec(flags_ref, i, inw, 0)
    has = inw & ((fl & bit) != 0)
    if refs.narrow(loc_ref):
        lo = refs.load_vec(loc_ref, i, has, 0).astype(jnp.uint32)
    elif len(loc_ref.shape) == 1:
        lo = refs.load_vec(loc_ref, 2 * i, has, 0)
    else:
        lo = refs.load_word(loc_ref, i, 0, has)
    return fl, has, jnp.where(has, lo, pairs.u32(0)).astype(jnp.int32)
