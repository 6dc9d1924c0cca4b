"""What the native path's executors read from a jaxpr where jax versions differ (jax 0.8.3 through 0.12).

* **High-level primitives.** jax 0.12 binds some jnp functions (``jnp.searchsorted`` among them, which the plan
  build uses) as one ``call_hi_primitive`` equation whose ``_prim`` param is a ``HiPrim`` object; its ``expand``
  traces to the primitives that jax <= 0.11 put in the jaxpr directly. The executor
  (:mod:`interop.native.program`) inlines that expansion as it inlines a ``jit`` body, so the steps it runs are
  the same on every jax.
* **Scan operand counts.** jax <= 0.11 gives a ``scan`` equation ``num_consts`` and ``num_carry``; jax 0.12 gives
  flat trees ``ft_in`` (consts, carry, xs) and ``ft_out`` (carry, the ys the body returns) instead.
"""

from __future__ import annotations

import jax
import jax.extend.core as jcore

from interop.native.prims_dtypes import UnsupportedPrimitive

HI_CALL = "call_hi_primitive"
"""The equation name jax 0.12 gives a high-level primitive's call."""


def expansion(eqn) -> jcore.ClosedJaxpr:
    """The closed jaxpr that ``eqn`` (a ``call_hi_primitive``) stands for, traced at its operands' shapes and dtypes.

    Raises:
      UnsupportedPrimitive: the high-level primitive has no ``expand`` (named).
    """
    prim = eqn.params.get("_prim")
    expand = getattr(prim, "expand", None)
    if expand is None:
        raise UnsupportedPrimitive(f"canary native: high-level primitive {type(prim).__name__} has no expansion")
    return jax.make_jaxpr(expand)(*(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars))


def scan_counts(params) -> tuple[int, int]:
    """``(num_consts, num_carry)`` of a ``scan`` equation's params, on either form."""
    if "num_consts" in params:
        return int(params["num_consts"]), int(params["num_carry"])
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))
