"""Saving and decoding canary state dumps (``canary-jax demo --dump`` / ``canary-jax verify-dump``).

A dump is a ``.npy`` array or an ``.npz`` archive. Recognised contents:

* a violation ring: ``int64[R, 8]`` (SGLang's layout, e.g. ``state.violation_log.ring.cpu().numpy()``) or
  canary-jax's ``uint32[R, 8, 2]``; in an ``.npz`` under ``ring`` / ``violation_ring`` with the count under
  ``write_index`` / ``violation_write_index``. Without a count, the rows up to the last row with any non-zero
  column are taken (the ring is fill-once and zero-initialised), with a warning: trailing all-zero rows and
  an overflow cannot be seen that way.
* canary buffers: ``uint8[num_slots, stride >= 32]`` (a bare ``.npy``, or ``canary_buf`` / ``head_buf`` /
  ``tail_buf`` / ``k_head`` / ``k_tail`` in an ``.npz``). With ``req_to_token`` (``int32[rows, L]``),
  ``req_pool_indices`` and ``seq_lens`` in the archive each buffer is verified like a per-forward verify of
  those requests (SPEC 7.1 plans); with ``k_buffer`` (layer-0 K rows as ``uint8[rows, bytes]``) and
  ``page_size`` the TAIL buffer's real-KV fingerprints are checked too. Without the batch metadata a buffer
  gets a chain-link census instead: every record's ``prev_hash`` should be the chain hash of some record at
  the previous position (freed slots keep stale records, so breaks are hints, not proof).
"""

from __future__ import annotations

import collections
import os
from typing import Any

import numpy as np

from canary_jax import constants, hashing
from canary_jax.decode import decode_violations, format_violations, recorded_rows


class DumpError(ValueError):
    """A dump file that cannot be read or holds nothing the decoder recognises."""


_RING_KEYS = ("ring", "violation_ring")
_INDEX_KEYS = ("write_index", "violation_write_index")
_BUF_KEYS = ("canary_buf", "head_buf", "tail_buf", "k_head", "k_tail", "v_head", "v_tail")


def save_dump(
    path: str,
    *,
    log,
    head_buf,
    tail_buf,
    req_to_token,
    req_pool_indices,
    seq_lens,
    k_pool_layer0,
    page_size: int,
    real_kv_hash_mode: int,
) -> None:
    """Writes an ``.npz`` that :func:`load_and_report` understands."""
    k = np.asarray(k_pool_layer0)
    np.savez(
        path,
        ring=_ring_int64(log),
        write_index=np.asarray(log.write_index, np.int32),
        head_buf=np.asarray(head_buf),
        tail_buf=np.asarray(tail_buf),
        req_to_token=np.asarray(req_to_token, np.int32),
        req_pool_indices=np.asarray(req_pool_indices, np.int64),
        seq_lens=np.asarray(seq_lens, np.int64),
        k_buffer=np.ascontiguousarray(k).view(np.uint8).reshape(k.shape[0], -1),
        page_size=np.int64(page_size),
        real_kv_hash_mode=np.int64(int(real_kv_hash_mode)),
    )


def _ring_int64(log) -> np.ndarray:
    from canary_jax.ints import pairs_to_int64_np

    return pairs_to_int64_np(np.asarray(log.ring))


def _load(path: str) -> dict[str, np.ndarray]:
    if os.path.isdir(path):
        raise DumpError(f"{path} is a directory, not a .npy/.npz file")
    if not os.path.isfile(path):
        raise DumpError(f"dump file not found: {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(6)
    except OSError as e:
        raise DumpError(f"cannot read {path}: {e.strerror}") from None
    if magic != b"\x93NUMPY" and magic[:4] not in (b"PK\x03\x04", b"PK\x05\x06"):
        raise DumpError(f"{path} is not a .npy or .npz file")
    try:
        obj = np.load(path, allow_pickle=False)
        if isinstance(obj, np.ndarray):
            return {"": obj}
        with obj:
            data = {k: obj[k] for k in obj.files}
    except Exception as e:  # numpy raises several types for bad files
        raise DumpError(f"cannot read {path} as .npy/.npz: {e}") from None
    if not data:
        raise DumpError(f"{path} is an empty .npz archive (no arrays); nothing to decode")
    return data


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
    if a.ndim == 3:
        from canary_jax.ints import pairs_to_int64_np

        return pairs_to_int64_np(a)
    return a.astype(np.int64)


def _infer_write_index(ring: np.ndarray) -> int:
    """Rows up to and including the last row with any non-zero column (a fill-once, zeroed ring)."""
    used = np.nonzero(np.any(ring != 0, axis=1))[0]
    return int(used[-1]) + 1 if used.size else 0


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


def chain_census(buf: np.ndarray) -> dict[str, Any]:
    """Counts records whose ``prev_hash`` matches no record at the previous position (slot 0 excluded)."""
    rec = _records(buf)
    used = np.any(rec != 0, axis=1)
    used[0] = False
    idx = np.nonzero(used)[0]
    tok, pos, prev = rec[idx, 0], rec[idx, 1], rec[idx, 2]
    chain = _mix3_np(prev.copy(), tok.copy(), pos.copy())
    known = set(zip(pos.tolist(), chain.view(np.int64).tolist()))
    anchor = hashing.splitmix64_python(constants.CANARY_CHAIN_ANCHOR)
    anchor = anchor - (1 << 64) if anchor >= 1 << 63 else anchor
    broken = []
    for s, p, ph in zip(idx.tolist(), pos.tolist(), prev.tolist()):
        ok = (ph == anchor) if p == 0 else ((p - 1, ph) in known)
        if not ok:
            broken.append(dict(slot=s, position=p))
    return dict(records=int(idx.size), broken_links=len(broken), broken=broken[:50])


def _verify_buffer(buf: np.ndarray, tag: constants.CanaryLaunchTag, meta: dict, k_buffer, page_size: int, mode: int):
    import jax.numpy as jnp

    from canary_jax import launch
    from canary_jax.layout import ViolationLog
    from canary_jax.plan_builder import build_plans
    from canary_jax.plans import VerifyOrWriteContext
    from canary_jax.sources import RealKvSource

    r2t = np.asarray(meta["req_to_token"], np.int32)
    rpi = np.asarray(meta["req_pool_indices"], np.int64).reshape(-1)
    lens = np.asarray(meta["seq_lens"], np.int64).reshape(-1)
    if rpi.shape != lens.shape:
        raise DumpError(f"req_pool_indices has {rpi.size} entries but seq_lens has {lens.size}")
    keep = rpi != 0
    rpi, lens = rpi[keep], lens[keep]
    cap = max(1, int(lens.sum()))
    vplan, _ = build_plans(
        req_pool_indices=rpi,
        prefix_lens=lens,
        extend_seq_lens=np.zeros_like(lens),
        req_to_token=r2t,
        verify_capacity=cap,
        write_req_capacity=max(1, rpi.size),
    )
    buf = np.array(buf)
    sources = ()
    mode = constants.RealKvHashMode(mode)
    if tag.is_tail and k_buffer is not None and mode != constants.RealKvHashMode.NONE:
        nbpt = k_buffer.shape[1] // page_size
        read = constants.PARTIAL_READ_BYTES if mode == constants.RealKvHashMode.PARTIAL else nbpt
        sources = (
            RealKvSource(tensor=jnp.asarray(k_buffer), page_size=page_size, num_bytes_per_token=nbpt, read_bytes=read),
        )
        checked_rkv = True
    else:
        # Without the K bytes the stored fingerprints cannot be recomputed: blank them (NONE compares with 0).
        rec = np.ascontiguousarray(buf[:, : constants.CANARY_SLOT_BYTES]).copy()
        rec[:, 24:32] = 0
        buf[:, : constants.CANARY_SLOT_BYTES] = rec
        mode = constants.RealKvHashMode.NONE
        checked_rkv = False
    ctx = VerifyOrWriteContext(
        canary_buf=jnp.asarray(buf),
        kernel_kind=tag,
        log=ViolationLog.allocate(ring_capacity=max(1, cap)),
        real_kv_sources=sources,
        real_kv_hash_mode=mode,
    )
    ctx = launch.verify(ctx, vplan, backend="reference")
    return ctx.log, checked_rkv, int(lens.sum())


def load_and_report(path: str, *, write_index: int | None = None, start: int = 0) -> dict[str, Any]:
    """Decodes a dump into ``{"rings": [...], "buffers": [...]}`` (formatted texts plus counts).

    Raises:
      DumpError: unreadable file or nothing recognisable in it.
    """
    data = _load(path)
    out: dict[str, Any] = dict(path=path, rings=[], buffers=[], warnings=[])
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
        rep = _ring_report(name, ring, wi, start)
        rep["write_index_source"] = source
        if start > 0 and start >= rep["recorded_rows"]:
            past = (
                f"the {wi} recorded violations"
                if not rep["ring_overflow"]
                else f"the ring's {ring.shape[0]} rows (it overflowed: {wi} violations recorded)"
            )
            out["warnings"].append(f"{name}: --start {start} is at or past {past}; nothing to decode")
        out["rings"].append(rep)
    bufs = [(k, data[k]) for k in _BUF_KEYS if k in data]
    if not bufs and "" in data and _is_canary_buf(data[""]):
        bufs = [("canary_buf", data[""])]
    meta_ok = all(k in data for k in ("req_to_token", "req_pool_indices", "seq_lens"))
    page_size = int(np.asarray(data.get("page_size", 1)).reshape(-1)[0])
    mode = int(np.asarray(data.get("real_kv_hash_mode", int(constants.RealKvHashMode.ALL))).reshape(-1)[0])
    k_buffer = data.get("k_buffer")
    for name, buf in bufs:
        if not _is_canary_buf(buf):
            raise DumpError(
                f"{name} has shape {buf.shape} dtype {buf.dtype}; a canary buffer is "
                "uint8[num_slots, stride >= 32] with stride a multiple of 8"
            )
        entry: dict[str, Any] = dict(name=name, num_slots=int(buf.shape[0]), census=chain_census(buf))
        if meta_ok:
            tag = constants.CanaryLaunchTag.TAIL_K_FULL if "tail" in name else constants.CanaryLaunchTag.HEAD_K_FULL
            log, checked, entries = _verify_buffer(buf, tag, data, k_buffer, page_size, mode)
            rep = _ring_report(f"verify of {name}", _ring_int64(log), log.num_violations(), 0)
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


def _ring_report(name: str, ring: np.ndarray, wi: int, start: int) -> dict[str, Any]:
    """Decodes rows ``[start, recorded)``. Unknown tags and fail bits are labelled ``unknown(...)`` by
    :mod:`canary_jax.decode`; a negative (wrapped int32) index means a full, overflowed ring."""
    recs = decode_violations(ring, np.array([wi]), start=start)
    counts = collections.Counter()
    for r in recs:
        counts[f"{r.tag}:{'+'.join(r.reasons) or 'none'}"] += 1
    return dict(
        name=name,
        ring_capacity=int(ring.shape[0]),
        write_index=int(wi),
        start=int(start),
        recorded_rows=recorded_rows(int(wi), ring.shape[0]),
        ring_overflow=bool(wi > ring.shape[0] or wi < 0),
        decoded=len(recs),
        by_reason=dict(counts),
        violations=[r.as_dict() for r in recs],
        messages=format_violations(ring, np.array([wi]), start=start),
    )
