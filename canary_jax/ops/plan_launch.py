"""The plan build with a backend: SGLang's ``launch_canary_plan_kernels`` (SPEC 7) on the backend's plan kernel.

:func:`build_plans` takes :func:`canary_jax.planning.plan_builder.build_plans`' arguments and ``backend``, checks
them once (:func:`canary_jax.planning.plan_inputs.check_plan_inputs`), and builds the plans on the backend's plan
kernel (:func:`canary_jax.ops.backends.plan_kernel`: ``pallas`` builds both plans in one launch,
:mod:`pallas_kernels.plan`). The jnp builder runs everything else: the ``reference`` and ``pallas_tpu`` backends
and launches the kernel does not take (a table of the caller's own, or sizes past its limits). Every path gives the
same bytes, also over old plans (``*_plan_out``: what SGLang leaves untouched keeps its bytes).
"""

from __future__ import annotations

from typing import Any

import jax

from canary_jax.ops import backends
from canary_jax.planning import plan_builder
from canary_jax.planning.plan_inputs import check_plan_inputs
from canary_jax.planning.plans import VerifyPlan, WritePlan

__all__ = ["build_plans"]


def build_plans(
    *, backend: str | None = None, platform: str | None = None, **kwargs: Any
) -> tuple[VerifyPlan, WritePlan]:
    """One group's ``(VerifyPlan, WritePlan)`` on ``backend``'s plan kernel where it has one.

    Args:
      backend: a name of :data:`canary_jax.ops.backends.BACKENDS`, or None for
        :func:`canary_jax.ops.backends.resolve_backend`'s default (``pallas`` on a GPU).
      platform: where the launch's data lives (``"cuda"``, ``"cpu"``, ...: JAX platform names or torch device
        types), which decides the default backend and interpret mode (compiled on a GPU). None: the slot table's
        platform when it is a concrete array, else JAX's default backend (a traced table).
      **kwargs: :func:`canary_jax.planning.plan_builder.build_plans`' arguments, with its meanings and errors.

    Returns:
      ``(VerifyPlan, WritePlan)``, byte-identical to the jnp builder's.

    Raises:
      ValueError / TypeError: the jnp builder's (SGLang's messages), and an unknown backend name.
    """
    inputs = check_plan_inputs(keep_int32=True, **kwargs)  # narrow traced int32 rows: the kernel reads them so
    if platform is None:
        leaves = jax.tree_util.tree_leaves(inputs.table)
        platform = backends.array_platform(leaves[0]) if leaves else None
    kernel = backends.plan_kernel(backend, platform=platform)
    if kernel is not None:
        plans = kernel(inputs)
        if plans is not None:
            return plans
    return plan_builder._build_plans_impl(*inputs.widened()[:-2], cap=inputs.cap, cw=inputs.cw)
