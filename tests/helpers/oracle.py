"""Independent Python-int oracle of the KV canary (SPEC sections 1, 2, 5, 6), for tests only.

Written from SPEC, not from ``canary_jax``'s jnp code: every hash is computed with Python ints on uint64
values, every buffer is a numpy array handled byte by byte. It never imports jax or canary_jax.

State mirrors SGLang's tensors exactly:

* canary buffer: ``uint8[num_slots, stride]``; slot s's first 32 bytes are little-endian int64
  ``[token, position, prev_hash, real_kv_hash]``;
* ring: ``int64[R, 8]``; write index: a Python int; counters: ``int64[num_tags]``.

Decisions where SGLang is undefined (the documented canary-jax choices, SPEC 13 and
``canary_jax/ops/reference.py``'s docstring):

* verify: a slot or prev slot outside ``[0, num_slots)`` (other than slot 0 = skip, prev 0 = unreachable and
  prev < 0 = anchor) reads as an all-zero record; a verify slot outside the canary buffer also fingerprints
  as all-zero KV bytes;
* write: an entry whose slot is < 0 or >= num_slots is skipped (no store, no count, no row, no chain
  advance); a seed slot >= num_slots reads as an all-zero record;
* real-KV rows outside a source read as zero bytes;
* write seeds are read from the canary as it was before the launch; two entries of one launch storing the
  same slot: the later one wins;
* offsets are clamped into ``[0, num_tokens]``, ``num_valid`` / ``num_valid_reqs`` into ``[0, capacity]``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

MASK64 = (1 << 64) - 1
ANCHOR = 0xC0FFEE1234567890
NUM_TAGS = 12

# FailReason bits (SPEC 1.3)
CHAIN = 1
POSITION = 2
REAL_KV = 4
WRITE_TOKEN = 8
WRITE_POSITION = 16
TOKEN = 32

# RealKvHashMode (SPEC 1.4)
NONE, PARTIAL, ALL = 0, 1, 2


# --- integers ----------------------------------------------------------------------------------------------
def u64(v: int) -> int:
    return int(v) & MASK64


def s64(v: int) -> int:
    v = int(v) & MASK64
    return v - (1 << 64) if v >> 63 else v


def splitmix64(x: int) -> int:
    x = u64(x)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def mix3(a: int, b: int, c: int) -> int:
    h = splitmix64(u64(a))
    h = splitmix64(h ^ u64(b))
    return splitmix64(h ^ u64(c))


ANCHOR_HASH = splitmix64(ANCHOR)


def fold_bytes(data: bytes) -> int:
    """Per-source fold: ``acc = splitmix64(acc ^ le_u64(chunk))`` over 8-byte chunks (zero-padded tail)."""
    data = bytes(data)
    if len(data) % 8:
        data += bytes(8 - len(data) % 8)
    acc = 0
    for k in range(0, len(data), 8):
        acc = splitmix64(acc ^ int.from_bytes(data[k : k + 8], "little"))
    return acc


def combine(per_source: Sequence[int]) -> int:
    acc = 0
    for h in per_source:
        acc = splitmix64(acc ^ u64(h))
    return acc


# --- real-KV sources ---------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Source:
    """A real-KV source as host bytes: ``data`` is the tensor viewed as ``uint8[rows, row_bytes]``."""

    data: np.ndarray
    page_size: int
    num_bytes_per_token: int
    read_bytes: int

    @classmethod
    def of(cls, tensor, page_size: int, num_bytes_per_token: int, read_bytes: int) -> Source:
        arr = np.ascontiguousarray(np.asarray(tensor))
        u8 = arr.view(np.uint8).reshape(arr.shape[0], -1)
        return cls(u8, page_size, num_bytes_per_token, read_bytes)

    def slot_bytes(self, slot: int, nbytes: int) -> bytes:
        """The first ``nbytes`` bytes owned by ``slot`` (zeros where outside the source)."""
        row = slot // self.page_size
        col0 = (slot % self.page_size) * self.num_bytes_per_token
        if slot < 0 or row >= self.data.shape[0]:
            return bytes(nbytes)
        chunk = bytes(self.data[row, col0 : col0 + nbytes].tobytes())
        return chunk + bytes(nbytes - len(chunk))


def real_kv_hash(sources: Sequence[Source], mode: int, slot: int) -> int:
    """Combined fingerprint (uint64) of ``slot``; 0 for mode NONE or no sources."""
    if mode == NONE or not sources:
        return 0
    per = []
    for s in sources:
        eff = 16 if mode == PARTIAL else s.read_bytes
        per.append(fold_bytes(s.slot_bytes(slot, eff)))
    return combine(per)


# --- canary buffer -----------------------------------------------------------------------------------------
def read_record(buf: np.ndarray, slot: int) -> tuple[int, int, int, int]:
    """(token, position, prev_hash, real_kv_hash) of ``slot`` as signed ints; zeros when out of range."""
    if slot < 0 or slot >= buf.shape[0]:
        return (0, 0, 0, 0)
    raw = bytes(buf[slot, :32].tobytes())
    return tuple(int.from_bytes(raw[8 * f : 8 * f + 8], "little", signed=True) for f in range(4))


def write_record(buf: np.ndarray, slot: int, fields: Sequence[int]) -> None:
    raw = b"".join(u64(v).to_bytes(8, "little") for v in fields)
    buf[slot, :32] = np.frombuffer(raw, np.uint8)


def slot_hash(buf: np.ndarray, src_slot: int) -> int:
    """What the successor of ``src_slot`` must store as prev_hash (uint64); anchor hash for src_slot < 0."""
    if src_slot < 0:
        return ANCHOR_HASH
    tok, pos, prev, _ = read_record(buf, src_slot)
    return mix3(prev, tok, pos)


# --- state -------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class State:
    buf: np.ndarray  # uint8[N, stride]
    ring: np.ndarray  # int64[R, 8]
    write_index: int = 0
    slot_counters: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(NUM_TAGS, np.int64))
    kernel_counters: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(NUM_TAGS, np.int64))
    chain_position_assert: int = 1

    @classmethod
    def fresh(cls, num_slots: int, stride: int = 32, ring_capacity: int = 64, chain_position_assert: int = 1):
        return cls(
            np.zeros((num_slots, stride), np.uint8),
            np.zeros((ring_capacity, 8), np.int64),
            chain_position_assert=chain_position_assert,
        )

    def copy(self) -> State:
        return State(
            self.buf.copy(),
            self.ring.copy(),
            self.write_index,
            self.slot_counters.copy(),
            self.kernel_counters.copy(),
            self.chain_position_assert,
        )

    def append(self, row: Sequence[int]) -> None:
        """Fill-once ring: stored only while the index is below capacity; the index always grows."""
        if 0 <= self.write_index < self.ring.shape[0]:
            self.ring[self.write_index] = [s64(v) for v in row]
        self.write_index += 1

    def bump(self, tag: int, slots: int) -> None:
        self.kernel_counters[tag] = s64(int(self.kernel_counters[tag]) + 1)
        self.slot_counters[tag] = s64(int(self.slot_counters[tag]) + slots)

    def rows(self) -> np.ndarray:
        return self.ring[: max(0, min(self.write_index, self.ring.shape[0]))]


def verify(
    st: State,
    *,
    tag: int,
    slots: Sequence[int],
    positions: Sequence[int],
    prev_slots: Sequence[int],
    expected_tokens: Sequence[int] | None = None,
    num_valid: int | None = None,
    enable: int = 1,
    check_token: bool = False,
    sources: Sequence[Source] = (),
    mode: int = NONE,
) -> None:
    """One verify launch (SPEC 5), in place on ``st``. ``slots`` etc. are the full capacity arrays."""
    cap = len(slots)
    if not enable:
        st.kernel_counters[tag] = s64(int(st.kernel_counters[tag]) + 1)
        return
    active = cap if num_valid is None else max(0, min(int(num_valid), cap))
    n_slots = st.buf.shape[0]
    for i in range(active):
        slot = int(slots[i])
        if slot == 0:
            continue
        tok, pos, prev, rkv = read_record(st.buf, slot)
        exp_tok = int(expected_tokens[i]) if check_token else -1
        prev_slot = int(prev_slots[i])
        reachable = prev_slot != 0
        exp_chain = s64(slot_hash(st.buf, prev_slot)) if reachable else prev
        if 0 <= slot < n_slots:
            exp_rkv = s64(real_kv_hash(sources, mode, slot))
        else:
            exp_rkv = 0
        bits = 0
        if reachable and prev != exp_chain:
            bits |= CHAIN
        if check_token and exp_tok != -1 and tok != exp_tok:
            bits |= TOKEN
        if pos != int(positions[i]):
            bits |= POSITION
        if rkv != exp_rkv:
            bits |= REAL_KV
        if bits:
            st.append([tag, slot, pos, tok, exp_tok, prev, exp_chain, bits])
    st.bump(tag, active)


def write(
    st: State,
    *,
    tag: int,
    offsets: Sequence[int],
    seeds: Sequence[int],
    input_ids: Sequence[int],
    positions: Sequence[int],
    out_cache_loc: Sequence[int],
    num_valid_reqs: int | None = None,
    input_assert: bool = False,
    expected_tokens: Sequence[int] | None = None,
    expected_positions: Sequence[int] | None = None,
    sources: Sequence[Source] = (),
    mode: int = NONE,
) -> None:
    """One write launch (SPEC 6), in place on ``st``. ``offsets`` has Cw + 1 entries, ``seeds`` Cw."""
    cw = len(seeds)
    t = len(input_ids)
    n_slots = st.buf.shape[0]
    before = st.buf.copy()  # seeds read the canary as it was before the launch
    nreq = cw if num_valid_reqs is None else max(0, min(int(num_valid_reqs), cw))
    written = 0
    for r in range(nreq):
        start = max(0, min(int(offsets[r]), t))
        end = max(0, min(int(offsets[r + 1]), t))
        seed = int(seeds[r])
        running = slot_hash(before, seed)
        gate = seed >= 0 and st.chain_position_assert != 0
        run_pos = read_record(before, seed)[1] if gate else 0
        for i in range(start, end):
            slot = int(out_cache_loc[i])
            if slot < 0 or slot >= n_slots:
                continue
            tok, pos = int(input_ids[i]), int(positions[i])
            rkv = real_kv_hash(sources, mode, slot)
            if input_assert:
                et, ep = int(expected_tokens[i]), int(expected_positions[i])
                bits = (WRITE_TOKEN if tok != et else 0) | (WRITE_POSITION if pos != ep else 0)
                if bits:
                    st.append([tag, slot, pos, tok, et, running, ep, bits])
            if gate:
                want = s64(run_pos + 1)
                if pos != want:
                    st.append([tag, slot, pos, tok, tok, running, want, WRITE_POSITION])
                run_pos = pos
            write_record(st.buf, slot, [tok, pos, running, rkv])
            running = mix3(running, tok, pos)
            written += 1
    st.bump(tag, written)


def chain_prev_hashes(tokens: Sequence[int], positions: Sequence[int], seed_hash: int = ANCHOR_HASH) -> list[int]:
    """prev_hash each slot of a linear chain stores (uint64), plus the next running value at the end."""
    out = [seed_hash]
    for tok, pos in zip(tokens, positions, strict=True):
        out.append(mix3(out[-1], tok, pos))
    return out
