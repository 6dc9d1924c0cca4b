"""Torch rules and compilers for the shape primitives (views, concatenation, split, iota), pad, sort,
reductions and cumulative ops (see :mod:`interop.native.prims` for the conventions and
:func:`~interop.native.prims.compile_rule`).

Compiled forms are one torch call per view (a reshape, a permute, an expand, a narrow or a precomputed index
tuple); a ``concatenate`` drops its empty operands; a ``pad`` scatters its operand into a precomputed template of
the padding value in one out-of-place ``index_put``; ``iota`` is built on the compiled-for device.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from interop.native.prims_dtypes import Table, _bits, _fill_scalar, _kind, _order, _out, _smin, _uis, storage_dtype

_T = Table()
_reg, _comp = _T.rule, _T.comp
register = _T.register


# --- shapes ---------------------------------------------------------------------------------------------------
@_reg("reshape", fresh=False)
def _reshape(eqn, args, donate):
    x, dims = args[0], eqn.params.get("dimensions")
    return (x.permute(dims) if dims is not None else x).reshape(eqn.params["new_sizes"])


_reg("squeeze", fresh=False)(lambda eqn, args, donate: args[0].reshape(_out(eqn).shape))
_reg("transpose", fresh=False)(lambda eqn, args, donate: args[0].permute(eqn.params["permutation"]))
_reg("rev")(lambda eqn, args, donate: torch.flip(args[0], tuple(eqn.params["dimensions"])))
_reg("concatenate")(lambda eqn, args, donate: torch.cat(args, dim=eqn.params["dimension"]))
_reg("stack")(lambda eqn, args, donate: torch.stack(args, dim=eqn.params["axis"]))
_reg("split", fresh=False, multi=True)(
    lambda eqn, args, donate: list(torch.split(args[0], list(eqn.params["sizes"]), dim=eqn.params["axis"]))
)
_reg("unstack", fresh=False, multi=True)(lambda eqn, args, donate: list(torch.unbind(args[0], eqn.params["axis"])))
_reg("tile")(lambda eqn, args, donate: args[0].repeat(tuple(eqn.params["reps"])))
_reg("optimization_barrier", fresh=False, multi=True)(lambda eqn, args, donate: list(args))


@_reg("broadcast_in_dim", fresh=False)
def _broadcast_in_dim(eqn, args, donate):
    x, shape, dims = args[0], tuple(eqn.params["shape"]), eqn.params["broadcast_dimensions"]
    view = [1] * len(shape)
    for i, d in enumerate(dims):
        view[d] = x.shape[i]
    return x.reshape(view).expand(shape)


@_reg("slice", fresh=False)
def _slice(eqn, args, donate):
    p = eqn.params
    steps = p["strides"] or (1,) * len(p["start_indices"])
    return args[0][tuple(slice(s, e, k) for s, e, k in zip(p["start_indices"], p["limit_indices"], steps))]


@_reg("iota")
def _iota(eqn, args, donate):
    p = eqn.params
    shape, d, st = tuple(p["shape"]), p["dimension"], storage_dtype(p["dtype"])
    view = [1] * len(shape)
    view[d] = shape[d]
    r = torch.arange(shape[d], dtype=torch.float64 if st.is_floating_point else torch.int64)
    return r.to(st).reshape(view).expand(shape)


# --- pad ------------------------------------------------------------------------------------------------------
def _pad(eqn, args, donate):
    x, value = args
    cfg = eqn.params["padding_config"]
    full, place, crop = [], [], []
    for n, (lo, hi, interior) in zip(x.shape, cfg):
        lo_p, hi_p = max(lo, 0), max(hi, 0)
        body = n + max(n - 1, 0) * interior
        full.append(lo_p + body + hi_p)
        place.append(slice(lo_p, lo_p + body, interior + 1))
        crop.append(slice(lo_p - lo, lo_p + body + hi))
    buf = value.expand(full).contiguous()
    if x.numel():
        buf[tuple(place)] = x
    return buf[tuple(crop)]


# --- sort -----------------------------------------------------------------------------------------------------
def _sort_key(x: torch.Tensor, dt) -> torch.Tensor:
    """A key torch sorts in jax's order (floats: NaN last and -0 == 0, which jax's comparator canonicalizes to)."""
    if dt == np.bool_:
        return x.to(torch.uint8)
    return _order(x, dt)


def _sort(eqn, args, donate):
    d, nk = eqn.params["dimension"], eqn.params["num_keys"]
    keys = [_sort_key(args[i], np.dtype(eqn.invars[i].aval.dtype)) for i in range(nk)]
    perm = None
    for k in reversed(keys):  # least significant key first; stable sorts keep the earlier keys' order
        _, idx = torch.sort(k if perm is None else torch.take_along_dim(k, perm, d), dim=d, stable=True)
        perm = idx if perm is None else torch.take_along_dim(perm, idx, d)
    return [torch.take_along_dim(x, perm, d) for x in args]


# --- reductions -----------------------------------------------------------------------------------------------
def _axes(eqn) -> tuple[int, ...]:
    return tuple(eqn.params["axes"])


def _empty_reduce(eqn, x, ident):
    return torch.full(eqn.outvars[0].aval.shape, ident, dtype=x.dtype, device=x.device)


def _reduce_minmax(is_max: bool):
    def rule(eqn, args, donate):
        x, dt, axes = args[0], np.dtype(eqn.invars[0].aval.dtype), _axes(eqn)
        if not axes:
            return x.clone()
        if any(x.shape[a] == 0 for a in axes):
            if dt == np.bool_:
                return _empty_reduce(eqn, x, not is_max)
            if _kind(dt) == "f":
                return _empty_reduce(eqn, x, -math.inf if is_max else math.inf)
            info = np.iinfo(dt)
            return _empty_reduce(eqn, x, _fill_scalar(int(info.min if is_max else info.max), dt))
        if dt == np.bool_:
            return torch.any(x, dim=axes) if is_max else torch.all(x, dim=axes)
        f = torch.amax if is_max else torch.amin
        if _uis(dt):
            s = _smin(_bits(dt))
            return f(x ^ s, dim=axes) ^ s
        return f(x, dim=axes)

    return rule


def _reduce_sum(eqn, args, donate):
    x, axes = args[0], _axes(eqn)
    return torch.sum(x, dim=axes, dtype=x.dtype) if axes else x.clone()


def _reduce_prod(eqn, args, donate):
    x = args[0]
    for a in sorted(_axes(eqn), reverse=True):
        x = torch.prod(x, dim=a, dtype=x.dtype)
    return x if _axes(eqn) else x.clone()


def _reduce_bits(op: str):
    def rule(eqn, args, donate):
        x, axes = args[0], _axes(eqn)
        if x.dtype == torch.bool and op != "xor":
            return (torch.all if op == "and" else torch.any)(x, dim=axes) if axes else x.clone()
        keep = [d for d in range(x.ndim) if d not in axes]
        n = math.prod(x.shape[a] for a in axes)
        x = x.permute(*keep, *axes).reshape(*(x.shape[d] for d in keep), n)
        if n == 0:
            ones = 255 if x.dtype == torch.uint8 else -1
            return _empty_reduce(eqn, x, ones if op == "and" else 0)
        while x.shape[-1] > 1:  # halve the reduced axis each round
            h = x.shape[-1] // 2
            y = _bitop(op, x[..., :h], x[..., h : 2 * h])
            x = torch.cat([y, x[..., 2 * h :]], dim=-1) if x.shape[-1] % 2 else y
        return x[..., 0].clone()

    return rule


def _bitop(op: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a & b if op == "and" else (a | b if op == "or" else a ^ b)


def _argminmax(is_max: bool):
    def rule(eqn, args, donate):
        x = _sort_key(args[0], np.dtype(eqn.invars[0].aval.dtype))
        r = (torch.argmax if is_max else torch.argmin)(x, dim=_axes(eqn)[0])
        return r.to(storage_dtype(eqn.params["index_dtype"]))

    return rule


def _cumulative(kind: str):
    def rule(eqn, args, donate):
        x, dt = args[0], np.dtype(eqn.invars[0].aval.dtype)
        axis, rev = eqn.params["axis"], eqn.params["reverse"]
        if rev:
            x = torch.flip(x, (axis,))
        if kind == "sum":
            y = torch.cumsum(x, axis, dtype=x.dtype)
        elif kind == "prod":
            y = torch.cumprod(x, axis, dtype=x.dtype)
        elif kind == "logsumexp":
            y = torch.logcumsumexp(x, axis)
        else:
            k = _sort_key(x, dt)
            s = _smin(_bits(dt)) if _uis(dt) else None
            y = (torch.cummax if kind == "max" else torch.cummin)(k, axis).values
            y = y ^ s if s is not None else y.to(x.dtype)
        return torch.flip(y, (axis,)) if rev else y

    return rule


_reg("pad")(_pad)
_reg("sort", multi=True)(_sort)
_reg("reduce_max")(_reduce_minmax(True))
_reg("reduce_min")(_reduce_minmax(False))
_reg("reduce_sum")(_reduce_sum)
_reg("reduce_prod")(_reduce_prod)
for _op in ("and", "or", "xor"):
    _reg(f"reduce_{_op}")(_reduce_bits(_op))
_reg("argmax")(_argminmax(True))
_reg("argmin")(_argminmax(False))
for _k in ("sum", "prod", "max", "min", "logsumexp"):
    _reg(f"cum{_k}")(_cumulative(_k))


# --- compiled forms -------------------------------------------------------------------------------------------
@_comp("reshape")
def _c_reshape(ctx):
    shape, dims = tuple(ctx.params["new_sizes"]), ctx.params.get("dimensions")
    if dims is not None:
        dims = tuple(dims)
        return lambda args, donate: [args[0].permute(dims).reshape(shape)]
    return lambda args, donate: [args[0].reshape(shape)]


@_comp("squeeze")
def _c_squeeze(ctx):
    shape = tuple(ctx.out().shape)
    return lambda args, donate: [args[0].reshape(shape)]


@_comp("transpose")
def _c_transpose(ctx):
    perm = tuple(ctx.params["permutation"])
    return lambda args, donate: [args[0].permute(perm)]


@_comp("rev")
def _c_rev(ctx):
    dims = tuple(ctx.params["dimensions"])
    return lambda args, donate: [torch.flip(args[0], dims)]


@_comp("broadcast_in_dim")
def _c_broadcast_in_dim(ctx):
    shape, dims, src = tuple(ctx.params["shape"]), ctx.params["broadcast_dimensions"], ctx.shape(0)
    view = [1] * len(shape)
    for i, d in enumerate(dims):
        view[d] = src[i]
    view = tuple(view)
    if src == shape:
        return lambda args, donate: [args[0]]
    if view == shape:
        return lambda args, donate: [args[0].reshape(shape)]
    if view == (1,) * (len(shape) - len(src)) + src:  # expand adds leading dims itself
        return lambda args, donate: [args[0].expand(shape)]
    return lambda args, donate: [args[0].reshape(view).expand(shape)]


@_comp("slice")
def _c_slice(ctx):
    p, shape = ctx.params, ctx.shape(0)
    steps = p["strides"] or (1,) * len(shape)
    idx = [slice(s, e, k) for s, e, k in zip(p["start_indices"], p["limit_indices"], steps)]
    while idx and idx[-1] == slice(0, shape[len(idx) - 1], 1):  # trailing whole dims need no index
        idx.pop()
    if not idx:
        return lambda args, donate: [args[0]]
    key = idx[0] if len(idx) == 1 else tuple(idx)
    return lambda args, donate: [args[0][key]]


@_comp("concatenate")
def _c_concatenate(ctx):
    dim = ctx.params["dimension"]
    keep = [i for i in range(ctx.n_in) if math.prod(ctx.shape(i)) != 0]
    if len(keep) == 1:
        (k,) = keep
        return lambda args, donate: [args[k].clone()]
    if len(keep) == ctx.n_in:
        return lambda args, donate: [torch.cat(args, dim=dim)]
    if not keep:
        return None
    return lambda args, donate: [torch.cat([args[i] for i in keep], dim=dim)]


@_comp("stack")
def _c_stack(ctx):
    axis = ctx.params["axis"]
    return lambda args, donate: [torch.stack(args, dim=axis)]


@_comp("iota")
def _c_iota(ctx):
    p, dev = ctx.params, ctx.device
    shape, d, st = tuple(p["shape"]), p["dimension"], storage_dtype(p["dtype"])
    view = [1] * len(shape)
    view[d] = shape[d]
    wide = torch.float64 if st.is_floating_point else torch.int64
    return lambda args, donate: [torch.arange(shape[d], dtype=wide, device=dev).to(st).reshape(view).expand(shape)]


@_comp("pad")
def _c_pad(ctx):
    """The operand scattered into a template of the padding value with one ``index_put`` (per-dim positions,
    broadcast), then the negative padding cropped as a view."""
    shape, cfg, dev = ctx.shape(0), ctx.params["padding_config"], ctx.device
    full, pos, crop = [], [], []
    for d, (n, (lo, hi, interior)) in enumerate(zip(shape, cfg)):
        lo_p, hi_p = max(lo, 0), max(hi, 0)
        body = n + max(n - 1, 0) * interior
        full.append(lo_p + body + hi_p)
        view = [1] * len(shape)
        view[d] = n
        pos.append(torch.arange(lo_p, lo_p + body, interior + 1, dtype=torch.int64).reshape(view).to(dev))
        crop.append(slice(lo_p - lo, lo_p + body + hi))
    full, idx = tuple(full), tuple(pos)
    crop = tuple(crop) if any(lo < 0 or hi < 0 for lo, hi, _ in cfg) else None
    empty = math.prod(shape) == 0
    value = ctx.const(1)
    if value is not None:
        template = value.expand(full).contiguous()
        if empty:
            fill = lambda args: template.clone()  # noqa: E731
        else:
            fill = lambda args: torch.index_put(template, idx, args[0])  # noqa: E731
    elif empty:
        fill = lambda args: args[1].expand(full).contiguous()  # noqa: E731
    else:
        fill = lambda args: args[1].expand(full).contiguous().index_put_(idx, args[0])  # noqa: E731
    if crop is None:
        return lambda args, donate: [fill(args)]
    return lambda args, donate: [fill(args)[crop]]


@_comp("reduce_sum", "reduce_max", "reduce_min")
def _c_reduce(ctx):
    name, dt, axes, x_shape = ctx.eqn.primitive.name, ctx.dt(), tuple(ctx.params["axes"]), ctx.shape(0)
    if not axes or any(x_shape[a] == 0 for a in axes) or dt == np.bool_:
        return None
    st = storage_dtype(dt)
    if name == "reduce_sum":
        return lambda args, donate: [torch.sum(args[0], dim=axes, dtype=st)]
    f = torch.amax if name == "reduce_max" else torch.amin
    if _uis(dt):
        s = ctx.scalar(_smin(_bits(dt)), st)
        return lambda args, donate: [f(args[0] ^ s, dim=axes) ^ s]
    return lambda args, donate: [f(args[0], dim=axes)]
