"""Torch rules for JAX primitives, bit-identical to XLA: one equation of a launch jaxpr at a time.

Two forms of every rule:

* ``RULES[name](eqn, args, donate) -> outputs`` runs one ``JaxprEqn`` on torch tensors, reading everything it
  needs from ``eqn`` on every call (the reference form: tests and fallbacks use it).
* :func:`compile_rule` ``(eqn, device, consts) -> run(args, donate) -> outputs``: the same semantics, with every
  static decision (dtype branches, bounds, index grids, permutations, literal and constant operands) made once,
  so a call is the torch ops alone. The executor (:mod:`interop.native.program`) compiles each step once.

Values live in *storage* dtypes (:func:`storage_dtype`): ``uint16/32/64`` as the signed type's bit pattern
(torch lacks most unsigned ops), so the rules implement unsigned semantics themselves (comparisons, max/min,
div/rem, logical shifts, widening converts, index interpretation). Integer and boolean results match XLA bit for
bit (wraparound arithmetic, ``x / 0 == -1``, ``x % 0 == x``, ``INT_MIN / -1 == INT_MIN``, shifts past the
width); float add/sub/mul/neg/abs/max/min/sign/convert/bitcast/select/compare are IEEE-identical, other float
ops best effort.

Rules never read a value back to the host and take every shape from the avals and params, so a torch CUDA graph
can capture them (a compiled rule may read a *constant* input to the host once, at compile time, and does not
while a CUDA stream is capturing). Views (reshape, squeeze, broadcast, bitcast, slice, no-op converts, static
dynamic_slice) come back as views of their input; :data:`FRESH` names the primitives whose outputs never share
an input's memory. ``RULES["iota"]`` has no input to take a device from and builds on torch's default device;
the compiled ``iota`` builds on the ``device`` it was compiled for.

The rules live by job: :mod:`interop.native.prims_dtypes` (storage dtypes, shared helpers, the compile
context), :mod:`interop.native.prims_elementwise` (compiled in :mod:`interop.native.prims_elementwise_compiled`),
:mod:`interop.native.prims_convert` (convert / bitcast),
:mod:`interop.native.prims_shape` (views, concatenation, pad, iota, sort, reductions),
:mod:`interop.native.prims_index` (gather, scatter family, dynamic slices) with the compiled gather / scatter in
:mod:`interop.native.prims_index_compiled`; each registers into :data:`RULES` and :data:`COMPILERS` when this
module is imported. :mod:`interop.native.prims_views` compiles a chain of view equations into one call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.extend.core as jcore
import torch

from interop.native.prims_dtypes import (  # noqa: F401  (re-exported; the rule modules share the private helpers)
    Ctx,
    UnsupportedPrimitive,
    _bits,
    _dt,
    _index,
    _int_of,
    _kind,
    _lit,
    _out,
    _signed,
    _smin,
    _uis,
    constant,
    from_numpy,
    storage_dtype,
    to_numpy,
)

__all__ = [
    "COMPILERS", "FRESH", "RULES", "Compiled", "Ctx", "Rule", "UnsupportedPrimitive", "compile_rule", "constant",
    "from_numpy", "rule_for", "storage_dtype", "to_numpy",
]  # fmt: skip

Rule = Callable[[Any, list[torch.Tensor], tuple[bool, ...]], list[torch.Tensor]]
"""``rule(eqn, args, donate) -> outputs``: ``eqn`` a ``JaxprEqn`` (params, in/out avals); ``args`` one storage
tensor per invar with the aval's shape (literals already made with :func:`constant`); ``donate[i]``: ``args[i]``'s
memory may be overwritten. Returns one storage tensor per outvar, of exactly its shape and storage dtype."""

Compiled = Callable[[list[torch.Tensor], tuple[bool, ...]], list[torch.Tensor]]
"""``run(args, donate) -> outputs``: a rule with its equation bound (see :data:`Rule`)."""


# --- the tables -----------------------------------------------------------------------------------------------
RULES: dict[str, Rule] = {}
"""Primitive name -> rule. Structural primitives (calls, ``scan``, ``cond``, ``while``, ``pallas_call``) are the
executor's and absent."""
COMPILERS: dict[str, Callable[[Ctx], Compiled | None]] = {}
"""Primitive name -> ``compiler(ctx) -> run`` (or None: this equation takes the generic closure over its rule)."""
_FRESH: set[str] = set()
_CHECKS: dict[str, Callable[[Any], str | None]] = {}  # name -> eqn -> why unsupported (or None)


def _reg(*names: str, fresh: bool = True, multi: bool = False):
    """Registers ``fn(eqn, args, donate)`` for ``names``; single-output functions return a tensor."""

    def deco(fn):
        rule = fn if multi else (lambda eqn, args, donate: [fn(eqn, args, donate)])
        for n in names:
            RULES[n] = rule
            if fresh:
                _FRESH.add(n)
        return fn

    return deco


def _comp(*names: str):
    """Registers a compiler ``fn(ctx) -> run | None`` for ``names``."""

    def deco(fn):
        for n in names:
            COMPILERS[n] = fn
        return fn

    return deco


def rule_for(eqn) -> Rule:
    """The rule of ``eqn``'s primitive, after checking its params and dtypes are supported.

    Raises:
      UnsupportedPrimitive: no rule for the primitive, or a param value / dtype the rule refuses (named).
    """
    name = eqn.primitive.name
    rule = RULES.get(name)
    if rule is None:
        raise UnsupportedPrimitive(f"canary native: no torch rule for primitive {name!r}")
    for v in (*eqn.invars, *eqn.outvars):
        try:
            storage_dtype(v.aval.dtype)
        except (TypeError, AttributeError):
            raise UnsupportedPrimitive(f"canary native: {name!r} on dtype {getattr(v.aval, 'dtype', v.aval)}") from None
    why = _CHECKS[name](eqn) if name in _CHECKS else None
    if why:
        raise UnsupportedPrimitive(f"canary native: {name!r} with {why}")
    return rule


def _literals(eqn, consts: dict[int, torch.Tensor] | None, device) -> dict[int, torch.Tensor]:
    out = dict(consts or {})
    for i, v in enumerate(eqn.invars):
        if i not in out and isinstance(v, jcore.Literal):
            out[i] = constant(v.val, v.aval.dtype, device)
    return out


def compile_rule(eqn, device, consts: dict[int, torch.Tensor] | None = None) -> Compiled:
    """``eqn``'s rule compiled for ``device``: ``run(args, donate) -> outputs`` with exactly the semantics of
    ``RULES[name](eqn, args, donate)`` (the executor still passes every input, constants included, in ``args``).

    Every static decision is made here, once: dtype branches, bounds and clamps, index grids, permutations,
    literal operands as 0-d device tensors; inputs named in ``consts`` (position -> storage tensor on ``device``,
    literals added automatically) are baked in, so a gather / scatter with constant indices precomputes its flat
    targets (in-bounds mask, duplicate resolution) and runs one or two torch ops per call.

    Raises:
      UnsupportedPrimitive: as :func:`rule_for`.
    """
    rule = rule_for(eqn)
    device = torch.device(device)
    name = eqn.primitive.name
    comp = COMPILERS.get(name)
    run = comp(Ctx(eqn, device, _literals(eqn, consts, device))) if comp is not None else None
    if run is None:

        def run(args, donate, rule=rule, eqn=eqn):
            return rule(eqn, args, donate)

    return run


# --- registration ---------------------------------------------------------------------------------------------
from interop.native import (  # noqa: E402
    prims_convert,
    prims_elementwise,
    prims_elementwise_compiled,
    prims_index,
    prims_shape,
)

for _mod in (prims_elementwise, prims_elementwise_compiled, prims_convert, prims_shape, prims_index):
    _mod.register(_reg, _comp, _CHECKS)
FRESH: frozenset[str] = frozenset(_FRESH)
"""Primitives whose outputs never share memory with any input (the rest may return views or write in place)."""
