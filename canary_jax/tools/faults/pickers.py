"""Host-side slot pickers: which KV slot a fault should hit, chosen from a batch's metadata.

:func:`pick_used_slot` (a slot the next step verifies), :func:`pick_written_slot` (a slot the last step wrote,
SGLang's ``pick_out_cache_loc_slot``) and :func:`pick_orphan_slot` (a cached slot no live request maps, SGLang's
``real_kv_unused_cache``); each draws from a ``numpy.random.Generator`` and returns None when there is no
candidate. Re-exported by :mod:`canary_jax.tools.faults`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from canary_jax.contract import ints

__all__ = ["pick_orphan_slot", "pick_used_slot", "pick_written_slot"]


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
