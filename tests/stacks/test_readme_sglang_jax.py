"""The README's "sglang-jax: turn it on in N lines" block runs as pasted, and N counts its ``# canary`` lines."""

from __future__ import annotations

import contextlib
import io
import os
import pathlib
import re
import unittest

try:
    import sgl_jax  # noqa: F401
except ImportError as e:
    if os.environ.get("CANARY_REQUIRE_STACKS") == "1":
        raise ImportError(f"CANARY_REQUIRE_STACKS=1 but sglang-jax is not importable: {e}") from e
    raise unittest.SkipTest(f"sglang-jax is not installed ({e}); tests/stacks/requirements.txt pins it") from e

from absl.testing import absltest

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def section() -> tuple[int, str]:
    text = README.read_text()
    m = re.search(r"^## sglang-jax: turn it on in (\d+) lines\n(.*?)^## ", text, re.S | re.M)
    assert m, "README has no '## sglang-jax: turn it on in N lines' section"
    code = re.search(r"```python\n(.*?)```", m.group(2), re.S)
    assert code, "the section has no python block"
    return int(m.group(1)), code.group(1)


class ReadmeSglangJaxTest(absltest.TestCase):
    def test_block_runs_and_counts_its_lines(self):
        n, code = section()
        marked = [line for line in code.splitlines() if re.search(r"#\s*canary\b", line)]
        self.assertEqual(len(marked), n, marked)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})
        self.assertEqual(out.getvalue().split(), ["0"])


if __name__ == "__main__":
    absltest.main()
