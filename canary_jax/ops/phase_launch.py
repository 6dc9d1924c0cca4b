"""A HEAD / TAIL phase, verify then write, as the backend's one launch where it has one.

:func:`verify_then_write` is :func:`canary_jax.verify` followed by :func:`canary_jax.write` on its result (SGLang's
``launch_per_forward``, SPEC 8.2), with the same checks, arguments and bytes. Under ``jit`` a backend with a phase
kernel (:data:`canary_jax.ops.backends.PHASE_KERNELS`: the Pallas backend's ``canary_phase``) runs both in one
launch; outside ``jit``, and on the other backends, it makes the two calls.
"""

from __future__ import annotations

from canary_jax.contract import ints
from canary_jax.ops import backends, launch
from canary_jax.planning.plans import VerifyOrWriteContext, VerifyPlan, WritePlan


def verify_then_write(
    context: VerifyOrWriteContext,
    verify_plan: VerifyPlan,
    write_plan: WritePlan,
    input_ids,
    positions,
    out_cache_loc,
    *,
    check_verify_expected_token: bool = False,
    enable_write_input_assert: bool = False,
    expected_input_tokens=None,
    expected_input_positions=None,
    backend: str | None = None,
) -> VerifyOrWriteContext:
    """Verifies ``verify_plan``, then writes the step's tokens by ``write_plan``: :func:`canary_jax.verify`, then
    :func:`canary_jax.write` on the context it returns.

    Args:
      context: as for :func:`canary_jax.verify`; the canary buffer receives the write's stamps.
      verify_plan, write_plan: the phase's plans.
      input_ids, positions, out_cache_loc, expected_input_tokens, expected_input_positions,
      enable_write_input_assert: as for :func:`canary_jax.write`.
      check_verify_expected_token: as for :func:`canary_jax.verify`.
      backend: as for :func:`canary_jax.verify`. Traced, a backend with a phase kernel
        (:func:`canary_jax.ops.backends.phase_kernel`) runs the phase as one launch where the launch allows
        (:func:`pallas_kernels.phase.takes_one_launch`).

    Returns:
      The context with the new canary buffer and violation log. Outside ``jit`` both are donated, as for
      :func:`canary_jax.write`.

    Raises:
      TypeError / ValueError: any check of :func:`canary_jax.verify` or :func:`canary_jax.write` (the plans named
      ``verify_plan`` / ``write_plan``), all before either launch runs or anything is traced; nothing is mutated.
    """
    check, flag = bool(check_verify_expected_token), bool(enable_write_input_assert)
    # Both launches' checks before either runs: outside jit the verify donates the log, so a bad write argument
    # found after it would lose the caller's log.
    checked, tracing = launch.checked_verify(context, verify_plan, name="verify_plan")
    checked, tokens_traced, arrays = launch.checked_write(
        checked,
        write_plan,
        input_ids,
        positions,
        out_cache_loc,
        enable_write_input_assert=flag,
        expected_input_tokens=expected_input_tokens,
        expected_input_positions=expected_input_positions,
        name="write_plan",
        keep_int32=True,  # traced int32 token arrays reach the phase kernel as they are (no widening launches)
    )
    fn = None
    if tracing or tokens_traced:
        platform = backends.array_platform(checked.canary_buf)
        fn = backends.phase_kernel(backends.resolve_backend(backend, platform=platform), platform=platform)
    if fn is None:  # the checks are done: the two launches as verify() and write() make them
        ctx = launch.run_verify(checked, verify_plan, tracing, check=check, backend=backend)
        arrays = tuple(ints.widen(a) for a in arrays)
        return launch.run_write(ctx, write_plan, tokens_traced, arrays, flag=flag, backend=backend)
    ids, pos, loc, et, ep = arrays
    return fn(
        checked,
        verify_plan,
        write_plan,
        ids,
        pos,
        loc,
        check_verify_expected_token=check,
        enable_write_input_assert=flag,
        expected_input_tokens=et,
        expected_input_positions=ep,
    )
