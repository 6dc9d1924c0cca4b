"""The README's "sglang-jax: turn it on in N lines" block runs as pasted, and N counts its ``# canary`` lines."""

from __future__ import annotations

import os
import unittest

try:
    import sgl_jax  # noqa: F401
except ImportError as e:
    if os.environ.get("CANARY_REQUIRE_STACKS") == "1":
        raise ImportError(f"CANARY_REQUIRE_STACKS=1 but sglang-jax is not importable: {e}") from e
    raise unittest.SkipTest(f"sglang-jax is not installed ({e}); tests/stacks/requirements.txt pins it") from e

import readme_blocks
from absl.testing import absltest


class ReadmeSglangJaxTest(absltest.TestCase):
    def test_block_runs_and_counts_its_lines(self):
        _, out = readme_blocks.run_section(self, "sglang-jax")
        self.assertEqual(out.split(), ["0"])


if __name__ == "__main__":
    absltest.main()
