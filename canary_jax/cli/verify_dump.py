"""Decoding canary state dumps (``canary-jax verify-dump``).

A dump is a ``.npy`` array or an ``.npz`` archive. Recognised contents:

* a canary-jax dump (:mod:`canary_jax.dump`, written by ``canary-jax demo --dump``,
  :meth:`canary_jax.integration.CanaryGuard.dump` or :func:`canary_jax.dump.save_dump`): the ring and its write
  index, every group's HEAD / TAIL canary buffers (``g{i}_{k,v}_{head,tail}``), their SWA LUT and window, the
  real KV as bytes (``g{i}_{k,v}_src{j}``) and the live requests.
* a violation ring: ``int64[R, 8]`` (SGLang's layout, e.g. ``state.violation_log.ring.cpu().numpy()``) or
  canary-jax's ``uint32[R, 8, 2]``; in an ``.npz`` under ``ring`` / ``violation_ring`` with the count under
  ``write_index`` / ``violation_write_index``. Without a count, the rows up to the last row with any non-zero
  column are taken (the ring is fill-once and zero-initialised), with a warning: trailing all-zero rows and
  an overflow cannot be seen that way.
* canary buffers: ``uint8[num_slots, stride >= 32]`` (a bare ``.npy``, or ``canary_buf`` / ``head_buf`` /
  ``tail_buf`` / ``k_head`` / ``k_tail`` / ``v_head`` / ``v_tail`` in an ``.npz``; older demo dumps carry the
  layer-0 K bytes as ``k_buffer`` with ``page_size``).

With ``req_to_token`` (``int32[rows, L]``), ``req_pool_indices`` and ``seq_lens`` in the archive each buffer is
verified like a per-forward verify of those requests (SPEC 7.1 plans; SWA groups through their LUT and window);
with the real KV the TAIL buffers' real-KV fingerprints are checked too. Without the batch metadata a buffer
gets a chain-link census instead: every record's ``prev_hash`` should be the chain hash of some record at the
previous position (freed slots keep stale records, so breaks are hints, not proof).

Every message starts with SGLang's text, byte for byte. What the 8-column ring row cannot carry follows as
extra lines (:func:`canary_jax.decode.format_detail`): the position the failing verify entry expected, the
stored and the recomputed real-KV hash of the slot where they differ (recomputed from the KV as dumped), and
where ``req_to_token`` maps the slot. Rows identical in all 8 columns (one fault reported again by later steps)
are printed once, with a ``kv_canary violation repeated: ... count=N`` line.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from canary_jax import constants, decode, hashing, ints, pairs
from canary_jax import dump as dump_lib
from canary_jax import sources as sources_lib
from canary_jax.decode import decode_violations, recorded_rows
from canary_jax.dump import DumpError
from canary_jax.runtime.groups import PoolKind

__all__ = ["DumpError", "chain_census", "load_and_report"]

_RING_KEYS = ("ring", "violation_ring")
_INDEX_KEYS = ("write_index", "violation_write_index")
_LEGACY_BUF_KEYS = ("canary_buf", "head_buf", "tail_buf", "k_head", "k_tail", "v_head", "v_tail")
_RKV = int(constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_POS = int(constants.FailReason.VERIFY_POSITION_MISMATCH)
_VERIFY_BITS = int(
    constants.FailReason.VERIFY_CHAIN_HASH_MISMATCH
    | constants.FailReason.VERIFY_POSITION_MISMATCH
    | constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    | constants.FailReason.VERIFY_TOKEN_MISMATCH
)


# --- what the file holds ---------------------------------------------------------------------------------
@dataclasses.dataclass
class _Buffer:
    """One canary buffer of the dump and what is known about it."""

    name: str
    array: np.ndarray
    kind: PoolKind
    half: str  # "K" / "V"
    phase: str  # "HEAD" / "TAIL"
    lut: np.ndarray | None  # int64 host LUT of an SWA group
    window: int
    offset: int
    sources: tuple  # the half's real-KV sources (TAIL and SWEEP hash them)

    @property
    def tag(self) -> constants.CanaryLaunchTag:
        return constants.CanaryLaunchTag[f"{self.phase}_{self.half}_{self.kind.name}"]


def _is_ring(a: np.ndarray) -> bool:
    return (
        a.ndim == 2 and a.shape[1] == constants.VIOLATION_FIELDS and a.dtype.kind in "iu" and a.dtype.itemsize == 8
    ) or (
        a.ndim == 3
        and a.shape[1:] == (constants.VIOLATION_FIELDS, 2)
        and a.dtype.itemsize == 4
        and a.dtype.kind in "iu"
    )


def _is_canary_buf(a: np.ndarray) -> bool:
    return a.ndim == 2 and a.dtype == np.uint8 and a.shape[1] >= constants.CANARY_SLOT_BYTES and a.shape[1] % 8 == 0


def _ring_as_int64(a: np.ndarray) -> np.ndarray:
    return ints.pairs_to_int64_np(a) if a.ndim == 3 else a.astype(np.int64)


def _int(data: dict, key: str, default: int) -> int:
    return int(np.asarray(data.get(key, default)).reshape(-1)[0])


def _buffers(data: dict) -> list[_Buffer]:
    """The canary buffers of a dump, new format (groups) or legacy (single FULL group)."""
    out = []
    if dump_lib.VERSION_KEY in data:
        for i in range(_int(data, "num_groups", 0)):
            p = f"g{i}_"
            kind = PoolKind(_int(data, p + "kind", 0))
            lut = data.get(p + "swa_index_lut")
            for half in ("k", "v"):
                srcs = dump_lib.group_sources(data, i, half)
                for phase in ("head", "tail"):
                    name = f"{p}{half}_{phase}"
                    if name in data:
                        out.append(
                            _Buffer(
                                name=name,
                                array=data[name],
                                kind=kind,
                                half=half.upper(),
                                phase=phase.upper(),
                                lut=None if lut is None else np.asarray(lut, np.int64),
                                window=_int(data, p + "swa_window_size", 0),
                                offset=_int(data, p + "kv_token_id_vs_position_offset", 0),
                                sources=srcs if phase == "tail" else (),
                            )
                        )
        return out
    names = [k for k in _LEGACY_BUF_KEYS if k in data]
    if not names and "" in data and _is_canary_buf(data[""]):
        data = {"canary_buf": data[""]}
        names = ["canary_buf"]
    k_buffer = data.get("k_buffer")
    page_size = _int(data, "page_size", 1)
    for name in names:
        phase = "TAIL" if "tail" in name else "HEAD"
        half = "V" if name.startswith("v_") else "K"
        srcs = ()
        if phase == "TAIL" and half == "K" and k_buffer is not None:
            k = np.ascontiguousarray(k_buffer).view(np.uint8).reshape(k_buffer.shape[0], -1)
            nbpt = k.shape[1] // page_size
            srcs = (sources_lib.RealKvSource(tensor=k, page_size=page_size, num_bytes_per_token=nbpt, read_bytes=nbpt),)
        out.append(_Buffer(name, data[name], PoolKind.FULL, half, phase, None, 0, 0, srcs))
    return out


# --- host helpers ----------------------------------------------------------------------------------------
def _records(buf: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(buf[:, : constants.CANARY_SLOT_BYTES])
    return arr.view("<i8").reshape(buf.shape[0], 4)


def _mix3_np(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    def sm(x):
        x = x.astype(np.uint64)
        with np.errstate(over="ignore"):
            x = (x ^ (x >> np.uint64(30))) * np.uint64(constants.SPLITMIX64_MUL1)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(constants.SPLITMIX64_MUL2)
        return x ^ (x >> np.uint64(31))

    h = sm(a.view(np.uint64))
    h = sm(h ^ b.view(np.uint64))
    return sm(h ^ c.view(np.uint64))


def _anchor_signed() -> int:
    a = hashing.splitmix64_python(constants.CANARY_CHAIN_ANCHOR)
    return a - (1 << 64) if a >= 1 << 63 else a


def chain_census(buf: np.ndarray) -> dict[str, Any]:
    """Counts records whose ``prev_hash`` matches no record at the previous position (slot 0 excluded)."""
    rec = _records(buf)
    used = np.any(rec != 0, axis=1)
    used[0] = False
    idx = np.nonzero(used)[0]
    tok, pos, prev = rec[idx, 0], rec[idx, 1], rec[idx, 2]
    chain = _mix3_np(prev.copy(), tok.copy(), pos.copy())
    known = set(zip(pos.tolist(), chain.view(np.int64).tolist()))
    anchor = _anchor_signed()
    broken = []
    for s, p, ph in zip(idx.tolist(), pos.tolist(), prev.tolist()):
        ok = (ph == anchor) if p == 0 else ((p - 1, ph) in known)
        if not ok:
            broken.append(dict(slot=s, position=p))
    return dict(records=int(idx.size), broken_links=len(broken), broken=broken[:50])


def _chain_of(rec: np.ndarray, prev: int) -> int:
    """The prev_hash a successor of ``prev`` must store (signed): the anchor hash for ``prev < 0``; an
    out-of-range slot reads as an all-zero record (the reference's rule)."""
    if prev < 0:
        return _anchor_signed()
    if prev >= rec.shape[0]:
        return 0
    t, p, h, _ = rec[prev]
    return int(_mix3_np(np.array([h]), np.array([t]), np.array([p])).view(np.int64)[0])


def _recompute_real_kv(srcs: tuple, mode: constants.RealKvHashMode, slots: list[int]) -> dict[int, int]:
    """``slot -> real_kv_hash`` (signed) of the sources' bytes as dumped (canary-jax's own reference hash)."""
    if not slots:
        return {}
    descs = sources_lib.check_real_kv_sources(srcs, mode)
    dev = sources_lib.device_sources(srcs)
    u = sources_lib.real_kv_hash_reference([s.tensor for s in dev], descs, jax.device_put(np.asarray(slots, np.int32)))
    vals = ints.pairs_to_int64_np(np.asarray(pairs.pack(u)))
    return dict(zip(slots, vals.tolist()))


def _live_map(meta: dict | None, lut: np.ndarray | None) -> dict[int, list[tuple[int, int]]]:
    """``slot -> [(req_pool_index, position), ...]`` over the live requests (SWA slots through ``lut``)."""
    if meta is None:
        return {}
    r2t = np.asarray(meta["req_to_token"])
    out: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)
    for r, n in zip(meta["rpi"].tolist(), meta["lens"].tolist()):
        if r == 0 or not 0 <= r < r2t.shape[0]:
            continue
        for p in range(min(n, r2t.shape[1])):
            s = int(r2t[r, p])
            if lut is not None:
                s = int(lut[min(max(s, 0), lut.shape[0] - 1)]) if s >= 0 else s
            out[s].append((r, p))
    return out


# --- details of rows -------------------------------------------------------------------------------------
def _ring_details(
    recs: list, bufs: list[_Buffer], meta: dict | None, mode: constants.RealKvHashMode
) -> dict[int, decode.ViolationDetail]:
    """Details of ring rows from the dump's buffers, KV and requests (all as dumped): one hash launch and one
    ``req_to_token`` scan per buffer, whatever the number of rows."""
    by_tag = {b.tag: b for b in bufs}
    owner: dict[int, _Buffer] = {}
    for r in recs:
        try:
            tag = constants.CanaryLaunchTag(r.kernel_kind)
        except ValueError:
            continue
        phase = "HEAD" if tag.is_head else "TAIL"  # SWEEP rows read the TAIL buffer
        b = by_tag.get(constants.CanaryLaunchTag[f"{phase}_{'V' if tag.is_v_half else 'K'}_{tag.group}"])
        if b is not None:
            owner[r.index] = b
    maps, hashes = {}, {}
    for b in {id(b): b for b in owner.values()}.values():
        maps[b.name] = _live_map(meta, b.lut if b.kind is PoolKind.SWA else None)
        if b.sources and mode != constants.RealKvHashMode.NONE:
            slots = sorted({r.slot_idx for r in recs if owner.get(r.index) is b and 0 <= r.slot_idx < b.array.shape[0]})
            hashes[b.name] = (_records(b.array)[:, 3], _recompute_real_kv(b.sources, mode, slots))
    out = {}
    for r in recs:
        b = owner.get(r.index)
        if b is None:
            continue
        mapped = tuple(maps[b.name].get(r.slot_idx, ()))
        positions = {p for _, p in mapped}
        exp_pos = next(iter(positions)) if (len(positions) == 1 and r.fail_reason_bits & _VERIFY_BITS) else None
        stored = recomputed = None
        if b.name in hashes and r.slot_idx in hashes[b.name][1]:
            stored, recomputed = int(hashes[b.name][0][r.slot_idx]), hashes[b.name][1][r.slot_idx]
            if stored == recomputed and not r.fail_reason_bits & _RKV:
                stored = recomputed = None
        d = decode.ViolationDetail(
            expected_position=exp_pos, stored_real_kv_hash=stored, recomputed_real_kv_hash=recomputed, mapped_at=mapped
        )
        if not d.empty:
            out[r.index] = d
    return out


def _match_entries(recs: list, rec: np.ndarray, slots, positions, prevs) -> dict[int, int]:
    """``row index -> plan entry`` for a verify launch's rows: rows come in ascending entry order, one per
    failing entry, so each row is the next entry of its slot whose expected position and expected chain hash
    agree with the row (the position bit set iff the positions differ; ``expected_aux`` is the chain hash of
    the entry's predecessor, or the stored prev_hash when it has none)."""
    out, j = {}, 0
    for r in recs:
        stored_prev = int(rec[r.slot_idx, 2]) if 0 <= r.slot_idx < rec.shape[0] else 0
        while j < len(slots):
            s, p, pv = int(slots[j]), int(positions[j]), int(prevs[j])
            j += 1
            if s != r.slot_idx or bool(r.fail_reason_bits & _POS) != (p != r.position):
                continue
            if (_chain_of(rec, pv) if pv != 0 else stored_prev) == r.expected_aux:
                out[r.index] = j - 1
                break
    return out


# --- re-verifying a buffer -------------------------------------------------------------------------------
def _verify_buffer(b: _Buffer, meta: dict, mode: constants.RealKvHashMode):
    from canary_jax import launch
    from canary_jax.layout import ViolationLog
    from canary_jax.plan_builder import build_plans
    from canary_jax.plans import VerifyOrWriteContext

    rpi, lens = meta["rpi"], meta["lens"]
    keep = rpi != 0
    rpi, lens = rpi[keep], lens[keep]
    cap = max(1, int(lens.sum()))
    swa = b.kind is PoolKind.SWA
    vplan, _ = build_plans(
        req_pool_indices=rpi,
        prefix_lens=lens,
        extend_seq_lens=np.zeros_like(lens),
        req_to_token=meta["req_to_token"],
        verify_capacity=cap,
        write_req_capacity=max(1, rpi.size),
        swa_window_size=b.window if swa else 0,
        full_to_swa_index_mapping=b.lut if swa else None,
        kv_token_id_vs_position_offset=b.offset,
    )
    buf = np.array(b.array)
    srcs: tuple = ()
    if b.phase == "TAIL" and b.sources and mode != constants.RealKvHashMode.NONE:
        srcs, checked_rkv = b.sources, True
    else:
        # Without the KV bytes the stored fingerprints cannot be recomputed: blank them (NONE compares with 0).
        rec = np.ascontiguousarray(buf[:, : constants.CANARY_SLOT_BYTES]).copy()
        rec[:, 24:32] = 0
        buf[:, : constants.CANARY_SLOT_BYTES] = rec
        mode, checked_rkv = constants.RealKvHashMode.NONE, False
    ctx = VerifyOrWriteContext(
        canary_buf=jax.device_put(buf),
        kernel_kind=b.tag,
        log=ViolationLog.allocate(ring_capacity=cap),
        real_kv_sources=srcs,
        real_kv_hash_mode=mode,
    )
    ctx = launch.verify(ctx, vplan, backend="reference")
    # Details: the plan entry behind each row (its expected position), and both fingerprints of the slot.
    n = int(np.asarray(vplan.verify_num_valid).reshape(-1)[0]) if int(np.asarray(vplan.enable).reshape(-1)[0]) else 0
    plan = [
        ints.pairs_to_int64_np(np.asarray(a))[:n]
        for a in (vplan.verify_slot_indices, vplan.verify_expected_positions, vplan.verify_prev_slot_indices)
    ]
    recs = decode_violations(ctx.log)
    rec = _records(b.array)
    entry = _match_entries(recs, rec, *plan)
    rkv_slots = sorted({r.slot_idx for r in recs if r.fail_reason_bits & _RKV and 0 <= r.slot_idx < rec.shape[0]})
    recomputed = _recompute_real_kv(srcs, mode, rkv_slots) if checked_rkv else {}
    live = _live_map(meta, b.lut if swa else None)
    details = {}
    for r in recs:
        has_rkv = r.slot_idx in recomputed and bool(r.fail_reason_bits & _RKV)
        d = decode.ViolationDetail(
            expected_position=int(plan[1][entry[r.index]]) if r.index in entry else None,
            stored_real_kv_hash=int(rec[r.slot_idx, 3]) if has_rkv else None,
            recomputed_real_kv_hash=recomputed[r.slot_idx] if has_rkv else None,
            mapped_at=tuple(live.get(r.slot_idx, ())),
        )
        if not d.empty:
            details[r.index] = d
    return ctx.log, checked_rkv, int(lens.sum()), details


# --- the report ------------------------------------------------------------------------------------------
def _infer_write_index(ring: np.ndarray) -> int:
    """Rows up to and including the last row with any non-zero column (a fill-once, zeroed ring)."""
    used = np.nonzero(np.any(ring != 0, axis=1))[0]
    return int(used[-1]) + 1 if used.size else 0


def _meta(data: dict) -> dict | None:
    if not all(k in data for k in ("req_to_token", "req_pool_indices", "seq_lens")):
        return None
    rpi = np.asarray(data["req_pool_indices"], np.int64).reshape(-1)
    lens = np.asarray(data["seq_lens"], np.int64).reshape(-1)
    if rpi.shape != lens.shape:
        raise DumpError(f"req_pool_indices has {rpi.size} entries but seq_lens has {lens.size}")
    return dict(req_to_token=np.asarray(data["req_to_token"], np.int32), rpi=rpi, lens=lens)


def load_and_report(path: str, *, write_index: int | None = None, start: int = 0) -> dict[str, Any]:
    """Decodes a dump into ``{"rings": [...], "buffers": [...], "warnings": [...]}`` (formatted texts plus counts).

    Each ring report holds ``messages`` (one per distinct row: SGLang's text, then the detail and repeat
    lines), ``violations`` (every decoded row) and ``collapsed`` (distinct rows with counts and ring rows).

    Raises:
      DumpError: unreadable file or nothing recognisable in it.
    """
    data = dump_lib.read_arrays(path)
    out: dict[str, Any] = dict(path=path, rings=[], buffers=[], warnings=[])
    meta = _meta(data)
    bufs = _buffers(data)
    mode = constants.RealKvHashMode(_int(data, "real_kv_hash_mode", int(constants.RealKvHashMode.ALL)))
    if "step" in data:
        out["step"] = _int(data, "step", 0)
    ring_key = next((k for k in _RING_KEYS if k in data), None)
    if ring_key is None and "" in data and _is_ring(data[""]):
        ring_key = ""
    if ring_key is not None:
        ring = data[ring_key]
        if not _is_ring(ring):
            raise DumpError(
                f"{ring_key or 'array'} has shape {ring.shape} dtype {ring.dtype}; a violation ring is "
                "int64[R, 8] or uint32[R, 8, 2]"
            )
        ring = _ring_as_int64(ring)
        name = ring_key or "ring"
        wi_key = next((k for k in _INDEX_KEYS if k in data), None)
        if write_index is not None:
            wi, source = int(write_index), "--write-index"
        elif wi_key is not None:
            wi_arr = np.asarray(data[wi_key]).reshape(-1)
            if wi_arr.size != 1 or wi_arr.dtype.kind not in "iu":
                raise DumpError(
                    f"{wi_key} has shape {data[wi_key].shape} dtype {data[wi_key].dtype}; a write index is one integer"
                )
            wi, source = int(wi_arr[0]), wi_key
        else:
            wi, source = _infer_write_index(ring), "inferred"
            full = " (every row is used, so the ring may also have overflowed)" if wi == ring.shape[0] else ""
            out["warnings"].append(
                f"{name}: the file holds no write index; assuming {wi} violations, the rows up to the last "
                f"non-zero row{full}; pass --write-index N if you know the count"
            )
        recs = decode_violations(ring, np.array([wi]), start=start)
        details = _ring_details(recs, bufs, meta, mode) if bufs else {}
        rep = _ring_report(name, ring, wi, start, recs, details)
        rep["write_index_source"] = source
        if start > 0 and start >= rep["recorded_rows"]:
            past = (
                f"the {wi} recorded violations"
                if not rep["ring_overflow"]
                else f"the ring's {ring.shape[0]} rows (it overflowed: {wi} violations recorded)"
            )
            out["warnings"].append(f"{name}: --start {start} is at or past {past}; nothing to decode")
        out["rings"].append(rep)
    for b in bufs:
        if not _is_canary_buf(b.array):
            raise DumpError(
                f"{b.name} has shape {b.array.shape} dtype {b.array.dtype}; a canary buffer is "
                "uint8[num_slots, stride >= 32] with stride a multiple of 8"
            )
        entry: dict[str, Any] = dict(
            name=b.name, tag=b.tag.name, num_slots=int(b.array.shape[0]), census=chain_census(b.array)
        )
        if meta is not None:
            log, checked, entries, details = _verify_buffer(b, meta, mode)
            ring = ints.pairs_to_int64_np(np.asarray(log.ring))
            recs = decode_violations(ring, np.array([log.num_violations()]))
            rep = _ring_report(f"verify of {b.name}", ring, log.num_violations(), 0, recs, details)
            del rep["ring_capacity"]  # the scratch ring is sized to the entries; not a property of the dump
            rep["verified_entries"] = entries
            rep["real_kv_checked"] = checked
            entry["verify"] = rep
        out["buffers"].append(entry)
    if not out["rings"] and not out["buffers"]:
        raise DumpError(
            f"{path} holds no violation ring (int64[R, 8]) and no canary buffer (uint8[N, >=32]); "
            "found: " + ", ".join(f"{k or 'array'} {v.shape} {v.dtype}" for k, v in data.items())
        )
    return out


def _ring_report(
    name: str, ring: np.ndarray, wi: int, start: int, recs: list, details: dict[int, decode.ViolationDetail]
) -> dict[str, Any]:
    """Rows ``[start, recorded)`` as SGLang's messages, one per distinct row, each followed by its detail line
    (when known) and a repeat line (when the same 8 columns recur). Unknown tags and fail bits are labelled
    ``unknown(...)`` by :mod:`canary_jax.decode`; a negative (wrapped int32) index means a full, overflowed
    ring."""
    counts = collections.Counter()
    for r in recs:
        counts[f"{r.tag}:{'+'.join(r.reasons) or 'none'}"] += 1
    overflow = bool(wi > ring.shape[0] or wi < 0)
    collapsed = decode.collapse_violations(recs)
    messages = []
    for c in collapsed:
        lines = [decode.format_violation(c.record, total=wi, ring_overflow=overflow, step_when_pumped=0)]
        d = details.get(c.record.index)
        if d is not None:
            lines.append(decode.format_detail(d))
        if c.count > 1:
            lines.append(decode.format_repeat(c, unit="row"))
        messages.append("\n".join(lines))
    return dict(
        name=name,
        ring_capacity=int(ring.shape[0]),
        write_index=int(wi),
        start=int(start),
        recorded_rows=recorded_rows(int(wi), ring.shape[0]),
        ring_overflow=overflow,
        decoded=len(recs),
        distinct=len(collapsed),
        by_reason=dict(counts),
        violations=[
            dict(r.as_dict(), **({"detail": dataclasses.asdict(details[r.index])} if r.index in details else {}))
            for r in recs
        ],
        collapsed=[dict(row=c.record.index, count=c.count, first_row=c.first, last_row=c.last) for c in collapsed],
        messages=messages,
    )
