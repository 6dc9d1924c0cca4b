"""The README's adoption examples run as pasted: batches from sglang-jax and from vLLM-style block tables, and
real-KV sources from each pool layout. Each check reads what the example prints, computed by hand here."""

from __future__ import annotations

import contextlib
import io
import os
import re

from absl.testing import absltest

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def blocks(heading: str) -> list[str]:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    assert heading in text, f"no README section {heading!r}"
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})  # noqa: S102 - our own README
    return out.getvalue()


class ReadmeAdoptionTest(absltest.TestCase):
    def test_batch_adapters(self):
        sglang_jax, block_tables = blocks("## Batches from other JAX serving stacks")
        # Step 2 (decode) verifies the 3 + 2 tokens the two requests held before it; nothing is reported.
        self.assertEqual(run(sglang_jax).split(), ["5", "0"])
        # Row 0: positions 0..3 in block 5 (slots 20..23), then row 1: positions 0, 1 in block 3 (slots 12, 13).
        self.assertEqual(run(block_tables).strip(), "[20 21 22 23 12 13]")

    def test_layout_sources(self):
        (code,) = blocks("## Real-KV sources from your pool layout")
        self.assertEqual(run(code).strip(), "0")


if __name__ == "__main__":
    absltest.main()
