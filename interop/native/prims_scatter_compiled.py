"""Compiled forms of the scatter family (see :mod:`interop.native.prims_index_compiled`'s docstring for what the
constant-index and dynamic-index forms do; the semantics are :mod:`interop.native.prims_index`'s rules). Re-exported
by :mod:`interop.native.prims_index_compiled`, their first home.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from interop.native import prims_index_core as X
from interop.native.prims_dtypes import _bits, _kind, _smin, _uis, storage_dtype
from interop.native.prims_index_steps import _drop_fn, _grid, _lin_fn, _shaper, _work


# --- scatter --------------------------------------------------------------------------------------------------
def compile_scatter(ctx):
    """Compiled scatter family: precomputed targets for constant indices, else the device-side targets."""
    kind = X.SCATTERS[ctx.eqn.primitive.name]
    dt, oshape, ushape = ctx.dt(0), ctx.shape(0), ctx.shape(2)
    if math.prod(ushape) == 0 or math.prod(oshape) == 0:
        return lambda args, donate: [_work(args[0], donate[0])]
    op, neg = kind, False
    if dt == np.bool_:  # add = or, mul = and
        op = {"add": "amax", "sub": "amax", "prod": "amin"}.get(kind, kind)
    elif kind == "sub":
        op, neg = "add", True
    host = ctx.host(1)
    if host is not None:
        return _scatter_const(ctx, host, op, neg, dt, oshape, ushape)
    return _scatter_dynamic(ctx, op, neg, dt, oshape, ushape)


def _prep_vals(ctx, fns):
    """``updates -> values`` through ``fns`` in order, computed once when the updates are constant."""

    def prep(u):
        for f in fns:
            u = f(u)
        return u

    c = ctx.const(2)
    if c is not None:
        v = prep(c)
        return lambda u: v
    if not fns:
        return lambda u: u
    return prep


def _scatter_const(ctx, host, op, neg, dt, oshape, ushape):
    dev, n = ctx.device, math.prod(ushape)
    lin, valid = X._targets(ctx.eqn, oshape, host, torch.empty((), dtype=torch.int8).expand(ushape))
    lin = lin.numpy()
    pos = np.arange(n) if valid is None else np.flatnonzero(valid.numpy())
    if op == "replace":  # the last valid update of each target wins
        _, last = np.unique(lin[pos][::-1], return_index=True)
        pos = np.sort(pos[::-1][last])
    dst = lin[pos]
    if len(dst) == 0:
        return lambda args, donate: [_work(args[0], donate[0])]
    whole = len(pos) == n  # every update used, in order: index tensors shaped like the updates
    shape = ushape if whole else (len(pos),)
    idx = tuple(torch.from_numpy(np.ascontiguousarray(i).reshape(shape)).to(dev) for i in np.unravel_index(dst, oshape))
    src = torch.from_numpy(pos).to(dev)
    pick = [] if whole else [lambda u: torch.take(u, src)]
    negate = [torch.neg] if neg else []
    unique = len(np.unique(dst)) == len(dst)
    if op in ("replace", "add"):
        vals, acc = _prep_vals(ctx, pick + negate), op == "add"
        mask = _broadcast_mask(oshape, ushape, dst) if op == "replace" and whole else None
        if mask is not None:  # one update block that broadcasts into place: a select, not a scatter
            mask = mask.to(dev)

            def run(args, donate):
                x = args[0]
                if donate[0] and x.is_contiguous():
                    return [x.index_put_(idx, vals(args[2]))]
                return [torch.where(mask, vals(args[2]), x)]

            return run

        def run(args, donate):
            x, v = args[0], vals(args[2])
            if donate[0] and x.is_contiguous():
                return [x.index_put_(idx, v, accumulate=acc)]
            return [torch.index_put(x, idx, v, accumulate=acc)]

        return run
    if unique and _kind(dt) != "f":  # read, combine, write back
        return _combine_unique(ctx, op, dt, idx, pick)
    flat_dst = torch.from_numpy(dst).to(dev)
    flat_pick = [lambda u: u.reshape(-1)] if whole else pick
    return _reduce_flat(ctx, op, dt, (flat_dst, torch.from_numpy(np.unique(dst)).to(dev)), flat_pick)


def _broadcast_mask(oshape, ushape, dst):
    """The targets as a bool mask of the operand when the updates, broadcast to the operand's shape as they are,
    land on exactly their targets (``dst``: the flat target of each update element in row-major order), else
    None."""
    try:
        where = np.broadcast_to(np.arange(math.prod(ushape)).reshape(ushape), oshape).reshape(-1)
    except ValueError:
        return None
    mask = np.zeros(math.prod(oshape), dtype=bool)
    mask[dst] = True
    if not np.array_equal(where[dst], np.arange(len(dst))):
        return None
    return torch.from_numpy(mask.reshape(oshape))


def _combine_unique(ctx, op, dt, idx, pick):
    """Integer max / min / mul into unique targets: ``x[idx] = op(x[idx], vals)``."""
    if dt == np.bool_:
        f = torch.logical_or if op == "amax" else torch.logical_and
        vals, key = _prep_vals(ctx, pick), None
    elif op == "prod":
        f, vals, key = torch.mul, _prep_vals(ctx, pick), None
    else:
        f = torch.maximum if op == "amax" else torch.minimum
        key = ctx.scalar(_smin(_bits(dt)), storage_dtype(dt)) if _uis(dt) else None
        vals = _prep_vals(ctx, pick + ([lambda u: u ^ key] if key is not None else []))

    def run(args, donate):
        x, v = args[0], vals(args[2])
        g = x[idx]
        new = f(g, v) if key is None else f(g ^ key, v) ^ key
        if donate[0] and x.is_contiguous():
            return [x.index_put_(idx, new)]
        return [torch.index_put(x, idx, new)]

    return run


def _reduce_flat(ctx, op, dt, targets, pick):
    """``scatter_reduce_`` into the flat working copy (the rule's path); unsigned max / min flip the targets' sign
    bits there and back. ``targets``: ``(flat targets, unique targets)`` tensors (constant indices, nothing
    dropped), or ``args -> (flat targets, dropped or None)`` (dropped updates get the op's identity)."""
    st = storage_dtype(dt)
    is_bool, flip = dt == np.bool_, _uis(dt) and op != "prod"
    s = ctx.scalar(_smin(_bits(dt)), st) if flip else None
    as_u8 = [lambda u: u.view(torch.uint8)] if is_bool else []
    vals = _prep_vals(ctx, pick + as_u8 + ([lambda u: u ^ s] if flip else []))
    rst = torch.uint8 if is_bool else st
    ident = ctx.scalar(X._identity(op, rst), rst)
    static = not callable(targets)

    def run(args, donate):
        work = _work(args[0], donate[0])
        flat = work.view(-1).view(torch.uint8) if is_bool else work.view(-1)
        v = vals(args[2])
        if static:
            lin, uniq = targets
        else:
            lin, drop = targets(args)
            uniq = lin
            if drop is not None:
                v = torch.where(drop, ident, v)
        if flip:
            flat.index_put_((uniq,), torch.take(flat, uniq) ^ s)
        flat.scatter_reduce_(0, lin, v, op, include_self=True)
        if flip:
            flat.index_put_((uniq,), torch.take(flat, uniq) ^ s)
        return [work]

    return run


def _scatter_dynamic(ctx, op, neg, dt, oshape, ushape):
    p = ctx.params
    dn, idt, ishape = p["dimension_numbers"], ctx.dt(1), ctx.shape(1)
    rank = len(ushape)
    window = [d for d in range(len(oshape)) if d not in dn.inserted_window_dims]
    window_pos = dict(zip(window, dn.update_window_dims))
    sizes = [ushape[window_pos[d]] if d in window_pos else 1 for d in range(len(oshape))]
    smap = tuple(dn.scatter_dims_to_operand_dims)
    batch_pos = [i for i in range(rank) if i not in dn.update_window_dims]
    bview = [1] * rank
    for i, n in zip(batch_pos, ishape[:-1]):
        bview[i] = n
    starts, lo, hi, strides, win, never, py_strides = _grid(ctx, oshape, smap, sizes, window_pos, rank, (idt, False))
    if never or len(smap) == 0:
        return None
    clip = p["mode"] == X._CLIP
    lin_of = _lin_fn(len(smap), strides, py_strides, ishape, bview, win)
    lin_shape = tuple(np.broadcast_shapes(tuple(bview), tuple(win.shape) if win is not None else ()))
    flat_lin = _shaper(lin_shape, lin_shape, ushape, flat=True)
    drop_of = _drop_fn(len(smap), ishape, bview, ushape, flat=True)

    def targets(args):  # (flat targets [N], dropped [N] or None)
        s = starts(args[1])
        cl = torch.clamp(s, lo, hi)
        if clip:
            return flat_lin(lin_of(cl)), None
        return flat_lin(lin_of(cl)), drop_of(cl, s)

    flat_pick = [lambda u: u.reshape(-1)] + ([torch.neg] if neg else [])
    if op == "replace":
        unique, vals = bool(p["unique_indices"]), _prep_vals(ctx, flat_pick)

        def run(args, donate):
            work = _work(args[0], donate[0])
            lin, drop = targets(args)
            if drop is None and unique:
                work.view(-1).index_put_((lin,), vals(args[2]))
            else:
                X._scatter_replace(ctx.eqn, work.view(-1), lin, None if drop is None else ~drop, vals(args[2]))
            return [work]

        return run
    if op == "add":
        vals = _prep_vals(ctx, flat_pick)
        ident = ctx.scalar(-0.0 if _kind(dt) == "f" else 0, storage_dtype(dt))

        def run(args, donate):
            work = _work(args[0], donate[0])
            lin, drop = targets(args)
            v = vals(args[2])
            work.view(-1).index_put_((lin,), v if drop is None else torch.where(drop, ident, v), accumulate=True)
            return [work]

        return run
    signed = _signed_trick(ctx, op, dt)
    if signed is not None:
        return signed(targets, _prep_vals(ctx, flat_pick))
    return _reduce_flat(ctx, op, dt, targets, flat_pick)


def _signed_trick(ctx, op, dt):
    """Unsigned scatter-max (min) with constant updates all below (all at or above) 2**(bits-1): a signed
    scatter-max (min), where updates to targets at or above (below) 2**(bits-1), and dropped ones, become the
    signed identity. Exact: such targets keep their value under the unsigned op, and the rest compare the same
    signed and unsigned."""
    c = ctx.host(2)
    if c is None or not _uis(dt) or op not in ("amax", "amin"):
        return None
    if (op == "amax" and not bool((c >= 0).all())) or (op == "amin" and not bool((c < 0).all())):
        return None
    st = storage_dtype(dt)
    zero, ident = ctx.scalar(0, st), ctx.scalar(X._identity(op, st), st)
    is_max = op == "amax"

    def make(targets, vals):
        def run(args, donate):
            work = _work(args[0], donate[0])
            flat = work.view(-1)
            lin, drop = targets(args)
            g = torch.take(flat, lin)
            other = g < zero if is_max else g >= zero
            v = torch.where(other if drop is None else other | drop, ident, vals(args[2]))
            flat.scatter_reduce_(0, lin, v, op, include_self=True)
            return [work]

        return run

    return make
