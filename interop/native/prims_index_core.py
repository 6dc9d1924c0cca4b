"""The index arithmetic that the indexing primitives' torch rules (:mod:`interop.native.prims_index`) and their
compiled forms (:mod:`interop.native.prims_index_compiled`) share: gather / scatter modes, start indices,
window terms and flat targets, the gather itself, the last-wins scatter and the reductions' identities (the
semantics are described in :mod:`interop.native.prims_index`). Both build on this module.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from jax import lax

from interop.native.prims_convert import _convert_value
from interop.native.prims_dtypes import UnsupportedPrimitive, _index

_FILL = lax.GatherScatterMode.FILL_OR_DROP
_CLIP = lax.GatherScatterMode.CLIP
_MODES = (_CLIP, _FILL, lax.GatherScatterMode.PROMISE_IN_BOUNDS)

# jax 0.12.1 clamps unsigned FILL_OR_DROP gather indices above the index dtype's max before converting them
# (``lax._clamp_and_cast_index`` in ``slicing._gather_fill``): a uint64 index 2**32 + 3 is then out of bounds; earlier
# jax converts with wraparound and reads row 3.
try:
    from jax._src.lax import lax as _lax_impl
except ImportError:  # another jax layout: assume the older wraparound
    _lax_impl = None
FILL_CLAMPS_UNSIGNED = hasattr(_lax_impl, "_clamp_and_cast_index")


def fill_index_clamp(idt, target) -> int | None:
    """The bound this jax clamps FILL_OR_DROP start indices of JAX dtype ``idt`` to before converting them to the
    signed ``target`` dtype, or None where it converts with wraparound (signed indices; any index before 0.12.1)."""
    idt, target = np.dtype(idt), np.dtype(target)
    if FILL_CLAMPS_UNSIGNED and idt.kind == "u" and np.iinfo(idt).max > np.iinfo(target).max:
        return int(np.iinfo(target).max)
    return None


SCATTERS = {"scatter": "replace", "scatter-add": "add", "scatter-sub": "sub", "scatter-mul": "prod"}
SCATTERS |= {"scatter-max": "amax", "scatter-min": "amin"}
"""Scatter primitive -> its torch reduction (``replace``: last update in row-major update order wins)."""


def _arange_at(n: int, pos: int, rank: int, device, step: int = 1) -> torch.Tensor:
    """``arange(0, n*step, step)`` shaped to ``rank`` dims with the ``n`` at ``pos``."""
    view = [1] * rank
    view[pos] = n
    return torch.arange(0, n * step, step, device=device).reshape(view)


def _starts(indices: torch.Tensor, idt, fill: bool, operand_shape) -> torch.Tensor:
    """Start indices as int64. jax lowers a FILL_OR_DROP gather by first converting them to int32 (int64 for an
    operand dim past INT32_MAX), wrapping: an int64 index 2**32 + 3 reads row 3 (unsigned ones are clamped
    first where :func:`fill_index_clamp` says so)."""
    if not fill:
        return _index(indices, idt)
    target = np.dtype(np.int32 if max(operand_shape, default=0) <= np.iinfo(np.int32).max else np.int64)
    bound = fill_index_clamp(idt, target)
    if bound is not None:
        return torch.clamp(_index(indices, idt), max=bound)
    return _convert_value(indices, idt, target).long()


def _window_terms(
    operand_shape, starts, sizes, start_map, window_pos, batch_pos, rank, clip: bool, device, strides=None
):
    """Per operand dim, the index of every output (update) element, broadcastable to ``rank`` dims, and the mask
    of in-bounds windows (None when every window is, or ``clip``). With ``strides``, one summed linear index."""
    view = [1] * rank
    for p, n in zip(batch_pos, starts.shape[:-1]):
        view[p] = n
    terms, mask = [], None
    for d, dim in enumerate(operand_shape):
        t = None
        if d in start_map:
            s = starts[..., start_map.index(d)]
            hi = dim - sizes[d]
            if not clip:
                ok = (s >= 0) & (s <= hi)
                mask = ok if mask is None else mask & ok
            t = s.clamp(0, max(hi, 0)).reshape(view)
            if strides is not None:
                t = t * strides[d]
        if d in window_pos:
            w = _arange_at(sizes[d], window_pos[d], rank, device, 1 if strides is None else strides[d])
            t = w if t is None else t + w
        terms.append(t if t is not None else torch.zeros([1] * rank, dtype=torch.long, device=device))
    if mask is not None:
        mask = mask.reshape(view)
    if strides is not None:
        return sum(terms[1:], terms[0]) if terms else torch.zeros([1] * rank, dtype=torch.long, device=device), mask
    return terms, mask


def _gather_values(operand, indices, idt, p, out_shape, fill_value):
    """The gather of ``operand`` at ``indices`` (JAX dtype ``idt``) with params ``p``; windows out of bounds under
    FILL_OR_DROP give ``fill_value``."""
    dn, sizes = p["dimension_numbers"], tuple(p["slice_sizes"])
    if math.prod(out_shape) == 0:
        return torch.empty(out_shape, dtype=operand.dtype, device=operand.device)
    rank = len(out_shape)
    fill = p["mode"] == _FILL
    starts = _starts(indices, idt, fill, operand.shape)
    batch_pos = [i for i in range(rank) if i not in dn.offset_dims]
    window = [d for d in range(operand.ndim) if d not in dn.collapsed_slice_dims]
    terms, mask = _window_terms(
        operand.shape, starts, sizes, tuple(dn.start_index_map), dict(zip(window, dn.offset_dims)), batch_pos,
        rank, not fill, operand.device,
    )  # fmt: skip
    res = operand[tuple(terms)]
    if mask is not None:
        res = torch.where(mask, res, fill_value)
    return res.expand(out_shape) if tuple(res.shape) != out_shape else res


def _targets(eqn, shape, indices, updates):
    """Flat row-major target of every update element (int64 [N], clamped in bounds) and its window's in-bounds
    mask ([N] bool, None under CLIP)."""
    dn, rank = eqn.params["dimension_numbers"], updates.ndim
    window = [d for d in range(len(shape)) if d not in dn.inserted_window_dims]
    window_pos = dict(zip(window, dn.update_window_dims))
    sizes = [updates.shape[window_pos[d]] if d in window_pos else 1 for d in range(len(shape))]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    starts = _index(indices, eqn.invars[1].aval.dtype)
    batch_pos = [i for i in range(rank) if i not in dn.update_window_dims]
    clip = eqn.params["mode"] == _CLIP
    lin, mask = _window_terms(
        shape, starts, sizes, tuple(dn.scatter_dims_to_operand_dims), window_pos, batch_pos, rank, clip,
        updates.device, strides,
    )  # fmt: skip
    lin = lin.expand(updates.shape).reshape(-1)
    return lin, None if mask is None else mask.expand(updates.shape).reshape(-1)


def _scatter_replace(eqn, flat, lin, valid, vals):
    n = lin.shape[0]
    if valid is None and eqn.params["unique_indices"]:
        return flat.index_put_((lin,), vals)
    # Last in update order wins, dropped updates keep the old value: sort by (target, rank) with rank 0 for
    # dropped elements, then every element writes its group's last (winning) value.
    if flat.numel() * (n + 1) + n >= 2**63:
        raise UnsupportedPrimitive(f"canary native: scatter of {n} updates into {flat.numel()} elements")
    pos = torch.arange(n, device=lin.device)
    rank = pos + 1 if valid is None else torch.where(valid, pos + 1, 0)
    order = torch.argsort(lin * (n + 1) + rank)
    lin_s = lin[order]
    last = torch.cat([lin_s[1:] != lin_s[:-1], torch.ones(1, dtype=torch.bool, device=lin.device)])
    end = torch.flip(torch.cummin(torch.flip(torch.where(last, pos, n), (0,)), 0).values, (0,))
    winner = order[end]
    v = vals[winner]
    if valid is not None:
        v = torch.where(valid[winner], v, flat[lin_s])
    flat.index_put_((lin_s,), v)


def _identity(op: str, st: torch.dtype):
    if op == "prod":
        return 1
    if st.is_floating_point:
        return -math.inf if op == "amax" else math.inf
    info = torch.iinfo(st)
    return info.min if op == "amax" else info.max
