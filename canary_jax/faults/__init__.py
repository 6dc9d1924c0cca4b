"""Fault injection for your own serving stack: the bugs the KV canary exists to catch, as pure functions, plus a
host-side campaign tracker that says which faults were caught, how fast, and what fired falsely.

Every fault models a serving bug class SGLang's self-test perturbations inject (``python/sglang/srt/kv_canary/
perturb/``: ``real_kv_used``, ``real_kv_unused_cache``, ``real_kv_post_forward``, ``req_to_token``,
``next_token_swap``). The functions take arrays (numpy, or JAX and then jit-able, indices may be traced) and
return new ones; nothing is changed in place:

=========================  ===============================================  =====================================
function                   the bug                                          what catches it
=========================  ===============================================  =====================================
:func:`flip_kv_bits`       KV bytes of a slot change after they were        TAIL verify ``verify_real_kv_hash`` of
                           written: a slot a running request reads          the next step reading the slot
                           (``kv_flip_used``), a slot the step just wrote,  (the same for post-TAIL flips); an
                           after TAIL (``kv_flip_post_tail``), or a cached  orphan only by the SWEEP verify
                           slot no request reads (``kv_flip_orphan``)       (``sweep_interval > 0``)
:func:`remap_req_to_token`  a ``req_to_token`` entry points at another      HEAD/TAIL ``verify_position`` +
                           live slot (``r2t_remap``)                        ``verify_chain_hash``
:func:`remap_block_table`  a block-table (page-table) entry points at       the same, on every slot of the page
                           another page (``block_table_remap``)
:func:`swap_token`,        the token fed to the model differs from the      ``write_token`` (write input assert),
:func:`swap_tokens`        request's history (``token_swap``)               then ``verify_token`` (token oracle)
:func:`shift_position`     a token fed at the wrong position (``pos_shift``)  ``write_position``, then
                                                                              ``verify_position``
:func:`flip_canary_bits`   a canary record itself corrupted                 verify chain / position
=========================  ===============================================  =====================================

PARTIAL real-KV hashing sees only bytes ``[0, 16)`` of a slot; NONE sees no KV fault at all. SGLang's own
perturbation XORs ``0xFF`` into byte 0 of a slot (the defaults here).

The slot pickers (:func:`pick_used_slot`, :func:`pick_orphan_slot`, :func:`pick_written_slot`) choose targets
on the host from your batch metadata, and :class:`FaultCampaign` tracks episodes: inject, observe the violations
each step recorded (e.g. ``CanaryGuard(on_violations=campaign.observe)``), and :meth:`FaultCampaign.report`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from canary_jax import constants, ints, sources
from canary_jax.decode import ViolationRecord
from canary_jax.runtime import shapes

__all__ = [
    "BLOCK_TABLE_REMAP",
    "CANARY_CORRUPT",
    "FAULT_KINDS",
    "KV_FLIP_ORPHAN",
    "KV_FLIP_POST_TAIL",
    "KV_FLIP_USED",
    "POSITION_SHIFT",
    "REQ_TO_TOKEN_REMAP",
    "TOKEN_SWAP",
    "CampaignReport",
    "Episode",
    "FaultCampaign",
    "KindReport",
    "flip_canary_bits",
    "flip_kv_bits",
    "kind_report",
    "pick_orphan_slot",
    "pick_used_slot",
    "pick_written_slot",
    "reason_keys",
    "remap_block_table",
    "remap_req_to_token",
    "shift_position",
    "swap_token",
    "swap_tokens",
]

KV_FLIP_USED = "kv_flip_used"
KV_FLIP_POST_TAIL = "kv_flip_post_tail"
KV_FLIP_ORPHAN = "kv_flip_orphan"
REQ_TO_TOKEN_REMAP = "r2t_remap"
BLOCK_TABLE_REMAP = "block_table_remap"
TOKEN_SWAP = "token_swap"
POSITION_SHIFT = "pos_shift"
CANARY_CORRUPT = "canary_corrupt"
FAULT_KINDS = (
    KV_FLIP_USED,
    KV_FLIP_POST_TAIL,
    KV_FLIP_ORPHAN,
    REQ_TO_TOKEN_REMAP,
    BLOCK_TABLE_REMAP,
    TOKEN_SWAP,
    POSITION_SHIFT,
    CANARY_CORRUPT,
)


# --- array helpers ---------------------------------------------------------------------------------------
def _is_jax(x: Any) -> bool:
    return isinstance(x, jax.Array)


def _check_index(v: Any, name: str, size: int) -> None:
    """Refuses a concrete index that is not one int in ``[0, size)``, naming it (a traced index is left to
    ``mode="drop"``: out of range, it changes nothing)."""
    if shapes.is_traced(v):
        return
    if isinstance(v, bool) or not isinstance(v, (int, np.integer, np.ndarray, jax.Array)):
        raise TypeError(f"kv-canary: {name} must be an int, got {type(v).__name__}")
    a = np.asarray(v)
    if a.size != 1 or not np.issubdtype(a.dtype, np.integer):
        raise TypeError(f"kv-canary: {name} must be one integer, got {a.dtype} of shape {a.shape}")
    i = int(a.reshape(-1)[0])
    if not 0 <= i < size:
        raise ValueError(f"kv-canary: {name} must be in [0, {size}), got {i}")


def _set(x: Any, index: tuple, value: Any) -> Any:
    """A copy of ``x`` with ``x[index] = value`` (numpy) or ``x.at[index].set(value, mode="drop")`` (JAX)."""
    if _is_jax(x):
        return x.at[index].set(jnp.asarray(value).astype(x.dtype), mode="drop")
    out = np.array(x, copy=True)
    out[index] = value
    return out


def _check_array(x: Any, name: str, ndim: int) -> None:
    if not (_is_jax(x) or isinstance(x, np.ndarray)):
        raise TypeError(f"kv-canary: {name} must be a numpy or JAX array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"kv-canary: {name} must be {ndim}-D, got shape {tuple(x.shape)}")
    if not np.issubdtype(np.dtype(x.dtype), np.integer):
        raise TypeError(f"kv-canary: {name} must be an integer array, got dtype {x.dtype}")


# --- KV bytes --------------------------------------------------------------------------------------------
def _rows_bytes(tensor: Any) -> tuple[int, int]:
    rows = int(tensor.shape[0])
    return rows, int(np.prod(tensor.shape[1:], dtype=np.int64)) * sources.element_bits(tensor.dtype) // 8


def _to_bytes(t: jax.Array) -> jax.Array:
    """``t`` (JAX, >= 2-D) as ``uint8[rows, row_bytes]`` (bit casts, no arithmetic)."""
    rows = t.shape[0]
    flat = t.reshape(rows, -1)
    u8 = jax.lax.bitcast_convert_type(flat, jnp.uint8)
    return u8.reshape(rows, -1)


def _from_bytes(u8: jax.Array, like: jax.Array) -> jax.Array:
    rows = like.shape[0]
    itemsize = np.dtype(like.dtype).itemsize
    t = u8.reshape(rows, -1, itemsize) if itemsize > 1 else u8.reshape(rows, -1)
    return jax.lax.bitcast_convert_type(t, like.dtype).reshape(like.shape)


def flip_kv_bits(
    tensor: Any,
    slot: Any,
    *,
    page_size: int | None = None,
    num_bytes_per_token: int | None = None,
    byte: Any = 0,
    xor: int = 0xFF,
) -> Any:
    """XORs ``xor`` into byte ``byte`` of ``slot``'s KV bytes: ``u8[slot // page_size, (slot % page_size) *
    num_bytes_per_token + byte] ^= xor``, where ``u8`` is the tensor viewed as ``uint8[rows, row_bytes]`` (the
    addressing of a :class:`~canary_jax.sources.RealKvSource`, SPEC 3; SGLang's ``flip_first_byte_in_source``
    with ``byte=0, xor=0xFF``). For a chunked source (``RealKvSource.chunks``, canary-jax's extension) ``byte``
    indexes the slot's hashed sequence: chunk ``byte // chunk_bytes``, which starts ``offset_bytes + c *
    chunk_stride_bytes`` bytes after the slot's first byte in the tensor's flat bytes.

    Args:
      tensor: the KV buffer (numpy or JAX, any dtype of 1 byte or more per element, >= 2-D; dim 0 = pages), or
        a RealKvSource (its tensor, page size, bytes per token and chunks are used).
      slot: the KV slot (int, or a traced int32 inside ``jit``: then an out-of-range slot changes nothing).
      page_size: slots per row (default 1, or the source's).
      num_bytes_per_token: bytes each slot owns in its row (default ``row_bytes // page_size``, or the
        source's).
      byte: the byte within the slot, in ``[0, num_bytes_per_token)`` (chunked: ``[0, num_chunks *
        chunk_bytes)``, and a Python int); may be traced for a dense layout. Bytes ``>= 16`` are seen only by
        ALL hashing (and only below the source's ``read_bytes``).
      xor: the bit mask, in ``[1, 255]`` (``1 << b`` flips bit b).

    Returns:
      A new array of the tensor's dtype and shape (numpy in, numpy out; JAX in, JAX out).

    Raises:
      TypeError: a tensor that is not an array or RealKvSource, or non-int indices.
      ValueError: a tensor below 2-D, bad page_size / num_bytes_per_token / xor, or a concrete slot or byte
        out of range; naming the argument.
      NotImplementedError: a packed sub-byte dtype (``int4``), or a traced ``byte`` of a chunked source.
    """
    chunks = None
    if isinstance(tensor, sources.RealKvSource):
        page_size = tensor.page_size if page_size is None else page_size
        num_bytes_per_token = tensor.num_bytes_per_token if num_bytes_per_token is None else num_bytes_per_token
        chunks = getattr(tensor, "chunks", None)
        tensor = tensor.tensor
    if not (_is_jax(tensor) or isinstance(tensor, np.ndarray)):
        raise TypeError(
            f"kv-canary: tensor must be a numpy or JAX array or a RealKvSource, got {type(tensor).__name__}"
        )
    if tensor.ndim < 2:
        raise ValueError(f"kv-canary: tensor must be at least 2-D, got shape {tuple(tensor.shape)}")
    if sources.element_bits(tensor.dtype) < 8:
        raise NotImplementedError(f"kv-canary: flip_kv_bits does not address packed sub-byte dtypes ({tensor.dtype})")
    rows, row_bytes = _rows_bytes(tensor)
    ps = 1 if page_size is None else ints.check_int(page_size, name="page_size")
    if ps < 1:
        raise ValueError(f"kv-canary: page_size must be >= 1, got {ps}")
    nbpt = (
        row_bytes // ps
        if num_bytes_per_token is None
        else ints.check_int(num_bytes_per_token, name="num_bytes_per_token")
    )
    if nbpt < 1 or (chunks is None and ps * nbpt > row_bytes):
        raise ValueError(
            f"kv-canary: num_bytes_per_token must be in [1, row_bytes / page_size = {row_bytes // ps}], got {nbpt}"
        )
    x = ints.check_int(xor, name="xor")
    if not 1 <= x <= 255:
        raise ValueError(f"kv-canary: xor must be in [1, 255], got {x}")
    _check_index(slot, "slot", rows * ps)
    # The byte's place past the slot's first byte, split into whole rows and a remainder (no int32 overflow).
    if chunks is None:
        _check_index(byte, "byte", nbpt)
        extra_rows, extra = 0, byte
    else:
        if shapes.is_traced(byte):
            raise NotImplementedError("kv-canary: flip_kv_bits needs a concrete byte for a chunked source")
        _check_index(byte, "byte", chunks.num_chunks * chunks.chunk_bytes)
        c, w = divmod(int(np.asarray(byte)), chunks.chunk_bytes)
        extra_rows, extra = divmod(chunks.offset_bytes + c * chunks.chunk_stride_bytes + w, row_bytes)
    if _is_jax(tensor):
        s = jnp.asarray(slot, jnp.int32)
        at = (s % ps) * nbpt + jnp.asarray(extra, jnp.int32)
        row, col = s // ps + extra_rows + at // row_bytes, at % row_bytes
        u8 = _to_bytes(tensor)
        u8 = u8.at[row, col].set(u8[row, col] ^ jnp.uint8(x), mode="drop")
        return _from_bytes(u8, tensor)
    s = int(np.asarray(slot))
    at = (s % ps) * nbpt + int(np.asarray(extra))
    row, col = s // ps + extra_rows + at // row_bytes, at % row_bytes
    if row >= rows:
        raise ValueError(f"kv-canary: byte {int(np.asarray(byte))} of slot {s} lies past the tensor's {rows} rows")
    out = np.array(tensor, copy=True)
    out.view(np.uint8).reshape(rows, -1)[row, col] ^= np.uint8(x)
    return out


def flip_canary_bits(canary_buf: Any, slot: Any, *, field: int, bit: Any) -> Any:
    """Flips bit ``bit`` of field ``field`` of ``slot``'s canary record (a corrupted canary buffer):
    ``canary_buf[slot, 8 * field + bit // 8] ^= 1 << (bit % 8)`` (fields are little-endian int64, SPEC 1.1).

    Args:
      canary_buf: ``uint8[num_slots, stride >= 32]`` (numpy or JAX).
      slot: the slot (may be traced).
      field: 0 token, 1 position, 2 prev_hash, 3 real_kv_hash (``canary_jax.constants.CANARY_FIELD_*``).
      bit: the bit of the int64 field, in ``[0, 64)`` (may be traced).

    Returns:
      A new buffer.

    Raises:
      TypeError / ValueError: a buffer that is not ``uint8[N, >= 32]``, or a field, slot or bit out of range.
    """
    if not (_is_jax(canary_buf) or isinstance(canary_buf, np.ndarray)):
        raise TypeError(f"kv-canary: canary_buf must be a numpy or JAX array, got {type(canary_buf).__name__}")
    if canary_buf.ndim != 2 or np.dtype(canary_buf.dtype) != np.uint8 or canary_buf.shape[1] < 32:
        raise ValueError(
            f"kv-canary: canary_buf must be uint8[num_slots, >= 32], got {canary_buf.dtype} {tuple(canary_buf.shape)}"
        )
    f = ints.check_int(field, name="field")
    if not 0 <= f < constants.CANARY_FIELDS_PER_SLOT:
        raise ValueError(f"kv-canary: field must be in [0, {constants.CANARY_FIELDS_PER_SLOT}), got {f}")
    _check_index(slot, "slot", int(canary_buf.shape[0]))
    _check_index(bit, "bit", 64)
    if _is_jax(canary_buf):
        b = jnp.asarray(bit, jnp.int32)
        col = 8 * f + b // 8
        mask = jnp.left_shift(jnp.uint8(1), (b % 8).astype(jnp.uint8))
        s = jnp.asarray(slot, jnp.int32)
        return canary_buf.at[s, col].set(canary_buf[s, col] ^ mask, mode="drop")
    out = np.array(canary_buf, copy=True)
    out[int(slot), 8 * f + int(bit) // 8] ^= np.uint8(1 << (int(bit) % 8))
    return out


# --- metadata --------------------------------------------------------------------------------------------
def remap_req_to_token(req_to_token: Any, *, row: Any, position: Any, slot: Any) -> Any:
    """``req_to_token[row, position] = slot``: a request's position now points at another slot (SGLang's
    ``req_to_token`` perturbation: another active request's slot).

    Args:
      req_to_token: ``int32[max_reqs, max_seq_len]`` (numpy or JAX).
      row: the request's ``req_pool_index``; position: the position; slot: the new slot.

    Returns:
      A new table.

    Raises:
      TypeError / ValueError: not a 2-D integer array, or a concrete row / position out of range.
    """
    _check_array(req_to_token, "req_to_token", 2)
    _check_index(row, "row", int(req_to_token.shape[0]))
    _check_index(position, "position", int(req_to_token.shape[1]))
    return _set(req_to_token, (row, position), slot)


def remap_block_table(block_table: Any, *, row: Any, block: Any, page: Any) -> Any:
    """``block_table[row, block] = page``: every slot of a request's block now reads another page (the paged
    form of :func:`remap_req_to_token`).

    Args:
      block_table: ``int32[max_reqs, max_blocks]`` page indices (numpy or JAX).
      row, block: the entry; page: the new page.

    Returns:
      A new table.

    Raises:
      TypeError / ValueError: as :func:`remap_req_to_token`.
    """
    _check_array(block_table, "block_table", 2)
    _check_index(row, "row", int(block_table.shape[0]))
    _check_index(block, "block", int(block_table.shape[1]))
    return _set(block_table, (row, block), page)


def swap_token(input_ids: Any, *, index: Any, token: Any) -> Any:
    """``input_ids[index] = token``: the model is fed a token the request never had.

    Raises:
      TypeError / ValueError: not a 1-D integer array, or a concrete index out of range.
    """
    _check_array(input_ids, "input_ids", 1)
    _check_index(index, "index", int(input_ids.shape[0]))
    return _set(input_ids, (index,), token)


def swap_tokens(input_ids: Any, i: Any, j: Any) -> Any:
    """Exchanges ``input_ids[i]`` and ``input_ids[j]`` (SGLang's ``next_token_swap``: two requests' sampled
    tokens trade places).

    Raises:
      TypeError / ValueError: as :func:`swap_token`.
    """
    _check_array(input_ids, "input_ids", 1)
    _check_index(i, "i", int(input_ids.shape[0]))
    _check_index(j, "j", int(input_ids.shape[0]))
    if _is_jax(input_ids):
        a, b = input_ids[i], input_ids[j]
        return input_ids.at[i].set(b).at[j].set(a)
    out = np.array(input_ids, copy=True)
    out[[int(i), int(j)]] = out[[int(j), int(i)]]
    return out


def shift_position(positions: Any, *, index: Any, delta: Any = 1) -> Any:
    """``positions[index] += delta``: a token fed at the wrong position (EAGLE's draft-position bug class).

    Raises:
      TypeError / ValueError: as :func:`swap_token`.
    """
    _check_array(positions, "positions", 1)
    _check_index(index, "index", int(positions.shape[0]))
    return _set(positions, (index,), positions[index] + delta)


# --- slot pickers (host) ---------------------------------------------------------------------------------
def _np64(x: Any, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim >= 1 and a.shape[-1:] == (2,) and a.dtype == np.uint32 and a.ndim == 2:
        return ints.pairs_to_int64_np(a)
    return ints.exact_int64_np(a, name=name).reshape(-1)


def _mapped(req_to_token: Any, req_pool_indices: Any, lens: Any) -> list[tuple[int, int, int]]:
    """``(slot, req_pool_index, position)`` for positions ``< lens[r]`` of every non-padding row."""
    r2t = np.asarray(req_to_token)
    rpi = _np64(req_pool_indices, "req_pool_indices")
    n = _np64(lens, "lens")
    if rpi.shape != n.shape:
        raise ValueError(f"kv-canary: req_pool_indices has {rpi.size} entries but the lengths have {n.size}")
    out = []
    for r, m in zip(rpi.tolist(), n.tolist()):
        if r == 0:
            continue
        out += [(int(r2t[r, p]), r, p) for p in range(min(m, r2t.shape[1]))]
    return out


def pick_used_slot(
    rng: np.random.Generator, *, req_to_token: Any, req_pool_indices: Any, prefix_lens: Any
) -> tuple[int, int, int] | None:
    """A slot the next step verifies: ``(slot, req_pool_index, position)`` drawn from the verified prefixes
    (positions ``< prefix_lens``) of the batch's rows, slot 0 excluded; None if there is none.

    Flip its KV before that step and the step's TAIL verify reports ``verify_real_kv_hash``.
    """
    cands = [c for c in _mapped(req_to_token, req_pool_indices, prefix_lens) if c[0] != 0]
    return None if not cands else cands[int(rng.integers(len(cands)))]


def pick_written_slot(rng: np.random.Generator, *, out_cache_loc: Any, num_tokens: int | None = None) -> int | None:
    """A slot the last step wrote (SGLang's ``pick_out_cache_loc_slot``), padding slot 0 excluded; None if none.

    Flip its KV after the step (after TAIL stamped its fingerprint): the next step that reads it reports it.
    """
    loc = _np64(out_cache_loc, "out_cache_loc")
    if num_tokens is not None:
        loc = loc[: int(num_tokens)]
    cands = [int(s) for s in loc.tolist() if s > 0]
    return None if not cands else cands[int(rng.integers(len(cands)))]


def pick_orphan_slot(
    rng: np.random.Generator,
    *,
    cached_slots: Sequence[int],
    req_to_token: Any = None,
    req_pool_indices: Any = None,
    seq_lens: Any = None,
) -> int | None:
    """A cached slot no live request maps (SGLang's ``real_kv_unused_cache``): drawn from ``cached_slots``
    (e.g. a prefix cache's slots) minus every slot of ``req_to_token``'s live rows (positions ``< seq_lens``);
    slot 0 excluded; None if there is none. Only a sweep sees a flip of it.
    """
    live = set()
    if req_to_token is not None:
        live = {s for s, _, _ in _mapped(req_to_token, req_pool_indices, seq_lens)}
    cands = sorted({int(s) for s in np.asarray(cached_slots).reshape(-1).tolist()} - live - {0})
    return None if not cands else cands[int(rng.integers(len(cands)))]


# --- the campaign tracker (host) -------------------------------------------------------------------------
def reason_keys(records: Sequence[ViolationRecord]) -> collections.Counter:
    """``"TAG:reason"`` -> rows, one count per (row, fail reason); rows without a reason count as ``none``."""
    out: collections.Counter = collections.Counter()
    for r in records:
        for reason in r.reasons or ["none"]:
            out[f"{r.tag}:{reason}"] += 1
    return out


@dataclasses.dataclass
class Episode:
    """One fault's run from injection to detection (or not).

    Fields:
      kind: the fault kind (any string; :data:`FAULT_KINDS` names the standard ones).
      label: a free label (e.g. ``"kv_flip_used#2"``).
      injected, inject_step: whether / at which step the fault was injected (the first step that ran with it).
      detected, detect_step, steps_to_detect: the first violation recorded at or after ``inject_step``; latency
        in steps (0 = the step the fault was injected before caught it).
      reasons: ``"TAG:reason"`` -> rows, over every violation after the injection.
      violations: rows recorded after the injection.
      false_positives: rows recorded before the injection (nothing was broken yet).
      details: what the injection said it broke.
      first_violation: the first record attributed to the fault.
    """

    kind: str
    label: str = ""
    injected: bool = False
    inject_step: int | None = None
    detected: bool = False
    detect_step: int | None = None
    steps_to_detect: int | None = None
    reasons: dict = dataclasses.field(default_factory=dict)
    violations: int = 0
    false_positives: int = 0
    details: dict = dataclasses.field(default_factory=dict)
    first_violation: ViolationRecord | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class KindReport:
    """The campaign's row for one fault kind.

    Fields:
      kind: the fault kind; trials: episodes; injected / detected: how many.
      steps_to_detect: each detected episode's latency in steps; mean / max of them (None if none).
      fail_reasons: ``"TAG:reason"`` -> rows, summed over the kind's episodes.
    """

    kind: str
    trials: int
    injected: int
    detected: int
    steps_to_detect: tuple[int, ...]
    mean_steps_to_detect: float | None
    max_steps_to_detect: int | None
    fail_reasons: dict


def kind_report(kind: str, episodes: Sequence[Any]) -> KindReport:
    """Aggregates episodes (:class:`Episode`, or anything with ``injected``, ``detected``, ``steps_to_detect``
    and ``reasons``) of one kind."""
    lat = tuple(int(e.steps_to_detect) for e in episodes if e.steps_to_detect is not None)
    reasons: collections.Counter = collections.Counter()
    for e in episodes:
        reasons.update(e.reasons)
    return KindReport(
        kind=kind,
        trials=len(episodes),
        injected=sum(bool(e.injected) for e in episodes),
        detected=sum(bool(e.detected) for e in episodes),
        steps_to_detect=lat,
        mean_steps_to_detect=round(statistics.fmean(lat), 2) if lat else None,
        max_steps_to_detect=max(lat) if lat else None,
        fail_reasons=dict(sorted(reasons.items())),
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CampaignReport:
    """Detected per kind, steps to detection, false positives (what ``canary-jax demo`` prints).

    Fields:
      kinds: one :class:`KindReport` per kind, in first-injected order.
      false_positives: rows recorded while no fault was active (outside episodes, or before an episode's
        injection).
      false_positive_reasons: ``"TAG:reason"`` -> rows of those.
    """

    kinds: tuple[KindReport, ...]
    false_positives: int
    false_positive_reasons: dict

    @property
    def ok(self) -> bool:
        """Every injected fault detected and no false positive."""
        return self.false_positives == 0 and all(k.detected == k.injected for k in self.kinds)

    def lines(self) -> list[str]:
        """A plain-text table: kind, injected, detected, steps to detect, fail reasons; then the false
        positives."""
        head = ("fault kind", "injected", "detected", "steps to detect", "fail reasons")
        rows = [
            (
                k.kind,
                str(k.injected),
                str(k.detected),
                ",".join(str(x) for x in k.steps_to_detect) or "-",
                " ".join(k.fail_reasons) or "-",
            )
            for k in self.kinds
        ]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
        out = [fmt(head)] + [fmt(r) for r in rows]
        out.append(f"false positives: {self.false_positives}")
        return out


class FaultCampaign:
    """Host-side bookkeeping of a fault campaign: episodes of one injected fault each, and the violations each
    step recorded.

    Usage::

        campaign = FaultCampaign()
        guard = CanaryGuard(step_fn, ..., mode="log", on_violations=campaign.observe)
        with campaign.episode("kv_flip_used"):
            ...                                             # clean steps: any violation is a false positive
            kv = flip_kv_bits(kv, slot)
            campaign.injected(step=guard.step_index, slot=slot)
            ...                                             # steps until the guard reports it
        print("\\n".join(campaign.report().lines()))

    Violations are attributed by the step that *recorded* them (:class:`~canary_jax.integration.CanaryGuard`
    reports them one step late, with that step): before the episode's injection step they are false positives,
    from it on the fault's detection.
    """

    def __init__(self) -> None:
        self.episodes: list[Episode] = []
        self.current: Episode | None = None
        self.false_positives = 0
        self.false_positive_reasons: collections.Counter = collections.Counter()

    def begin(self, kind: str, *, label: str = "") -> Episode:
        """Starts an episode for one fault of ``kind``.

        Raises:
          RuntimeError: an episode is still open (call :meth:`end` first).
        """
        if self.current is not None:
            raise RuntimeError(f"kv-canary: episode {self.current.label!r} is still open; end it first")
        self.current = Episode(kind=str(kind), label=label or str(kind))
        self.episodes.append(self.current)
        return self.current

    def injected(self, *, step: int, **details: Any) -> None:
        """Marks the open episode's fault as injected before step ``step`` (the first step that runs with it).

        Raises:
          RuntimeError: no open episode, or its fault was already injected.
        """
        ep = self.current
        if ep is None:
            raise RuntimeError("kv-canary: injected() outside an episode; call begin(kind) first")
        if ep.injected:
            raise RuntimeError(f"kv-canary: episode {ep.label!r} already injected its fault at step {ep.inject_step}")
        ep.injected, ep.inject_step, ep.details = True, int(step), dict(details)

    def observe(self, records: Sequence[ViolationRecord], *, step: int) -> None:
        """Attributes the violations recorded by step ``step`` (0-based; the guard's ``on_violations``)."""
        records = list(records)
        if not records:
            return
        ep = self.current
        if ep is None or not ep.injected or int(step) < ep.inject_step:
            if ep is None:
                self.false_positives += len(records)
            else:
                ep.false_positives += len(records)
            self.false_positive_reasons.update(reason_keys(records))
            return
        ep.violations += len(records)
        ep.reasons = dict(collections.Counter(ep.reasons) + reason_keys(records))
        if not ep.detected:
            ep.detected, ep.detect_step = True, int(step)
            ep.steps_to_detect = int(step) - ep.inject_step
            ep.first_violation = records[0]

    def end(self) -> Episode:
        """Closes the open episode and returns it.

        Raises:
          RuntimeError: no open episode.
        """
        if self.current is None:
            raise RuntimeError("kv-canary: end() without an open episode")
        ep, self.current = self.current, None
        return ep

    @contextlib.contextmanager
    def episode(self, kind: str, *, label: str = "") -> Iterator[Episode]:
        """``begin`` ... ``end`` as a context manager."""
        ep = self.begin(kind, label=label)
        try:
            yield ep
        finally:
            if self.current is ep:
                self.end()

    def report(self) -> CampaignReport:
        """Per kind (in first-seen order): injected, detected, steps to detect, fail reasons; false positives."""
        kinds: dict[str, list[Episode]] = {}
        for ep in self.episodes:
            kinds.setdefault(ep.kind, []).append(ep)
        return CampaignReport(
            kinds=tuple(kind_report(k, eps) for k, eps in kinds.items()),
            false_positives=self.false_positives + sum(ep.false_positives for ep in self.episodes),
            false_positive_reasons=dict(sorted(self.false_positive_reasons.items())),
        )
