"""Byte-identical results with ``jax_enable_x64`` off and on (SPEC 13), checked against the oracle.

Two subprocesses (started together) run the fixed scenarios of ``tests/x64_scenarios.py`` with
``JAX_ENABLE_X64=0`` and ``=1``; the x64 run additionally feeds JAX int64 token arrays and int64 real-KV
tensors. The canary bytes, the whole ring, write_index, both counter arrays and the per-launch write_index
trace must be identical across modes and equal to the Python-int oracle.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
from absl.testing import absltest

from helpers import x64_scenarios as X

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KEYS = ("buf", "ring", "wi", "slot", "kernel", "trace")


class X64ModesTest(absltest.TestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.tmp = tempfile.TemporaryDirectory()
        procs = {}
        for x64 in ("0", "1"):
            env = dict(
                os.environ,
                JAX_ENABLE_X64=x64,
                JAX_PLATFORMS="cpu",
                PYTHONPATH=os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
            )
            out = os.path.join(cls.tmp.name, f"x64_{x64}.npz")
            args = [sys.executable, os.path.join(HERE, "helpers", "x64_scenarios.py"), out]
            if x64 == "1":
                args.append("--int64-inputs")
            procs[x64] = (subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out)
        cls.dumps = {}
        cls.logs = {}
        for x64, (p, out) in procs.items():
            log, _ = p.communicate(timeout=600)
            cls.logs[x64] = (p.returncode, log.decode(errors="replace"))
            if p.returncode == 0:
                with np.load(out) as z:
                    cls.dumps[x64] = {k: z[k] for k in z.files}
        cls.scenarios = X.scenarios()
        cls.oracle = [X.run_oracle(sc) for sc in cls.scenarios]

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()
        super().tearDownClass()

    def dump(self, x64: str) -> dict:
        rc, log = self.logs[x64]
        self.assertEqual(rc, 0, f"JAX_ENABLE_X64={x64} subprocess failed:\n{log[-4000:]}")
        return self.dumps[x64]

    def test_modes_really_differ(self):
        self.assertFalse(bool(self.dump("0")["0_x64"][0]))
        self.assertTrue(bool(self.dump("1")["0_x64"][0]))

    def test_x64_off_matches_oracle(self):
        d = self.dump("0")
        for i, want in enumerate(self.oracle):
            for k in KEYS:
                np.testing.assert_array_equal(d[f"{i}_{k}"], want[k], err_msg=f"scenario {i} {k}")

    def test_x64_on_matches_x64_off_bytes(self):
        off, on = self.dump("0"), self.dump("1")
        for i in range(len(self.scenarios)):
            for k in KEYS:
                a, b = off[f"{i}_{k}"], on[f"{i}_{k}"]
                self.assertEqual(a.tobytes(), b.tobytes(), f"scenario {i} {k}")

    def test_int64_jax_inputs_same_bytes(self):
        on = self.dump("1")
        for i, want in enumerate(self.oracle):
            for k in KEYS:
                np.testing.assert_array_equal(on[f"{i}_int64_{k}"], want[k], err_msg=f"scenario {i} {k}")

    def test_scenarios_exercise_violations(self):
        self.assertGreater(sum(int(o["wi"][0]) for o in self.oracle), 5)
        self.assertTrue(any(int(o["wi"][0]) > X.RING for o in self.oracle))  # a ring overflow is covered


if __name__ == "__main__":
    absltest.main()
