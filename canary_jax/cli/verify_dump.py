"""Decoding canary state dumps (``canary-jax verify-dump``).

A dump is a ``.npy`` array or an ``.npz`` archive. Recognised contents:

* a canary-jax dump (:mod:`canary_jax.runtime.dump`, written by ``canary-jax demo --dump``,
  :meth:`canary_jax.integration.CanaryGuard.dump` or :func:`canary_jax.runtime.dump.save_dump`): the ring and its write
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
extra lines (:func:`canary_jax.contract.decode.format_detail`): the position the failing verify entry expected, the
stored and the recomputed real-KV hash of the slot where they differ (recomputed from the KV as dumped), and
where ``req_to_token`` maps the slot. Rows identical in all 8 columns (one fault reported again by later steps)
are printed once, with a ``kv_canary violation repeated: ... count=N`` line.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np

from canary_jax.cli.dump_contents import (
    _INDEX_KEYS,
    _RING_KEYS,
    _buffers,
    _infer_write_index,
    _int,
    _is_canary_buf,
    _is_ring,
    _meta,
    _ring_as_int64,
)
from canary_jax.cli.dump_details import _ring_details, _verify_buffer
from canary_jax.cli.dump_hashes import chain_census
from canary_jax.contract import constants, decode, ints
from canary_jax.contract.decode import decode_violations, recorded_rows
from canary_jax.runtime import dump as dump_lib
from canary_jax.runtime.dump import DumpError

__all__ = ["DumpError", "chain_census", "load_and_report"]


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
    ``unknown(...)`` by :mod:`canary_jax.contract.decode`; a negative (wrapped int32) index means a full, overflowed
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
