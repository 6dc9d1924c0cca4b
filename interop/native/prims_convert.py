"""Torch rules and compilers for ``convert_element_type`` and ``bitcast_convert_type`` (see
:mod:`interop.native.prims` for the storage-dtype conventions and :func:`~interop.native.prims.compile_rule`).

Converts that are no-ops in storage (``uint32 <-> int32``, same dtype) return the input itself or a same-size
dtype view; bitcasts are ``view(dtype)`` plus the squeeze / unsqueeze of the element-size change.
"""

from __future__ import annotations

import numpy as np
import torch

from interop.native.prims_dtypes import Table, _bits, _dt, _kind, _out, _smin, _uis, _widen_u, storage_dtype

_T = Table()
_reg, _comp = _T.rule, _T.comp
register = _T.register


# --- conversions ----------------------------------------------------------------------------------------------
def _float_to_int(x: torch.Tensor, dst, st: torch.dtype) -> torch.Tensor:
    """XLA's saturating float -> int convert: truncation, NaN -> 0, out of range -> the nearest bound."""
    bits = _bits(dst)
    lo, hi = (0, (1 << bits) - 1) if _kind(dst) == "u" else (_smin(bits), (1 << (bits - 1)) - 1)
    d = torch.nan_to_num(x.double(), nan=0.0, posinf=float(2**65), neginf=-float(2**65))
    if bits < 64:
        return d.clamp(lo, hi).long().to(st)
    top = float(2**63 - 1024)  # the largest double below 2**63
    if _kind(dst) == "i":
        return torch.where(d >= 2.0**63, hi, d.clamp(lo, top).long())
    big = (d - 2.0**63).clamp(0, top).long() ^ _smin(64)
    out = torch.where(d >= 2.0**63, big, d.clamp(0, top).long())
    return torch.where(d >= 2.0**64, -1, out)


@_reg("convert_element_type", fresh=False)
def _convert(eqn, args, donate):
    return _convert_value(args[0], _dt(eqn), np.dtype(_out(eqn).dtype))


def _convert_value(x: torch.Tensor, src, dst) -> torch.Tensor:
    """``convert_element_type`` of storage tensor ``x`` from JAX dtype ``src`` to ``dst``."""
    st = storage_dtype(dst)
    if src == dst:
        return x
    if dst == np.bool_:
        return x != 0
    if src == np.bool_:
        return x.to(st)
    if _kind(dst) in "iu" and _kind(src) in "iu":
        if dst.itemsize == src.itemsize:  # same bits (uint32 <-> int32): a no-op in storage
            return x if x.dtype == st else x.view(st)
        if dst.itemsize > src.itemsize and _uis(src):  # zero-extend
            return x.to(st) & ((1 << _bits(src)) - 1)
        return x.to(st)  # sign-extend, zero-extend from torch.uint8, or truncate (wraps)
    if _kind(dst) == "f" and _uis(src):
        if _bits(src) < 64:
            return _widen_u(x, _bits(src)).to(st)
        half = ((x >> 1) & ~_smin(64)) | (x & 1)  # round-to-odd halving keeps the rounding exact
        return torch.where(x < 0, half.to(st) * 2, x.to(st))
    if _kind(dst) in "iu":
        return _float_to_int(x, dst, st)
    return x.to(st)


@_reg("bitcast_convert_type", fresh=False)
def _bitcast(eqn, args, donate):
    x, src, dst = args[0], _dt(eqn), np.dtype(_out(eqn).dtype)
    st = storage_dtype(dst)
    if src.itemsize == dst.itemsize:
        return x if x.dtype == st else x.view(st)
    if src.itemsize > dst.itemsize:  # [...] -> [..., n]
        return _view_dtype(x.unsqueeze(-1), st)
    return _view_dtype(x, st).squeeze(-1)  # [..., n] -> [...]


def _view_dtype(x: torch.Tensor, st: torch.dtype) -> torch.Tensor:
    try:
        return x.view(st)
    except RuntimeError:  # a last dim or storage offset that cannot be reinterpreted in place
        return x.clone(memory_format=torch.contiguous_format).view(st)


# --- compiled forms -------------------------------------------------------------------------------------------
def _convert_fn(ctx, src, dst):
    """``x -> convert(x)`` from JAX dtype ``src`` to ``dst`` (None: the rule's general path)."""
    st = storage_dtype(dst)
    if src == dst:
        return lambda x: x
    if dst == np.bool_:
        return lambda x: x.to(torch.bool)  # x != 0: NaN is True, -0.0 False, as XLA
    if src == np.bool_:
        return lambda x: x.to(st)
    if _kind(dst) in "iu" and _kind(src) in "iu":
        if dst.itemsize == src.itemsize:
            return (lambda x: x) if storage_dtype(src) == st else (lambda x: x.view(st))
        if dst.itemsize > src.itemsize and _uis(src):
            m = ctx.scalar((1 << _bits(src)) - 1, st)
            return lambda x: x.to(st) & m
        return lambda x: x.to(st)
    if _kind(dst) == "f" and _uis(src) and _bits(src) < 64:
        m = ctx.scalar((1 << _bits(src)) - 1, torch.int64)
        return lambda x: (x.long() & m).to(st)
    if _kind(dst) == "f" and _kind(src) in "fiu" and not _uis(src):
        return lambda x: x.to(st)
    return None


@_comp("convert_element_type")
def _c_convert(ctx):
    src, dst = ctx.dt(), np.dtype(ctx.out().dtype)
    fn = _convert_fn(ctx, src, dst)
    if fn is None:
        return lambda args, donate: [_convert_value(args[0], src, dst)]
    return lambda args, donate: [fn(args[0])]


@_comp("bitcast_convert_type")
def _c_bitcast(ctx):
    src, dst = ctx.dt(), np.dtype(ctx.out().dtype)
    st = storage_dtype(dst)
    if src.itemsize == dst.itemsize:
        if storage_dtype(src) == st:
            return lambda args, donate: [args[0]]
        return lambda args, donate: [args[0].view(st)]
    if src.itemsize > dst.itemsize:  # [...] -> [..., n]

        def run(args, donate):
            x = args[0].unsqueeze(-1)
            try:
                return [x.view(st)]
            except RuntimeError:
                return [x.clone(memory_format=torch.contiguous_format).view(st)]

        return run

    def narrow(args, donate):  # [..., n] -> [...]
        x = args[0]
        try:
            return [x.view(st).squeeze(-1)]
        except RuntimeError:
            return [x.clone(memory_format=torch.contiguous_format).view(st).squeeze(-1)]

    return narrow
