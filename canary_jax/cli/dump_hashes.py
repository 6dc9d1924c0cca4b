"""Host recomputation over a dump's canary records: the chain-link census, chain hashes, real-KV hashes.

The one job here is reading canary records (``int64[num_slots, 4]``: token, position, prev_hash, real_kv_hash;
SPEC 1.1) on the host and recomputing what they should hold: :func:`chain_census` (records whose ``prev_hash``
matches no record at the previous position), the chain hash a successor must store, the real-KV fingerprint of
the KV bytes as dumped (canary-jax's reference hash), and where the live requests map each slot. Used by
:mod:`canary_jax.cli.verify_dump`, which re-exports :func:`chain_census`.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import numpy as np

from canary_jax.contract import constants, hashing, ints, pairs
from canary_jax.contract import sources as sources_lib

__all__ = ["chain_census"]


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
    a = hashing.ANCHOR_HASH
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
