"""Public-entry suite: ``canary_jax.verify`` / ``write`` with ``backend=BACKEND``: validation shared by every
backend (raised before tracing, nothing mutated), and one fuzzed pipeline through the donating entry points.

``PublicEntrySuite`` is a mixin: a ``test_*.py`` class mixes it into ``absltest.TestCase`` and sets
``BACKEND`` (see ``suite_base``). The public entry points take no kernel configuration, so a class that only
varies ``CONFIG`` (``test_pallas_long_chain.py``) leaves this suite out.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

import canary_jax
from helpers import oracle
from helpers.pipeline_suite import fuzz_pipeline
from helpers.suite_base import ALL, NONE, SrcSpec, SuiteBase, pairs


class PublicEntrySuite(SuiteBase):
    """Validation and donation through the public entry points."""

    def test_more_than_four_sources_rejected_before_tracing(self):
        data = np.zeros((self.NUM_SLOTS, 16), np.uint8)
        for mode in (NONE, ALL):
            h = self.harness(sources=[SrcSpec(data, 1, 16, 16)] * 5, mode=mode, public=True)
            before = (np.asarray(h.ctx.canary_buf).copy(), np.asarray(h.ctx.log.ring).copy())
            with self.assertRaisesRegex(
                ValueError, r"^kv-canary: at most 4 RealKvSource entries supported by the CUDA ABI, got 5$"
            ):
                h.verify([(1, 0, -1)])
            with self.assertRaisesRegex(ValueError, r"at most 4 RealKvSource entries .* got 5"):
                h.st = oracle.State.fresh(self.NUM_SLOTS)  # (oracle ran first; reset it, we only check the raise)
                h.write([(-1, [(1, 1, 0)])])
            np.testing.assert_array_equal(np.asarray(h.ctx.canary_buf), before[0])
            np.testing.assert_array_equal(np.asarray(h.ctx.log.ring), before[1])
            self.assertEqual(h.kernel_counter(), 0)

    def test_write_expected_inputs_presence(self):
        h = self.harness()
        plan = canary_jax.WritePlan(
            write_offsets=pairs([0, 1], self.WRITE_REQ_CAPACITY + 1),
            write_seed_slot_indices=pairs([-1], self.WRITE_REQ_CAPACITY, fill=-1),
            write_num_valid_reqs=jnp.asarray(np.array([1], np.int32)),
        )
        t = np.ones(self.NUM_TOKENS, np.int64)
        before = np.asarray(h.ctx.canary_buf).copy()
        with self.assertRaisesRegex(
            ValueError, r"^kv-canary: expected input tensors are required when enable_write_input_assert=True$"
        ):
            canary_jax.write(
                h.ctx, plan, t, t, t, enable_write_input_assert=True, expected_input_tokens=t, backend=self.BACKEND
            )
        with self.assertRaisesRegex(
            ValueError, r"^kv-canary: expected input tensors must be None when enable_write_input_assert=False$"
        ):
            canary_jax.write(
                h.ctx, plan, t, t, t, enable_write_input_assert=False, expected_input_positions=t, backend=self.BACKEND
            )
        np.testing.assert_array_equal(np.asarray(h.ctx.canary_buf), before)
        self.assertEqual(h.kernel_counter(), 0)

    def test_public_entry_points_match_the_oracle(self):
        """The first pipeline of ``test_fuzz_pipeline`` through the public entry points (int64 numpy token
        arrays, canary buffer and log donated outside jit): the same whole state as the oracle."""
        h = fuzz_pipeline(self, 0, public=True)
        self.assertGreater(h.write_index, 0)
