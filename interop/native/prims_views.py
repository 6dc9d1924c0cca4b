"""Chains of view equations as one torch call (for the executor, :mod:`interop.native.program`).

A launch body's glue is mostly views: ``reshape`` then ``bitcast_convert_type`` of each byte buffer to words
(``u8[N, 48] -> u8[N, 12, 4] -> u32[N, 12]``), and back; ``slice -> squeeze -> broadcast_in_dim`` of a row.
Each step costs a torch call (about 1 us on CPU) plus the executor's own per-step work. On a contiguous input a
whole chain is one reinterpretation of the same memory: :func:`compile_view_chain` works out, once, on a
``meta`` tensor, the chain's final dtype, shape, strides and offset, and a call is ``x.view(dtype)`` or
``x.view(shape)`` or ``x.as_strided(...)`` (at most two calls); any other input (non-contiguous, or one whose
storage offset a dtype view rejects), and a chain that copies even on a contiguous input (a reshape of a
transposed slice), runs step by step through the compiled rules.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from interop.native import prims

VIEW_PRIMS = frozenset(
    {"reshape", "squeeze", "expand_dims", "broadcast_in_dim", "bitcast_convert_type", "convert_element_type"}
    | {"slice", "transpose"}
)
"""Primitives :func:`is_view` may accept."""


def is_view(eqn) -> bool:
    """Whether ``eqn`` returns a view of its single input whatever that input's layout (a chain link): the
    :data:`VIEW_PRIMS` except a permuting ``reshape`` and a ``convert_element_type`` that changes bytes."""
    name = eqn.primitive.name
    if name not in VIEW_PRIMS or len(eqn.invars) != 1 or len(eqn.outvars) != 1:
        return False
    if name == "reshape" and eqn.params.get("dimensions") is not None:
        return False
    if name == "convert_element_type":
        src, dst = np.dtype(eqn.invars[0].aval.dtype), np.dtype(eqn.outvars[0].aval.dtype)
        ints = prims._kind(src) in "iu" and prims._kind(dst) in "iu" and src.itemsize == dst.itemsize
        return src == dst or ints
    return True


def compile_view_chain(eqns: Sequence, device) -> prims.Compiled:
    """``run([x], donate) -> [y]`` for a chain of :func:`is_view` equations, each reading the one before's
    output (the first reads ``x``; the caller pairs them, the avals are checked): the same values and memory
    sharing as running them in turn, in one or two torch calls when ``x`` is contiguous.

    Raises:
      ValueError: an equation that is not a view, or one whose input aval is not the previous one's output aval.
      interop.native.prims.UnsupportedPrimitive: as :func:`interop.native.prims.compile_rule`.
    """
    eqns = list(eqns)
    if not eqns or not all(is_view(e) for e in eqns):
        raise ValueError(f"canary native: not a chain of views: {[e.primitive.name for e in eqns]}")
    for a, b in zip(eqns, eqns[1:]):  # (the vars may differ across an inlined call: compare avals)
        va, vb = a.outvars[0].aval, b.invars[0].aval
        if (tuple(va.shape), np.dtype(va.dtype)) != (tuple(vb.shape), np.dtype(vb.dtype)):
            raise ValueError(f"canary native: {b.primitive.name} cannot read {a.primitive.name}'s output {va}")
    steps = [prims.compile_rule(e, device, {}) for e in eqns]
    fast = _fast_path(eqns)
    no = (False,)

    def slow(x):
        for s in steps:
            (x,) = s([x], no)
        return x

    if fast is None:
        return lambda args, donate: [slow(args[0])]

    def run(args, donate):
        x = args[0]
        if x.is_contiguous():
            try:
                return [fast(x)]
            except RuntimeError:  # a dtype view of an offset the new element size does not divide
                pass
        return [slow(x)]

    return run


def _fast_path(eqns):
    """``x -> chain(x)`` for a contiguous ``x`` in at most two calls, found on the meta device (None when the
    chain does not run there)."""
    aval = eqns[0].invars[0].aval
    x = torch.empty(tuple(aval.shape), dtype=prims.storage_dtype(aval.dtype), device="meta")
    try:
        y = x
        for e in eqns:
            (y,) = prims.compile_rule(e, "meta", {})([y], (False,))
    except (RuntimeError, NotImplementedError):
        return None
    if y.untyped_storage()._cdata != x.untyped_storage()._cdata:  # a step copied (a reshape that cannot view)
        return None
    st, shape, stride = y.dtype, tuple(y.shape), tuple(y.stride())
    if st == x.dtype:
        z, first = x, None
    else:
        try:
            z, first = x.view(st), (lambda t: t.view(st))
        except RuntimeError:
            z, first = x.reshape(-1).view(st), (lambda t: t.view(-1).view(st))
    off = y.storage_offset() - z.storage_offset()
    if (tuple(z.shape), tuple(z.stride()), off) == (shape, stride, 0):
        second = None
    elif y.is_contiguous() and off == 0:
        second = lambda t: t.view(shape)  # noqa: E731
    else:
        second = lambda t: t.as_strided(shape, stride, t.storage_offset() + off)  # noqa: E731
    if first is None and second is None:
        return lambda t: t
    if first is None:
        return second
    if second is None:
        return first
    return lambda t: second(first(t))
