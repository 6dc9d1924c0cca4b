"""Compilers of the elementwise primitives (see :func:`interop.native.prims.compile_rule`; the rules, whose
results these match, are :mod:`interop.native.prims_elementwise`'s).

Compiled forms bind every dtype decision and make literal / constant operands device tensors once (0-d ones for
scalars: a binary op with a 0-d tensor costs half what one with a Python scalar does): unsigned comparisons and
max/min key a constant operand at compile time, a constant shift amount takes the two-op logical shift, a
constant divisor without zeros (or ``-1`` for signed types) skips the guards.
"""

from __future__ import annotations

import operator

import numpy as np
import torch

from interop.native.prims_dtypes import (
    Table,
    _bits,
    _int_of,
    _kind,
    _signed,
    _smin,
    _uis,
    storage_dtype,
)
from interop.native.prims_elementwise import _divrem, _minmax

_T = Table()
_comp = _T.comp
register = _T.register


# --- compiled forms -------------------------------------------------------------------------------------------
def _binary_run(ctx, fn, key=None):
    """``run`` for ``fn(key(a), key(b))`` (``key`` None: the identity); a constant operand is keyed here, once."""
    k0, k1 = ctx.const(0), ctx.const(1)
    if key is not None:
        k0 = key(k0) if k0 is not None else None
        k1 = key(k1) if k1 is not None else None
    if k0 is not None and k1 is not None:
        return lambda args, donate: [fn(k0, k1)]
    if key is None:
        if k1 is not None:
            return lambda args, donate: [fn(args[0], k1)]
        if k0 is not None:
            return lambda args, donate: [fn(k0, args[1])]
        return lambda args, donate: [fn(args[0], args[1])]
    if k1 is not None:
        return lambda args, donate: [fn(key(args[0]), k1)]
    if k0 is not None:
        return lambda args, donate: [fn(k0, key(args[1]))]
    return lambda args, donate: [fn(key(args[0]), key(args[1]))]


def _order_key(ctx, dt):
    """The key making signed comparison give ``dt``'s order (None when storage order already is)."""
    if not _uis(dt):
        return None
    s = ctx.scalar(_smin(_bits(dt)), storage_dtype(dt))
    return lambda x: x ^ s


_PLAIN = {"sub": operator.sub, "and": operator.and_, "or": operator.or_, "xor": operator.xor}
_PLAIN |= {"eq": operator.eq, "ne": operator.ne, "shift_left": torch.bitwise_left_shift}
_ORDERED = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge}


@_comp("add", "mul", *_PLAIN)
def _c_plain(ctx):
    name, dt = ctx.eqn.primitive.name, ctx.dt()
    if name in ("add", "mul"):
        fn = {"add": operator.or_, "mul": operator.and_}[name] if dt == np.bool_ else getattr(operator, name)
    else:
        fn = _PLAIN[name]
    return _binary_run(ctx, fn)


@_comp(*_ORDERED)
def _c_ordered(ctx):
    return _binary_run(ctx, _ORDERED[ctx.eqn.primitive.name], _order_key(ctx, ctx.dt()))


@_comp("lt_to", "le_to", "eq_to")
def _c_total(ctx):
    dt = ctx.dt()
    fn = {"lt_to": operator.lt, "le_to": operator.le, "eq_to": operator.eq}[ctx.eqn.primitive.name]
    if _kind(dt) != "f":
        return _binary_run(ctx, fn, _order_key(ctx, dt))
    it, bits = _int_of(storage_dtype(dt)), _bits(dt)
    sh, mask = ctx.scalar(bits - 1, it), ctx.scalar((1 << (bits - 1)) - 1, it)

    def key(x):
        b = x.view(it)
        return b ^ ((b >> sh) & mask)

    return _binary_run(ctx, fn, key)


@_comp("max", "min")
def _c_minmax(ctx):
    dt, is_max = ctx.dt(), ctx.eqn.primitive.name == "max"
    if dt == np.bool_:
        return _binary_run(ctx, operator.or_ if is_max else operator.and_)
    f = torch.maximum if is_max else torch.minimum
    if _kind(dt) == "f":
        return _binary_run(ctx, lambda a, b: _minmax(a, b, dt, is_max))
    if not _uis(dt):
        return _binary_run(ctx, f)
    s = ctx.scalar(_smin(_bits(dt)), storage_dtype(dt))
    return _binary_run(ctx, lambda a, b: f(a, b) ^ s, lambda x: x ^ s)


@_comp("clamp")
def _c_clamp(ctx):
    dt = ctx.dt(1)
    if _kind(dt) == "f" or dt == np.bool_:
        return None
    lo, hi = ctx.const(0), ctx.const(2)
    if _uis(dt):
        s = ctx.scalar(_smin(_bits(dt)), storage_dtype(dt))
        lo, hi = (None if c is None else c ^ s for c in (lo, hi))

        def run(args, donate):
            a, b = (args[0] ^ s) if lo is None else lo, (args[2] ^ s) if hi is None else hi
            return [torch.clamp(args[1] ^ s, a, b) ^ s]

        return run
    return lambda args, donate: [torch.clamp(args[1], args[0] if lo is None else lo, args[2] if hi is None else hi)]


@_comp("div", "rem")
def _c_divrem(ctx):
    dt, rem = ctx.dt(), ctx.eqn.primitive.name == "rem"
    b = ctx.host(1)
    st, bits = storage_dtype(dt), _bits(dt)
    if b is not None and _kind(dt) in "iu" and bool((b != 0).all()):  # a constant divisor without zeros
        if _uis(dt) and bits < 64:  # exact in int64: non-negative operands
            m = ctx.scalar((1 << bits) - 1, torch.int64)
            bl = ctx.const(1).long() & m
            if rem:
                return lambda args, donate: [torch.remainder(args[0].long() & m, bl).to(st)]
            return lambda args, donate: [torch.div(args[0].long() & m, bl, rounding_mode="floor").to(st)]
        if not _uis(dt) and not (_kind(dt) == "i" and bool((b == -1).any())):  # no INT_MIN / -1 case
            bc = ctx.const(1)
            if rem:
                return lambda args, donate: [torch.fmod(args[0], bc)]
            return lambda args, donate: [torch.div(args[0], bc, rounding_mode="trunc")]
    return lambda args, donate: [_divrem(args[0], args[1], dt, rem)]


@_comp("shift_right_logical")
def _c_srl(ctx):
    dt = ctx.dt()
    bits, st = _bits(dt), storage_dtype(dt)
    if st == torch.uint8:
        return _binary_run(ctx, operator.rshift)
    k = ctx.host(1)
    if k is not None and k.ndim == 0:  # a constant amount (almost always): at most two ops
        k = int(k) & ((1 << bits) - 1)
        if k >= bits:
            return lambda args, donate: [torch.zeros_like(args[0])]
        if k == 0:
            return lambda args, donate: [args[0].clone()]
        kt, mask = ctx.scalar(k, st), ctx.scalar(_signed((1 << (bits - k)) - 1, bits), st)
        return lambda args, donate: [(args[0] >> kt) & mask]
    if bits <= 32:
        m = ctx.scalar((1 << bits) - 1, torch.int64)
        return lambda args, donate: [((args[0].long() & m) >> args[1].long()).to(st)]
    return None


@_comp("shift_right_arithmetic")
def _c_sra(ctx):
    if storage_dtype(ctx.dt()) == torch.uint8:
        return None
    return _binary_run(ctx, operator.rshift)


@_comp("select_n")
def _c_select_n(ctx):
    n = ctx.n_in - 1
    if n == 1:
        return lambda args, donate: [args[1].clone()]
    if ctx.dt(0) != np.bool_:
        return None
    c0, c1 = ctx.const(1), ctx.const(2)
    if c0 is not None and c1 is not None:
        return lambda args, donate: [torch.where(args[0], c1, c0)]
    if c0 is not None:
        return lambda args, donate: [torch.where(args[0], args[2], c0)]
    if c1 is not None:
        return lambda args, donate: [torch.where(args[0], c1, args[1])]
    return lambda args, donate: [torch.where(args[0], args[2], args[1])]


_UNARY = {"neg": operator.neg, "not": operator.invert, "copy": torch.clone, "copy_p": torch.clone}
_UNARY |= {"exp": torch.exp, "exp2": torch.exp2, "log": torch.log, "log1p": torch.log1p, "expm1": torch.expm1}
_UNARY |= {"sqrt": torch.sqrt, "rsqrt": torch.rsqrt, "tanh": torch.tanh, "logistic": torch.sigmoid}
_UNARY |= {"sin": torch.sin, "cos": torch.cos, "floor": torch.floor, "ceil": torch.ceil, "erf": torch.erf}
_UNARY |= {"is_finite": torch.isfinite}


@_comp(*_UNARY, "square", "abs", "sign")
def _c_unary(ctx):
    name, dt = ctx.eqn.primitive.name, ctx.dt()
    if name == "square":
        return lambda args, donate: [args[0] * args[0]]
    if name == "abs":
        fn = torch.clone if _kind(dt) == "u" else torch.abs
    elif name == "sign":
        if _kind(dt) == "f":
            return None
        if _kind(dt) == "u":
            st, zero = storage_dtype(dt), ctx.scalar(0, storage_dtype(dt))
            return lambda args, donate: [(args[0] != zero).to(st)]
        fn = torch.sign
    else:
        fn = _UNARY[name]
    return lambda args, donate: [fn(args[0])]
