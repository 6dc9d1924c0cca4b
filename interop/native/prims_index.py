"""Torch rules for the indexing primitives: gather, scatter family, dynamic slices, registered into
:data:`interop.native.prims.RULES` (see that module for the storage-dtype conventions and the rule signature).
The compiled gather and scatter are in :mod:`interop.native.prims_index_compiled`; the compiled dynamic slices
(static slices when every start is constant) are here.

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
from jax import lax

from interop.native.prims_convert import _convert_value
from interop.native.prims_dtypes import (
    UnsupportedPrimitive,
    _bits,
    _fill_scalar,
    _index,
    _kind,
    _lit,
    _smin,
    _uis,
)

_FILL = lax.GatherScatterMode.FILL_OR_DROP
_CLIP = lax.GatherScatterMode.CLIP
_MODES = (_CLIP, _FILL, lax.GatherScatterMode.PROMISE_IN_BOUNDS)


def _arange_at(n: int, pos: int, rank: int, device, step: int = 1) -> torch.Tensor:
    """``arange(0, n*step, step)`` shaped to ``rank`` dims with the ``n`` at ``pos``."""
    view = [1] * rank
    view[pos] = n
    return torch.arange(0, n * step, step, device=device).reshape(view)


def _starts(indices: torch.Tensor, idt, fill: bool, operand_shape) -> torch.Tensor:
    """Start indices as int64. jax lowers a FILL_OR_DROP gather by first converting them to int32 (int64 for an
    operand dim past INT32_MAX), wrapping: an int64 index 2**32 + 3 reads row 3."""
    if fill and max(operand_shape, default=0) <= np.iinfo(np.int32).max:
        return _convert_value(indices, idt, np.dtype(np.int32)).long()
    if fill:
        return _convert_value(indices, idt, np.dtype(np.int64))
    return _index(indices, idt)


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


def _gather(eqn, args, donate):
    p, out = eqn.params, eqn.outvars[0].aval
    fill = _fill_scalar(p["fill_value"], np.dtype(out.dtype))
    return _gather_values(args[0], args[1], eqn.invars[1].aval.dtype, p, tuple(out.shape), fill)


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


def _identity(op: str, st: torch.dtype):
    if op == "prod":
        return 1
    if st.is_floating_point:
        return -math.inf if op == "amax" else math.inf
    info = torch.iinfo(st)
    return info.min if op == "amax" else info.max


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
    from interop.native import prims_index_compiled as c  # noqa: PLC0415  (it imports this module)

    comp("gather")(c.compile_gather)
    for name in SCATTERS:
        comp(name)(c.compile_scatter)
    comp("dynamic_slice")(_compile_dynamic_slice)
    comp("dynamic_update_slice")(_compile_dynamic_update_slice)


SCATTERS = {"scatter": "replace", "scatter-add": "add", "scatter-sub": "sub", "scatter-mul": "prod"}
SCATTERS |= {"scatter-max": "amax", "scatter-min": "amin"}
"""Scatter primitive -> its torch reduction (``replace``: last update in row-major update order wins)."""
