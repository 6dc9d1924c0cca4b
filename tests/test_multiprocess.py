"""Two processes, one mesh: ``jax.distributed`` on this machine (localhost coordinator, 2 forced CPU devices per
process, gloo collectives), a 2x2 (dp, tp) mesh with dp row ``i`` on process ``i``. Process 1 flips a KV bit in
its shard (1, 1); the violation must be reported exactly once across both processes' outputs, by process 1,
naming that shard (``tests/helpers/sharded_child.py multi``). Bounded: 120 s per process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest

import numpy as np

from helpers.child_env import child_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


class MultiProcessTest(unittest.TestCase):
    def test_fault_in_one_process_is_reported_once_with_its_shard(self):
        env = child_env()
        port = str(free_port())
        with tempfile.TemporaryDirectory() as tmp:
            outs = [os.path.join(tmp, f"p{i}.npz") for i in range(2)]
            procs = [
                subprocess.Popen(
                    [sys.executable, "-m", "tests.helpers.sharded_child", "multi", outs[i], str(i), port],
                    cwd=ROOT,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
                for i in range(2)
            ]
            logs = []
            try:
                for p in procs:
                    logs.append(p.communicate(timeout=TIMEOUT_S)[0])
            finally:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                        p.communicate()
            for i, p in enumerate(procs):
                self.assertEqual(p.returncode, 0, f"process {i} failed:\n{logs[i][-6000:] if i < len(logs) else ''}")
            res = [json.loads(str(np.load(o)["json"])) for o in outs]
        self.assertEqual(res[0]["local_shards"], [[0, 0], [0, 1]])
        self.assertEqual(res[1]["local_shards"], [[1, 0], [1, 1]])
        d, t, slot = res[1]["kv_fault"]
        msgs = res[0]["messages"] + res[1]["messages"]
        self.assertEqual(res[0]["messages"], [])
        self.assertEqual(len(msgs), 1, msgs)
        self.assertTrue(
            msgs[0].startswith(
                f"kv_canary violation: launch_tag=SWEEP_K_FULL fail_reason=verify_real_kv_hash slot_idx={slot} "
            ),
            msgs[0],
        )
        self.assertTrue(msgs[0].endswith(f" shard=({d},{t})"), msgs[0])
        self.assertEqual([r["shard"] for r in res[1]["records"]], [[d, t]])
        self.assertEqual(res[0]["records"], [])
        # the total over every process's shards, gathered: the same line on both processes
        self.assertEqual(res[0]["total_line"], res[1]["total_line"])
        self.assertIn(" violations=1 ", res[0]["total_line"])
        self.assertTrue(res[0]["total_line"].endswith(" shards=4"))


if __name__ == "__main__":
    unittest.main()
