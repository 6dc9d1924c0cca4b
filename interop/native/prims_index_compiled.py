"""Compiled forms of gather and the scatter family (see :func:`interop.native.prims.compile_rule`; the semantics
are :mod:`interop.native.prims_index`'s rules; the shared index arithmetic is
:mod:`interop.native.prims_index_core`).

* **Constant indices.** The flat targets are computed once, on the host, by the rules themselves (a gather of an
  iota operand; the scatter's target computation), with the in-bounds mask, the dropped updates filtered out and,
  for a plain scatter, duplicates resolved to the last update in row-major order. A gather is then one ``take``
  (a ``where`` more when a FILL_OR_DROP window is out of bounds). A scatter is one ``index_put`` with
  per-dimension index tensors (out of place when the operand is not donated, so no separate copy; a ``take`` of
  the surviving updates first when some were dropped or lost to a duplicate), or one ``where`` when the updates
  broadcast into place (a row set: the write / verify launches' counters). Integer max/min/mul with unique
  targets read, combine and write back (three to five ops); the rest is ``scatter_reduce_`` as in the rule.
  Constant updates are prepared (gathered, negated, sign-flipped) once too.
* **Dynamic indices.** Bounds, strides and window offsets are device tensors made once; a call clamps the
  starts in one op (int32 starts stay int32), finds out-of-bounds windows in one or two, sums the flat target in
  two (none for one index dimension of stride 1) and reads with ``index_select`` (whole-row gathers) or
  ``take``. An unsigned scatter-max (min) whose constant updates all have the sign bit clear (set) runs as a
  signed one, masking the updates of targets on the other side of the sign bit, instead of flipping every
  target's sign bit there and back (the write launch's claim scatter-max: 11 ops instead of 14).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from interop.native import prims_index_core as X
from interop.native.prims_convert import _convert_fn
from interop.native.prims_dtypes import _bits, _fill_scalar, _kind, _smin, _uis, storage_dtype


# --- shared ---------------------------------------------------------------------------------------------------
def _work(x: torch.Tensor, donate: bool) -> torch.Tensor:
    """The rules' ``_work``: the operand when donated and contiguous, else a contiguous copy."""
    return x if donate and x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)


def _starts_fn(ctx, idt, to_int32: bool, top: int):
    """``(indices -> start values, their torch dtype)``: the rules' ``_index`` (or, first, the int32 conversion a
    FILL_OR_DROP gather's lowering applies), kept int32 when they are and ``top`` (the largest clamp bound) fits,
    so the clamp and compare run without a widening op."""
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


# --- gather ---------------------------------------------------------------------------------------------------
def compile_gather(ctx):
    """Compiled ``gather``: a precomputed ``take`` for constant indices, else ``index_select`` / ``take``."""
    p, out = ctx.params, ctx.out()
    out_shape, st, dev = tuple(out.shape), storage_dtype(out.dtype), ctx.device
    if math.prod(out_shape) == 0:
        return lambda args, donate: [torch.empty(out_shape, dtype=st, device=dev)]
    fill_value = _fill_scalar(p["fill_value"], np.dtype(out.dtype))
    oshape, idt = ctx.shape(0), ctx.dt(1)
    host = ctx.host(1)
    if host is not None:
        base = torch.arange(math.prod(oshape), dtype=torch.int64).reshape(oshape)
        flat = X._gather_values(base, host, idt, p, out_shape, -1).contiguous()
        ok = flat >= 0
        if bool(ok.all()):
            flat = flat.to(dev)
            return lambda args, donate: [torch.take(args[0], flat)]
        flat, ok, fill_t = flat.clamp(min=0).to(dev), ok.to(dev), ctx.scalar(fill_value, st)
        return lambda args, donate: [torch.where(ok, torch.take(args[0], flat), fill_t)]
    return _gather_dynamic(ctx, p, out_shape, st, fill_value)


def _gather_dynamic(ctx, p, out_shape, st, fill_value):
    dn, sizes, oshape = p["dimension_numbers"], tuple(p["slice_sizes"]), ctx.shape(0)
    idt, ishape = ctx.dt(1), ctx.shape(1)
    rank, fill, bshape = len(out_shape), p["mode"] == X._FILL, ishape[:-1]
    smap = tuple(dn.start_index_map)
    batch_pos = [i for i in range(rank) if i not in dn.offset_dims]
    window = [d for d in range(len(oshape)) if d not in dn.collapsed_slice_dims]
    window_pos = dict(zip(window, dn.offset_dims))
    bview = [1] * rank
    for i, n in zip(batch_pos, bshape):
        bview[i] = n
    to_int32 = fill and max(oshape, default=0) <= np.iinfo(np.int32).max
    starts, lo, hi, strides, win, never, py_strides = _grid(ctx, oshape, smap, sizes, window_pos, rank, (idt, to_int32))
    if never or len(smap) == 0 or min(oshape, default=1) == 0:
        return None
    fill_t = ctx.scalar(fill_value, st) if fill else None
    if _row_gather(dn, sizes, oshape, smap, bshape, batch_pos, window_pos, rank):
        d0 = smap[0]
        flat, back = _shaper(ishape, (math.prod(bshape),)), _shaper(_selected(oshape, d0, bshape), out_shape)
        drop = _drop_fn(1, ishape, bview)

        def run(args, donate):
            s = starts(args[1])
            cl = torch.clamp(s, lo, hi)
            res = back(torch.index_select(args[0], d0, flat(cl)))
            return [torch.where(drop(cl, s), fill_t, res) if fill else res]

        return run
    lin = _lin_fn(len(smap), strides, py_strides, ishape, bview, win)
    expand = tuple(np.broadcast_shapes(tuple(bview), tuple(win.shape) if win is not None else ())) != out_shape
    drop = _drop_fn(len(smap), ishape, bview)

    def run(args, donate):
        s = starts(args[1])
        cl = torch.clamp(s, lo, hi)
        flat = lin(cl)
        res = torch.take(args[0], flat.expand(out_shape) if expand else flat)
        return [torch.where(drop(cl, s), fill_t, res) if fill else res]

    return run


def _selected(oshape, d0, bshape):
    return (*oshape[:d0], math.prod(bshape), *oshape[d0 + 1 :])


def _row_gather(dn, sizes, oshape, smap, bshape, batch_pos, window_pos, rank) -> bool:
    """Whether the gather is ``index_select`` along the one indexed dim, reshaped: every other dim taken whole,
    and the output's elements in the order of [dims before it, batch dims, dims after it] (size-1 dims aside)."""
    if len(smap) != 1 or sizes[smap[0]] != 1:
        return False
    d0 = smap[0]
    if any(sizes[d] != oshape[d] for d in range(len(oshape)) if d != d0):
        return False
    label = {pos: ("w", d) for d, pos in window_pos.items()} | {pos: ("b", j) for j, pos in enumerate(batch_pos)}
    size = {("w", d): sizes[d] for d in window_pos} | {("b", j): n for j, n in enumerate(bshape)}
    got = [label[i] for i in range(rank) if size[label[i]] != 1]
    want = [("w", d) for d in range(d0)] + [("b", j) for j in range(len(bshape))]
    want += [("w", d) for d in range(d0 + 1, len(oshape))]
    return got == [w for w in want if size.get(w, 1) != 1]


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
