"""The README's "EasyDeL eSurge: turn it on in N lines" block runs as pasted, N counts its ``# canary`` lines, and
the canary it turns on reports a K byte flipped past the first 16 bytes at the next step.

Skipped when easydel is not importable, unless ``CANARY_REQUIRE_STACKS=1`` and ``CANARY_STACK=esurge`` (its CI job,
.ci/run): then a missing package fails the collection.
"""

from __future__ import annotations

import os
import unittest

try:
    import easydel.inference.esurge  # noqa: F401
except ImportError as e:
    if os.environ.get("CANARY_REQUIRE_STACKS") == "1" and os.environ.get("CANARY_STACK") == "esurge":
        raise ImportError(f"CANARY_REQUIRE_STACKS=1 CANARY_STACK=esurge but easydel is not importable: {e}") from e
    raise unittest.SkipTest(f"easydel is not installed ({e}); tests/stacks/requirements-esurge.txt pins it") from e

import jax
import numpy as np
import readme_blocks
from absl.testing import absltest

from canary_jax.runtime.report import CanaryViolationError


class ReadmeEsurgeTest(absltest.TestCase):
    def test_block_runs_counts_its_lines_and_catches_a_flip(self):
        ns, out = readme_blocks.run_section(self, "EasyDeL eSurge")
        self.assertEqual(out.split(), ["0"])
        self.assertEqual(ns["canary"].num_slots, 16 * 4)
        # slot 4 (page 1, offset 0), layer 0, K head 1 (combined head 2): bytes 256.. of the K sequence
        cache = ns["cache"]
        view = cache.views[0]
        pages = np.array(view.kv_pages)
        pages.view(np.uint16)[1, 0, 2, 10] ^= 0x0100
        cache.views[0] = view.replace(kv_pages=jax.device_put(pages, view.kv_pages.sharding))
        token_ids = ns["token_ids"]
        token_ids[0, 7] = 18
        with self.assertRaises(CanaryViolationError) as cm:
            ns["execute"](token_ids, np.array([7, 0], np.int32), np.array([1, 0], np.int32), ns["page_table"], 2)
        first = str(cm.exception).splitlines()[0]
        self.assertIn("fail_reason=verify_real_kv_hash ", first)
        self.assertIn(" slot_idx=4 ", first)
        self.assertIn("launch_tag=TAIL_K_FULL", first)


if __name__ == "__main__":
    absltest.main()
