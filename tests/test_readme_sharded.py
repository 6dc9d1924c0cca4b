"""The README's sharded-pool example runs as pasted (section "Sharded pools"), in a fresh interpreter.

The block sets ``XLA_FLAGS`` to force 4 CPU devices before it imports jax, so it runs in a subprocess (this
process keeps its one device). Asserted: the head shards agree, the one report names the shard and slot of the
injected KV change, and the stats lines carry the values this test derives from the scenario itself.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

from absl.testing import absltest

from helpers.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
TIMEOUT_S = 180

# The scenario the block is written for; the test checks that the block still states it.
PROMPTS = [[101, 7, 42, 9, 13], [5, 6, 7]]  # one request per dp shard, position p in slot p + 1
FAULT = (1, 2, 3)  # (dp shard, slot, head) of the KV change
HEADS, TP = 4, 2
SHARDS = [(d, t) for d in range(2) for t in range(TP)]


def example_code() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Sharded pools (`canary_jax.runtime.sharded`)", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"expected one python block in the section, found {len(blocks)}"
    return blocks[0]


class ReadmeShardedTest(absltest.TestCase):
    def test_sharded_example_runs_as_pasted(self):
        code = example_code()
        self.assertIn(f"prompts = {PROMPTS!r}", code)
        self.assertIn(f"k_pool.at[{FAULT[0]}, {FAULT[1]}, {FAULT[2]}, 0].add(1)", code)
        self.assertIn("ShardLayout.create(dp=2, tp=2)", code)
        self.assertIn(f"SLOTS, HEADS, DIM = 32, {HEADS}, 8", code)
        env = child_env()
        proc = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
        )
        self.assertEqual(proc.returncode, 0, proc.stdout[-4000:] + proc.stderr[-8000:])
        lines = proc.stdout.splitlines()

        # the head shards agree on tokens, positions and chains, before the fault
        self.assertEqual(lines[0], "[[0, 0], [0, 0]]")

        # one violation: SWEEP_K_FULL's real-KV hash at the changed slot, reported by the shard holding the head
        d, slot, head = FAULT
        shard = (d, head // (HEADS // TP))
        starts = [i for i, ln in enumerate(lines) if ln.startswith("kv_canary violation: ")]
        self.assertLen(starts, 1, proc.stdout)
        msg = lines[starts[0] : starts[0] + 7]
        position = slot - 1
        self.assertTrue(
            msg[0].startswith(
                "kv_canary violation: launch_tag=SWEEP_K_FULL fail_reason=verify_real_kv_hash "
                f"slot_idx={slot} position={position} stored_token={PROMPTS[d][position]} expected_token=-1 "
            ),
            msg[0],
        )
        self.assertEqual(msg[3], "  fail_reasons: verify_real_kv_hash")
        self.assertEqual(
            msg[-1], f"  total_violations=1 ring_overflow=False step_when_pumped=1 shard=({shard[0]},{shard[1]})"
        )
        self.assertEqual(sum(" shard=(" in ln and ln.startswith("  total_violations=") for ln in lines), 1)

        # stats: a prefill of n tokens is written n times by HEAD and by TAIL (nothing to verify yet: the prefix
        # is empty, SPEC 7.1), then each of the 2 sweeps verifies n entries: 4 n protected tokens per shard.
        # Active tags: HEAD_K_FULL, TAIL_K_FULL, SWEEP_K_FULL.
        stats = lines[starts[0] + 7 :]
        self.assertLen(stats, len(SHARDS) + 1)
        for (dd, t), line in zip(SHARDS, stats):
            protected = 4 * len(PROMPTS[dd])
            violations = int((dd, t) == shard)
            self.assertEqual(
                line,
                f"[canary] step=1 protected_tokens={protected} sweep_passes=2 violations={violations} "
                f"launch_tags_active=3/12 shard=({dd},{t})",
            )
        total = sum(4 * len(PROMPTS[dd]) for dd, _ in SHARDS)
        self.assertEqual(
            stats[-1],
            f"[canary] step=1 protected_tokens={total} sweep_passes=2 violations=1 launch_tags_active=3/12 shards=4",
        )


if __name__ == "__main__":
    absltest.main()
