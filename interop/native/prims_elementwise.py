"""Torch rules and compilers for the elementwise primitives (see :mod:`interop.native.prims` for the
storage-dtype conventions, the rule signature and :func:`~interop.native.prims.compile_rule`).

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
    _dt,
    _int_of,
    _kind,
    _lit,
    _order,
    _signed,
    _smin,
    _uis,
    _widen_u,
    storage_dtype,
)

_T = Table()
_reg, _comp, _CHECKS = _T.rule, _T.comp, _T.checks
register = _T.register


# --- elementwise ----------------------------------------------------------------------------------------------
def _binary(fn):
    return lambda eqn, args, donate: fn(args[0], args[1], _dt(eqn))


_reg("add")(_binary(lambda a, b, dt: a | b if dt == np.bool_ else a + b))
_reg("sub")(_binary(lambda a, b, dt: a - b))
_reg("mul")(_binary(lambda a, b, dt: a & b if dt == np.bool_ else a * b))
_reg("and")(_binary(lambda a, b, dt: a & b))
_reg("or")(_binary(lambda a, b, dt: a | b))
_reg("xor")(_binary(lambda a, b, dt: a ^ b))
_reg("eq")(_binary(lambda a, b, dt: a == b))
_reg("ne")(_binary(lambda a, b, dt: a != b))
_reg("lt")(_binary(lambda a, b, dt: _order(a, dt) < _order(b, dt)))
_reg("le")(_binary(lambda a, b, dt: _order(a, dt) <= _order(b, dt)))
_reg("gt")(_binary(lambda a, b, dt: _order(a, dt) > _order(b, dt)))
_reg("ge")(_binary(lambda a, b, dt: _order(a, dt) >= _order(b, dt)))
_reg("shift_left")(_binary(lambda a, b, dt: torch.bitwise_left_shift(a, b)))  # torch: >= width or < 0 gives 0
_reg("neg")(lambda eqn, args, donate: -args[0])
_reg("not")(lambda eqn, args, donate: ~args[0])
_reg("square")(lambda eqn, args, donate: args[0] * args[0])
_reg("copy", "copy_p")(lambda eqn, args, donate: args[0].clone())


def _total_key(x: torch.Tensor, dt) -> torch.Tensor:
    """XLA's TOTALORDER compare key: floats as signed ints (-NaN < -inf < -0 < 0 < inf < NaN)."""
    if _kind(dt) != "f":
        return _order(x, dt)
    b = x.view(_int_of(x.dtype))
    return b ^ ((b >> (_bits(dt) - 1)) & ((1 << (_bits(dt) - 1)) - 1))


_reg("lt_to")(_binary(lambda a, b, dt: _total_key(a, dt) < _total_key(b, dt)))
_reg("le_to")(_binary(lambda a, b, dt: _total_key(a, dt) <= _total_key(b, dt)))
_reg("eq_to")(_binary(lambda a, b, dt: _total_key(a, dt) == _total_key(b, dt)))


def _minmax(a: torch.Tensor, b: torch.Tensor, dt, is_max: bool) -> torch.Tensor:
    if dt == np.bool_:
        return a | b if is_max else a & b
    f = torch.maximum if is_max else torch.minimum
    if _uis(dt):
        s = _smin(_bits(dt))
        return f(a ^ s, b ^ s) ^ s
    if _kind(dt) == "f":  # torch returns its first operand for (+-0, -+0); XLA max gives +0 and min gives -0
        it = _int_of(a.dtype)
        ab, bb = a.view(it), b.view(it)
        zeros = (ab | bb) if not is_max else (ab & bb)
        return torch.where(a == b, zeros.view(a.dtype), f(a, b))
    return f(a, b)


_reg("max")(_binary(lambda a, b, dt: _minmax(a, b, dt, True)))
_reg("min")(_binary(lambda a, b, dt: _minmax(a, b, dt, False)))


@_reg("clamp")
def _clamp(eqn, args, donate):
    lo, x, hi = args
    dt = _dt(eqn, 1)
    return _minmax(_minmax(x, lo, dt, True), hi, dt, False)


def _divrem(a: torch.Tensor, b: torch.Tensor, dt, rem: bool) -> torch.Tensor:
    if _kind(dt) == "f":
        return torch.fmod(a, b) if rem else a / b
    bits, zero = _bits(dt), b == 0
    if _uis(dt) and bits < 64:  # exact in int64
        st, m = a.dtype, (1 << bits) - 1
        a, b = a.long() & m, torch.where(zero, 1, b.long() & m)
        q = torch.div(a, b, rounding_mode="trunc")
        r = a - q * b
        return torch.where(zero, a, r).to(st) if rem else torch.where(zero, -1, q).to(st)
    if _uis(dt):  # uint64 (Hacker's Delight 9-3: an unsigned divide from a signed one)
        s = _smin(64)
        b = torch.where(zero, 1, b)
        q = torch.div((a >> 1) & ~s, b, rounding_mode="trunc") << 1
        q = q + ((a - q * b) ^ s >= b ^ s).long()
        q = torch.where(b < 0, (a ^ s >= b ^ s).long(), q)  # divisor >= 2**63: quotient 0 or 1
    else:  # signed (uint8 is torch.uint8: unsigned there); INT_MIN / -1 divides by 1 instead
        odd = (a == _smin(bits)) & (b == -1) if _kind(dt) == "i" else zero
        b = torch.where(zero | odd, 1, b)
        q = torch.div(a, b, rounding_mode="trunc")
    if rem:
        return torch.where(zero, a, a - q * b)
    return torch.where(zero, -1 if _kind(dt) == "i" or _uis(dt) else (1 << bits) - 1, q)


_reg("div")(_binary(lambda a, b, dt: _divrem(a, b, dt, False)))
_reg("rem")(_binary(lambda a, b, dt: _divrem(a, b, dt, True)))


@_reg("shift_right_arithmetic")
def _sra(eqn, args, donate):
    a, b = args
    if a.dtype == torch.uint8:  # XLA fills with the top bit on unsigned types too
        return (a.view(torch.int8) >> b.view(torch.int8)).view(torch.uint8)
    return a >> b  # torch: >= width or < 0 (a huge unsigned amount) fills with the sign


@_reg("shift_right_logical")
def _srl(eqn, args, donate):
    a, b = args
    dt, k = _dt(eqn), _lit(eqn, 1)
    bits = _bits(dt)
    if a.dtype == torch.uint8:
        return a >> b  # torch: unsigned, >= width gives 0
    if k is not None:  # a literal amount (almost always): two ops
        k = int(k) & ((1 << bits) - 1)
        return (a >> k) & _signed((1 << (bits - k)) - 1, bits) if k < bits else torch.zeros_like(a)
    if bits <= 32:  # widen: the value is non-negative in int64, so >> is logical; torch gives 0 past 63 / < 0
        return ((a.long() & ((1 << bits) - 1)) >> b.long()).to(a.dtype)
    valid = (b >= 0) & (b < bits)
    return torch.where(valid, (a >> b) & ~(-1 << (bits - b)), 0)


@_reg("select_n")
def _select_n(eqn, args, donate):
    pred, *cases = args
    if len(cases) == 1:
        return cases[0].clone()
    if pred.dtype == torch.bool:
        return torch.where(pred, cases[1], cases[0])
    out = cases[0]
    for i, c in enumerate(cases[1:], 1):
        out = torch.where(pred >= i, c, out)
    return out


@_reg("abs")
def _abs(eqn, args, donate):
    return args[0].clone() if _kind(_dt(eqn)) == "u" else torch.abs(args[0])


@_reg("sign")
def _sign(eqn, args, donate):
    x, dt = args[0], _dt(eqn)
    if _kind(dt) == "u":
        return (x != 0).to(x.dtype)
    if _kind(dt) == "f":  # XLA keeps -0 and NaN
        return torch.where((x == 0) | torch.isnan(x), x, torch.sign(x))
    return torch.sign(x)


def _popcount32(v: torch.Tensor) -> torch.Tensor:
    """Bit counts of int64 values in [0, 2**32)."""
    v = v - ((v >> 1) & 0x55555555)
    v = (v & 0x33333333) + ((v >> 2) & 0x33333333)
    v = (v + (v >> 4)) & 0x0F0F0F0F
    return ((v * 0x01010101) >> 24) & 0xFF


def _clz32(v: torch.Tensor) -> torch.Tensor:
    for s in (1, 2, 4, 8, 16):
        v = v | (v >> s)
    return 32 - _popcount32(v)


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (x >> 32) & 0xFFFFFFFF, x & 0xFFFFFFFF


@_reg("population_count")
def _popcnt(eqn, args, donate):
    x, bits = args[0], _bits(_dt(eqn))
    if bits == 64:
        hi, lo = _halves(x)
        return _popcount32(hi) + _popcount32(lo)
    return _popcount32(_widen_u(x, bits)).to(x.dtype)


@_reg("clz")
def _clz(eqn, args, donate):
    x, bits = args[0], _bits(_dt(eqn))
    if bits == 64:
        hi, lo = _halves(x)
        return torch.where(hi != 0, _clz32(hi), 32 + _clz32(lo))
    return (_clz32(_widen_u(x, bits)) - (32 - bits)).to(x.dtype)


@_reg("integer_pow")
def _integer_pow(eqn, args, donate):  # jax's own square-and-multiply order, so floats round as XLA does
    x, y = args[0], eqn.params["y"]
    if y == 0:
        return torch.ones_like(x)
    acc, n = None, abs(y)
    while n > 0:
        if n & 1:
            acc = x if acc is None else acc * x
        n >>= 1
        if n > 0:
            x = x * x
    return 1 / acc if y < 0 else (acc.clone() if acc is args[0] else acc)


_reg("mulhi")(_binary(lambda a, b, dt: ((_order_wide(a, dt) * _order_wide(b, dt)) >> _bits(dt)).to(a.dtype)))
_CHECKS["mulhi"] = lambda eqn: f"dtype {_dt(eqn)} (64-bit mulhi)" if _bits(_dt(eqn)) == 64 else None


def _order_wide(x: torch.Tensor, dt) -> torch.Tensor:
    return _widen_u(x, _bits(dt)) if _kind(dt) == "u" else x.long()


def _float_round(eqn, args, donate):
    x = args[0]
    if int(eqn.params["rounding_method"]) == 1:  # to nearest even
        return torch.round(x)
    t = torch.trunc(x)  # away from zero; x - trunc(x) is exact
    return torch.where(torch.abs(x - t) >= 0.5, t + torch.sign(x), t)


_reg("round")(_float_round)
for _name, _fn in {
    "exp": torch.exp,
    "exp2": torch.exp2,
    "log": torch.log,
    "log1p": torch.log1p,
    "expm1": torch.expm1,
    "sqrt": torch.sqrt,
    "rsqrt": torch.rsqrt,
    "tanh": torch.tanh,
    "logistic": torch.sigmoid,
    "sin": torch.sin,
    "cos": torch.cos,
    "floor": torch.floor,
    "ceil": torch.ceil,
    "erf": torch.erf,
    "is_finite": torch.isfinite,
}.items():
    _reg(_name)(lambda eqn, args, donate, f=_fn: f(args[0]))
_reg("pow")(lambda eqn, args, donate: torch.pow(args[0], args[1]))
_reg("atan2")(lambda eqn, args, donate: torch.atan2(args[0], args[1]))


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
