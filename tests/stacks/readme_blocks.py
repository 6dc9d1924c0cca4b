"""The README's per-stack "turn it on in N lines" sections, as the stack tests run them."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def section(title: str) -> tuple[int, str]:
    """``(N, code)`` of the README section ``## {title}: turn it on in N lines``: N and its python block."""
    text = README.read_text()
    m = re.search(rf"^## {re.escape(title)}: turn it on in (\d+) lines\n(.*?)^## ", text, re.S | re.M)
    assert m, f"README has no '## {title}: turn it on in N lines' section"
    code = re.search(r"```python\n(.*?)```", m.group(2), re.S)
    assert code, "the section has no python block"
    return int(m.group(1)), code.group(1)


def marked_lines(code: str) -> list[str]:
    """The block's lines marked ``# canary`` (the lines a user adds)."""
    return [line for line in code.splitlines() if re.search(r"#\s*canary\b", line)]


def run_block(code: str) -> tuple[dict, str]:
    """Runs the block as pasted: ``(its namespace, what it printed)``."""
    ns = {"__name__": "__readme__"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), ns)
    return ns, out.getvalue()


def run_section(test, title: str) -> tuple[dict, str]:
    """Checks (``test.assertEqual``) that section ``title``'s N counts its ``# canary`` lines, then runs its block
    as pasted: ``(its namespace, what it printed)``."""
    n, code = section(title)
    marked = marked_lines(code)
    test.assertEqual(len(marked), n, marked)
    return run_block(code)
