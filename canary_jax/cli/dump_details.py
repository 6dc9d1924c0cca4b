"""Details of violation rows from a dump (``canary-jax verify-dump``), and the re-verify of a buffer.

What the 8-column ring row cannot carry, recovered from the buffers, KV and requests as dumped: the position
the failing verify entry expected, the stored and the recomputed real-KV hash of the slot, and where
``req_to_token`` maps the slot (:class:`~canary_jax.contract.decode.ViolationDetail`). :func:`_verify_buffer` runs a
per-forward verify of the dump's live requests over one buffer (SPEC 7.1 plans, the reference backend) and
details its rows; :func:`_ring_details` details the rows of the dump's own ring.
"""

from __future__ import annotations

import jax
import numpy as np

from canary_jax.cli.dump_contents import _Buffer
from canary_jax.cli.dump_hashes import _chain_of, _live_map, _recompute_real_kv, _records
from canary_jax.contract import constants, decode, ints
from canary_jax.contract.decode import decode_violations
from canary_jax.runtime.groups import PoolKind

_RKV = int(constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
_POS = int(constants.FailReason.VERIFY_POSITION_MISMATCH)
_VERIFY_BITS = int(
    constants.FailReason.VERIFY_CHAIN_HASH_MISMATCH
    | constants.FailReason.VERIFY_POSITION_MISMATCH
    | constants.FailReason.VERIFY_REAL_KV_HASH_MISMATCH
    | constants.FailReason.VERIFY_TOKEN_MISMATCH
)


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
    from canary_jax.contract.layout import ViolationLog
    from canary_jax.ops import launch
    from canary_jax.planning.plan_builder import build_plans
    from canary_jax.planning.plans import VerifyOrWriteContext

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
