"""The equations of a jaxpr with nested ``jit`` / ``pjit`` calls entered (a ``pallas_call``'s kernel body is not):
what the launch-structure tests count (kernels, their outputs, primitives)."""

from __future__ import annotations

from collections.abc import Iterator

import jax


def eqns(jaxpr) -> Iterator:
    """Every equation of ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) in order, a nested jit's own equations in place of
    its call."""
    for e in getattr(jaxpr, "jaxpr", jaxpr).eqns:
        inner = e.params.get("jaxpr") if e.primitive.name in ("jit", "pjit") else None
        if inner is None:
            yield e
        else:
            yield from eqns(inner)


def traced_eqns(fn, *args) -> list:
    """:func:`eqns` of ``jax.make_jaxpr(fn)(*args)``."""
    return list(eqns(jax.make_jaxpr(fn)(*args)))
