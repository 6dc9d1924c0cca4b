"""The static pieces the compiled gather and scatter share (:mod:`interop.native.prims_index_compiled`,
:mod:`interop.native.prims_scatter_compiled`): the working copy of an operand, start indices in the narrowest
dtype the clamp allows, reshapes that cost a call only when they change something, and a dynamic target
computation's bounds, strides, window offsets, flat targets and dropped windows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from interop.native.prims_convert import _convert_fn
from interop.native.prims_dtypes import _bits, _index, _uis, storage_dtype
from interop.native.prims_index_core import fill_index_clamp


# --- shared ---------------------------------------------------------------------------------------------------
def _work(x: torch.Tensor, donate: bool) -> torch.Tensor:
    """The rules' ``_work``: the operand when donated and contiguous, else a contiguous copy."""
    return x if donate and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _starts_fn(ctx, idt, to_int32: bool, top: int):
    """``(indices -> start values, their torch dtype)``: the rules' ``_index`` (or, first, the int32 conversion a
    FILL_OR_DROP gather's lowering applies), kept int32 when they are and ``top`` (the largest clamp bound) fits,
    so the clamp and compare run without a widening op."""
    bound = fill_index_clamp(idt, np.int32) if to_int32 else None
    if bound is not None:
        return (lambda t: torch.clamp(_index(t, idt), max=bound)), torch.int64
    if to_int32:
        conv = _convert_fn(ctx, idt, np.dtype(np.int32))
        return conv, torch.int32
    if _uis(idt) and _bits(idt) < 64:
        m = ctx.scalar((1 << _bits(idt)) - 1, torch.int64)
        return (lambda t: t.long() & m), torch.int64
    if _uis(idt):
        big = ctx.scalar((1 << 63) - 1, torch.int64)
        return (lambda t: torch.where(t < 0, big, t)), torch.int64
    st = storage_dtype(idt)
    if st == torch.int64 or (st == torch.int32 and top < 2**31):  # (index_select takes only these two)
        return (lambda t: t), st
    return (lambda t: t.long()), torch.int64


def _shaper(cur, view, full=None, flat=False):
    """``t -> t`` reshaped from static shape ``cur`` to ``view``, expanded to ``full``, flattened, each only when
    it changes something (a call each)."""
    fns = []
    cur, view = tuple(cur), tuple(view)
    if cur != view:
        fns.append(lambda t, v=view: t.reshape(v))
    if full is not None and tuple(np.broadcast_shapes(view, full)) != view:
        fns.append(lambda t, f=tuple(full): t.expand(f))
        view = tuple(full)
    if flat and len(view) != 1:
        fns.append(lambda t: t.reshape(-1))
    if not fns:
        return lambda t: t
    if len(fns) == 1:
        return fns[0]
    return lambda t: _chain(fns, t)


def _chain(fns, t):
    for f in fns:
        t = f(t)
    return t


def _grid(ctx, shape, starts_map, sizes, window_pos, rank, starts_args):
    """Static pieces of a dynamic target computation: ``indices -> starts`` (:func:`_starts_fn` with
    ``starts_args``), the clamp bounds in the starts' dtype and the per-start strides (int64) as device tensors,
    the window offsets (int64, broadcastable to ``rank`` dims; None when no window dim exceeds 1), whether some
    window can never be in bounds, and the per-start strides as ints."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    his = [shape[d] - sizes[d] for d in starts_map]
    dev = ctx.device
    starts, sdt = _starts_fn(ctx, *starts_args, max(his, default=0))
    lo = torch.zeros(len(starts_map), dtype=sdt, device=dev)
    hi = torch.tensor([max(h, 0) for h in his], dtype=sdt, device=dev)
    st = torch.tensor([strides[d] for d in starts_map], dtype=torch.int64, device=dev)
    win = None
    for d, pos in window_pos.items():
        if sizes[d] > 1:
            view = [1] * rank
            view[pos] = sizes[d]
            w = torch.arange(0, sizes[d] * strides[d], strides[d], dtype=torch.int64).reshape(view)
            win = w if win is None else win + w
    win = None if win is None else win.to(dev)
    return starts, lo, hi, st, win, any(h < 0 for h in his), [strides[d] for d in starts_map]


def _lin_fn(k: int, st: torch.Tensor, py_strides, ishape, bview, win):
    """``clamped starts [..., k] -> flat targets`` shaped ``bview`` (+ window offsets)."""
    if k == 1:
        shape = _shaper(ishape, bview)
        lin = (lambda cl: shape(cl).long()) if py_strides[0] == 1 else (lambda cl: shape(cl) * st)  # st: int64 [1]
    else:
        shape = _shaper(ishape[:-1], bview)
        lin = lambda cl: shape((cl * st).sum(-1))  # noqa: E731
    if win is None:
        return lin
    return lambda cl: lin(cl) + win


def _drop_fn(k: int, ishape, bview, full=None, flat=False):
    """``(clamped, starts) -> dropped windows`` shaped ``bview`` (expanded to ``full``, flattened)."""
    if k == 1:
        shape = _shaper(ishape, bview, full, flat)
        return lambda cl, s: shape(cl != s)
    shape = _shaper(ishape[:-1], bview, full, flat)
    return lambda cl, s: shape((cl != s).any(-1))
