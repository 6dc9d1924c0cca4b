"""Torch rules for the indexing primitives: gather, scatter family, dynamic slices, registered into
:data:`interop.native.prims.RULES` (see that module for the storage-dtype conventions and the rule signature).
The compiled gather and scatter are in :mod:`interop.native.prims_index_compiled`; the compiled dynamic slices
(static slices when every start is constant) are here. The index arithmetic both use is
:mod:`interop.native.prims_index_core`.

Gather and scatter follow XLA's ``GatherDimensionNumbers`` / ``ScatterDimensionNumbers`` in general (index
vector last; ``operand_batching_dims`` refused). Start indices are interpreted in their own dtype (unsigned
ones unsigned). Modes, as XLA:CPU does them under jax 0.10.2:

* gather ``CLIP`` / ``PROMISE_IN_BOUNDS``: each start clamped to ``[0, dim - slice_size]``.
* gather ``FILL_OR_DROP``: indices first converted to int32 (jax's lowering), a window not wholly in bounds
  gives ``fill_value`` (default: NaN for floats, ``INT_MIN`` for signed, all ones for unsigned, True for bool).
* scatter ``CLIP``: starts clamped as for gather; ``FILL_OR_DROP`` / ``PROMISE_IN_BOUNDS``: an update window not
  wholly in bounds is dropped.
* scatter (replace) with duplicate targets: the last update in row-major update order wins, deterministically
  on every device (a sort gives every duplicate the winner's value, so racing writes write the same bytes).

With ``donate[0]`` the scatter family and ``dynamic_update_slice`` write the operand in place (when it is
contiguous, respectively has no broadcast dims); otherwise they work on a copy.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from interop.native import prims_index_compiled as c
from interop.native.prims_dtypes import _bits, _fill_scalar, _index, _kind, _lit, _smin, _uis
from interop.native.prims_index_core import (
    _MODES,
    SCATTERS,
    _arange_at,
    _gather_values,
    _identity,
    _scatter_replace,
    _targets,
)


def _gather(eqn, args, donate):
    p, out = eqn.params, eqn.outvars[0].aval
    fill = _fill_scalar(p["fill_value"], np.dtype(out.dtype))
    return _gather_values(args[0], args[1], eqn.invars[1].aval.dtype, p, tuple(out.shape), fill)


def _batching(eqn) -> str | None:
    """Why a gather / scatter is refused, or None."""
    if eqn.primitive.name == "scatter" and eqn.params.get("update_jaxpr") is not None:
        return "update_jaxpr (a scatter_apply combiner)"
    dn = eqn.params["dimension_numbers"]
    if dn.operand_batching_dims:
        return f"operand_batching_dims={tuple(dn.operand_batching_dims)}"
    if eqn.params["mode"] not in _MODES:
        return f"mode={eqn.params['mode']}"
    return None


# --- scatter --------------------------------------------------------------------------------------------------
def _work(operand: torch.Tensor, donate: bool) -> torch.Tensor:
    """The operand itself when donated and contiguous (written in place), else a contiguous copy."""
    if donate and operand.is_contiguous():
        return operand
    return operand.clone(memory_format=torch.contiguous_format)


def _scatter(kind: str):
    def rule(eqn, args, donate):
        operand, indices, updates = args
        dt = np.dtype(eqn.invars[0].aval.dtype)
        work = _work(operand, donate[0])
        if updates.numel() == 0 or work.numel() == 0:
            return work
        flat = work.view(-1)
        lin, valid = _targets(eqn, tuple(work.shape), indices, updates)
        vals = updates.reshape(-1)
        if kind == "replace":
            _scatter_replace(eqn, flat, lin, valid, vals)
            return work
        op = kind
        if dt == np.bool_:  # add = or, mul = and
            flat, vals = flat.view(torch.uint8), vals.view(torch.uint8)
            op = {"add": "amax", "sub": "amax", "mul": "amin"}.get(kind, kind)
        elif kind == "sub":
            op, vals = "add", -vals
        if op == "add":
            ident = -0.0 if _kind(dt) == "f" else 0
            flat.index_put_((lin,), vals if valid is None else torch.where(valid, vals, ident), accumulate=True)
            return work
        flip = _smin(_bits(dt)) if _uis(dt) and op != "prod" else None
        if flip is not None:  # unsigned order on signed storage: flip the targets (only), reduce, flip back
            flat.index_put_((lin,), flat[lin] ^ flip)
            vals = vals ^ flip
        if valid is not None:
            vals = torch.where(valid, vals, _identity(op, vals.dtype))
        flat.scatter_reduce_(0, lin, vals, op, include_self=True)
        if flip is not None:
            flat.index_put_((lin,), flat[lin] ^ flip)
        return work

    return rule


# --- dynamic slices -------------------------------------------------------------------------------------------
def _dyn_index(eqn, args, first: int, operand_shape, sizes, device):
    """Per dim: a static slice when the start is a literal, else an int64 index tensor (clamped start +
    arange) shaped for advanced indexing; and whether all are static."""
    rank = len(operand_shape)
    static = [_lit(eqn, first + d) for d in range(rank)]
    if all(s is not None for s in static):
        out = []
        for d, (s, n) in enumerate(zip(static, sizes)):
            s = min(max(int(s), 0), operand_shape[d] - n)  # a numpy scalar of the index dtype: exact
            out.append(slice(s, s + n))
        return tuple(out), True
    terms = []
    for d, n in enumerate(sizes):
        s = _index(args[first + d], eqn.invars[first + d].aval.dtype).clamp(0, operand_shape[d] - n)
        terms.append(s + _arange_at(n, d, rank, device))
    return tuple(terms), False


def _dynamic_slice(eqn, args, donate):
    x, sizes = args[0], tuple(eqn.params["slice_sizes"])
    if math.prod(sizes) == 0:
        return torch.empty(sizes, dtype=x.dtype, device=x.device)
    idx, _ = _dyn_index(eqn, args, 1, x.shape, sizes, x.device)
    return x[idx]


def _dynamic_update_slice(eqn, args, donate):
    x, upd = args[0], args[1]
    writable = all(s != 0 or n <= 1 for s, n in zip(x.stride(), x.shape))
    work = x if donate[0] and writable else x.clone(memory_format=torch.contiguous_format)
    if upd.numel() == 0:
        return work
    idx, static = _dyn_index(eqn, args, 2, x.shape, tuple(upd.shape), x.device)
    if static:
        work[idx].copy_(upd)
    else:
        work.index_put_(idx, upd)
    return work


# --- compiled dynamic slices ----------------------------------------------------------------------------------
def _static_starts(ctx, first: int, shape, sizes):
    """Per dim ``slice(start, start + size)`` when every start is a constant (clamped as the rules do), else
    None."""
    out = []
    for d, n in enumerate(sizes):
        h = ctx.host(first + d)
        if h is None:
            return None
        s = int(_index(h.reshape(()), ctx.dt(first + d)))
        s = min(max(s, 0), shape[d] - n)
        out.append(slice(s, s + n))
    return tuple(out)


def _compile_dynamic_slice(ctx):
    """Compiled ``dynamic_slice``: a static slice (a view) when every start is constant."""
    shape, sizes = ctx.shape(0), tuple(ctx.params["slice_sizes"])
    if math.prod(sizes) == 0:
        return None
    idx = _static_starts(ctx, 1, shape, sizes)
    if idx is None:
        return None
    return lambda args, donate: [args[0][idx]]


def _compile_dynamic_update_slice(ctx):
    """Compiled ``dynamic_update_slice``: a static slice copy when every start is constant."""
    shape, ushape = ctx.shape(0), ctx.shape(1)
    idx = _static_starts(ctx, 2, shape, ushape)
    if idx is None or math.prod(ushape) == 0:
        return None

    def run(args, donate):
        x = args[0]
        if donate[0] and all(s != 0 or n <= 1 for s, n in zip(x.stride(), x.shape)):
            work = x
        else:
            work = x.clone(memory_format=torch.contiguous_format)
        work[idx].copy_(args[1])
        return [work]

    return run


def register(reg, comp, checks: dict) -> None:
    """Adds this module's rules, compilers and param checks to :mod:`interop.native.prims`' tables."""
    reg("gather")(_gather)
    checks["gather"] = _batching
    for name, kind in SCATTERS.items():
        reg(name, fresh=False)(_scatter(kind))
        checks[name] = _batching
    reg("dynamic_slice", fresh=False)(_dynamic_slice)
    reg("dynamic_update_slice", fresh=False)(_dynamic_update_slice)
    comp("gather")(c.compile_gather)
    for name in SCATTERS:
        comp(name)(c.compile_scatter)
    comp("dynamic_slice")(_compile_dynamic_slice)
    comp("dynamic_update_slice")(_compile_dynamic_update_slice)
