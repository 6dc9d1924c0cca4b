"""Compiled forms of gather and the scatter family (see :func:`interop.native.prims.compile_rule`; the semantics
are :mod:`interop.native.prims_index`'s rules; the shared index arithmetic is
:mod:`interop.native.prims_index_core`). The gather is here; the scatter family is
:mod:`interop.native.prims_scatter_compiled` and the static pieces both use :mod:`interop.native.prims_index_steps`
(this module re-exports both).

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
  target's sign bit there and back (11 ops instead of 14 for the write's former claim scatter-max; the claim is
  now a kernel, ``canary_write_claim``).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from interop.native import prims_index_core as X
from interop.native.prims_dtypes import _fill_scalar, storage_dtype
from interop.native.prims_index_steps import (  # noqa: F401  (re-exported: their first home is here)
    _chain,
    _drop_fn,
    _grid,
    _lin_fn,
    _shaper,
    _starts_fn,
    _work,
)
from interop.native.prims_scatter_compiled import (  # noqa: F401  (re-exported: their first home is here)
    _broadcast_mask,
    _combine_unique,
    _prep_vals,
    _reduce_flat,
    _scatter_const,
    _scatter_dynamic,
    _signed_trick,
    compile_scatter,
)


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
