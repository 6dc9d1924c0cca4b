"""Torch rules for the elementwise primitives (see :mod:`interop.native.prims` for the storage-dtype conventions,
the rule signature and :func:`~interop.native.prims.compile_rule`).

Their compiled forms, which bind every dtype decision and make literal / constant operands device tensors once,
are :mod:`interop.native.prims_elementwise_compiled`'s (it reads :func:`_minmax` and :func:`_divrem` from here).
"""

from __future__ import annotations

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
