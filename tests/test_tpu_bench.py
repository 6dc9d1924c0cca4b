"""Smoke test of the TPU benchmark entry points on a CPU: ``benchmarks.tpu_bench`` refuses without a TPU and
builds its case list and serving-step command lines; ``benchmarks.tpu_launches`` counts a decode step's kernels.
Nothing here times or runs a kernel."""

from __future__ import annotations

import tempfile

import jax
from absl.testing import absltest

from benchmarks import bench, harness, kernel_cases, tpu_bench, tpu_launches
from benchmarks.serving_step import cli as ss_cli


class TpuBenchTest(absltest.TestCase):
    def test_refuses_without_tpu_naming_the_platform(self):
        platform = jax.default_backend()
        self.assertNotEqual(platform, "tpu")
        with self.assertRaises(tpu_bench.NoTpu) as cm:
            tpu_bench.main(["--out", tempfile.mkdtemp()])
        self.assertIn(repr(platform), str(cm.exception.code))
        self.assertIn("no TPU", str(cm.exception.code))

    def test_case_list_is_bench_py_s(self):
        a = tpu_bench.parse_args([])
        ids = [c.id for c in tpu_bench.kernel_case_list(a)]
        self.assertLen(ids, 13)
        self.assertEqual(ids, [c.id for c in kernel_cases.cases(tpu_bench.bench_args(a))])
        self.assertIn("verify_all_x4", ids)
        self.assertIn("write_4096x1_none", ids)
        self.assertEqual(tpu_bench.kernel_case_list(tpu_bench.parse_args(["--only", "none"])), [])
        self.assertEqual(harness.HBM_BYTES_PER_S, 4.8e12)  # bench.py's GPU figure; the TPU ones are per kind
        self.assertTrue(callable(bench.summarize))

    def test_serving_plan_skips_what_does_not_fit(self):
        a = tpu_bench.parse_args(["--out", "/tmp/x"])
        cmds, skipped = tpu_bench.serving_plan(a, bytes_limit=16 * 10**9)  # a v5e chip's 16 GiB-ish
        self.assertEqual(sorted(skipped), ["decode128", "prefill"])
        self.assertLen(cmds, 2)
        for argv in cmds:
            parsed = ss_cli.parse_args(argv)  # the serving step accepts the command line as built
            self.assertEqual(parsed.scenarios, ["decode1", "write4096"])
            self.assertEqual(parsed.pool_for, "chosen")
            self.assertIn(parsed.backend, ("pallas_tpu", "reference"))
        cmds, skipped = tpu_bench.serving_plan(a, bytes_limit=None)
        self.assertEqual(skipped, {})
        self.assertEqual(ss_cli.parse_args(cmds[0]).scenarios, ["decode1", "decode128", "prefill", "write4096"])

    def test_hbm_by_device_kind(self):
        self.assertEqual(tpu_bench.hbm_bytes_per_s("TPU v5 lite"), 819e9)
        self.assertEqual(tpu_bench.hbm_bytes_per_s("TPU v6e"), 1640e9)
        self.assertIsNone(tpu_bench.hbm_bytes_per_s("TPU v4"))


class TpuLaunchCountTest(absltest.TestCase):
    def test_decode_b1_step_has_the_tpu_verify_and_write_kernels(self):
        tpu_launches.force_compiled_tpu_kernel()
        r = tpu_launches.count_step(1, "partial", sweep=False)
        write_kernels = ("canary_write_seeds_tpu", "canary_write_chain_tpu", "canary_write_store_tpu")
        want = {"canary_verify_tpu": 2, **{k: 2 for k in write_kernels}}  # HEAD and TAIL: verify and write each
        self.assertEqual(r["path_kernels"], want)
        self.assertEqual(r["path_per_part"]["plan"]["pallas_call"], 0)
        self.assertGreater(r["tpu_stablehlo"]["tpu_custom_call"], 2)  # every prefix bucket's branch


if __name__ == "__main__":
    absltest.main()
