"""Launch mechanics: the platform a launch's backend follows (the canary buffer's), launches inside a user's
``jit`` equal eager ones, no retrace for the same shapes, and ``resolve_backend``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest

import canary_jax
from canary_jax.contract import constants
from helpers.launch_refusals import (
    TAG,
    ctx_with,
    snapshot,
    tok,
    vplan,
    wplan,
)


class BackendPlatformTest(absltest.TestCase):
    """The backend and the Pallas interpret mode follow where the canary buffer lives, not JAX's default backend
    (a GPU host keeps CPU arrays too: compiling Pallas for the GPU on them fails). Simulated on a CPU by making
    JAX's default backend report a GPU."""

    def test_platform_of_arrays(self):
        from canary_jax.ops import backends

        self.assertEqual(backends.array_platform(jnp.zeros(2)), "cpu")
        self.assertIsNone(backends.array_platform(np.zeros(2)))
        seen = []
        jax.jit(lambda a: seen.append(backends.array_platform(a)) or a)(jnp.zeros(2))
        self.assertEqual(seen, [None])  # a tracer's device is unknown
        bound = backends.implementation("verify", "pallas", platform="cpu")
        self.assertEqual(bound.keywords, {"interpret": True})
        self.assertIs(bound, backends.implementation("verify", "pallas", platform="cpu"))  # one program cache key
        self.assertEqual(backends.implementation("write", "pallas", platform="cuda").keywords, {"interpret": False})
        self.assertEqual(backends.implementation("write", "pallas", platform="gpu").keywords, {"interpret": False})
        self.assertIs(backends.implementation("verify", "reference", platform="gpu"), canary_jax.verify_reference)

    def test_cpu_buffer_on_a_gpu_host(self):
        from unittest import mock

        from pallas_kernels.verify import verify_pallas

        def run(launch, ctx):
            ctx = canary_jax.write(
                ctx, wplan(), tok((7, 8, 9, 9)), tok((0, 1, 2, 2)), tok((4, 0, 0, 0)), backend="reference"
            )
            plan = canary_jax.VerifyPlan.from_entries(slots=[4, 5], positions=[1, 0], prev_slots=[-1, -1])
            return snapshot(launch(ctx, plan))

        want = run(
            lambda c, p: canary_jax.verify(c, p, backend="reference"), ctx_with(mode=constants.RealKvHashMode.NONE)
        )
        self.assertEqual(int(want[2][0]), 2)  # two violations: position and chain of slot 4, empty slot 5
        with mock.patch.object(jax, "default_backend", lambda: "gpu"):
            self.assertEqual(canary_jax.resolve_backend(None), "pallas")  # the default backend's choice
            for launch in (
                lambda c, p: canary_jax.verify(c, p),  # auto: the CPU buffer picks the reference
                lambda c, p: canary_jax.verify(c, p, backend="pallas"),  # Pallas, interpreted on the CPU
                lambda c, p: verify_pallas(c, p),  # the wrapper called directly, on concrete CPU arrays
            ):
                got = run(launch, ctx_with(mode=constants.RealKvHashMode.NONE))
                for a, b in zip(got, want):
                    np.testing.assert_array_equal(a, b)


class LaunchMechanicsTest(absltest.TestCase):
    def test_inside_user_jit_matches_eager(self):
        def run(ctx):
            ctx = canary_jax.write(
                ctx, wplan(), tok((7, 8, 9, 9)), tok((0, 1, 2, 2)), tok((4, 0, 0, 0)), backend="reference"
            )
            return canary_jax.verify(
                ctx,
                canary_jax.VerifyPlan.from_entries(slots=[4], positions=[1], prev_slots=[-1], verify_capacity=4),
                backend="reference",
            )

        eager = run(ctx_with())
        jitted = jax.jit(run)(ctx_with())
        for a, b in zip(snapshot(eager), snapshot(jitted)):
            np.testing.assert_array_equal(a, b)
        self.assertEqual(eager.log.num_violations(), 1)

    def test_no_retrace_for_same_shapes(self):
        from canary_jax.ops import launch

        ctx = ctx_with(mode=constants.RealKvHashMode.NONE)
        ctx = canary_jax.verify(ctx, vplan(), backend="reference")
        n0 = launch.trace_count("verify")
        for k in range(3):
            ctx = canary_jax.verify(ctx, vplan(n=k + 1), backend="reference")
        self.assertEqual(launch.trace_count("verify"), n0)
        self.assertEqual(ctx.log.kernel_run_counter(TAG), 4)

    def test_resolve_backend(self):
        self.assertEqual(canary_jax.resolve_backend("REFERENCE"), "reference")
        self.assertEqual(canary_jax.resolve_backend("pallas"), "pallas")
        want = r"backend must be one of \('reference', 'pallas', 'pallas_tpu'\), got 'triton'"
        with self.assertRaisesRegex(ValueError, want):
            canary_jax.resolve_backend("triton")


if __name__ == "__main__":
    absltest.main()
