"""The README's serving-step example runs as pasted (plan, HEAD, the model's KV write, TAIL, sweeps, report).

The test extracts the one ``python`` block of the README section "A serving step", runs it, and checks what it
promises: a clean run of 8 steps with 2 sweeps, then a KV bit flip that the final sweep reports at slot 3.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

from absl.testing import absltest

from canary_jax.contract import constants, decode

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def example_code() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## A serving step", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return blocks[0]


class ReadmeExampleTest(absltest.TestCase):
    def test_serving_step_example_runs_as_pasted(self):
        ns = {"__name__": "__readme__"}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(example_code(), "README.md", "exec"), ns)  # noqa: S102 - our own README
        lines = out.getvalue()
        self.assertRegex(lines, r"\[canary\] step=8 protected_tokens=\d+ sweep_passes=2 violations=0 ")
        log = ns["state"].log
        self.assertEqual(log.kernel_run_counter(constants.CanaryLaunchTag.SWEEP_K_FULL), 3)
        rec = decode.decode_violations(log)
        self.assertEqual([(r.tag, r.slot_idx, r.reasons) for r in rec], [("SWEEP_K_FULL", 3, ["verify_real_kv_hash"])])
        self.assertIn("launch_tag=SWEEP_K_FULL", lines)


if __name__ == "__main__":
    absltest.main()
